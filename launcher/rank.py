"""The rank process: started by the agent in every container, once per generation.

It finds the job's code (run.function, run.pickle or run.script) before it joins the
world, so that a deterministic error (an ImportError, a missing script) shows in every
rank at once; joins the MPI world; exports the torch.distributed contract
(launcher.torch_env: RANK, LOCAL_RANK, MASTER_ADDR...); builds the RunContext and runs
the code. Exit status 0 means this rank finished the job.

When the code fails, the rank writes its error as one line (`Type: message`, or the
last line it printed to stderr before a non-zero SystemExit) to the store
(keys.error), with the phase it failed in, before the traceback goes to the log: the
agent reports that line and decides from it whether a restart could help.

User code that reports no steps (a torchrun-style script) is kept from being taken for
hung by a liveness thread; once the code reports progress itself (ctx.heartbeat,
ctx.report, training.dist), idle silence is a hang again (launcher.heartbeat_timeout; a
rank at work, using CPU, for up to launcher.monitor.BUSY_LIMIT times that).
"""
import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback

from conf import paths
from conf.errors import YarnappError
from conf.schema import BUILTIN_RUNNER, PACKAGES

from . import exitcodes, failure, identity, keys, network, stacks, store as store_mod, torch_env, world
from .failure import Failure, caused_by_an_end
from .user_code import UserCodeError, entry_point, run_code
from .user_errors import LastLine, error_line, exit_line, print_user_traceback

log = logging.getLogger("launcher.rank")

LIVENESS_S = 1.0           # how often the liveness thread touches the heartbeat
FINISH_WAIT_FRACTION = 1 / 6   # of launcher.heartbeat_timeout (10 s of the default 60 s): how long code
                                # on torch.distributed (and ctx.comm) waits at its end for every rank


def own_logging(stream, rank, container, *handlers):
    """yarnapp's own loggers (its packages': launcher, training, ...) write to `stream` (the
    rank's stderr past LastLine, so that a rank that exits non-zero is described by the last
    line its code wrote, never by ours), at INFO, with `handlers` too; the root logger is left
    to the job's code, whose `logging.basicConfig(...)` works as under torchrun (it was a
    no-op: the root logger had ours)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} {container} %(name)s: %(message)s"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for h in (handler, *handlers):
            logger.addHandler(h)


class Notices(logging.Handler):
    """Publishes the warnings yarnapp's own code logs in this rank (a checkpoint passed over,
    a rank that costs more than it saves, a return value not kept) to the store, where
    `yarnapp status` and `submit --wait` show them: otherwise they are in a container's log
    only. The first LIMIT of a generation; never raises into the code that logged."""
    LIMIT = 10

    def __init__(self, store, gen, rank):
        super().__init__(level=logging.WARNING)
        self.store, self.gen, self.rank, self.n = store, gen, rank, 0
        self.pid = os.getpid()      # a forked child (a DataLoader's worker) has no store of its own

    def emit(self, record):
        if record.levelno != logging.WARNING or record.name.split(".", 1)[0] not in PACKAGES \
                or self.n >= self.LIMIT or os.getpid() != self.pid:
            return
        try:
            text = record.getMessage().splitlines()[0]
            self.store.put(keys.notice(self.gen, self.rank, self.n), json.dumps(
                {"rank": self.rank, "generation": self.gen, "time": record.created, "text": text}))
            self.n += 1
        except Exception:  # noqa: BLE001 - a warning is never worth a failure
            pass


class Liveness(threading.Thread):
    """Touches the heartbeat every LIVENESS_S while the code reports no progress itself; and
    once the code has imported torch.optim, counts every optimizer step as progress seen
    (an unmodified script reports none: a rank of it that hung was never noticed)."""

    def __init__(self, ctx):
        super().__init__(name="yarnapp-liveness", daemon=True)
        self.ctx = ctx
        self.hooked = False
        self.last = 0.0

    def run(self):
        while self.ctx.phase != "train":
            try:
                os.utime(self.ctx.heartbeat_path)
            except OSError:
                pass
            # (in sys.modules while it still imports: its function may not be defined yet)
            register = getattr(sys.modules.get("torch.optim.optimizer"), "register_optimizer_step_post_hook", None)
            if not self.hooked and register is not None:
                try:
                    register(self.stepped)
                    self.hooked = True
                except Exception as e:  # noqa: BLE001 - the liveness thread must go on beating
                    log.warning("optimizer steps will not count as progress: %s", e)
                    self.hooked = True
            time.sleep(LIVENESS_S)

    def stepped(self, optimizer, args, kwargs):
        now = time.monotonic()
        if now - self.last >= LIVENESS_S and self.ctx.phase != "finished":    # (a write per step: a small model's step)
            self.last = now
            try:
                self.ctx.heartbeat("train", seen=True)
            except OSError:
                pass


ERROR_LINE_CHARS = failure.ERROR_LINE_CHARS
FAILED_LOG = logging.getLogger(failure.FAILED_LOGGER)   # the line fail() ends with (failure.logged_error)


def record_error(store, gen, rank, line, phase, input_error=None, repeats=None, certain=None, blames=None):
    """Write this rank's one-line error for the agents (first write wins); input_error: the
    line is the whole story; blames: the rank at fault, where every rank raised it alike (see
    launcher.failure.Failure)."""
    try:
        line = failure.cut(line)
        store.put_if_absent(keys.error(gen, rank), Failure(reason=line, error=line, phase=phase, rank=rank,
                                                           generation=gen, input_error=input_error,
                                                           repeats=repeats, certain=certain,
                                                           blames=blames).stamped().dumps())
    except Exception:  # noqa: BLE001 - reporting must never hide the failure itself
        log.exception("could not record the error in the store")


def fail(store, gen, rank, line, phase, code=exitcodes.RANK_FAILED, input_error=None, repeats=None, certain=None,
         blames=None):
    record_error(store, gen, rank, line, phase, input_error, repeats, certain, blames)
    FAILED_LOG.error("%s", line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)      # no MPI_Finalize: peers may be gone or blocked


def close_user_process_group():
    """Destroy the torch.distributed process group the user's code left open, as the end of
    its process would under torchrun: a rank whose code returns early (sys.exit(0) at
    step 3) then closes its sockets, so the ranks still in a collective with it fail at
    once. True when there was one: the sockets of a group something still holds (a
    DistributedDataParallel model) close only with the process, so the caller does not
    wait for its peers in the Barrier, where they would wait on it (meet_at_the_end)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            return True
    except Exception:  # noqa: BLE001 - the user's code is done; its group's teardown cannot fail it
        log.warning("could not close the torch.distributed process group", exc_info=True)
        return True
    # ... or the code closed it itself (the DDP tutorial's destroy_process_group()): a model may
    # still hold its sockets, and a peer one step behind waited on them for 120 s
    c10d = sys.modules.get("torch.distributed.distributed_c10d")      # (_backend: init with a store= too)
    return any(getattr(c10d, name, None) is not None for name in ("_default_pg_init_method", "_backend"))


def meet_at_the_end(store, gen, rank, world_size, wait):
    """The end of code on torch.distributed: say so in the store, and wait up to `wait`
    seconds for every rank to, without an MPI call (a rank that left early is gone, and
    its MPI peers would fail on it). Code that also used the MPI world is then done with
    it on every rank, as after the Barrier; a rank whose peers still wait on it in a
    collective leaves after `wait`, and its closed sockets fail them, as under torchrun.
    A generation already aborted (its peers failed) is not waited for, and a rank whose
    code never read the MPI world (ctx.comm) does not wait at all (`wait` 0): it is in
    none of its peers' MPI calls, and leaving closes its torch.distributed sockets at once,
    as torchrun's end of a process does. Returns how the wait ended (wait_for_peers)."""
    store.put(keys.finished(gen, rank), LEFT)
    return wait_for_peers(store, gen, world_size, wait)


LEFT = "left"       # keys.finished's value of a rank that leaves without the MPI world's Barrier


def a_peer_left(store, gen):
    """Whether a rank of generation `gen` left without the Barrier (meet_at_the_end): the
    ranks on the MPI world then leave without it too, where it would wait for that one."""
    try:
        return any(v in (LEFT, LEFT.encode()) for v in store.get_prefix(keys.finished(gen)).values())
    except Exception as e:  # noqa: BLE001 - the code succeeded: the Barrier, as before the store said
        log.warning("could not read the ranks' ends from the store: %s", e)
        return False


DONE, ABORTED, WAITED = "done", "aborted", "waited"


def wait_for_peers(store, gen, world_size, wait=None):
    """DONE once every rank's code has finished in generation `gen` (keys.finished),
    ABORTED when the generation is aborted first, WAITED once `wait` seconds (None: no
    limit) have passed. Polls often at first, then once a second (a rank may wait minutes
    for one that evaluates alone: N ranks' polls are the store's load)."""
    start = time.monotonic()
    while len(store.get_prefix(keys.finished(gen))) < world_size:
        if store.get(keys.abort(gen)) is not None:
            return ABORTED
        if wait is not None and time.monotonic() - start >= wait:
            return WAITED
        time.sleep(0.05 if time.monotonic() - start < 2.0 else 1.0)
    return DONE


def leave_aborted(store, gen):
    """A rank whose code finished in a generation that was aborted since: where its end was
    the cause (its peers waited for it, or lost it: launcher.failure.caused_by_an_end) it
    leaves with 0, the rank that ended early, and the failure is not retried; where a peer
    failed on its own (a crash in rank 0's final save) it ends as one of the aborted world's,
    not with 0, which its agent would record as success, refusing the restart owed."""
    if caused_by_an_end(Failure.load(store.get(keys.abort(gen)))):
        return
    logging.shutdown()
    os._exit(exitcodes.RANK_FAILED)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--heartbeat", required=True)
    args = p.parse_args(argv)
    ident = identity.from_env()
    stderr = sys.stderr = LastLine(sys.stderr)
    store = store_mod.from_env()
    gen, job = args.generation, ident.job
    own_logging(stderr._stream, ident.rank, ident.container, Notices(store, gen, ident.rank))
    theirs = os.environ.get("YARNAPP_CODE")          # the YARN client's (yarnapp.backends.yarn)
    ours = identity.code() if theirs and ident.rank == 0 else theirs
    if theirs and theirs.split()[0] != ours.split()[0]:
        log.warning("this container runs yarnapp from %s, whose code differs from the client's (%s): install "
                    "the client's yarnapp for the cluster's python, or pack the client's environment "
                    "(environment.packer)", ours.split(" ", 1)[1], theirs.split(" ", 1)[1])
    with open(args.heartbeat, "w") as f:
        f.write(f"setup {time.time()}")
    stacks.enable(args.heartbeat + stacks.SUFFIX)     # where it is, should it hang (launcher.stacks)
    workdir = os.getcwd()
    try:
        fn = entry_point(job, workdir)
    except UserCodeError as e:
        traceback.print_exception(e.__cause__ or e)
        fail(store, gen, ident.rank, str(e), "setup", input_error=e.__cause__ is None or None)

    net = network.configure()   # MPI over this container's own address (emulated nodes); else no-op
    with open(args.heartbeat, "w") as f:        # its code imported: joining now (launcher.monitor: importing)
        f.write(f"setup {time.time()} joining")
    # No limit of its own: its agent judges launcher.rendezvous_timeout, which waits on while the
    # resource manager has containers of the job to start (launcher.diagnosis: starting), and
    # records the abort that ends this wait.
    comm, took = world.join(store, gen, ident.rank, ident.world_size, ident.secret, timeout=None,
                            aborted=lambda: store.get(keys.abort(gen)) is not None)
    assert comm.Get_rank() == ident.rank and comm.Get_size() == ident.world_size
    import socket
    info = comm.gather({"rank": ident.rank, "container": ident.container, "host": socket.gethostname(),
                        "pid": os.getpid(), **(net or {})}, root=0)
    env = torch_env.contract(comm, store, gen, ident.rank, ident.world_size, ident.backend, ident.app_id,
                             job.max_restarts, own_gpus=job.ranks()[ident.rank]["gpus"] > 0)
    os.environ.update(env)
    if ident.rank == 0:
        store.put(keys.formed(gen), json.dumps({"time": time.time(), "seconds": took, "members": info}))
    log.info("world generation %d formed: rank %d of %d in %.2fs", gen, ident.rank, ident.world_size, took)

    from training.context import RunContext, rank_infos
    own = job.run.function != BUILTIN_RUNNER
    if own:     # where own code keeps what every rank and restart must see (a relative path is one container's)
        os.environ["YARNAPP_CHECKPOINT_URI"] = uri = ident.checkpoint_uri
        if paths.is_local(uri):
            try:
                os.makedirs(paths.local_path(uri), exist_ok=True)       # torch.save needs it
            except OSError as e:        # the code's own write says where and why, in its one line
                log.warning("could not create %s: %s", uri, e)
    ctx = RunContext(comm=comm, rank=ident.rank, world_size=ident.world_size, ranks=rank_infos(job),
                     job=job, app_id=ident.app_id, generation=gen, workdir=workdir,
                     checkpoint_uri=ident.checkpoint_uri, checkpoint_siblings=ident.checkpoint_siblings,
                     logdir=ident.logdir,
                     publish=store.put, heartbeat_path=args.heartbeat,
                     local_rank=int(env["LOCAL_RANK"]), local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                     group_rank=int(env["GROUP_RANK"]), master_addr=env["MASTER_ADDR"],
                     master_port=int(env["MASTER_PORT"]))
    ctx.heartbeat("setup")
    if own:
        Liveness(ctx).start()
        if ident.rank == 0:         # own code's TensorBoard: what it reports (the runner logs its own)
            try:
                from training.tensorboard import ReportLog
                ctx.tensorboard = ReportLog(ident.logdir, ident.app_id, job.tensorboard.sync_every, scratch=workdir)
            except ImportError as e:    # an environment of the job's own, without pyarrow or tensorboard
                log.warning("no TensorBoard for what this code reports: %s", e)
    ctx.comm_used = False
    try:
        run_code(job, ctx, fn)
    except SystemExit as e:
        if e.code not in (None, 0):
            line = exit_line(e, stderr.last)
            fail(store, gen, ident.rank, line, ctx.phase, e.code if isinstance(e.code, int) else exitcodes.RANK_FAILED)
    except YarnappError as e:       # bad input (data, model...): its one line is the whole story
        fail(store, gen, ident.rank, str(e), ctx.phase, input_error=True, repeats=getattr(e, "repeats", None) or None,
             certain=getattr(e, "certain", None) or None, blames=getattr(e, "blames", None))
    except BaseException as e:  # noqa: BLE001 - the user's error: its line, then its traceback
        print_user_traceback(e)
        fail(store, gen, ident.rank, error_line(e), ctx.phase)
    if ctx.tensorboard is not None:
        ctx.tensorboard.close()
    ctx.heartbeat("finished")       # waiting for its peers now: not hung itself if they never come (agent)
    if close_user_process_group():
        # code that never read ctx.comm made no MPI call: nothing of its peers' waits on it
        if meet_at_the_end(store, gen, ident.rank, ident.world_size,
                           FINISH_WAIT_FRACTION * ident.job.launcher.heartbeat_timeout if ctx.comm_used
                           else 0.0) == ABORTED:
            leave_aborted(store, gen)
    else:
        # Code on the MPI world: every rank is done with it before any leaves (the Barrier),
        # entered once every rank's code has finished (the store), so that a rank that ended
        # early is not in a Barrier its peers' collectives would match: they wait in theirs
        # for it, and their agents name it (launcher.monitor's EARLY_END_FRACTION), or fail on its end.
        try:
            store.put(keys.finished(gen, ident.rank), "1")     # a peer's agent finding it waited for names it
            peers = wait_for_peers(store, gen, ident.world_size)
        except Exception as e:  # noqa: BLE001 - the code succeeded; the Barrier alone then
            log.warning("could not record this rank's end in the store: %s", e)
            peers = DONE
        if peers == ABORTED:
            leave_aborted(store, gen)
        elif not a_peer_left(store, gen):
            comm.Barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip MPI_Finalize's disconnect handshake between singleton-joined processes: the world
    # agreed (the Barrier, or the store) that every rank is done, or this rank waited long
    # enough on peers that still wait on it.
    os._exit(exitcodes.SUCCEEDED)


if __name__ == "__main__":
    main()
