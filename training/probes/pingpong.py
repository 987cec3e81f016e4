"""Ping-pong between two joined ranks: one-way seconds of messages of given sizes.

Args: sizes [[bytes, repetitions, buffers], ...] (the buffers cycle, so large messages
are not in the cache), trials (after one warm-up; the fastest counts, or the median
when `loaded`), polite (rank 1 waits politely), work (seconds each side computes
between its messages), shm (optional [bytes, repetitions]: also time the shared-memory
all-reduce of that many bytes, training.collectives.shm). Result: {bytes: one-way
seconds}, and "shm": seconds per all-reduce (None where the ranks cannot share memory).
"""
import statistics
import time

import numpy as np

from launcher.world import join_local
from training import collectives
from training.probes import arguments, finish, report


def shared_allreduce_s(comm, nbytes, reps, trials):
    """The fastest trial's seconds per shared-memory all-reduce of nbytes (float32)."""
    import torch

    from training.collectives import shm
    arena = shm.Arena.create(comm, nbytes, 1)
    if arena is None:
        return None
    op = arena.allreduce(arena.tensor(nbytes // 4, torch.float32))
    best = float("inf")
    for trial in range(trials + 1):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            op.run()
        if trial:
            best = min(best, comm.allreduce((time.perf_counter() - t) / reps, op=_max()))
    return best


def _max():
    from mpi4py import MPI
    return MPI.MAX


def main():
    a = arguments()
    comm, rank, _ = join_local()
    collectives.set_polite(rank == 1 and a["polite"])
    wait, work_s = collectives.wait, a["work"]

    def work():                                 # a rank computes between its messages
        t = time.perf_counter()
        while time.perf_counter() - t < work_s:
            pass

    out = {}
    for size, reps, pool in a["sizes"]:
        bufs = [np.ones(size, np.uint8) for _ in range(pool)]
        trials = []
        for trial in range(a["trials"] + 1):
            comm.Barrier()
            t = time.perf_counter()
            for i in range(reps):
                buf = bufs[i % pool]
                if rank == 0:
                    work(); wait(comm.Isend(buf, 1, 5)); wait(comm.Irecv(buf, 1, 5))   # noqa: E702
                else:
                    wait(comm.Irecv(buf, 0, 5)); work(); wait(comm.Isend(buf, 0, 5))   # noqa: E702
            if trial:                               # the first trial warms up
                trials.append(((time.perf_counter() - t) / reps - 2 * work_s) / 2)
        out[size] = min(trials) if not a["loaded"] else statistics.median(trials)
    if a.get("shm"):
        out["shm"] = shared_allreduce_s(comm, *a["shm"], trials=a["trials"])
    report(rank, out)
    finish(comm)


if __name__ == "__main__":
    main()
