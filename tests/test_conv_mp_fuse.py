"""Which channel-wise layers conv-MP runs inside the shards (training.strategies.conv_mp.fuse):
found in the traced model, and the fused forward computes what the model computes."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from training.models import build_model
from training.strategies.conv_mp import fuse

pytestmark = pytest.mark.unit


class Reused(nn.Module):
    """One ReLU module after two convs: it cannot move into either shard."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.relu, self.pool = nn.ReLU(), nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(self.relu(self.conv2(self.relu(self.conv1(x)))))


class Branches(nn.Module):
    """conv1's output used twice (a residual); conv2's ReLU output used twice."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        y = F.relu(y) + y
        z = torch.relu(self.conv2(y))
        return F.avg_pool2d(z, 2) + F.max_pool2d(z, 2)


class TrainOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = F.relu(self.conv(x))
        return y * 2 if self.training else y


class Dynamic(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return F.relu(self.conv(x)) if x.sum() > 0 else self.conv(x)


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 4 * 4, 3)

    def forward(self, x):
        x = F.max_pool2d(F.leaky_relu(self.conv1(x), 0.1), 2)
        x = F.adaptive_avg_pool2d(self.conv2(x).relu(), (4, 4))
        return self.fc(x.flatten(1))


class Shard(nn.Module):
    """What DistributedConv2d computes with its followers: the chain right after the conv,
    and with a head the Linear on its flattened output."""

    def __init__(self, conv, chain, head=None):
        super().__init__()
        self.conv, self.chain, self.head = conv, chain, head

    def forward(self, x):
        x = self.conv(x)
        for f in self.chain:
            x = f(x)
        return x if self.head is None else self.head(x.flatten(1))


def fused_equals_model(model, names, shape):
    """The plan's graph (chains, flattens and heads removed) with each conv replaced by
    conv + its chain (+ its head) computes exactly what the model computes."""
    torch.manual_seed(0)
    x = torch.randn(2, *shape)
    want = model(x)
    plan = fuse.plan(model, names)
    chains = plan.followers(model)
    for name in set(chains) | set(plan.heads):
        head = model.get_submodule(plan.heads[name]) if name in plan.heads else None
        setattr(model, name, Shard(getattr(model, name), chains.get(name, []), head))
    return plan, torch.equal(plan.graph_module(model)(x), want)


def test_seed_cnn_moves_relu_and_pool_into_the_shards_and_computes_the_same():
    torch.manual_seed(0)
    model = build_model("seed_cnn", (3, 16, 16), 10, {"conv1": 4, "conv2": 8})
    relu1, pool1 = model.relu1, model.pool1
    plan, same = fused_equals_model(model, ["conv1", "conv2"], (3, 16, 16))
    assert plan.describe() == ("conv1 + relu1 + pool1; conv2 + relu2 + pool2; conv1 -> conv2; "
                               "conv2 -> fc row-parallel")
    assert plan.links == {"conv1": "conv2"}     # conv1's pooled map goes to conv2 alone
    assert plan.heads == {"conv2": "fc"}        # conv2's, flattened, to the classifier alone
    assert plan.chains["conv1"] == ["relu1", "pool1"] and model.conv1.chain == [relu1, pool1]
    assert same


def test_functional_and_method_followers_are_found_and_compute_the_same():
    plan, same = fused_equals_model(Functional(), ["conv1", "conv2"], (3, 8, 8))
    assert plan.describe() == ("conv1 + leaky_relu + max_pool2d; conv2 + relu + adaptive_avg_pool2d; "
                               "conv1 -> conv2; conv2 -> fc row-parallel")
    assert same
    plan, _ = fused_equals_model(Functional(), ["conv2"], (3, 8, 8))      # only the distributed ones
    assert list(plan.chains) == ["conv2"] and plan.links == {} and plan.heads == {"conv2": "fc"}


class Classifier(nn.Module):
    """conv -> ReLU -> flattened as `flatten` says -> fc; `tied`: fc's weight also in `other`."""

    def __init__(self, flatten, tied=False, features=4 * 4 * 4):
        super().__init__()
        self.conv, self.fc, self.how = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(features, 3), flatten
        self.flat = nn.Flatten()
        self.other = nn.Linear(features, 3)
        if tied:
            self.other.weight = self.fc.weight

    def forward(self, x):
        y = F.relu(self.conv(x))
        how = self.how
        if how == "module":
            return self.fc(self.flat(y))
        if how == "function":
            return self.fc(torch.flatten(y, 1))
        if how == "method":
            return self.fc(y.flatten(1))
        if how == "view":
            return self.fc(y.view(y.size(0), -1))
        if how == "reshape":
            return self.fc(y.reshape(y.size(0), -1))
        if how == "flatten0":       # (N·C·H·W,): not the classifier's input
            return self.fc(y.flatten().view(x.size(0), -1))
        if how == "twice":           # fc also elsewhere
            return self.fc(y.flatten(1)) + self.fc(torch.ones_like(y).flatten(1))
        if how == "dropout":         # not channel-wise: stays on the master
            return self.fc(F.dropout(y, 0.5, self.training).flatten(1))
        return self.fc(y.flatten(1))


@pytest.mark.parametrize("how", ["module", "function", "method", "view", "reshape"])
def test_the_classifier_on_a_conv_flattened_output_runs_row_parallel(how):
    plan, same = fused_equals_model(Classifier(how), ["conv"], (3, 4, 4))
    assert plan.heads == {"conv": "fc"} and same
    assert not [n for n in plan.graph.nodes if n.op == "call_module" and n.target in ("fc", "flat")]


@pytest.mark.parametrize("how,tied", [("flatten0", False), ("twice", False), ("method", True)])
def test_a_classifier_used_elsewhere_or_fed_otherwise_stays_on_the_master(how, tied):
    plan = fuse.plan(Classifier(how, tied), ["conv"])
    assert plan is None or plan.heads == {}


def _double(module, args, output):
    return output * 2


def test_a_classifier_with_hooks_or_held_by_a_block_fx_keeps_whole_stays_on_the_master():
    # a hook on the Linear (the old weight_norm computes `weight` in one from weight_g and weight_v)
    hooked = Classifier("method")
    hooked.fc.register_forward_hook(_double)
    assert fuse.plan(hooked, ["conv"]).heads == {}
    normed = Classifier("method")
    normed.fc = nn.utils.weight_norm(normed.fc)
    plan = fuse.plan(normed, ["conv"])
    assert plan is None or plan.heads == {}

    class Head(nn.Module):          # a user's block (a leaf for the trace) holding the same Linear
        def __init__(self, fc):
            super().__init__()
            self.fc = fc

        def forward(self, x):
            return self.fc(x)

    class Twice(Classifier):
        def __init__(self):
            super().__init__("method")
            self.head = Head(self.fc)

        def forward(self, x):
            y = F.relu(self.conv(x)).flatten(1)
            return self.fc(y) + self.head(x.new_zeros(x.shape[0], self.fc.in_features))
    assert fuse.plan(Twice(), ["conv"]).heads == {}


def test_a_classifier_without_a_whole_number_of_features_per_channel_stays_on_the_master():
    class Cropped(Classifier):
        def forward(self, x):
            return self.fc(F.relu(self.conv(x)).flatten(1)[:, :63])
    assert fuse.plan(Cropped("method", features=63), ["conv"]).heads == {}


def test_shared_modules_and_reused_outputs_stay_on_the_master():
    # conv1's output feeds the residual too: nothing follows it into the shard; conv2's
    # ReLU does (its output, used twice, is what is gathered)
    plan, same = fused_equals_model(Branches(), ["conv1", "conv2"], (4, 8, 8))
    assert plan.describe() == "conv2 + relu" and same and plan.links == {}
    assert fuse.plan(Reused(), ["conv1", "conv2"]) is None     # one ReLU serves both convs


class Direct(nn.Module):
    """conv1 straight into conv2, then conv3 on conv2's output and on the input's again."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 5, 3, padding=1)
        self.conv3 = nn.Conv2d(5, 5, 1)

    def forward(self, x):
        y = self.conv2(self.conv1(x))
        return self.conv3(y) + y


def test_a_conv_feeding_the_next_alone_is_linked_to_it_even_without_a_chain():
    plan, same = fused_equals_model(Direct(), ["conv1", "conv2", "conv3"], (3, 6, 6))
    # conv2's output also goes to the sum: not linked to conv3
    assert plan.chains == {} and plan.links == {"conv1": "conv2"} and same
    assert fuse.plan(Direct(), ["conv2", "conv3"]) is None   # conv1 is not distributed: no link to it


def test_models_fx_cannot_trace_or_whose_training_forward_differs_are_not_fused(caplog):
    with caplog.at_level("INFO"):
        assert fuse.plan(Dynamic(), ["conv"]) is None
        assert fuse.plan(TrainOnly(), ["conv"]) is None
    assert "torch.fx cannot trace the model" in caplog.text
    assert "differs between training and evaluation" in caplog.text


def test_resnet_convs_feed_batchnorm_and_are_not_fused():
    model = build_model("resnet", (3, 32, 32), 10, {})
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert fuse.plan(model, names) is None


def test_a_shard_with_its_chain_gives_the_gradients_of_conv_then_chain():
    """_ShardConv2d (what each rank runs) with an in-place ReLU and a max-pool after the
    conv, against plain autograd through the same layers, forward and every gradient."""
    from training.strategies.conv_mp.comm import Timings
    from training.strategies.conv_mp.layers import _ShardConv2d

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.relu, self.pool = nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)

        def forward(self, x):
            return self.pool(self.relu(self.conv(x)))

    torch.manual_seed(0)
    model = InPlace()
    chain = fuse.plan(model, ["conv"]).followers(model)["conv"]
    assert [type(f).__name__ for f in chain] == ["ReLU", "MaxPool2d"] and not chain[0].inplace
    assert model.relu.inplace                                       # the model's own is left as it was
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    g = torch.randn(4, 5, 4, 4)
    model(x).backward(g)
    want = [x.grad, model.conv.weight.grad, model.conv.bias.grad]
    w = model.conv.weight.detach().requires_grad_()
    b = model.conv.bias.detach().requires_grad_()
    x2 = x.detach().requires_grad_()
    timings = Timings()
    y = _ShardConv2d.apply(x2, w, b, ((1, 1), (1, 1), (1, 1)), timings, chain, True)
    assert y.shape == (4, 5, 4, 4) and torch.equal(y, model(x).detach())
    y.backward(g)
    for got, ref in zip([x2.grad, w.grad, b.grad], want):
        assert torch.allclose(got, ref, atol=1e-6)
    assert timings.conv_s > 0                                       # the chain is timed with the share


class SubclassConv(nn.Conv2d):
    """A user's Conv2d subclass: called as a module, as the strategy replaces it."""


class Optional_(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = SubclassConv(3, 4, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, scale=None):
        y = F.relu(self.conv1(x))
        return y if scale is None else y * scale


class NoGrad(Optional_):
    def forward(self, x):
        with torch.no_grad():
            y = self.conv1(x)
        return F.relu(y)


class Counting(Optional_):
    def forward(self, x):
        self.calls += 1
        return F.relu(self.conv1(x))


def test_what_a_trace_would_change_is_never_fused(caplog):
    # a Conv2d subclass is one call (not traced into); an optional argument takes its default
    plan, same = fused_equals_model(Optional_(), ["conv1"], (3, 8, 8))
    assert plan.describe() == "conv1 + relu" and same
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Identity(), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    plan, same = fused_equals_model(seq, ["0"], (3, 10, 10))
    assert plan.describe() == "0 + 1 + 2 + 3" and same
    counting = Counting()
    with caplog.at_level("INFO"):
        assert fuse.plan(NoGrad(), ["conv1"]) is None
        assert fuse.plan(counting, ["conv1"]) is None
    assert "changes the grad mode" in caplog.text and "assigns to the module" in caplog.text
    assert counting.calls.item() == 0                  # tracing ran on a copy


def test_a_second_backward_through_a_fused_shard_is_refused_not_wrong():
    from training.strategies.conv_mp.comm import Timings
    from training.strategies.conv_mp.layers import _ShardConv2d
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    x = torch.randn(2, 3, 8, 8)
    y = _ShardConv2d.apply(x, w, None, ((1, 1), (1, 1), (1, 1)), Timings(), [nn.ReLU(), nn.MaxPool2d(2)], True)
    loss = y.square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*fuse: false"):
        loss.backward()
