"""What a rank knows about its world: handed to training by the launcher.

Training code never reaches into launcher internals; it gets a RunContext (the
argument of `run.function`, or `training.context.current()` from a script).
"""
import dataclasses
import json
import os
import time
from typing import Any, Callable, List, Optional


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    group: str
    instance: int
    container: str
    vcores: float
    memory_mib: int
    gpus: int
    omp_threads: Optional[int] = None       # its group's env's OMP_NUM_THREADS, if set

    @property
    def threads(self):
        """Compute threads for this rank: its group's OMP_NUM_THREADS, else its vcores,
        rounded up, at least 1."""
        return self.omp_threads or max(1, int(-(-self.vcores // 1)))

    @property
    def throttled(self):
        """A CPU quota below one core per thread (e.g. 0.5 vcore): waits should sleep."""
        return self.vcores < self.threads


def rank_infos(job):
    """One RankInfo per rank of conf.JobSpec `job`, in rank order (JobSpec.ranks)."""
    fields = [f.name for f in dataclasses.fields(RankInfo)]
    return [RankInfo(**{k: r[k] for k in fields}) for r in job.ranks()]


@dataclasses.dataclass
class RunContext:
    comm: Any                    # mpi4py intracommunicator of the whole world
    rank: int
    world_size: int
    ranks: List[RankInfo]        # every rank of the world, in rank order
    job: Any                     # conf.JobSpec
    app_id: str
    generation: int              # 0 on the first world, +1 after every restart
    workdir: str                 # this container's working directory
    checkpoint_uri: str
    logdir: str
    publish: Optional[Callable[[str, bytes], None]] = None   # store writer (set by the launcher)
    heartbeat_path: Optional[str] = None
    # The torch.distributed contract (launcher.torch_env), also exported as RANK,
    # LOCAL_RANK, MASTER_ADDR... in the environment of every rank.
    local_rank: int = 0          # among this application's containers on the same host
    local_world_size: int = 1
    group_rank: int = 0          # the index of this rank's host (torchrun's node rank)
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    checkpoint_siblings: Optional[str] = None    # checkpoint.uri unset: where other applications' directories are
    tensorboard: Any = None      # own code's rank 0: a training.tensorboard.ReportLog of report()/final()
    finished: bool = False       # final() was called
    comm_used: bool = False      # `comm` was read (launcher.rank: a rank whose code never did
                                 # takes part in no MPI call, and need not wait for its peers)

    def __getattribute__(self, name):
        if name == "comm":
            object.__setattr__(self, "comm_used", True)
        return object.__getattribute__(self, name)

    @classmethod
    def offline(cls, comm, job, app_id="offline", workdir="/tmp"):
        """A context for driving a strategy outside the launcher (the planner's probes,
        benchmarks): the ranks of conf.JobSpec `job` on `comm`, no checkpoints or logs."""
        return cls(comm=comm, rank=comm.Get_rank(), world_size=comm.Get_size(), ranks=rank_infos(job), job=job,
                   app_id=app_id, generation=0, workdir=workdir, checkpoint_uri="", logdir="")

    @classmethod
    def alone(cls):
        """A world of one rank outside a container (`python train.py`): this process on this
        machine's cores and GPUs, no checkpoints or logs."""
        import psutil
        import torch
        from mpi4py import MPI
        me = RankInfo(rank=0, group="local", instance=0, container="local_0", vcores=float(os.cpu_count() or 1),
                      memory_mib=psutil.virtual_memory().total // 2**20, gpus=torch.cuda.device_count())
        return cls(comm=MPI.COMM_SELF, rank=0, world_size=1, ranks=[me], job=None, app_id="local", generation=0,
                   workdir=os.getcwd(), checkpoint_uri="", logdir="")

    @property
    def run_logdir(self):
        """This application's TensorBoard run, `<logdir>/<app id>`: where a SummaryWriter of
        your own belongs (the runs of one experiment's logdir side by side, each its own
        curves; `logdir` itself is the experiment's, shared by its applications)."""
        return self.logdir.rstrip("/") + "/" + self.app_id if self.logdir else ""

    @property
    def me(self):
        return self.ranks[self.rank]

    @property
    def device(self):
        """Where this rank computes: cuda:0 when its container has GPUs and CUDA is
        available, else the CPU (training.devices.rank_device, the one rule)."""
        from training.devices import rank_device
        return rank_device(self.me)

    @property
    def restart_count(self):
        """How many times the world was formed again before this one (torchrun's
        TORCHELASTIC_RESTART_COUNT): the generation."""
        return self.generation

    def init_process_group(self, backend=None, **kwargs):
        """`torch.distributed.init_process_group` for this world, through MASTER_ADDR /
        MASTER_PORT (env://). backend: "nccl" where this rank's container has GPUs and
        CUDA is available, else "gloo". Returns the default process group.

        The same as calling `torch.distributed.init_process_group(backend)` in a script:
        the launcher exports RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for it.
        """
        import torch.distributed as dist
        if backend is None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.master_port is None:
            raise RuntimeError("no MASTER_PORT: this context was not built by the launcher")
        dist.init_process_group(backend, init_method=f"tcp://{self.master_addr}:{self.master_port}",
                                rank=self.rank, world_size=self.world_size, **kwargs)
        return dist.group.WORLD

    phase: str = "setup"         # "train" from the first training step on (heartbeat)
    said_progress: bool = False  # the code itself said it made progress (not only its optimizer's steps)

    def heartbeat(self, phase="train", seen=False):
        """Tell the agent this rank is making progress (it declares silence a hang).

        phase "setup" (before the first step: imports, data, calibration) is held to
        launcher.rendezvous_timeout; "train" to the shorter launcher.heartbeat_timeout.
        A failure in "setup" that every rank shares is not retried (launcher.agent).
        seen: progress the launcher saw, not the code said (a torch optimizer's step in an
        unmodified script: launcher.rank): until the code says any itself, a rank silent
        that long is hung only while it is idle, as a rank waiting for a peer is; one busy
        (an evaluation, a save) is not.
        """
        if phase == "train" and not seen:
            self.said_progress = True
        self.phase = phase
        if self.heartbeat_path:
            with open(self.heartbeat_path, "w") as f:
                f.write(f"{phase} {time.time()}" + (" seen" if seen and not self.said_progress else ""))

    def report(self, **metrics):
        """Publish this rank's progress (shown by `yarnapp status`/`submit --wait`); rank 0's
        numbers are TensorBoard scalars too (report/<name>, at `step`) when the code is the
        user's own (the built-in runner logs its own)."""
        self.heartbeat()
        if self.publish:
            from launcher import keys  # keys is plain data: no launcher state is touched
            self.publish(keys.progress(self.rank), json.dumps(
                {"rank": self.rank, "time": time.time(), "generation": self.generation, **metrics}, default=plain))
        if self.tensorboard is not None:
            self.tensorboard.report(metrics)

    def final(self, **metrics):
        """Rank 0's final metrics: printed by `submit --wait` as `final: k=v ...`."""
        self.finished = True
        if self.publish and self.rank == 0:
            from launcher import keys
            self.publish(keys.FINAL, json.dumps(metrics, default=plain))
        if self.tensorboard is not None:
            self.tensorboard.report(metrics, prefix="final/")


def plain(value):
    """A metric JSON can hold: JSON's own values as they are, a numpy or torch number
    (np.float32, a 0-d tensor: what a loop has at hand) as a Python one, an array as a list,
    anything else as its text. A metric never stops training (before, np.float32(0.9)
    crashed the rank, and its restarts)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    for convert in ("item", "tolist"):
        try:
            return getattr(value, convert)()
        except (AttributeError, TypeError, ValueError, RuntimeError):
            continue
    return str(value)


_current: Optional[RunContext] = None


class NoContext(RuntimeError):
    """current() outside a yarnapp rank, or before its context is set."""


def in_a_container():
    """Whether this process is a yarnapp rank (or its container's): the launcher's environment."""
    return any(os.environ.get(v) for v in ("YARNAPP_RANK", "YARNAPP_APP_ID", "SKEIN_APPLICATION_ID"))


def current():
    """The RunContext of this process (for `run.script` jobs)."""
    if _current is None:
        raise NoContext("no yarnapp RunContext: this code must run inside a yarnapp container (yarnapp submit)")
    return _current


def _set_current(ctx):
    global _current
    _current = ctx


def world_from_env():
    """Rank/world as the launcher exported them (for code that only needs the numbers)."""
    return int(os.environ["YARNAPP_RANK"]), int(os.environ["YARNAPP_WORLD_SIZE"])
