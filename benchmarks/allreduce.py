"""All-reduce time and bandwidth, 1 KiB .. 64 MiB: ours vs mpi4py Allreduce vs gloo.

    python benchmarks/allreduce.py [--quick] [--ranks 2]

starts itself on RANKS processes joined as an application's containers join
(common.relaunch: launcher.world.spawn_local, MPI singletons connected through a store,
so MPICH talks over its network module as the product's ranks do), then every rank
times, for each message size, in interleaved trials:

    ours   what GradientReducer runs for a bucket of that size, in place on float32:
           when every rank is on this host, from 8 KiB up the shared-memory sum of a
           tensor in an Arena (training.collectives.shm); otherwise (or --no-shm) a
           persistent MPI_Allreduce below the ring threshold and the chunked ring of
           persistent point-to-point requests from it up (PreparedAllreduce);
    once   training.collectives.allreduce_ (the same algorithms, set up per call);
    mpi    mpi4py comm.Allreduce(MPI.IN_PLACE, numpy float32 array);
    gloo   torch.distributed.all_reduce on a gloo process group (file:// store) in
           the same processes.

Time per call = the slowest rank's time for `reps` back-to-back calls / reps; the
median over trials is reported. Bandwidth = message bytes / time (algorithm
bandwidth; the ring moves 2 (n-1)/n of it per rank). Prints a table and writes
benchmarks/results/allreduce.json (or --out).
gloo uses TCP.
"""
import argparse
import os
import sys
import tempfile
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = [1 << k for k in range(10, 27, 2)]           # 1 KiB, 4 KiB, ..., 64 MiB
QUICK_SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes, trials and repetitions")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--chunk-kb", type=int, default=None, help="ring chunk (default: the library's)")
    p.add_argument("--threshold-kb", type=float, default=None, help="ring threshold (default: the library's)")
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--no-shm", action="store_true", help="ours without shared memory: the ring")
    common.add_out(p, "allreduce")
    return p.parse_args(argv)



def reps_for(nbytes, quick):
    budget = (1 << 25) if quick else (1 << 27)       # bytes moved per trial and contender
    return int(min(200 if quick else 1000, max(3, budget // nbytes)))


def bench(args, comm):
    import numpy as np
    import torch
    from mpi4py import MPI

    from training import collectives
    from training.collectives import shm

    torch.set_num_threads(1)
    rank, n = comm.Get_rank(), comm.Get_size()
    chunk = (args.chunk_kb << 10) if args.chunk_kb else collectives.RING_CHUNK_BYTES
    threshold = collectives.RING_THRESHOLD_BYTES
    if args.threshold_kb is not None:
        threshold = args.threshold_kb * 1024
    workspace = np.empty(chunk // 4, np.float32)

    dist = None
    if not args.no_gloo:
        import torch.distributed as dist
        path = comm.bcast(tempfile.mktemp(prefix="gloo-store-") if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)

    prepared = {}

    def ours(t, a):
        prepared[t.numel()][0].run()

    def prepare(nbytes):
        """(the op, its Arena or None): GradientReducer's choice for a bucket of nbytes."""
        if nbytes >= min(threshold, shm.THRESHOLD_BYTES) and not args.no_shm:
            arena = shm.Arena.create(comm, nbytes, 1)
            if arena is not None:
                return arena.allreduce(arena.tensor(nbytes // 4, torch.float32)), arena
        return collectives.PreparedAllreduce(torch.zeros(nbytes // 4), comm, threshold_bytes=threshold,
                                             chunk_bytes=chunk, workspace=workspace), None

    def once(t, a):
        collectives.allreduce_(t, comm, threshold_bytes=threshold, chunk_bytes=chunk, workspace=workspace)

    def mpi(t, a):
        comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def gloo(t, a):
        dist.all_reduce(t)

    contenders = {"ours": ours, "once": once, "mpi": mpi}
    if dist is not None:
        contenders["gloo"] = gloo
    sizes = QUICK_SIZES if args.quick else SIZES
    trials = args.trials or (3 if args.quick else 5)
    rows = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)              # zeros: sums stay finite, any count of reps
        a = t.numpy()
        prepared[t.numel()] = prepare(nbytes)
        reps = reps_for(nbytes, args.quick)
        names = list(contenders)
        times = {k: [] for k in names}
        for name in names:                         # warm up (first-touch, connections)
            contenders[name](t, a)
        for trial in range(trials):
            order = names[trial % len(names):] + names[:trial % len(names)]
            for name in order:
                fn = contenders[name]
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(t, a)
                dt = (time.perf_counter() - t0) / reps
                times[name].append(comm.allreduce(dt, op=MPI.MAX))
        med = {k: float(np.median(v)) for k, v in times.items()}
        row = {"bytes": nbytes, "reps": reps, "trials": trials,
               "algorithm": prepared[t.numel()][0].algorithm}
        for k, v in med.items():
            row[f"{k}_s"] = v
            row[f"{k}_GBps"] = nbytes / v / 1e9
        row["ours_vs_mpi"] = med["mpi"] / med["ours"]          # > 1: ours faster
        row["once_vs_mpi"] = med["mpi"] / med["once"]
        if "gloo" in med:
            row["ours_vs_gloo"] = med["gloo"] / med["ours"]
        rows.append(row)
        op, arena = prepared.pop(t.numel())
        op.free()
        if arena is not None:
            del op
            arena.close()
        if rank == 0:
            print_row(row, header=len(rows) == 1)
    if dist is not None:
        dist.destroy_process_group()
    return rows, {"ranks": n, "chunk_bytes": chunk, "threshold_bytes": threshold,
                  "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                  "mpi4py": __import__("mpi4py").__version__, "torch": torch.__version__}


def fmt_size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def print_row(r, header):
    if header:
        print(f"{'size':>8} {'alg':>4} | {'ours ms':>9} {'GB/s':>6} | {'once ms':>9} | "
              f"{'mpi ms':>9} {'GB/s':>6} | "
              f"{'gloo ms':>9} {'GB/s':>6} | {'ours/mpi':>8} {'ours/gloo':>9}")
    g = (f"{r['gloo_s'] * 1e3:9.3f} {r['gloo_GBps']:6.2f}" if "gloo_s" in r else f"{'-':>9} {'-':>6}")
    og = f"{r['ours_vs_gloo']:8.2f}x" if "ours_vs_gloo" in r else f"{'-':>9}"
    print(f"{fmt_size(r['bytes']):>8} {r['algorithm']:>4} | {r['ours_s'] * 1e3:9.3f} {r['ours_GBps']:6.2f} | "
          f"{r['once_s'] * 1e3:9.3f} | "
          f"{r['mpi_s'] * 1e3:9.3f} {r['mpi_GBps']:6.2f} | {g} | {r['ours_vs_mpi']:7.2f}x {og}", flush=True)



def main(argv=None):
    return common.mpi_main(__file__, argv, parse_args, bench, ratios="ours_vs_X = time_X / time_ours (> 1: ours faster)")


if __name__ == "__main__":
    sys.exit(main())
