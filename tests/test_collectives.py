"""Ring all-reduce and data-parallel gradients, in real MPI worlds of 1, 2 and 3 ranks."""
import json

import pytest
import torch

from mpi_util import run_mpi

COLLECTIVES = """
import numpy as np, torch
from mpi4py import MPI
from training import collectives
from training.collectives import PreparedAllreduce, allreduce_
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()
collectives.set_polite(POLITE)   # a throttled rank's waits sleep: same sums, same bits
# small, odd, not divisible by 2 or 3, fewer elements than ranks, several ring chunks
def data(rank, count):
    return np.random.default_rng(1000 * rank + count).standard_normal(count).astype(np.float32)

for count in [0, 1, 2, 7, 1001, 65537, (1 << 18) + 3]:
    want = np.sum([data(q, count).astype(np.float64) for q in range(n)], 0)
    for alg in ["mpi", "ring", "auto"]:
        x = torch.from_numpy(data(r, count))
        chunk = 4096 if count < 100000 else 1 << 16
        y = x.clone()
        assert allreduce_(y, comm, alg, chunk_bytes=chunk) is y
        assert np.allclose(y.numpy(), want, rtol=1e-5, atol=1e-5), (count, alg)
        # the same sum on every rank, bit for bit
        assert all(b == y.numpy().tobytes() for b in comm.allgather(y.numpy().tobytes()))
        # prepared (persistent requests), blocking and nonblocking, run twice: same bits
        z = torch.empty_like(x)
        op = PreparedAllreduce(z, comm, alg, chunk_bytes=chunk)
        for _ in range(2):
            z.copy_(x)
            op.run()
            assert torch.equal(y, z), (count, alg)
            z.copy_(x)
            op.start()
            while not op.test():
                pass
            op.wait()
            assert torch.equal(y, z), (count, alg)
        op.free()
# float64 and a 2-D tensor reduce in place through the zero-copy view
x = torch.full((3, 5), float(r + 1), dtype=torch.float64)
allreduce_(x, comm, "ring", chunk_bytes=16)
assert torch.equal(x, torch.full((3, 5), n * (n + 1) / 2, dtype=torch.float64))
try:
    allreduce_(torch.ones(4, 4).t(), comm)
    raise SystemExit("a non-contiguous tensor was accepted")
except ValueError as e:
    assert "contiguous" in str(e)
print("COLLECTIVES OK", r)
"""

# A small CNN (with one parameter that forward never uses) trained on a global batch
# split 3:1:2. Every rank also computes the single-process reference on the whole batch.
TRAINING = """
import json, sys, numpy as np, torch
from torch import nn
import torch.nn.functional as F
import conf
from mpi_util import make_ctx
from training.strategies.allreduce import AllReduceStrategy
torch.set_num_threads(1)
ctx = make_ctx()
n, rank, comm = ctx.world_size, ctx.rank, ctx.comm
OUT = sys.argv[1] if len(sys.argv) > 1 else None

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3)
        self.c2 = nn.Conv2d(4, 8, 3)
        self.fc = nn.Linear(8 * 4 * 4, 5)
        self.unused = nn.Parameter(torch.ones(3))
    def forward(self, x):
        x = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(x.flatten(1))

def spec(shares, bucket_mb, threshold_kb):
    job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": n}],
                         "training": {"data": {"train": "file:///unused"}, "shares": shares,
                                      "strategy": {"name": "allreduce", "bucket_mb": bucket_mb,
                                                   "ring_threshold_kb": threshold_kb}}})
    return job.training

def make_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)

def model(seed):
    torch.manual_seed(seed + 100 * rank)     # different on every rank: setup must broadcast
    m = Net()
    torch.manual_seed(seed)
    ref = Net()
    return m, ref

def batch(step, rows):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 1, 8, 8, generator=g), torch.randint(0, 5, (rows,), generator=g)

def check_gradients(shares, rows, bucket_mb, threshold_kb, overlap):
    m, ref = model(0)
    s = AllReduceStrategy(ctx, spec(shares, bucket_mb, threshold_kb))
    s.overlap = overlap
    s.setup(m, make_opt)
    # setup made every rank rank 0's model; rank 0's model is seed 0 + 0: `ref`
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    ref_opt = make_opt(ref.parameters())
    for step in range(2):
        x, y = batch(step, rows)
        lo, hi = s.batch_slice(rows)
        parts = comm.allgather((lo, hi))
        assert parts[0][0] == 0 and parts[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        stats = s.train_step(x[lo:hi], y[lo:hi])
        ref_opt.zero_grad()
        out = ref(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            want = q.grad if q.grad is not None else torch.zeros_like(q)
            err = (p.grad - want).abs().max().item()
            assert err <= 1e-5, (shares, overlap, name, err)
        ref_opt.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert (p - q).abs().max().item() <= 1e-5
        assert abs(stats.loss - loss.item()) <= 1e-5, (stats.loss, loss.item())
        assert stats.correct == int((out.argmax(1) == y).sum())
        assert stats.samples == rows and stats.comm_s >= 0 and stats.compute_s > 0
    s.close()
    return parts

def train(overlap, steps=4):
    m, _ = model(7)
    s = AllReduceStrategy(ctx, spec([3, 1, 2][:n], 0.001, 0))   # many buckets, all ring
    s.overlap = overlap
    s.setup(m, make_opt)
    for step in range(steps):
        x, y = batch(step, 12)
        lo, hi = s.batch_slice(12)
        s.train_step(x[lo:hi], y[lo:hi])
    s.close()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    return m, flat

shares = [3, 1, 2][:n]
parts = check_gradients(shares, 12, 0.001, 0, "poll")          # ring, several buckets
if n == 3:
    assert [hi - lo for lo, hi in parts] == [6, 2, 4], parts
check_gradients(shares, 12, 4, 256, "thread")                  # one bucket, MPI_Allreduce
check_gradients("equal", 12, 0.001, 0, "none")
if n == 3:                                                      # 2 rows, 3 ranks: rank 2 gets none
    assert [hi - lo for lo, hi in check_gradients("equal", 2, 0.001, 0, "poll")] == [1, 1, 0]

# shares 'speed': timed passes on every rank, one set of weights everywhere, the
# model left exactly as setup's broadcast made it
m, ref = model(3)
s = AllReduceStrategy(ctx, spec("speed", 4, 256))
s.setup(m, make_opt, example_input=torch.randn(8, 1, 8, 8))
assert len(s.weights) == n and all(w > 0 for w in s.weights)
assert comm.allgather(s.weights) == [s.weights] * n
parts = comm.allgather(s.batch_slice(12))
assert parts[0][0] == 0 and parts[-1][1] == 12 and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
assert all(p.grad is None for p in m.parameters())
s.close()

m, flat = train("poll")
for other in ("thread", "none"):
    assert torch.equal(flat, train(other)[1]), other
assert all(b == flat.numpy().tobytes() for b in comm.allgather(flat.numpy().tobytes()))
if rank == 0 and OUT:
    torch.save(m.state_dict(), OUT)
print("TRAINING OK", rank)
"""


@pytest.mark.parametrize("n", [1, 2, 3])
def test_allreduce_matches_numpy_sum(n):
    proc = run_mpi(n, "POLITE = False\n" + COLLECTIVES, timeout=120)
    assert proc.stdout.count("COLLECTIVES OK") == n


def test_polite_waits_give_the_same_sums():
    proc = run_mpi(3, "POLITE = True\n" + COLLECTIVES, timeout=120)
    assert proc.stdout.count("COLLECTIVES OK") == 3


WAIT_CPU = """
import json, time, numpy as np
from mpi4py import MPI
from training import collectives
comm = MPI.COMM_WORLD
out = {}
for polite in (False, True):
    buf = np.zeros(1 << 16, np.float32)
    comm.Barrier()
    if comm.Get_rank() == 0:
        time.sleep(0.6)                       # the peer waits 0.6 s for this message
        comm.Send(buf + 1, dest=1)
    else:
        wall, cpu = time.perf_counter(), time.process_time()
        collectives.wait(comm.Irecv(buf, source=0), polite=polite)
        out[str(polite)] = [time.perf_counter() - wall, time.process_time() - cpu]
        assert buf[0] == 1
if comm.Get_rank() == 1:
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_polite_wait_sleeps_instead_of_spinning():
    """MPICH spins in MPI_Wait (a 0.5-vcore rank would burn its quota waiting); the polite
    wait of a throttled rank leaves the CPU to others."""
    proc = run_mpi(2, WAIT_CPU, timeout=60)
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    (spin_wall, spin_cpu), (polite_wall, polite_cpu) = res["False"], res["True"]
    assert spin_wall > 0.5 and polite_wall > 0.5
    assert spin_cpu > 0.5 * spin_wall, res          # the plain wait burnt the CPU
    assert polite_cpu < 0.25 * polite_wall, res     # the polite one mostly slept


@pytest.mark.parametrize("n", [1, 2])
def test_gradient_equals_single_process_global_batch(n):
    proc = run_mpi(n, TRAINING.replace("sys.argv[1] if len(sys.argv) > 1 else None", "None"),
                   timeout=120)
    assert proc.stdout.count("TRAINING OK") == n


def test_three_ranks_gradients_and_bit_identical_reruns(tmp_path):
    """Shares 3:1:2 (and a rank with no rows) on 3 ranks, run twice: same weights."""
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.pt"
        code = TRAINING.replace("sys.argv[1] if len(sys.argv) > 1 else None", repr(str(out)))
        proc = run_mpi(3, code, timeout=120)
        assert proc.stdout.count("TRAINING OK") == 3
        runs.append(torch.load(out))
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k
