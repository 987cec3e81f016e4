"""Whether a failed generation is worth another attempt (launcher.agent.Agent.after_abort
asks after every abort). These are not, since a restart would fail as this one did:
- every rank failed before its first training step with the same error line (an
  ImportError, a missing file, a bad argument);
- the same rank was killed for its container's memory in this generation and the one
  before: a step too big for the container (a batch, a model) is killed at the same place
  every attempt, and each retry cost a restart and the time to reach it (a step-0 kill ran
  4 attempts). One retry stays, for a passing cause (another process's page cache, a burst);
- a rank failed on the data's content (training.data.common.BadData: a page whose CRC
  fails, an image that does not decode, found at the same step of every attempt), or could
  not write a checkpoint for its storage (full, read-only, no permission:
  training.checkpoint.CheckpointError's `repeats`), with the same line in this generation
  and the one before. Other errors in training are retried as often as the job allows: the
  same line twice may still be a passing cause (a peer that left). A filesystem out of reach
  (launcher.failure.storage_unreachable: a NameNode or DataNode restarting, safe mode) is
  retried as often as the job allows in every phase, even where every rank met it as a
  restart began, and the agents wait a little longer before each such restart
  (storage_backoff_s): a 10-20 s NameNode outage spent every restart in 3 s;
- a rank found a mistake in the job's model or strategy settings (a model the strategy
  cannot run, a layer it cannot split: an error class marked `certain`,
  training.strategies.base.StrategyError, training.models.ModelError,
  training.partition.PartitionError), in any phase: the
  hypergraph strategy partitions at its first step, and a model it cannot place was tried
  as often as the job allowed;
- a rank's container has no CUDA device for its code (no driver, no GPU, an ordinal past its
  GPUs: launcher.failure.lacks_a_device), in any phase: a GPU script's `.cuda()` after a
  first step on the CPU, or on some ranks only, was tried as often as the job allowed;
- ranks waited in different collectives of training.dist (launcher.diagnosis.called_apart:
  their code calls them in another order, which every attempt runs again);
- a rank's code ended (exit 0) in the generation that failed: its agent, and on YARN its
  container, ended with it, so no new world can form (each restart waited out
  launcher.rendezvous_timeout, then failed as "world not formed; missing: w_1").
"""
import time

from . import keys
from .failure import (CALLED_APART, EXITED_EARLY, WAITED_FOR_FINISHED, Failure, Kind, ended_in, lacks_a_device,
                      storage_unreachable)

NOT_RETRIED = ("every rank failed the same way before training started, so it was not retried "
               "(a restart would fail the same way)")
NOT_RETRIED_AGAIN = NOT_RETRIED.replace("before training started", "as the restart began").replace(
    "not retried", "not retried again")     # (training had started: "before training started" misled)
OOM_AGAIN = "killed for memory in two attempts in a row, so it was not retried again (a restart would be too)"
INPUT_AGAIN = "the same error in two attempts in a row, so it was not retried again (a restart would fail the same way)"
CERTAIN = "a mistake in the job's model or strategy settings, which every attempt meets, so it was not retried"
NO_DEVICE = ("its container cannot use the CUDA device its code asks for (none given: groups[].gpus gives a "
             "container GPUs, each seeing its own from cuda:0; or a torch or driver without CUDA for them), which "
             "every attempt meets, so it was not retried")
FEWER_STEPS = "every attempt would run the same steps, so it was not retried"
SAME_CALLS = "every attempt would make the same calls, so it was not retried"
ENDED = ("{who} " + EXITED_EARLY + " in this attempt, and {whose} container with {it}, so it was not retried (a "
         "new world cannot form without {it})")
ENDED_NAMED = "so it was not retried ({whose} container ended with {it}: a new world cannot form without {it})"


def not_worth_retrying(store, members, gen, cause, poll_s, wait_s):
    """What to add to `cause`'s reason when generation `gen` ended in a way a restart would
    repeat, or None. members: the job's ranks; poll_s, wait_s: how often and how long to
    wait for every rank's agent to record how its rank ended (see same_setup_failure)."""
    passing = storage_unreachable(cause.error or cause.reason)      # back in a moment, maybe: retried
    if not passing and same_setup_failure(store, members, gen, cause, poll_s, wait_s):
        return NOT_RETRIED if gen == 0 else NOT_RETRIED_AGAIN
    if cause.certain:       # (an error class's own words where it has them: training.data.common.DataChanged)
        return cause.certain if isinstance(cause.certain, str) else CERTAIN
    if lacks_a_device(cause.error):
        return NO_DEVICE
    if WAITED_FOR_FINISHED in (cause.reason or ""):
        return FEWER_STEPS
    if CALLED_APART in (cause.reason or ""):
        return SAME_CALLS
    if oom_again(store, gen, cause):
        return OOM_AGAIN
    if not passing and input_error_again(store, gen, cause):
        return INPUT_AGAIN
    done = ended_in(store, members, gen, 2 * poll_s)
    if done:
        one = len(done) == 1
        named = EXITED_EARLY in cause.reason            # launcher.failure.ended_early's note names them
        return (ENDED_NAMED if named else ENDED).format(who=", ".join(done), whose="its" if one else "their",
                                                       it="it" if one else "them")
    return None


STORAGE_BACKOFF_S = 5.0  # before a restart after k generations in a row ended with a filesystem out of reach:
STORAGE_BACKOFF_MAX_S = 30.0    # k times this, at most that


def storage_backoff_s(store, gen):
    """Seconds to wait before restarting after generation `gen` aborted: where it, and the
    k - 1 before it in a row, ended with a filesystem out of reach, k times
    STORAGE_BACKOFF_S (at most STORAGE_BACKOFF_MAX_S); else 0."""
    k = 0
    for g in range(gen, -1, -1):
        f = Failure.load(store.get(keys.abort(g)))
        if f is None or not storage_unreachable(f.error or f.reason):
            break
        k += 1
    return min(STORAGE_BACKOFF_MAX_S, STORAGE_BACKOFF_S * k)


def same_setup_failure(store, members, gen, cause, poll_s, wait_s):
    """Whether every rank failed before its first training step with `cause`'s error line.
    Waits (at most wait_s) until every rank's agent has recorded how its rank ended."""
    if cause.phase != "setup" or not cause.error:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        records = [Failure.load(store.get(keys.error(gen, m["rank"]))) for m in members]
        if all(records) or time.monotonic() > deadline:
            break
        # A rank that succeeded (its code returned early) records no failure: not the same.
        if any(store.get(keys.done(m["container"])) is not None for m, r in zip(members, records) if r is None):
            return False
        time.sleep(poll_s)
    return all(r and r.phase == "setup" and r.error == cause.error for r in records)


def _twice(store, gen, cause, same, same_rank=True):
    """Whether generation `gen` and the one before it ended by the same rank (and container;
    any rank where not `same_rank`) failing in a way `same(failure)` tells."""
    if gen == 0 or not same(cause):
        return False
    before = Failure.load(store.get(keys.abort(gen - 1)))
    return before is not None and same(before) and (not same_rank or before.rank == cause.rank
                                                    and before.container == cause.container)


def oom_again(store, gen, cause):
    """Whether the same rank was killed for its container's memory in generation `gen` and
    in the one before."""
    return _twice(store, gen, cause, lambda f: f.kind == Kind.OOM.value)


def input_error_again(store, gen, cause):
    """Whether a rank failed on what a restart meets again (the data's content, a checkpoint's
    storage full or read-only) with the same line in generation `gen` and in the one before:
    the line names the file (or the URI and the rank that could not write), so any rank's
    counts (every rank raises a checkpoint's error, and the first recorded names the abort)."""
    return bool(cause.error) and _twice(store, gen, cause, lambda f: bool(f.repeats) and f.error == cause.error,
                                        same_rank=False)
