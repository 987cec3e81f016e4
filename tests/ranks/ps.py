"""Parameter servers, central and sharded, against single-process training
(tests/test_ps.py): every case on 2 or 3 ranks; rank 0 reports the largest differences."""
import io

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import conf
from launcher.world import join_local
from training import strategies
from training.context import RunContext
from training.probes import finish, report

comm, rank, n = join_local()
torch.set_num_threads(1)
B = 12
UNEQUAL = {2: [3.0, 1.0], 3: [5.0, 2.0, 1.0]}[n]
STARVED = {2: [11.0, 1.0], 3: [10.0, 1.0, 1.0]}[n]   # with B=6: the last rank reads 0 rows (n=3)
VCORES = {2: [1.0, 0.5], 3: [1.0, 0.5, 0.5]}[n]


class SmallCNN(nn.Module):
    input_shape = (3, 8, 8)

    def __init__(self, norm=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6) if norm else nn.Identity()
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def fresh(seed=0, norm=False):
    torch.manual_seed(seed)
    return SmallCNN(norm)


def data(step, batch=B):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),
}


def make(strategy, shares, opt, seed=0, norm=False):
    job = conf.offline_job(VCORES, strategy=strategy, model="small", batch_size=B, shares=shares)
    s = strategies.get(strategy)(RunContext.offline(comm, job), job.training)
    s.setup(fresh(seed, norm), OPTIMIZERS[opt])
    return s


def step(s, i, batch=B):
    x, y = data(i, batch)
    lo, hi = s.batch_slice(batch)
    return s.train_step(x[lo:hi], y[lo:hi]), hi - lo


def maxdiff(model, ref):
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    return max(float((got[k].detach().double() - want[k].detach().double()).abs().max()) for k in want)


def flat_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()] +
                     [b.detach().reshape(-1).float() for b in model.buffers()])


out = {}
for strategy in ("ps_central", "ps_sharded"):
    for shares_name, shares, batch in (("equal", "equal", B), ("unequal", UNEQUAL, B),
                                       ("vcores", "vcores", B), ("starved", STARVED, 6)):
        for opt in ("sgd", "adam"):
            s = make(strategy, shares, opt)
            ref = fresh()
            ref_opt = OPTIMIZERS[opt](ref.parameters())
            worst, loss_err, rows = 0.0, 0.0, []
            for i in range(3):
                st, mine = step(s, i, batch)
                rows.append(mine)
                x, y = data(i, batch)
                ref_opt.zero_grad()
                loss = F.cross_entropy(ref(x), y)
                loss.backward()
                ref_opt.step()
                worst = max(worst, maxdiff(s.model, ref))
                loss_err = max(loss_err, abs(st.loss - float(loss)))
                assert st.samples == batch, (st.samples, batch)
            every = comm.gather(flat_of(s.model).numpy(), root=0)
            identical = rank != 0 or all(np.array_equal(every[0], e) for e in every)
            all_rows = comm.gather(rows[0], root=0)
            key = f"{strategy}/{shares_name}/{opt}"
            res = comm.gather((worst, loss_err), root=0)
            if rank == 0:
                out[key] = {"param_diff": max(r[0] for r in res), "loss_diff": max(r[1] for r in res),
                            "identical": bool(identical), "rows": all_rows}
            s.close()

    # Checkpoint round trip: 2 steps, save, 2 more (A); a fresh strategy built from a
    # differently initialised model loads the save and does the same 2 steps (B): A == B.
    s = make(strategy, UNEQUAL, "sgd")
    for i in range(2):
        step(s, i)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    for i in range(2, 4):
        step(s, i)
    a = flat_of(s.model)
    t = make(strategy, UNEQUAL, "sgd", seed=7)
    before = float((flat_of(t.model) - a).abs().max())
    buf.seek(0)
    t.load_state_dict(torch.load(buf, weights_only=False))
    for i in range(2, 4):
        step(t, i)
    exact = bool(torch.equal(flat_of(t.model), a))
    res = comm.gather((exact, before), root=0)
    if rank == 0:
        out[f"{strategy}/resume"] = {"exact": all(e for e, _ in res), "differed_before": min(b for _, b in res)}
    s.close(); t.close()

    # BatchNorm statistics come from local rows; rank 0's are broadcast before every step.
    s = make(strategy, UNEQUAL, "sgd", norm=True)
    for i in range(2):
        step(s, i)
    step(s, 2)
    s._sync_buffers()
    every = comm.gather(flat_of(s.model).numpy(), root=0)
    if rank == 0:
        out[f"{strategy}/batchnorm"] = {"identical": all(np.array_equal(every[0], e) for e in every)}
    s.close()

report(rank, out)
finish(comm)
