"""Checkpoints that become visible only when complete, on any pyarrow URI.

Layout under the job's checkpoint URI:

    step-00000050.tmp-<gen>/rank-00000.pt ...   being written (never read)
    step-00000050/rank-00000.pt ...             complete: renamed after every rank wrote
    final/model.pt                              the trained model (rank 0)

Every rank writes its own part (model/optimizer shard, RNG states, data position)
into the temporary directory; after a barrier rank 0 renames it. A name is never
overwritten (HDFS refuses to rename onto an existing path), so a checkpoint for a
step that already exists is skipped. The last `keep` complete checkpoints are kept.
"""
import logging
import os
import random
import re
import time

import numpy as np
import pyarrow as pa
import torch

from conf.errors import YarnappError

from . import fsutil

log = logging.getLogger(__name__)
_COMPLETE = re.compile(r"^step-(\d{8})$")


def rng_state():
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(s):
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


class Checkpointer:
    def __init__(self, uri, comm, keep=3, generation=0):
        self.uri = uri
        self.fs, self.root = fsutil.resolve(uri)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.keep = keep
        self.generation = generation
        self.write_s = 0.0

    def _dir(self, step, tmp=False):
        return f"{self.root}/step-{step:08d}" + (f".tmp-{self.generation}" if tmp else "")

    def complete_steps(self):
        return sorted(int(m.group(1)) for n in fsutil.listdir(self.fs, self.root)
                      if (m := _COMPLETE.match(n)))

    def latest(self):
        """(step, this rank's state) of the newest complete checkpoint, or (0, None)."""
        steps = self.complete_steps() if self.rank == 0 else None
        steps = self.comm.bcast(steps, root=0)
        if not steps:
            return 0, None
        step = steps[-1]
        data = fsutil.read_bytes(self.fs, f"{self._dir(step)}/rank-{self.rank:05d}.pt")
        return step, fsutil.torch_load(data)

    def save(self, step, state):
        """Collective: every rank passes its own state; returns when the checkpoint is complete.

        If any rank cannot write its part (disk full, read-only, unreachable URI), or rank 0
        cannot commit the checkpoint, every rank raises the same CheckpointError naming the
        URI and the first error; the temporary directory is never renamed, so the previous
        complete checkpoint stays the newest and is what a restart resumes from.
        """
        t0 = time.perf_counter()
        exists = self.comm.bcast(step in self.complete_steps() if self.rank == 0 else None, root=0)
        if exists:
            return False
        tmp = self._dir(step, tmp=True)
        error = _attempt(lambda: fsutil.write_bytes(self.fs, f"{tmp}/rank-{self.rank:05d}.pt",
                                                    fsutil.torch_bytes(state)))
        _maybe_fault("crash_in_checkpoint", step, self.rank, self.generation)
        self._raise_first(step, "write", self.comm.allgather(error))
        if self.rank == 0:
            error = _attempt(lambda: self._commit(step, tmp))
        self._raise_first(step, "commit", [self.comm.bcast(error, root=0)])
        self.write_s += time.perf_counter() - t0
        log.info("checkpoint step %d complete", step)
        return True

    def _commit(self, step, tmp):
        """Rank 0: make step's checkpoint visible (one rename), then tidy up."""
        self.fs.move(tmp, self._dir(step))
        for old in self.complete_steps()[:-self.keep]:
            self.fs.delete_dir(self._dir(old))
        for n in fsutil.listdir(self.fs, self.root):
            if ".tmp-" in n:                       # left by a generation that crashed mid-write
                self.fs.delete_dir(f"{self.root}/{n}")

    def _raise_first(self, step, what, errors):
        first = next(((r, e) for r, e in enumerate(errors) if e), None)
        if first:
            raise CheckpointError(f"checkpoint.uri {self.uri}: cannot {what} the checkpoint of step {step}"
                                  f"{f' (rank {first[0]})' if what == 'write' else ''}: {first[1]}; "
                                  f"free space or fix its permissions (the checkpoint before it is intact)")

    def save_model(self, model):
        if self.rank == 0 and model is not None:
            fsutil.write_bytes(self.fs, f"{self.root}/final/model.pt",
                               fsutil.torch_bytes({k: v.detach().cpu() for k, v in model.state_dict().items()}))


class CheckpointError(YarnappError, OSError):
    """A checkpoint that cannot be written. str() names the URI and the first error."""


def _attempt(fn):
    """None if fn() succeeds, else its error as one line (storage errors span pages)."""
    try:
        fn()
        return None
    except (OSError, pa.ArrowException) as e:
        lines = str(e).strip().splitlines()
        return " ".join(lines[:2]) if lines else type(e).__name__


def _maybe_fault(kind, step, rank, generation):
    """Fault injection for recovery tests and demos: YARNAPP_FAULT=KIND:STEP:RANK makes
    that rank die at that point of generation 0 (set it in a group's `env`)."""
    if generation == 0 and os.environ.get("YARNAPP_FAULT") == f"{kind}:{step}:{rank}":
        log.error("fault injection: %s at step %d on rank %d", kind, step, rank)
        os._exit(99)


def load_final(uri):
    fs, root = fsutil.resolve(uri)
    return fsutil.torch_load(fsutil.read_bytes(fs, f"{root}/final/model.pt"))
