"""Checkpoints that become visible only when complete, on any pyarrow URI, one
directory per application, and which one a new application resumes from.

Layout under the job's checkpoint URI:

    <app_id>/application.json                    {"app_id", "name", "created"} (rank 0)
    <app_id>/step-00000050.tmp-<gen>/rank-00000.pt ...  being written (never read)
    <app_id>/step-00000050/rank-00000.pt ...     complete: renamed after every rank wrote
    <app_id>/final/model.pt                      the trained model (rank 0)
    <app_id>/final/model.json                    ... how to build and feed it (training.trained)

Every rank writes its own part (its model/optimizer shard, RNG states, data position;
all-reduce's model and optimizer, the same on every rank, by rank 0 alone) into the
temporary directory; after every rank wrote, rank 0 renames it. A name is never
overwritten (HDFS refuses to rename onto an existing path), so a checkpoint for a step
that already exists is skipped. The last `keep` complete checkpoints are kept.

Where a run starts (`latest`): a restarted world (a later generation of the same
application) resumes from its own newest complete checkpoint. A new application
starts from nothing unless `checkpoint.resume` asks otherwise:
    never    (the default) start from step 0, whatever the URI holds
    latest   the newest complete checkpoint of the most recent earlier application of
             the same job name under this URI
    APP_ID   that application's newest complete checkpoint (any job name)
It never writes into another application's directory. With checkpoint.uri unset each
application's URI is its own directory's `checkpoints` (`siblings`/<app_id>/checkpoints),
and `resume` looks for the others there.
"""
import json
import logging
import os
import random
import time

import numpy as np
import pyarrow as pa
import torch

from conf.errors import YarnappError
from launcher.identity import checkpoint_dir, complete_steps

from . import fsutil

log = logging.getLogger(__name__)
FINAL_CARD = "model.json"       # beside final/model.pt: how to build and feed the model (training.trained)


def rng_state():
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(s):
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


class Checkpointer:
    def __init__(self, uri, comm, keep=3, generation=0, app_id="app", name="job", resume="never", siblings=None,
                 data=None, trains=None):
        """comm None: a client's look at what is there (earlier(), refusal()), no application
        of its own. data: what the steps mean (batch size, training rows), recorded with the
        application so that a client can refuse a resume that would read them otherwise;
        trains: what its states are of (what_it_trains), recorded for the same reason."""
        self.uri = uri
        self.fs, self.base = fsutil.resolve(uri)
        self.siblings = siblings            # the directory of the applications' own directories, or None
        self._siblings = fsutil.resolve(siblings)[1].rstrip("/") if siblings else None
        self.root = checkpoint_dir(app_id, self.base) if comm else None
        self.comm = comm
        self.rank = comm.Get_rank() if comm else 0
        self.data = data
        self.trains = trains
        self.keep = keep
        self.generation = generation
        self.app_id, self.name, self.resume = app_id, name, resume
        self.resumed_app = None       # whose checkpoint this run started from
        # What its errors name: the field the user set, or (unset) the directory it defaulted to
        self.where = f"checkpoint.uri {uri}" if not siblings else f"{uri} (checkpoint.uri unset: the application's own)"
        self._created = None          # when this application registered there (rank 0's _register)
        self.write_s = 0.0

    def _dir(self, step, tmp=False, root=None):
        return f"{root or self.root}/step-{step:08d}" + (f".tmp-{self.generation}" if tmp else "")

    def complete_steps(self, root=None):
        return complete_steps(fsutil.listdir(self.fs, root or self.root))

    def _app_root(self, app):
        """Where application `app` checkpoints (`siblings`: in its own directory)."""
        return checkpoint_dir(app, self.base, self._siblings)

    def applications(self):
        """[(created, app_id, name)] of every application with a checkpoint directory there."""
        out = []
        for app in fsutil.listdir(self.fs, self._siblings or self.base):
            try:
                meta = json.loads(fsutil.read_bytes(self.fs, f"{self._app_root(app)}/application.json"))
            except (OSError, ValueError, pa.ArrowException):
                continue
            out.append((meta.get("created", 0), app, meta.get("name")))
        return sorted(out)

    def _source(self):
        """(directory, app_id, complete steps, oldest first) to start from, or (None, None, []).
        Rank 0 only."""
        steps = self.complete_steps()
        if steps:
            return self.root, self.app_id, steps
        return self.earlier()

    def earlier(self):
        """(directory, app_id, complete steps) of the earlier application `resume` names, or
        (None, None, []); CheckpointError when it names one without a complete checkpoint."""
        if self.resume == "never":
            return None, None, []
        where = self.siblings or self.uri
        if self.resume == "latest":
            for created, app, name in reversed(self.applications()):
                root = self._app_root(app)
                if self._created is not None and created >= self._created:
                    continue            # started after this one: not an earlier application
                if app != self.app_id and name == self.name and self.complete_steps(root):
                    return root, app, self.complete_steps(root)
            log.warning("checkpoint.resume latest: no earlier application of job %r has a complete "
                        "checkpoint under %s; starting from step 0", self.name, where)
            return None, None, []
        root = self._app_root(self.resume)
        steps = self.complete_steps(root) if fsutil.exists(self.fs, root) else []
        if not steps:
            raise CheckpointError(f"checkpoint.resume {self.resume}: no complete checkpoint of that application "
                                  f"under {where}; give an application id listed there, latest or never")
        return root, self.resume, steps

    def latest(self):
        """(step, this rank's state) to start from (see the module docstring), or (0, None).
        Collective; rank 0 also records this application under the URI.

        The newest complete checkpoint every rank can read: one whose file of some rank is
        missing, does not load (a hand's truncate) or whose bytes changed since it was written
        (a disk's fault: its CRC-32s, fsutil.check_crcs) is passed over, with a
        warning naming the file, for the one before it; when none can be read, every rank
        raises the same CheckpointError naming the newest's bad file (so no restart is
        spent on it: it would fail the same way)."""
        found = None
        if self.rank == 0:
            error = _attempt(self._register)
            try:
                if error:
                    found = f"{self.where}: cannot write to it: {error}"
                else:
                    found = self._source()
                    found = self._written_by_fewer(*found) or found
            except CheckpointError as e:
                found = str(e)
            except STORAGE_ERRORS as e:     # its listing out of reach (a NameNode restarting): every rank says so
                found = f"{self.where}: cannot read its checkpoints: {_error_line(e)}"
        found = self.comm.bcast(found, root=0)
        if isinstance(found, str):                    # every rank fails the same way
            raise CheckpointError(found)
        root, app, steps = found
        if root is None:
            return 0, None
        first_bad = None
        for step in reversed(steps):
            path = f"{self._dir(step, root=root)}/rank-{self.rank:05d}.pt"
            try:
                state, bad = fsutil.torch_load_file(self.fs, path), None
            except Exception as e:  # noqa: BLE001 - any unreadable file: try the checkpoint before
                first = (str(e).strip().splitlines() or [""])[0].split(". ")[0]   # torch's goes on for 5 sentences
                state, bad = None, f"{path}: {type(e).__name__}: {first}"
            bad = next((b for b in self.comm.allgather(bad) if b), None)
            if bad is None:
                break
            first_bad = first_bad or bad
            if self.rank == 0:
                log.warning("the checkpoint of step %d cannot be read (%s); trying the one before it", step, bad)
                if root == self.root:       # this application's own: set aside, so the step is written anew
                    _attempt(lambda: self.fs.move(self._dir(step), f"{self._dir(step)}.unreadable-{self.generation}"))
        else:
            raise CheckpointError(f"no complete checkpoint of application {app} can be read (step {steps[-1]}: "
                                  f"{first_bad}); remove the broken step directories, or start afresh "
                                  f"(checkpoint.resume: never)")
        if app != self.app_id:
            self.resumed_app = app
            if self.rank == 0:
                log.info("resuming from application %s's checkpoint of step %d (checkpoint.resume: %s)",
                         app, step, self.resume)
                if app == self.resume:      # named, so ended (submit refuses one that runs): a kill's litter
                    _attempt(lambda: self._tidy(root))      # mid-write is removed (its own next start never comes)
        return step, state

    def _written_by_fewer(self, root, app, steps, size=None):
        """The line refusing a checkpoint written by fewer ranks than this world (of `size`)
        has (its files are not broken: there is none for the others), or by another number
        of ranks where the job's strategy keeps a part of the model or optimizer on each rank
        (SAME_RANKS: a sharded server's segments, conv-MP's kernel shares, hypergraph's
        parts; they failed in every rank after submit took them), or None."""
        if root is None:
            return None
        ranks = max(sum(1 for n in fsutil.listdir(self.fs, self._dir(step, root=root)) if n.startswith("rank-"))
                    for step in steps)        # the most any step has: one missing file is a broken step
        size = size or self.comm.Get_size()
        strategy = (self.trains or {}).get("strategy")
        if 0 < ranks < size or (strategy in SAME_RANKS and ranks and ranks != size):
            how = (f"{strategy} keeps a part of the model on each rank: resume it with {ranks} ranks"
                   if strategy in SAME_RANKS else f"resume it with at most {ranks}")
            return (f"checkpoint.resume: the checkpoint of step {steps[-1]} (application {app}) was written by "
                    f"{ranks} ranks, and this job has {size} (groups[].instances); {how}, or start afresh "
                    f"(checkpoint.resume: never)")
        return None

    def refusal(self, source, size, data, trains=None):
        """What a client can tell before starting a world of `size` ranks for `data` and
        `trains` (see __init__; rows None: not known): the line refusing `source` (an
        earlier()), or None."""
        root, app, steps = source
        if root is None:
            return None
        try:
            meta = json.loads(fsutil.read_bytes(self.fs, f"{root}/application.json"))
        except (OSError, ValueError, pa.ArrowException):
            meta = {}                   # written before it was recorded: the ranks check their states
        saved = meta.get("data")
        if saved:                       # not known here (a dataset of the user's: its rows): as saved
            data = {**data, **{k: saved.get(k) for k, v in data.items() if v is None}}
        self.trains = self.trains or trains
        return (self._written_by_fewer(root, app, steps, size)
                or other_model(steps[-1], app, meta.get("trains"), trains) or other_data(steps[-1], app, saved, data))

    def _register(self):
        """Record this application under the URI, once (its first world); a restarted world
        reads when it was (`latest` takes no application started after it)."""
        path = f"{self.root}/application.json"
        created = None
        if fsutil.exists(self.fs, path):
            try:
                self._created = float(json.loads(fsutil.read_bytes(self.fs, path))["created"])
                self._tidy()    # a world restarting after a crash mid-checkpoint
                return
            except (ValueError, KeyError, TypeError):   # cut short by a crash: written again, dated by the file
                mtime = self.fs.get_file_info(path).mtime
                created = mtime.timestamp() if mtime else None
        self._created = created or time.time()
        fsutil.write_bytes(self.fs, path, json.dumps(
            {"app_id": self.app_id, "name": self.name, "created": self._created, "data": self.data,
             "trains": self.trains}).encode())
        self._tidy()

    def save(self, step, state):
        """Collective: every rank passes its own state; returns when the checkpoint is complete.

        If any rank cannot write its part (disk full, read-only, unreachable URI), or rank 0
        cannot commit the checkpoint, every rank raises the same CheckpointError naming the
        URI and the first error; the temporary directory is never renamed, so the previous
        complete checkpoint stays the newest and is what a restart resumes from.
        """
        t0 = time.perf_counter()
        exists = None
        if self.rank == 0:
            try:
                exists = step in self.complete_steps()
            except STORAGE_ERRORS as e:     # out of reach: every rank raises it (rank 0 alone crashed)
                exists = _error_line(e)
        exists = self.comm.bcast(exists, root=0)
        if isinstance(exists, str):
            self._raise_first(step, "write", [exists])
        if exists:
            return False
        tmp = self._dir(step, tmp=True)
        data = fsutil.torch_bytes(state)           # (torch's own errors are not the storage's)
        error = _attempt(lambda: fsutil.write_bytes(self.fs, f"{tmp}/rank-{self.rank:05d}.pt", data))
        _maybe_fault("crash_in_checkpoint", step, self.rank, self.generation)
        self._raise_first(step, "write", self.comm.allgather(error))
        if self.rank == 0:
            error = _attempt(lambda: self._commit(step, tmp))
        self._raise_first(step, "commit", [self.comm.bcast(error, root=0)])
        self.write_s += time.perf_counter() - t0
        if self.rank == 0:          # (every rank's log said it: a day's logs grew ~40 MB at every_steps: 5)
            log.info("checkpoint step %d complete", step)
        return True

    def _commit(self, step, tmp):
        """Rank 0: make step's checkpoint visible (one rename), then tidy up. An old checkpoint
        is renamed out of the complete ones before it is deleted, so a crash at any point of
        the clean-up leaves only complete checkpoints and litter the next start removes."""
        self.fs.move(tmp, self._dir(step))
        _maybe_fault("crash_after_commit", step, self.rank, self.generation)
        for old in self.complete_steps()[:-self.keep]:
            self.fs.move(self._dir(old), self._dir(old) + ".deleting")
            _maybe_fault("crash_in_cleanup", step, self.rank, self.generation)
        self._tidy()

    def _tidy(self, root=None):
        """Remove the litter of a crash mid-write or mid-clean-up (rank 0, no write under way)
        from this application's directory, or `root`, an ended one's."""
        root = root or self.root
        for n in fsutil.listdir(self.fs, root):
            if ".tmp-" in n or n.endswith(".deleting"):
                self.fs.delete_dir(f"{root}/{n}")

    def _raise_first(self, step, what, errors):
        first = next(((r, e) for r, e in enumerate(errors) if e), None)
        if first:
            if self.rank == 0:          # nothing half-written is left (a restart's _tidy would, the last not)
                _attempt(lambda: self.fs.delete_dir(self._dir(step, tmp=True)))
            detail = first[1].replace(f".tmp-{self.generation}", ".tmp")    # one line in every generation
            full = _full(detail)
            advice = "free space or fix its permissions" if full else "check that its filesystem is up (a restart " \
                "retries it)"
            e = CheckpointError(f"{self.where}: cannot {what} the checkpoint of step {step}"
                                f"{f' (rank {first[0]})' if what == 'write' else ''}: {detail}; "
                                f"{advice} (the checkpoint before it is intact)")
            e.repeats = full
            e.blames = first[0] if what == "write" else 0      # every rank raises it: the agents name this one
            raise e

    def final_uri(self):
        """Where save_model writes the final model's weights: the URI as the job gave it."""
        return f"{self.uri.rstrip('/')}/{self.app_id}/final/model.pt"

    def save_model(self, model, card=None):
        """The final model's weights (rank 0), and its card (training.trained: how to build
        it and feed it) where given: written beside `final` and renamed to it whole, so that
        a full disk leaves no truncated model.pt that load_final would take."""
        if self.rank != 0 or model is None:
            return
        tmp, final = f"{self.root}/final.tmp-{self.generation}", f"{self.root}/final"
        data = fsutil.torch_bytes({k: v.detach().cpu() for k, v in model.state_dict().items()})

        def write():
            fsutil.write_bytes(self.fs, f"{tmp}/model.pt", data)
            if card is not None:
                fsutil.write_bytes(self.fs, f"{tmp}/{FINAL_CARD}", json.dumps(card, indent=1).encode())
            if fsutil.exists(self.fs, final):      # (a run resumed after it had ended)
                self.fs.delete_dir(final)
            self.fs.move(tmp, final)
        error = _attempt(write)
        if error:
            _attempt(lambda: self.fs.delete_dir(tmp))
            e = CheckpointError(f"{self.where}: cannot write the final model: {error}; "
                                f"{'free space or fix its permissions' if _full(error) else 'check that its filesystem is up'}"
                                f" (its last complete checkpoint is kept: --resume goes on from it)")
            e.repeats = _full(error)
            e.blames = 0
            raise e


class CheckpointError(YarnappError, OSError):
    """A checkpoint that cannot be written. str() names the URI and the first error.
    repeats: its storage is full, read-only or not ours, which a restart meets again
    (launcher.retries: not retried a second time); blames: the rank that could not write
    (launcher.agent names it, not whichever rank ended first)."""
    repeats = False
    blames = None


STORAGE_FULL = ("no space left", "quota exceeded", "quotaexceeded", "read-only file system", "permission denied",
                "operation not permitted", "is exceeded: quota", "quota by storage type")   # (HDFS: "The DiskSpace
                                                                    # quota of /x is exceeded: quota = ...")


SAME_RANKS = ("ps_sharded", "conv_model_parallel", "hypergraph")  # resume only on as many ranks as wrote them


def what_it_trains(training):
    """What a checkpoint's states are of (conf's `training`): its strategy, model and model
    options, the layers a model-parallel strategy splits, and the optimizer. A checkpoint of
    another does not load (torch's size mismatches, a conv-MP shard missing, a hypergraph
    rank's part; SGD's state into Adam: KeyError 'step', in every rank, retried)."""
    s = training.strategy
    layers = getattr(s, "layers", None)
    return {"strategy": s.name, "model": training.model, "model_options": dict(training.model_options or {}),
            "layers": list(layers) if layers else None, "optimizer": training.optimizer}


def other_model(step, app, saved, now):
    """The line refusing to resume a checkpoint written by a job of another strategy, model or
    split layers (`saved`, `now`: what_it_trains'), or None (also where `saved` was not recorded:
    written by an earlier yarnapp)."""
    differ = [k for k in now if k in (saved or {}) and saved[k] != now[k]]     # (an earlier yarnapp's has fewer)
    if not differ:
        return None
    field = {"strategy": "training.strategy", "model": "training.model", "model_options": "training.model_options",
             "layers": "training.strategy.layers", "optimizer": "training.optimizer"}
    was = "; ".join(f"{field[k]} {saved.get(k)!r} (this job: {now[k]!r})" for k in differ)
    return (f"checkpoint.resume: the checkpoint of step {step} (application {app}) was written with {was}; its "
            f"states load only into the job that wrote them: resume with that job, or start afresh "
            f"(checkpoint.resume: never)")


def other_data(step, app, saved, now):
    """The line refusing to resume a checkpoint written for another batch size or training
    set (`saved`, `now`: {"batch_size", "train_rows", "seed", "order"}; the last two
    recorded since 2026-11-30), or None: its step would stand for another place in the data
    (step 240 of 1438 rows is epoch 10.9; of 719 rows, 21.8), and the run would silently
    train on other epochs than it left. Mid-epoch, another order of the epoch's rows (another
    training.seed, shuffle_window or row groups: Order.fingerprint) is refused too: the rest
    of the epoch would repeat some rows and skip others (an audit: 259 twice, 293 never,
    after a resume with a smaller window). At an epoch's end the new order starts whole."""
    if not saved:
        return None
    if (saved["batch_size"], saved["train_rows"]) != (now["batch_size"], now["train_rows"]):
        return (f"checkpoint.resume: the checkpoint of step {step} (application {app}) was written with "
                f"training.batch_size {saved['batch_size']} and {saved['train_rows']} rows of training.data.train; "
                f"this job has {now['batch_size']} and {now['train_rows']}, so its steps would be other places in "
                f"the data; resume with the batch size and data it was written with, or start afresh "
                f"(checkpoint.resume: never)")
    changed = [k for k in ("seed", "order") if None not in (saved.get(k), now.get(k)) and saved[k] != now[k]]
    spe = (saved["train_rows"] or 0) // saved["batch_size"]         # (training drops a last partial batch)
    if not changed or not spe or step % spe == 0:
        return None
    epoch, into = divmod(step, spe)
    why = ([f"training.seed {now['seed']} (it was written with {saved['seed']})"] if "seed" in changed else []) + \
        (["training.data.shuffle_window, or the training set's row groups, changed; training.data.memory and "
          "groups[].memory keep the order"] if "order" in changed else [])
    return (f"checkpoint.resume: the checkpoint of step {step} (application {app}) is {into} steps into epoch "
            f"{epoch + 1} (of {spe} steps), and this job orders that epoch's rows otherwise ({'; '.join(why)}): "
            f"the rest of the epoch would repeat some rows and skip others; resume with what it was written "
            f"with (a checkpoint at an epoch's end takes the change), or start afresh (checkpoint.resume: never)")


# What a filesystem raises: pyarrow's and the OS's errors, and fsspec's WebHDFS HDFS errors
# (RuntimeError: "Name node is in safe mode" escaped as a traceback; ValueError).
STORAGE_ERRORS = (OSError, pa.ArrowException, RuntimeError, ValueError)


def _full(error):
    """Whether a storage error is one a retry meets again (full, read-only, not ours)."""
    return any(w in error.lower() for w in STORAGE_FULL)


def _attempt(fn):
    """None if fn() (a filesystem's calls only) succeeds, else its error as one line (storage
    errors span pages)."""
    try:
        fn()
        return None
    except STORAGE_ERRORS as e:
        return _error_line(e)


def _error_line(e):
    """A storage error as one line (its messages span pages): its first two lines."""
    lines = _storage_message(e).strip().splitlines()
    return " ".join(lines[:2]) if lines else type(e).__name__


def _storage_message(e):
    """The error's text, HDFS's own where a WebHDFS response carries it (a DataNode's 403 was
    "403 Client Error: Forbidden for url: ...", its DSQuotaExceededException lost)."""
    try:
        remote = e.response.json()["RemoteException"]
        return f"{remote['exception']}: {remote['message']}"
    except Exception:  # noqa: BLE001 - no such response: the error as it is
        return str(e)


def _maybe_fault(kind, step, rank, generation):
    """Fault injection for recovery tests and demos: YARNAPP_FAULT=KIND:STEP:RANK makes
    that rank die at that point of generation 0 (set it in a group's `env`); KIND:STEP:RANK:GEN
    in generation GEN; several, comma-separated, each matched on its own. Kinds:
    crash_in_checkpoint (its part written, before the commit), crash_after_commit (rank 0,
    right after the rename), crash_in_cleanup (rank 0, an old checkpoint half removed)."""
    here = f"{kind}:{step}:{rank}"
    for fault in (f.strip() for f in os.environ.get("YARNAPP_FAULT", "").split(",")):
        if fault == here and generation == 0 or fault == f"{here}:{generation}":
            log.error("fault injection: %s at step %d on rank %d", kind, step, rank)
            os._exit(99)


def load_final(uri, app_id=None):
    """The final model an application saved under checkpoint URI `uri` (default: the
    newest application there that has one)."""
    fs, base = fsutil.resolve(uri)
    if app_id is None:
        done = [a for a in fsutil.listdir(fs, base) if fsutil.exists(fs, f"{base}/{a}/final/model.pt")]
        if not done:
            raise CheckpointError(f"{uri}: no application there saved a final model")
        app_id = max(done, key=lambda a: json.loads(fsutil.read_bytes(fs, f"{base}/{a}/application.json"))
                     .get("created", 0))
    return fsutil.torch_load(fsutil.read_bytes(fs, f"{base}/{app_id}/final/model.pt"))
