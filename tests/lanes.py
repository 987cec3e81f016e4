"""The suite on three pytest-xdist workers, and the tests that must run alone.

Most of an end-to-end test's time is waiting: for a heartbeat or rendezvous limit to pass,
for YARN to allocate a container, for a rank under a half-vcore quota to import torch.
Three workers overlap those waits on CI's 2 cores (the suite's budget is 20 minutes: with
two, it used 41% of the cores' time over 21 minutes). A test whose verdict rests on the
machine's time or CPU being its own (a limit of a few seconds it must reach or must not, a
CPU rate it measures, every process of a kind on the machine) is marked `alone`: it waits
for the other workers' tests to end, and their next tests wait for it (a readers-writer
lock on two files; the turnstile lets a waiting `alone` test in before new shared ones, so
it is not starved).

`-n 0` (or `-p no:xdist`) runs the suite in one process; `-n N` sets the workers. An `alone`
test keeps the other workers' tests out, not its module's fixtures: the Hadoop cluster's
idle daemons (tests/test_yarn_real.py) may run beside it.
"""
import contextlib
import fcntl
import os

WORKERS = 3


def default_workers(config):
    """Two workers unless the command line says (`-n N`), where pytest-xdist is installed;
    none under a debugger (--pdb, --trace)."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    debugging = config.getoption("usepdb", False) or config.getoption("trace", False)
    if config.option.numprocesses is None and not debugging:
        config.option.numprocesses = WORKERS
    if config.option.numprocesses and config.option.dist == "no":
        # A module's tests on one worker (its fixtures hold worlds of ranks, the Hadoop
        # cluster, a reference run: started once), the heaviest modules first (see order).
        # (xdist_group does not group under pytest 9.2, whose node ids xdist cannot suffix.)
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


# The modules that take longest (seconds on CI's 2 cores, in one process), started first so
# that the last to end is a short one; the others follow in their own order.
HEAVIEST = ("test_yarn_real", "test_recovery", "test_own_code", "test_own_code_failures", "test_failed_apps",
            "test_netem", "test_local_engine", "test_job_validation", "test_data_jobs", "test_planner",
            "test_training", "test_faults", "test_collectives", "test_notebook", "test_hypergraph")


def order(items):
    """The collected tests, the heaviest modules' first (a stable sort: within a module,
    and among the rest, the order stays)."""
    rank = {name: i for i, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(getattr(getattr(item, "module", None), "__name__", ""), len(HEAVIEST)))


_kept = None     # the lane still held exclusively for the next test, itself alone (see lane)


@contextlib.contextmanager
def lane(config, alone, next_alone=False):
    """Run the test this wraps shared with the other worker's, or `alone`. Outside xdist
    (one process) there is nobody to wait for. The lock files lie in the run's base
    temporary directory (a worker's is a folder of it), which pytest prunes as it does.
    Alone tests in a row (`next_alone`: a module's, whose fixture measured alone serves them
    all) keep the lane between them: released, it would let the other worker start a
    test that the next alone one then waits out, idle."""
    global _kept
    if not os.environ.get("PYTEST_XDIST_WORKER") or not config.option.basetemp:
        yield
        return
    if _kept is not None:
        held, _kept = _kept, None                   # exclusive already: taken by the alone test before
    else:
        d = os.path.dirname(os.path.abspath(config.option.basetemp))
        held = open(os.path.join(d, "lane"), "a")
        with open(os.path.join(d, "lane-turnstile"), "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if alone and next_alone:
            _kept = held
        else:
            fcntl.flock(held, fcntl.LOCK_UN)
            held.close()
