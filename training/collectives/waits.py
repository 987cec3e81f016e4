"""Waiting for MPI requests, and tensors as MPI buffers (every strategy's waits).

`wait` completes requests as MPI does (MPICH spins), or, on a rank throttled by a CPU
quota (`set_polite`), spinning briefly and then sleeping between tests. `as_buffer`
hands a contiguous CPU tensor to MPI as the numpy view of its own memory (no copy).
"""
import threading
import time

import numpy as np
import torch

from training import cputime

SPIN_S = 2e-4                       # a polite wait spins this long before it sleeps
MAX_PAUSE_S = 200e-6                # ... and then sleeps at most this long between tests

_polite = False
_MPI = None


def _mpi():
    """mpi4py.MPI, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI
        _MPI = MPI
    return _MPI


def set_polite(flag):
    """Make every wait of this module (and of the strategies) sleep once it has spun SPIN_S.

    MPICH busy-polls inside blocking calls. That is right for a rank with a core of its
    own, and wrong for one throttled by a CPU quota (a 0.5-vcore container): it burns
    its quota spinning while it waits for the others, is then stopped by the scheduler,
    and every other rank waits for it in the next exchange. The runner turns this on
    for a rank whose vcores are fewer than its threads (`RankInfo.throttled`).
    """
    global _polite
    _polite = bool(flag)




def is_polite():
    """Whether this process's waits are polite (set_polite)."""
    return _polite


def wait(reqs, polite=None):
    """Complete one MPI request or a list of them.

    Not polite: MPI_Waitall (MPICH spins). Polite (the module setting, or `polite=True`):
    test for SPIN_S (while the peers are present, a pipelined transfer completes in this
    phase at full speed), then sleep between tests, 20 µs doubling up to MAX_PAUSE_S.
    """
    with cputime.counting("wait"):
        _wait(reqs, polite)


def _wait(reqs, polite):
    mpi = _mpi()
    many = isinstance(reqs, (list, tuple))
    if not (_polite if polite is None else polite):
        if many:
            mpi.Request.Waitall(reqs)
        else:
            reqs.Wait()
        return
    _sleepy((lambda: mpi.Request.Testall(reqs)) if many else reqs.Test)


def wait_until(test, polite=None):
    """Call `test()` until it returns True: spinning, or, polite (as `wait`), spinning for
    SPIN_S and then sleeping between calls (shared-memory reductions wait with this).
    Off the main thread a spin yields the GIL at every call: the thread that runs
    backward must not wait for a communication thread's spinning."""
    with cputime.counting("wait"):
        if _polite if polite is None else polite:
            _sleepy(test)
        elif threading.current_thread() is threading.main_thread():
            while not test():
                pass
        else:
            while not test():
                time.sleep(0)


def _sleepy(test):
    deadline = time.perf_counter() + SPIN_S
    while time.perf_counter() < deadline:
        if test():
            return
    pause = 20e-6
    while not test():
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)


def mpi_datatype(dtype):
    """The MPI datatype of a float32/float64 torch dtype (what model-parallel layers send)."""
    from mpi4py import MPI
    if dtype == torch.float32:
        return MPI.FLOAT
    if dtype == torch.float64:
        return MPI.DOUBLE
    raise TypeError(f"MPI transfers here support float32 and float64 tensors, not {dtype}")


def as_buffer(x):
    """The 1-D numpy view of a tensor's memory (no copy), for use as an MPI buffer.

    Accepts a contiguous CPU torch tensor (with or without requires_grad) or a
    contiguous numpy array; anything else would need a copy, which would silently
    drop the result of an in-place reduction.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"all-reduce needs a CPU tensor, got one on {x.device}; "
                             "move it with .cpu() (and copy the result back)")
        arr = x.detach().numpy() if x.requires_grad else x.numpy()
    else:
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError("all-reduce needs a contiguous tensor; reduce x.contiguous() and "
                         "copy the result back")
    return arr if arr.ndim == 1 else arr.reshape(-1)

