"""All-reduce bandwidth between 2 ranks on 2 emulated nodes, against the link rate.

    sudo python benchmarks/netem_allreduce.py [--rates 100mbit,1gbit,10gbit,none] [--sizes 1,4,16]

For each link rate it builds a 2-node emulated network exactly as the local engine
does for `network: {nodes: 2, bandwidth: RATE}` (yarnapp/backends/local/netem.py),
starts one process in each node's namespace, and forms the world as a container
does: launcher.network.configure() (MPI over TCP on the node's own interface, no
shared memory), then launcher.world.join through a directory store. Each rank then
times, per message size, float32 sum all-reduces:

    mpi    mpi4py comm.Allreduce(MPI.IN_PLACE, array)
    ours   training.collectives.allreduce_ (the chunked ring from its threshold up),
           when that module imports

Time per call = the slowest rank's time, median over at least `--reps` calls (more
for small messages: ~3 s of them) after a warm-up.
Bandwidth = message bytes / time: with 2 ranks every rank must send (and receive)
2 (n-1)/n = 1 whole message, so this is what each link direction carried, and it
is compared with the link rate. The ceiling is below the rate: TCP/IP and Ethernet
headers take ~4.4% of every 1514-byte frame, so at most ~0.956 of the rate carries
data, and with both directions busy the ACKs take ~2% more (one plain TCP stream
each way between two 100 Mbit/s nodes measured 0.93 of the rate). `none` (no
shaping) shows what this machine itself manages over veths.
Prints a table and writes benchmarks/results/netem_allreduce.json (or --out).
Needs root; everything it creates is removed at the end, however it ends.
"""
import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PAYLOAD = 1448 / 1514          # TCP payload per Ethernet frame (MTU 1500, TCP timestamps)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100mbit,1gbit,10gbit,none",
                   help="comma-separated link rates (none: unshaped)")
    p.add_argument("--sizes", default="1,4,16", help="message sizes in MiB, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="least timed calls per size and contender "
                   "(more for small messages: about 3 s of calls)")
    common.add_out(p, "netem_allreduce")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)   # rank, inside a node
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reps-list", default=None, help=argparse.SUPPRESS)    # per size, set by the driver
    return p.parse_args(argv)


# -- inside a node: one rank ---------------------------------------------------------

def child(args):
    import numpy as np

    from launcher import network, world
    from launcher.store import FileStore

    net = network.configure()            # the container's path: MPI over its own address
    store = FileStore(args.store)
    comm, _ = world.join(store, 0, args.child, 2, "bench", timeout=120)
    from mpi4py import MPI
    try:
        from training import collectives
    except ImportError:                  # not finished yet where this runs: MPI only
        collectives = None
    contenders = {"mpi": lambda a: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)}
    if collectives is not None:
        contenders["ours"] = lambda a: collectives.allreduce_(a, comm)
    rows = []
    for mib, reps in zip([float(s) for s in args.sizes.split(",")], [int(r) for r in args.reps_list.split(",")]):
        a = np.zeros(int(mib * (1 << 20)) // 4, np.float32)
        row = {"bytes": a.nbytes, "reps": reps}
        for name, fn in contenders.items():
            fn(a)                                    # warm-up: connections, first touch
            times = []
            for _ in range(reps):
                comm.Barrier()
                t0 = time.perf_counter()
                fn(a)
                times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            row[f"{name}_s"] = float(np.median(times))
        rows.append(row)
    if args.child == 0:
        mpi_env = {k: os.environ.get(k) for k in network.mpi_env(net["addr"])}
        print(json.dumps({"rows": rows, "net": dict(net, mpi_env=mpi_env), "contenders": list(contenders),
                          "mpi_library": MPI.Get_library_version().splitlines()[0].strip()}), flush=True)
    comm.Barrier()
    sys.stdout.flush()
    os._exit(0)


# -- the driver: one emulated network per rate ---------------------------------------

def run_rate(rate_bps, args):
    from launcher.procs import die_with_parent
    from yarnapp.backends.local import netem

    net = netem.Network(f"bench_{secrets.token_hex(3)}", 2, rate_bps=rate_bps)
    store = tempfile.mkdtemp(prefix="netem-bench-")
    expected = [float(m) * (1 << 20) * 8 / (rate_bps or 20e9) for m in args.sizes.split(",")]
    reps = ",".join(str(int(min(100, max(args.reps, 3.0 / t)))) for t in expected)
    procs = []
    try:
        net.create()
        for rank in (1, 0):
            env = dict(os.environ, **net.container_env(rank), OMP_NUM_THREADS="1", YARNAPP_APP_ID=net.app_id,
                       PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(rank),
                   "--store", store, "--sizes", args.sizes, "--reps-list", reps]
            enter = net.enter(rank)           # as the local engine starts a container on a node

            def setup(enter=enter):
                die_with_parent()
                enter()
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=setup))
        before = net.counters()
        out, _ = procs[-1].communicate(timeout=900)
        procs[0].wait(timeout=60)
        after = net.counters()
        if procs[-1].returncode != 0 or not out.strip():
            raise RuntimeError(f"rank 0 exited with status {procs[-1].returncode}")
        result = json.loads(out.strip().splitlines()[-1])
        result["tx_bytes"] = {n: after[n]["tx_bytes"] - before.get(n, {}).get("tx_bytes", 0) for n in after}
        result["qdiscs"] = net.qdiscs(0)
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        net.remove()
        subprocess.run(["rm", "-rf", store])


def fmt_rate(bps):
    if bps is None:
        return "none"
    return f"{bps / 1e9:g}gbit" if bps >= 1e9 else f"{bps / 1e6:g}mbit"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    from conf.units import parse_rate_bps
    from yarnapp.backends.local import netem
    why = netem.unavailable_reason()
    if why:
        print(f"Error: {why}", file=sys.stderr)
        return 1
    rates = [None if r.strip() == "none" else parse_rate_bps(r) for r in args.rates.split(",")]
    t0 = time.time()
    rows, meta = [], {}
    print(f"{'link':>8} {'size':>7} | {'mpi ms':>8} {'Mbit/s':>8} {'of link':>7} | "
          f"{'ours ms':>8} {'Mbit/s':>8} {'of link':>7}", flush=True)
    for rate in rates:
        res = run_rate(rate, args)
        meta.update(mpi_library=res["mpi_library"], contenders=res["contenders"], transport=res["net"])
        for r in res["rows"]:
            row = {"link": fmt_rate(rate), "link_bps": rate, "bytes": r["bytes"], "reps": r["reps"],
                   "qdiscs": res["qdiscs"],
                   "link_tx_bytes": res["tx_bytes"]}
            cells = []
            for name in ("mpi", "ours"):
                if f"{name}_s" not in r:
                    cells.append(f"{'-':>8} {'-':>8} {'-':>7}")
                    continue
                bps = r["bytes"] * 8 / r[f"{name}_s"]
                row[f"{name}_s"] = r[f"{name}_s"]
                row[f"{name}_bps"] = bps
                frac = f"{bps / rate:7.2f}" if rate else f"{'-':>7}"
                if rate:
                    row[f"{name}_of_link"] = bps / rate
                cells.append(f"{r[f'{name}_s'] * 1e3:8.1f} {bps / 1e6:8.1f} {frac}")
            rows.append(row)
            print(f"{fmt_rate(rate):>8} {r['bytes'] >> 20:>3} MiB | {cells[0]} | {cells[1]}", flush=True)
    for row in rows:
        if row["link"] == "100mbit" and row["bytes"] == 16 << 20:
            frac = row["mpi_of_link"]
            print(f"100 Mbit/s link, 16 MiB all-reduce: {row['mpi_bps'] / 1e6:.1f} Mbit/s = {frac:.2f} of the "
                  f"link rate ({frac / PAYLOAD:.2f} of the ~{PAYLOAD * 100:.0f} Mbit/s TCP can carry): "
                  f"{'within' if frac >= 0.8 else 'NOT within'} 20%")
    meta.update(common.machine_meta(), least_reps=args.reps, wall_s=round(time.time() - t0, 1),
                payload_fraction=PAYLOAD,
                bandwidth="message bytes / time; with 2 ranks each link direction carries one message")
    common.write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
