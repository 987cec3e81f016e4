"""Every key of the coordination store, in one place.

The store is per application (skein's key-value store on YARN, a directory on the
local engine). Keys are built only here so that the protocol between the client,
the agents and the ranks can be read in one file.

World generations: the world is formed once per generation `gen` (0, 1, ...). A
failure of any rank aborts the generation (`abort(gen)`, first writer wins; see
launcher.diagnosis.says_more for the one exception); the
agents then form generation gen+1, which resumes from the last checkpoint.
"""
import json


def alive(container):
    """Owned by the container's agent: removed by the resource manager when it exits."""
    return f"alive/{container}"


def beat(container):
    """Owned by the container's agent, rewritten every second from a thread of its own:
    JSON {"incarnation", "group", "rank", "engine_id" (the resource manager's name of the
    container: skein's id of a replacement differs from its slot's), "n"}. A peer whose
    beat stops changing for launcher.heartbeat_timeout is frozen (launcher.beats)."""
    return f"beat/{container}"


BEAT_PREFIX = "beat/"


def replace(container, incarnation):
    """A request to the resource manager to replace `container`, whose agent `incarnation`
    went silent (first writer wins: one request per incarnation). The local master acts on
    it; on YARN the agent that wrote it asks skein (launcher.store.Store.replace_container)."""
    return f"replace/{container}/{incarnation}"


REPLACE_PREFIX = "replace/"


def abort(gen):
    """Why generation `gen` ended abnormally (first failure wins, but see
    launcher.diagnosis.says_more); JSON."""
    return f"gen/{gen:04d}/abort"


ABORT_PREFIX = "gen/"


def port(gen):
    """The MPI port name rank 0 accepts joiners on."""
    return f"gen/{gen:04d}/port"


def joined(gen, rank):
    return f"gen/{gen:04d}/joined/{rank:05d}"


def connecting(gen, rank):
    """Written by a joiner right before it Connects: the members Accept only then (MPI's
    blocking Accept spins a core while it waits: launcher.world)."""
    return f"gen/{gen:04d}/connecting/{rank:05d}"


def incarnation(gen, rank):
    """Which incarnation of a container's agent runs `rank` in generation `gen`."""
    return f"gen/{gen:04d}/incarnation/{rank:05d}"


def master(gen):
    """Where rank 0's torch.distributed TCPStore listens in generation `gen`: JSON
    {"addr", "port"} (launcher.torch_env; MASTER_ADDR / MASTER_PORT of every rank)."""
    return f"gen/{gen:04d}/master"


def finished(gen, rank=None):
    """Written by a rank whose code returned (launcher.rank: code on torch.distributed waits
    a bounded time for every rank's; a peer's agent that finds its rank waiting in a
    collective names the ranks that finished); without `rank`, the generation's prefix."""
    return f"gen/{gen:04d}/finished/" + ("" if rank is None else f"{rank:05d}")


def error(gen, rank):
    """The one-line error with which `rank` failed in generation `gen`, and whether it
    failed before its first training step: a launcher.failure.Failure with `error` and
    `phase` (launcher.rank), or its agent's record that it ended without one."""
    return f"gen/{gen:04d}/error/{rank:05d}"


def formed(gen):
    """Written by rank 0 once the whole world is formed: JSON with timings and addresses."""
    return f"gen/{gen:04d}/formed"


PROGRESS_PREFIX = "progress/"


def progress(rank):
    """Latest progress record of a rank (JSON: step, epoch, loss, samples/s...)."""
    return f"{PROGRESS_PREFIX}{rank:05d}"


def progress_records(items):
    """{rank: record} of the progress keys among `items` ({key: JSON} of a store)."""
    return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in items.items() if k.startswith(PROGRESS_PREFIX)}


def waiting(gen, rank=None):
    """Written by a rank's agent once a peer's code finished (launcher.agent): the wall-clock
    time it last found its rank waiting in a collective, or "0" when it found it busy; a
    rank is failed for waiting on finished ranks only when every unfinished rank waits.
    Without `rank`, the generation's prefix."""
    return f"gen/{gen:04d}/waiting/" + ("" if rank is None else f"{rank:05d}")


def stall(gen, rank):
    """Written by a rank whose call of a training.dist collective has lasted a while
    (training.stalls): JSON {"call": its number on this rank, "name", "at": the user's
    line}, and {"call", "name": null} once it left it; the agents compare them
    (launcher.diagnosis: called_apart)."""
    return f"gen/{gen:04d}/stall/{rank:05d}"


def spent(gen):
    """The prefixes of generation `gen`'s keys no one reads once generation gen+2 forms
    (launcher.retries compares a generation's failure with the one before it): all but its
    abort and formed records, which say what happened (restarts, the time the world first
    formed). Removed, so that the store, which every poll reads, does not grow with restarts."""
    return tuple(f"gen/{gen:04d}/{p}" for p in ("port", "master", "joined/", "connecting/", "incarnation/", "finished/",
                                                 "waiting/", "stall/", "error/"))


def done(container):
    """Written by an agent whose rank finished successfully."""
    return f"done/{container}"


NODE_PREFIX = "node/"


def node(container):
    """Where the local engine placed a container on emulated nodes: JSON {"node", "addr"}."""
    return f"{NODE_PREFIX}{container}"


CUT_PREFIX = "cut/"


def cut(node_name):
    """Written by `yarnapp netem --cut` while an emulated node's link is cut (removed when
    restored): the agents' network diagnosis names that node, which the peers' view alone
    cannot tell apart from its peer with two nodes."""
    return f"{CUT_PREFIX}{node_name}"


FINAL = "final"            # rank 0's final metrics (JSON)
FAILED = "failed"          # the application failed for good: JSON with the last generation's cause
RESTARTS = "restarts/"     # restarts/<gen> : JSON reason of each world restart
TENSORBOARD = "tensorboard/url"
TENSORBOARD_PORT = "tensorboard/port"   # the port it last bound (not owned): a restarted local service takes it again
NOTICES = "notices/"       # notices/<gen>/<rank>/<n>: JSON {"rank", "generation", "time", "text"} of a
                           # warning a rank logged (launcher.rank.Notices), shown by status and --wait


def notice(gen, rank, n):
    return f"{NOTICES}{gen:04d}/{rank:05d}/{n:03d}"


def restart(gen):
    return f"restarts/{gen:04d}"
