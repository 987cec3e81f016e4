"""Models: shapes, the conv-layer contract, determinism, user classes, and real training."""
import time

import pytest
import torch
from torch import nn

from training import data
from training.models import ModelError, build_model, conv_layers, parameter_count

pytestmark = pytest.mark.unit

SMALL = [
    ("digits_cnn", (1, 8, 8), {}),
    ("digits_cnn", (3, 5, 7), {"conv1": 3, "conv2": 4, "hidden": 6}),
    ("seed_cnn", (3, 32, 32), {"conv1": 4, "conv2": 6}),
    ("seed_cnn", (1, 12, 20), {"conv1": 2, "conv2": 3, "kernel": 3}),
    ("resnet", (3, 32, 32), {"width": 4, "blocks": 1}),
    ("resnet", (3, 16, 16), {"width": 2, "blocks": 2, "stages": 2, "norm": "none"}),
    ("mlp", (3, 32, 32), {"hidden": 16, "layers": 3}),
]


@pytest.fixture
def one_thread():
    """Tests share 2 cores with other work; more OpenMP threads than free cores is far slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name,shape,options", SMALL)
def test_output_shapes(name, shape, options):
    torch.manual_seed(0)
    model = build_model(name, shape, 7, options)
    out = model(torch.randn(2, *shape))
    assert tuple(out.shape) == (2, 7) and out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_job_schema_knows_every_built_in_model():
    """The client checks training.model before anything starts, without importing torch."""
    import conf.schema
    from training.models import MODELS
    assert conf.schema.BUILTIN_MODELS == tuple(MODELS)


def test_seed_cnn_defaults_are_the_papers_widths():
    model = build_model("seed_cnn", (3, 32, 32), 10)
    (n1, c1), (n2, c2) = conv_layers(model)
    assert (n1, c1.in_channels, c1.out_channels, c1.kernel_size, c1.padding) == ("conv1", 3, 500, (5, 5), (2, 2))
    assert (n2, c2.in_channels, c2.out_channels, c2.kernel_size) == ("conv2", 500, 1500, (5, 5))
    assert model.fc.in_features == 1500 * 8 * 8 and model.fc.out_features == 10
    assert parameter_count(model) == 3 * 500 * 25 + 500 + 500 * 1500 * 25 + 1500 + 96000 * 10 + 10


def test_mlp_is_communication_heavy_by_default():
    model = build_model("mlp", (3, 32, 32), 10)
    assert conv_layers(model) == []
    assert parameter_count(model) > 25_000_000


class _Spy(nn.Module):
    """Stands in for a distributed conv: delegates to the original and counts calls."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.conv(x)


@pytest.mark.parametrize("name,shape,options", [s for s in SMALL if s[0] != "mlp"])
def test_convs_are_plain_attributes_a_strategy_can_replace(name, shape, options):
    torch.manual_seed(0)
    model = build_model(name, shape, 5, options).eval()
    convs = conv_layers(model)
    assert convs and all(type(m) is nn.Conv2d for _, m in convs)
    x = torch.randn(3, *shape)
    with torch.no_grad():
        before = model(x)
    spies = []
    for qualified, conv in convs:
        parent_name, _, attr = qualified.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        assert getattr(parent, attr) is conv
        spy = _Spy(conv)
        setattr(parent, attr, spy)
        spies.append(spy)
    with torch.no_grad():
        after = model(x)
    assert all(s.calls == 1 for s in spies)                # the network really calls the replacements
    assert torch.equal(before, after)
    assert isinstance(model.relu1, nn.ReLU)                 # activations are modules of their own


def test_initialisation_is_deterministic_given_the_seed():
    for name, shape, options in SMALL:
        torch.manual_seed(42)
        a = build_model(name, shape, 10, options).state_dict()
        torch.manual_seed(42)
        b = build_model(name, shape, 10, options).state_dict()
        torch.manual_seed(43)
        c = build_model(name, shape, 10, options).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dtype.is_floating_point)


USER_MODULE = '''
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, input_shape, num_classes, hidden=8):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, hidden, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.fc = nn.Linear(hidden * h * w, num_classes)
        self.hidden = hidden

    def forward(self, x):
        return self.fc(torch.flatten(self.relu1(self.conv1(x)), 1))


class Flexible(nn.Module):
    def __init__(self, input_shape, num_classes, **options):
        super().__init__()
        self.options = options
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)


class NotAModule:
    pass
'''


def test_user_class_is_loaded_by_module_path(tmp_path, monkeypatch):
    pkg = tmp_path / "yarnapp_user_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))

    model = build_model("yarnapp_user_models.nets:TinyNet", (1, 8, 8), 10, {"hidden": 5})
    assert type(model).__name__ == "TinyNet" and model.hidden == 5
    assert tuple(model(torch.zeros(4, 1, 8, 8)).shape) == (4, 10)
    assert [n for n, _ in conv_layers(model)] == ["conv1"]
    flexible = build_model("yarnapp_user_models.nets:Flexible", (1, 2, 2), 3, {"anything": [1, 2]})
    assert flexible.options == {"anything": [1, 2]}

    for name, options, expect in [
        ("yarnapp_user_models.nets:TinyNet", {"width": 3}, "width"),
        ("yarnapp_user_models.nets:Missing", {}, "Missing"),
        ("yarnapp_user_models.nets:NotAModule", {}, "nn.Module"),
        ("yarnapp_no_such_package.nets:Net", {}, "yarnapp_no_such_package"),
        ("not_a_model_name", {}, "digits_cnn"),
    ]:
        with pytest.raises(ModelError) as e:
            build_model(name, (1, 8, 8), 10, options)
        assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name,options,expect", [
    ("digits_cnn", {"width": 3}, "unknown option 'width'"),
    ("seed_cnn", {"conv1": 0}, "conv1"),
    ("seed_cnn", {"kernel": 4}, "odd"),
    ("resnet", {"norm": "layer"}, "norm"),
    ("mlp", {"hidden": 2.5}, "hidden"),
])
def test_bad_options_are_refused(name, options, expect):
    with pytest.raises(ModelError) as e:
        build_model(name, (3, 32, 32), 10, options)
    assert expect in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ModelError):
        build_model("seed_cnn", (3, 2, 2), 10, {"conv1": 2, "conv2": 2})   # too small to pool twice


def test_digits_cnn_learns_the_real_digits(tmp_path, one_thread):
    start = time.perf_counter()
    data.import_digits(str(tmp_path / "digits"))
    train = data.ParquetSource(str(tmp_path / "digits" / "train"))
    test = data.ParquetSource(str(tmp_path / "digits" / "test"))
    torch.manual_seed(0)
    model = build_model("digits_cnn", train.shape, train.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with train.batches(32, 0, 32, seed=0, epochs=4) as loader:
        for epoch, step, x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert loader.stats.batches == 4 * loader.steps_per_epoch
    model.eval()
    correct = 0
    with torch.no_grad(), test.batches(100, 0, 100, seed=0, drop_last=False, epochs=1, train=False) as evaluation:
        for _, _, x, y in evaluation:
            correct += int((model(x).argmax(1) == y).sum())
    accuracy = correct / len(test)
    assert evaluation.stats.samples == len(test) == 359
    assert accuracy >= 0.95, accuracy
    assert time.perf_counter() - start < 30


def _flat(c, h, w, outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, outputs))


@pytest.mark.parametrize("make, says", [
    (lambda: _flat(1, 8, 8, 13), "gives outputs of shape (2, 13), but the data has 10 classes"),
    (lambda: _flat(1, 8, 8, 7), "gives outputs of shape (2, 7), but the data has 10 classes"),
    (lambda: nn.Conv2d(1, 10, 3, padding=1), "gives outputs of shape (2, 10, 8, 8)"),
    (lambda: _flat(3, 8, 8, 10), "shape (2, 1, 8, 8), does not go through it: RuntimeError: mat1 and mat2"),
])
def test_a_model_whose_output_does_not_fit_the_classes_is_one_line_before_training(make, says):
    """Before, 13 outputs for 10 classes trained and reported success; 7 failed inside
    cross_entropy with a torch traceback after a restart."""
    from training.models import check_output
    with pytest.raises(ModelError) as e:
        check_output(make(), "mine:net", torch.randn(16, 1, 8, 8), 10)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith("model 'mine:net': ")


def test_checking_a_models_output_changes_nothing_it_touches():
    """The check's forward runs in eval mode on a fork of the RNG: batch-norm statistics,
    each module's train/eval flag and the random stream are as they were."""
    from training.models import check_output

    class Noisy(nn.Module):                         # draws from the RNG in eval mode too
        def forward(self, x):
            return x + 0 * torch.rand_like(x)
    torch.manual_seed(0)
    model = nn.Sequential(build_model("resnet", (3, 16, 16), 10, {"width": 4, "blocks": 1, "stages": 2}), Noisy())
    frozen = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    frozen.eval()                                   # a user's frozen layer stays frozen
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    check_output(model, "resnet", torch.randn(16, 3, 16, 16), 10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == flags and not frozen.training
    after = torch.rand(3)
    torch.manual_seed(0)
    build_model("resnet", (3, 16, 16), 10, {"width": 4, "blocks": 1, "stages": 2})
    torch.randn(16, 3, 16, 16)
    assert torch.equal(after, torch.rand(3))
