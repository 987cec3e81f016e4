"""Helpers for tests that run code in a real MPI world (MPICH's mpiexec, -n ranks).

`run_mpi(n, code)` runs `code` (a Python source string) on n ranks and returns the
CompletedProcess; inside, `from mpi_util import make_ctx` gives a RunContext over
MPI.COMM_WORLD (this directory is put on PYTHONPATH).
"""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mpiexec():
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if not exe:
        raise RuntimeError("mpiexec not found: pip install mpich")
    return exe


def run_mpi(n, code, timeout=120, env=None, check=True):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(code))
        path = f.name
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, e.get("PYTHONPATH", "")])
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(env or {})
    try:
        proc = subprocess.run([mpiexec(), "-n", str(n), sys.executable, path], env=e,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(path)
    if check and proc.returncode != 0:
        raise AssertionError(f"mpiexec -n {n} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def mpi_result(n, code, timeout=120):
    """Run `code` on n ranks; return the JSON that rank 0 printed as `RESULT {...}`."""
    import json
    proc = run_mpi(n, code, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT "):])


def make_ctx(comm=None, job=None, vcores=None, workdir=None):
    """A RunContext over a real communicator, as the launcher would build it."""
    from mpi4py import MPI

    from training.context import RankInfo, RunContext
    comm = comm or MPI.COMM_WORLD
    n = comm.Get_size()
    vcores = vcores or [1.0] * n
    ranks = [RankInfo(rank=r, group="g", instance=r, container=f"g_{r}", vcores=vcores[r],
                      memory_mib=1024, gpus=0) for r in range(n)]
    wd = workdir
    if wd is None:                              # this rank's own, gone when it exits
        wd = tempfile.mkdtemp(prefix=f"rank{comm.Get_rank()}_")
        atexit.register(shutil.rmtree, wd, True)
    return RunContext(comm=comm, rank=comm.Get_rank(), world_size=n, ranks=ranks, job=job,
                      app_id="test", generation=0, workdir=wd,
                      checkpoint_uri="file://" + os.path.join(wd, "ckpt"),
                      logdir=os.path.join(wd, "tb"))
