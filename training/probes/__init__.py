"""Programs run as processes of their own, and how to run them.

A probe is a module run with `python -m MODULE ARGS_JSON` on `size` processes that join
one MPI world as the containers of an application join (launcher.world.spawn_local /
join_local: MPI singletons connected through a store, so they talk over the network
module as a job's ranks do, not over shared memory). Rank 0 prints one line
`RESULT {json}` (`report`), every rank ends with `finish(comm)`; `run` starts them,
waits, and returns that JSON.

The planner's probes (training.planner measures with them):
    pingpong      one-way times of messages between two ranks (the link)
    wait_cpu      the CPU a polite wait costs
    strategy_cpu  every strategy's own CPU per step (training.cputime, read, not patched)
    hog           a process busy a given fraction of every millisecond (a rank beyond the cores)
    co_runner     a process training the job's model in a loop (the other ranks' load)
The tests' ranks (tests/ranks/) and the benchmarks run the same way.
"""
import json
import os
import subprocess
import sys

TAG = "RESULT "
FAILED = "FAILED "     # a probe's line `FAILED <what>: <error>` on stderr: what could not run (strategy_cpu)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProbeError(RuntimeError):
    """A probe that failed or did not finish; str() ends with the last line it wrote."""


def stop_cleanly_on_sigterm():
    """`kill` (SIGTERM) or `timeout` stops this process as Ctrl-C does: by an exception, so
    its `finally` blocks run (worlds of run_local killed, cgroups removed), where the
    default action would end it at once and leave them behind. For scripts that start
    worlds (benchmarks); call it in the main process only."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signum}")
    signal.signal(signal.SIGTERM, stop)


def arguments():
    """In a probe: the JSON it was given (argv[1]), or {}."""
    return json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}


def report(rank, result):
    """In a probe: rank 0 prints the one line `run` returns."""
    if rank == 0:
        print(TAG + json.dumps(result), flush=True)


def finish(comm):
    """In a probe, at its end: once every rank is done (a Barrier), exit without
    MPI_Finalize's disconnect handshake between singleton-joined processes (seconds per
    world), as launcher.rank does."""
    comm.Barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def environment(extra_paths=(), **env):
    """The environment of a probe: this one, one torch/OpenMP thread, a rank's malloc
    settings (launcher.malloc), the repository (and `extra_paths`) first on PYTHONPATH;
    `env` is set over it (OMP_NUM_THREADS included)."""
    from launcher import malloc
    e = malloc.environment(dict(os.environ, **{"OMP_NUM_THREADS": "1", **env}))
    e["PYTHONPATH"] = os.pathsep.join([*extra_paths, ROOT, e.get("PYTHONPATH", "")])
    return e


def run(module, size, args=None, timeout=120, env=None):
    """Run `python -m module ARGS_JSON` (or `python module ...` for a path ending in .py)
    on `size` joined processes; rank 0's RESULT (parsed).

    Raises ProbeError when a process fails, none reports, or `timeout` seconds pass
    (then every process is killed)."""
    head = [module] if module.endswith(".py") else ["-m", module]
    return run_argv([sys.executable, *head] + ([json.dumps(args)] if args is not None else []), size,
                    timeout, env)


def run_argv(argv, size, timeout=120, env=None):
    """`run` for any command line `argv` (a benchmark script with its own options)."""
    from launcher.world import run_local
    module = os.path.basename(argv[1]) if argv[1:2] != ["-m"] else argv[2]
    try:
        outs = run_local(argv, size, env=env or environment(), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"{module} on {size} ranks did not finish in {timeout:g}s") from None
    lines = [ln for ln in outs[0][1].splitlines() if ln.startswith(TAG)]
    if any(rc != 0 for rc, _, _ in outs) or not lines:
        codes = [rc for rc, _, _ in outs]
        first = sorted(outs, key=lambda o: o[0] in (0, -9))     # what failed by itself speaks first, not those killed
        tail = next((e.strip().splitlines()[-1] for _, _, e in first if e.strip()), "no output")
        err = ProbeError(f"{module} on {size} ranks failed (exit codes {codes}): {tail}")
        err.output = "\n".join(o[-3000:] + e[-3000:] for _, o, e in outs)
        raise err
    return json.loads(lines[-1][len(TAG):])
