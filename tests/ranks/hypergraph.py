"""Hypergraph-partitioned execution and the strategy against single-process training
(tests/test_hypergraph.py), on 2 or 3 ranks; rank 0 reports the largest differences."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import conf
from launcher.world import join_local
from training import partition as P
from training.context import RunContext
from training.probes import finish, report
from training.strategies.hypergraph.execution import PartitionedModel
from training.strategies.hypergraph.strategy import HypergraphStrategy

comm, rank, n = join_local()
torch.set_num_threads(1)
CAPS = {2: [3.0, 1.0], 3: [2.0, 1.0, 1.0]}[n]
B = 6


class SmallCNN(nn.Module):
    input_shape = (3, 12, 12)

    def __init__(self, groups=1):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, groups=groups)
        self.fc1 = nn.Linear(16 * 3 * 3, 12)
        self.fc2 = nn.Linear(12, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = x.view(x.size(0), -1)       # the batch's size read at each step, not traced (batch 1)
        return self.fc2(F.relu(self.fc1(x)))


class WithDropout(SmallCNN):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(super().forward(x))


def fresh(seed=0, groups=1):
    torch.manual_seed(seed)
    return SmallCNN(groups)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 3, 12, 12, generator=g), torch.randint(0, 10, (B,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def make_ctx():
    return RunContext.offline(comm, conf.offline_job([1.0] * n, strategy="hypergraph"))


def spec(shares=CAPS, split=None):
    """The training section, capacities `split` set after validation: the strategy must
    refuse a wrong count too."""
    t = conf.offline_job([1.0] * n, strategy="hypergraph", model="small", seed=0, batch_size=B,
                         shares=shares).training
    return t.model_copy(update={"strategy": t.strategy.model_copy(update={"capacities": split})})


def maxdiff(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


def full_grads(net):
    """Every layer's full weight and bias gradients, assembled at rank 0 from the ranks' rows."""
    mine = [(net.own[l], net.weight(l).grad, net.bias(l).grad) for l in range(len(net.own))]
    every = comm.gather(mine, root=0)
    if rank:
        return None
    out = []
    for l, layer in enumerate(net.chain.layers[:-1]):
        w = torch.zeros((layer.units, *net.weight(l).shape[1:]), dtype=torch.float64)
        b = torch.zeros(layer.units, dtype=torch.float64)
        for idx, gw, gb in (every[r][l] for r in range(n)):
            if len(idx):
                w[torch.as_tensor(idx)] = gw.double()
                b[torch.as_tensor(idx)] = gb.double()
        out.append((layer.name, w, b))
    return out


out = {}

# 1. The partitioned model alone, on fixed scattered partitions (every layer spread, one rank
#    without units of fc1, the loss on the last rank): logits, loss, every gradient, bytes.
for groups in (1, 4):
    ref = fresh(groups=groups)
    chain = P.layer_chain(ref, SmallCNN.input_shape)
    hg = P.build_hypergraph(chain)
    parts = np.random.RandomState(groups).randint(0, n, hg.num_vertices)
    off = chain.offsets
    fc1 = parts[off[2]:off[3]]
    fc1[fc1 == 0] = 1
    parts[-1] = n - 1
    net = PartitionedModel(chain, parts, comm, ref)
    x, y = data(0)
    logits = net(x)
    if rank == net.loss_rank:
        loss = F.cross_entropy(logits, y)
        loss.backward()
    else:
        torch.autograd.backward([logits], [torch.zeros_like(logits)])
    sent = comm.allreduce(net.counters.sent_bytes)
    grads = full_grads(net)
    got = comm.gather((logits.detach(), loss.item()) if rank == net.loss_rank else None, root=0)
    if rank == 0:
        ref_logits = ref(x)
        ref_loss = F.cross_entropy(ref_logits, y)
        ref_loss.backward()
        modules = dict(ref.named_modules())
        gw = max(max(maxdiff(w, modules[name].weight.grad), maxdiff(b, modules[name].bias.grad))
                 for name, w, b in grads)
        norms = [float(modules[name].weight.grad.norm()) for name, _, _ in grads]
        out[f"layers{groups}"] = {
            "logits": maxdiff(got[n - 1][0], ref_logits), "loss": abs(got[n - 1][1] - ref_loss.item()),
            "grads": gw, "grad_norm_min": min(norms), "sent": sent,
            "predicted": 2 * B * P.evaluate(hg, parts, [1] * n)["forward_bytes_per_sample"],
            "fc1_units": np.bincount(fc1, minlength=n).tolist(), "loss_rank": net.loss_rank}

# 2. The strategy: partitioned by Mt-KaHyPar for capacities CAPS; SGD steps against one process.
ref = fresh()
ropt = sgd(ref.parameters())
model = fresh(seed=0 if rank == 0 else 10 + rank)      # rank 0's weights are broadcast
s = HypergraphStrategy(make_ctx(), spec())
s.setup(model, sgd)
out["slices"] = comm.gather(s.batch_slice(B), root=0)
losses, ref_losses = [], []
for step in range(3):
    x, y = data(step)
    st = s.train_step(x, y)
    losses.append([st.loss, st.correct, st.samples, st.compute_s, st.comm_s])
    if rank == 0:
        ropt.zero_grad()
        o = ref(x)
        l = F.cross_entropy(o, y)
        l.backward()
        ropt.step()
        ref_losses.append([l.item(), int((o.argmax(1) == y).sum())])
sent = comm.allreduce(s.net.counters.sent_bytes)
out["losses"] = comm.gather(losses, root=0)
out["split"] = comm.gather(s.split, root=0)
out["parts_agree"] = comm.gather(s.net.parts.tolist(), root=0)
hg = P.build_hypergraph(s.net.chain)
ev = P.evaluate(hg, s.net.parts, CAPS)
out["strategy_sent"], out["strategy_predicted"] = sent, 3 * 2 * B * ev["forward_bytes_per_sample"]
out["strategy_imbalance"] = ev["imbalance"]
export = s.model_for_export()
if rank == 0:
    out["ref_losses"] = ref_losses
    out["weights"] = max(maxdiff(p, q) for p, q in zip(export.parameters(), ref.parameters()))

# 3. Evaluation: the loss rank reports the sums, the others nothing.
x, y = data(7)
ev_all = comm.gather(list(s.eval_step(x, y)), root=0)
if rank == 0:
    with torch.no_grad():
        o = ref(x)
    out["eval"] = [ev_all, float(F.cross_entropy(o, y, reduction="sum")), int((o.argmax(1) == y).sum()),
                   s.net.loss_rank]

# 4. Checkpoint: a fresh strategy loading every rank's state continues exactly.
state = s.state_dict()
s2 = HypergraphStrategy(make_ctx(), spec(shares="equal"))   # other capacities: the checkpoint's parts win
s2.setup(fresh(seed=99), sgd)
s2.load_state_dict(state)
x, y = data(3)
s2.train_step(x, y)
export2 = s2.model_for_export()
if rank == 0:
    ropt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    ropt.step()
    out["resume"] = max(maxdiff(p, q) for p, q in zip(export2.parameters(), ref.parameters()))
out["resume_parts"] = bool(np.array_equal(s2.net.parts, s.net.parts))

# 5. Misconfigurations are refused on every rank (none hangs).
def refused(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None

def bad_caps():
    t = HypergraphStrategy(make_ctx(), spec(split=[1.0] * (n + 1)))
    t.setup(fresh(), sgd)
    t.train_step(*data(0))

def dropout():
    t = HypergraphStrategy(make_ctx(), spec())
    t.setup(WithDropout(), sgd)
    t.train_step(*data(0))

out["errors"] = comm.gather([refused(bad_caps), refused(dropout)], root=0)

report(rank, out)
finish(comm)
