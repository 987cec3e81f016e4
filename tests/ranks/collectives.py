"""Ring all-reduce and data-parallel gradients (tests/test_collectives.py).

Checks (args["checks"]):
    sums          allreduce_/PreparedAllreduce equal numpy's sum, bit-identical on every
                  rank and from run to run, for odd sizes and every algorithm
    sums_polite   the same with polite (sleeping) waits, woken by doorbells
    shm           (2, 3 ranks, one host) shared-memory sums equal the ring's bit for bit,
                  blocking and nonblocking, spinning, polite, and rank 1 alone polite woken
                  by doorbells; nothing left in /dev/shm
    wait_cpu      (2 ranks) a plain wait spins, a polite one sleeps: rank 1's wall and
                  CPU seconds waiting 0.6 s for rank 0, each way
    doorbell      (2 ranks, one host) rank 1 polite: with doorbells its 0.3 s wait wakes a
                  few times (rank 0's wait rings it), without them every pause; 5000 rings
                  nobody waits for are dropped
    dist_doorbell (2 ranks, one host) rank 1 of 0.5 vcore in a loop on training.dist:
                  polite after init(), its doorbell armed by the first collective
    doorbell_netns (2 ranks, last) rank 1 in a network namespace of its own (as an
                  emulated host), where rank 0's rings cannot reach it: no doorbell is armed
    training      a small CNN trained on a global batch split 3:1:2 (and by speed) equals
                  the single-process training on the whole batch; overlap modes agree
                  bit for bit; rank 0 saves the weights to args["out"] if given
"""
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import conf
from launcher.world import join_local
from training import collectives
from training.collectives import PreparedAllreduce, allreduce_
from training.context import RunContext
from training.probes import arguments, finish, report
from training.strategies.allreduce.strategy import AllReduceStrategy


def data(rank, count):
    return np.random.default_rng(1000 * rank + count).standard_normal(count).astype(np.float32)


def sums(comm, polite):
    """Small, odd, not divisible by 2 or 3, fewer elements than ranks, several ring chunks."""
    r, n = comm.Get_rank(), comm.Get_size()
    collectives.set_polite(polite)   # a throttled rank's waits sleep: same sums, same bits
    collectives.doorbells(comm)      # ... woken by the others' rings (all are polite here)
    try:
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
            raise AssertionError("a non-contiguous tensor was accepted")
        except ValueError as e:
            assert "contiguous" in str(e)
    finally:
        collectives.set_polite(False)
        collectives.close_doorbells()
    return comm.allgather("OK")


def shm_sums(comm):
    import glob

    from training.collectives import shm
    r = comm.Get_rank()
    counts = [1, 2, 7, 1001, 65537, (1 << 18) + 3]
    arena = shm.Arena.create(comm, sum(-(-c * 4 // 64) * 64 for c in counts), len(counts))
    assert arena is not None
    assert not glob.glob(f"{arena.name}*"), "the segments were not unlinked once mapped"
    ops = [arena.allreduce(arena.tensor(c, torch.float32)) for c in counts]
    try:
        for polite, bells in ((False, False), (True, False), (r == 1, True)):
            collectives.set_polite(polite)      # last: rank 1 polite, woken by the others' rings
            if bells:
                collectives.doorbells(comm)
            for c, op in zip(counts, ops):
                x = torch.from_numpy(data(r, c))
                ring = x.clone()
                allreduce_(ring, comm, "ring", chunk_bytes=4096)
                for _ in range(2):
                    op.tensor.copy_(x)
                    op.run()
                    assert torch.equal(op.tensor, ring), (c, polite)
                    op.tensor.copy_(x)
                    op.start()
                    while not op.test():
                        pass
                    op.wait()
                    assert torch.equal(op.tensor, ring), (c, polite)
    finally:
        collectives.set_polite(False)
        collectives.close_doorbells()
    for op in ops:
        op.free()
    del ops
    arena.close()
    return comm.allgather("OK")


def wait_cpu(comm):
    """Rank 1's (wall, CPU) seconds of a 0.6 s wait, plain and polite."""
    out = {}
    for polite in (False, True):
        buf = np.zeros(1 << 16, np.float32)
        comm.Barrier()
        if comm.Get_rank() == 0:
            time.sleep(0.6)                       # the peer waits 0.6 s for this message
            comm.Send(buf + 1, dest=1)
        elif comm.Get_rank() == 1:
            wall, cpu = time.perf_counter(), time.process_time()
            collectives.wait(comm.Irecv(buf, source=0), polite=polite)
            out[str(polite)] = [time.perf_counter() - wall, time.process_time() - cpu]
            assert buf[0] == 1
    return comm.bcast(out, root=1)


def doorbell(comm):
    """Rank 1's wake-ups in a polite 0.3 s wait for rank 0, with and without doorbells."""
    from training.collectives import waits
    rank = comm.Get_rank()
    collectives.set_polite(rank == 1)
    out = {}
    for bells in (True, False):
        if bells:
            collectives.doorbells(comm)
            out["bound"] = comm.gather(waits._bell is not None, root=1)
            if rank == 0:
                for _ in range(5000):       # nobody waits: its queue fills, the rest are dropped
                    collectives.ring()
        buf = np.zeros(1 << 10, np.float32)
        comm.Barrier()
        if rank == 0:
            time.sleep(0.3)
            collectives.wait(comm.Isend(buf + 1, dest=1))      # rings rank 1
        else:
            before = waits.wakeups
            collectives.wait(comm.Irecv(buf, source=0))
            out["bells" if bells else "timed"] = waits.wakeups - before
            assert buf[0] == 1
        collectives.close_doorbells()
    collectives.set_polite(False)
    return comm.bcast(out, root=1)


def dist_doorbell(comm):
    """[rank] -> (polite, doorbell after init(), doorbell after the first collective) of a
    loop on training.dist whose rank 1 has 0.5 vcore."""
    import training.dist as yd
    from training.collectives import waits
    ctx = RunContext.offline(comm, conf.offline_job([1.0, 0.5]))
    yd.init(ctx)
    before = waits._bell is not None
    yd.barrier()
    seen = (collectives.is_polite(), before, waits._bell is not None)
    collectives.close_doorbells()
    collectives.set_polite(False)
    yd._ctx = yd._armed = None
    torch.set_num_threads(1)
    return comm.allgather(seen)


def doorbell_netns(comm):
    """Whether doorbells are armed anywhere once rank 1 has a network namespace of its own
    (abstract Unix sockets are per namespace); None where it cannot have one (not root)."""
    import ctypes
    from training.collectives import waits
    rank = comm.Get_rank()
    collectives.set_polite(rank == 1)
    moved = True
    if rank == 1:
        moved = ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0     # CLONE_NEWNET
    if not comm.allreduce(int(moved), op=_mpi_min()):
        return None
    collectives.doorbells(comm)
    armed = comm.allgather(waits._bell is not None or waits._ringer is not None)
    collectives.close_doorbells()
    collectives.set_polite(False)
    return armed


def _mpi_min():
    from mpi4py import MPI
    return MPI.MIN


# -- training: a small CNN (with one parameter that forward never uses) on a global batch
# split 3:1:2; every rank also computes the single-process reference on the whole batch.

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


def make_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(step, rows):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 1, 8, 8, generator=g), torch.randint(0, 5, (rows,), generator=g)


class Training:
    def __init__(self, comm):
        self.comm, self.rank, self.n = comm, comm.Get_rank(), comm.Get_size()

    def strategy(self, shares, bucket_mb, threshold_kb, overlap=None, shared_memory=True):
        job = conf.offline_job([1.0] * self.n, shares=shares,
                               strategy={"name": "allreduce", "bucket_mb": bucket_mb,
                                         "ring_threshold_kb": threshold_kb, "shared_memory": shared_memory})
        s = AllReduceStrategy(RunContext.offline(self.comm, job), job.training)
        s.overlap = overlap
        return s

    def model(self, seed):
        torch.manual_seed(seed + 100 * self.rank)     # different on every rank: setup must broadcast
        m = Net()
        torch.manual_seed(seed)
        ref = Net()
        return m, ref

    def check_gradients(self, shares, rows, bucket_mb, threshold_kb, overlap):
        comm = self.comm
        m, ref = self.model(0)
        s = self.strategy(shares, bucket_mb, threshold_kb, overlap)
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

    def train(self, overlap, steps=4, shared_memory=True):
        m, _ = self.model(7)
        # many buckets, all ring (or shared memory: the same bits)
        s = self.strategy([3, 1, 2][:self.n], 0.001, 0, overlap, shared_memory)
        s.setup(m, make_opt)
        for step in range(steps):
            x, y = batch(step, 12)
            lo, hi = s.batch_slice(12)
            s.train_step(x[lo:hi], y[lo:hi])
        s.close()
        return m, torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    def run(self, out_path=None):
        comm, n = self.comm, self.n
        shares = [3, 1, 2][:n]
        parts = self.check_gradients(shares, 12, 0.001, 0, "poll")          # ring, several buckets
        if n == 3:
            assert [hi - lo for lo, hi in parts] == [6, 2, 4], parts
        self.check_gradients(shares, 12, 4, 256, "thread")                  # one bucket, MPI_Allreduce
        self.check_gradients("equal", 12, 0.001, 0, "none")
        if n == 3:                                                          # 2 rows, 3 ranks: rank 2 gets none
            assert [hi - lo for lo, hi in self.check_gradients("equal", 2, 0.001, 0, "poll")] == [1, 1, 0]
        # shares 'speed': timed passes on every rank, one set of weights everywhere, the
        # model left exactly as setup's broadcast made it
        m, ref = self.model(3)
        s = self.strategy("speed", 4, 256)
        s.setup(m, make_opt, example_input=torch.randn(8, 1, 8, 8))
        assert len(s.weights) == n and all(w > 0 for w in s.weights)
        assert comm.allgather(s.weights) == [s.weights] * n
        parts = comm.allgather(s.batch_slice(12))
        assert parts[0][0] == 0 and parts[-1][1] == 12 and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
        assert all(p.grad is None for p in m.parameters())
        s.close()
        m, flat = self.train("poll")
        for other in ("thread", "none"):
            assert torch.equal(flat, self.train(other)[1]), other
        assert torch.equal(flat, self.train("poll", shared_memory=False)[1])      # the ring itself
        assert all(b == flat.numpy().tobytes() for b in comm.allgather(flat.numpy().tobytes()))
        if self.rank == 0 and out_path:
            torch.save(m.state_dict(), out_path)
        return comm.allgather("OK")


def main():
    a = arguments()
    comm, rank, _ = join_local()
    torch.set_num_threads(1)
    out = {}
    for check in a["checks"]:
        if check == "sums":
            out[check] = sums(comm, polite=False)
        elif check == "sums_polite":
            out[check] = sums(comm, polite=True)
        elif check == "shm":
            out[check] = shm_sums(comm)
        elif check == "wait_cpu":
            out[check] = wait_cpu(comm)
        elif check == "doorbell":
            out[check] = doorbell(comm)
        elif check == "dist_doorbell":
            out[check] = dist_doorbell(comm)
        elif check == "doorbell_netns":
            out[check] = doorbell_netns(comm)
        elif check == "training":
            out[check] = Training(comm).run(a.get("out"))
        else:
            raise ValueError(f"unknown check {check!r}")
    report(rank, out)
    finish(comm)


if __name__ == "__main__":
    main()
