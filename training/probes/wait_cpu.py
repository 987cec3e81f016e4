"""What a polite wait costs in CPU (training.planner.cpu.measure_wait_cpu).

Two joined ranks, both waiting politely. For every entry of `late`, rank 0 computes
that long before it sends 8 bytes, rank 1 waits for them counting its own CPU and wall
seconds; then broadcasts of each of `sizes` bytes after 5 ms, `bcasts` of each,
interleaved, from buffers not in the cache (a step's activations are not). Result:
{late: [[cpu, wall], ...], "b<size>": [[cpu, wall], ...]} of rank 1's waits.
"""
import time

import numpy as np

from launcher.world import join_local
from training import collectives
from training.probes import arguments, finish, report


def main():
    a = arguments()
    comm, rank, _ = join_local()
    collectives.set_polite(True)
    collectives.doorbells(comm)                 # one host, as the runner's ranks wait here
    small, out = np.zeros(8, np.uint8), {}
    pool = {n: [np.zeros(n, np.uint8) for _ in range(4)] for n in a["sizes"]}   # cold, as a step's tensors
    plan = [(x, str(x)) for x in a["late"]] + [(0.005, n) for n in a["sizes"]] * a["bcasts"]
    for i, (late, key) in enumerate(plan):
        comm.Barrier()
        if rank == 0:
            t = time.perf_counter()
            while time.perf_counter() - t < late:
                pass
        if isinstance(key, int):                # a collective, as the strategies move data
            c, t = time.process_time(), time.perf_counter()
            collectives.wait(comm.Ibcast(pool[key][i % 4], root=0))
            key = "b%d" % key
        elif rank == 0:
            collectives.wait(comm.Isend(small, 1, 5))
            comm.Recv(small, 1, 6)
            continue
        else:
            c, t = time.process_time(), time.perf_counter()
            collectives.wait(comm.Irecv(small, 0, 5))
        if rank == 1:
            out.setdefault(key, []).append([time.process_time() - c, time.perf_counter() - t])
            if not key.startswith("b"):
                comm.Send(small, 0, 6)
    comm.Barrier()
    if rank == 0:
        report(rank, comm.recv(source=1))
    else:
        comm.send(out, dest=0)
    finish(comm)


if __name__ == "__main__":
    main()
