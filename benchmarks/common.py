"""What every benchmark needs: relaunching itself on ranks joined as an application's
containers join, describing the machine it ran on, and writing its results as JSON
beside the printed table."""
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


def is_child():
    return os.environ.get(CHILD_ENV) == "1"


def relaunch(script, argv, ranks):
    """Re-run `script` on `ranks` processes that join one world as an application's
    containers join (launcher.world.spawn_local: MPI singletons connected through a store,
    over MPICH's network module, as the product's ranks talk), one thread each; rank 0's
    output goes to this terminal. Returns the worst exit code."""
    sys.path.insert(0, ROOT)
    from launcher.world import spawn_local
    from training import probes
    env = probes.environment(**{CHILD_ENV: "1"})
    procs, store = spawn_local([sys.executable, os.path.abspath(script)] + list(argv), ranks, env=env)
    try:
        return max(p.wait() for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(store, ignore_errors=True)


def world():
    """In a relaunched benchmark: (comm, rank, size) of the joined world."""
    from launcher.world import join_local
    return join_local()


def mpi_main(script, argv, parse_args, bench, **meta_extra):
    """main() of a benchmark that runs on args.ranks joined ranks: relaunch, then on every
    rank `bench(args, comm) -> (rows, meta)`; rank 0 writes args.out."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not is_child():
        return relaunch(script, argv, args.ranks)
    sys.path.insert(0, ROOT)
    comm, rank, _ = world()
    t0 = time.time()
    rows, meta = bench(args, comm)
    if rank == 0:
        meta.update(machine_meta(), quick=args.quick, world="joined singletons (launcher.world.spawn_local)",
                    wall_s=round(time.time() - t0, 1), **meta_extra)
        write_results(args.out, meta, rows)
    from training.probes import finish
    finish(comm)


def random_batches(batch, shape, classes=10, count=16, seed=1):
    """`count` batches of random inputs of `shape` with random labels, to cycle through.

    Not one batch trained over and over: a fixed batch is learnt within ~30 steps, its
    wrong classes' probabilities then fall below 1e-38, and every product with such
    denormal numbers runs up to 50x slower on a CPU (MKL's sgemm of the classifier's dW,
    16 x 8192 by 16 x 10: 2.6 ms against 0.05 ms), a cost real training does not pay.
    Random labels over count x batch samples keep the loss near log(classes) for the
    benchmarks' few hundred steps."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(count)]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def machine_meta():
    return {"host": platform.node(), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": os.getloadavg(), "commit": commit(),
            "mpich_cvars": {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR_")}}


def commit():
    """The repository's commit, "+" where its files differ from it (a result matched to its code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+" if dirty else "")) or None


def add_out(parser, name):
    """The benchmark's --out: by default results/NAME.json, and results/NAME_quick.json
    with --quick (a quick run overwrote the full run's results the README cites)."""
    parser.add_argument("--out", default=None, help=f"JSON to write (default results/{name}.json; with --quick, "
                                                    f"results/{name}_quick.json)")
    parse = parser.parse_args

    def parse_args(*a, **k):
        args = parse(*a, **k)
        if args.out is None:
            args.out = os.path.join(HERE, "results", f"{name}{'_quick' if getattr(args, 'quick', False) else ''}.json")
        return args
    parser.parse_args = parse_args
    return parser


def write_results(path, meta, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def submit(job, log_lines=()):
    """A real `yarnapp submit` of `job` (a dict), waited for: its final status; any other
    end than SUCCEEDED ends the benchmark with one line naming the job. log_lines: the
    containers' log lines holding any of these are kept in the status, as "log_lines"."""
    import yarnapp
    run = yarnapp.submit(job)
    st = run.wait(timeout=1800)
    if st["state"] != "SUCCEEDED":
        sys.exit(f"Error: {job['name']} {st['state']}: {run.failure_message()}")
    if log_lines:
        st["log_lines"] = [line for text in run.logs().values() for line in str(text).splitlines()
                           if any(m in line for m in log_lines)]
    return st
