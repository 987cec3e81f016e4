"""What submit warns of about a job's resources, after every check passed (a warning
before a refusal's line was a second line): containers that leave a rank little memory
beside its data, GPUs a container holds and its rank leaves idle."""
import logging

from conf.schema import BUILTIN_RUNNER, DATA_MEMORY_FRACTION

log = logging.getLogger("yarnapp.preflight")

DATA_FRACTION = DATA_MEMORY_FRACTION    # training.data.source.MEMORY_FRACTION's, without pyarrow
RANK_BASE_MIB = 450     # a built-in runner's container besides its data: torch, the model, a batch (390 MiB
                        # for digits; 460-510 MiB with CIFAR-shaped batches of 256: under ~650 MiB were killed)


def warn_idle_gpus(job, where=None):
    """Warn where a container of the built-in runner holds more than one GPU: its one rank
    computes on the first (cuda:0), and the others stay idle while the job holds them (a
    TonY user asks for a node's GPUs in one container)."""
    if job.run.function != BUILTIN_RUNNER:
        return                  # own code may use them all (one process per GPU, DataParallel)
    pre = f"{where}: " if where else ""
    for i, g in enumerate(job.groups):
        if g.gpus > 1:
            log.warning("%sgroups[%d].gpus: %d: the built-in runner's rank computes on one GPU of its container, and "
                        "the other %d stay idle; give the group %d times the instances with gpus: 1 each", pre, i,
                        g.gpus, g.gpus - 1, g.gpus)


def warn_little_beside_data(job, where=None):
    """Warn where a container leaves a built-in runner's rank less than RANK_BASE_MIB beside the
    Parquet data it holds (training.data.memory, by default a quarter of it): the kernel killed
    448-640 MiB containers at the default, and one whose window submit's own advice had fitted
    to that data memory. Called once every check passed (before a refusal's line it was a
    second line)."""
    if job.run.function != BUILTIN_RUNNER or not job.training or not job.training.data.train:
        return
    pre = f"{where}: " if where else ""
    for i, g in enumerate(job.groups):      # (training.data.source.data_budget's, without pyarrow here:
        held = job.training.data.memory or int(g.memory * DATA_FRACTION)    # a client may lack it)
        if g.memory - held < RANK_BASE_MIB:
            log.warning("%sgroups[%d].memory: %d MiB leaves %d MiB beside the %d MiB of data its ranks hold "
                        "(training.data.memory%s), and a rank of the built-in runner takes about %d MiB besides "
                        "(torch, the model, a batch; more for big ones): it may be killed for memory; give %d MiB "
                        "or more, or lower training.data.memory", pre, i, g.memory, g.memory - held, held,
                        "" if job.training.data.memory else ": a quarter of it", RANK_BASE_MIB,
                        held + RANK_BASE_MIB + 64)
