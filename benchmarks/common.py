"""What every benchmark needs: relaunching itself under mpiexec, describing the
machine it ran on, and writing its results as JSON beside the printed table."""
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD_ENV = "YARNAPP_BENCH_CHILD"
# MPICH over TCP sockets (libfabric tcp, no shared memory), as launcher-joined ranks talk.
TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def is_child():
    return os.environ.get(CHILD_ENV) == "1"


def relaunch(script, argv, ranks, transport="shm", bind=None):
    """Re-run `script` under `mpiexec -n ranks` (one thread per rank); return its exit code."""
    search = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    exe = shutil.which("mpiexec", path=search)
    if not exe:
        sys.exit("Error: mpiexec not found (pip install mpich)")
    env = dict(os.environ, **{CHILD_ENV: "1", "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    if transport == "tcp":
        env.update(TCP_ENV)
    cmd = [exe, "-n", str(ranks)] + (["-bind-to", bind] if bind else [])
    return subprocess.call(cmd + [sys.executable, os.path.abspath(script)] + list(argv), env=env)


def mpi_main(script, argv, parse_args, bench, **meta_extra):
    """main() of a benchmark that runs itself under `mpiexec -n args.ranks`: relaunch, then
    on every rank `bench(args) -> (rows, meta)`; rank 0 writes args.out."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not is_child():
        return relaunch(script, argv, args.ranks, args.transport, args.bind)
    sys.path.insert(0, ROOT)
    from mpi4py import MPI
    t0 = time.time()
    rows, meta = bench(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        meta.update(machine_meta(), quick=args.quick, bind=args.bind, transport=args.transport,
                    wall_s=round(time.time() - t0, 1), **meta_extra)
        write_results(args.out, meta, rows)
    return 0


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def machine_meta():
    return {"host": platform.node(), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": os.getloadavg(),
            "mpich_cvars": {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR_")}}


def write_results(path, meta, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
