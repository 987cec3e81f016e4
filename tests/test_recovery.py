"""Failed and hung workers are restarted and training resumes exactly from the last
complete checkpoint (real processes, real signals, real MPI worlds)."""
import json
import os
import random
import re
import signal
import time

import pytest
import torch

import yarnapp
from launcher import keys
from yarnapp.backends.local.engine import LocalBackend
from recovery_util import digits_job, final_weights, rank_pid, resumed_steps, run_to_end, store_of, wait_step
from util import assert_nothing_left, tb_scalars

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits):
    """Uninterrupted runs, one per strategy, computed once."""
    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("YARNAPP_HOME")
    os.environ["YARNAPP_HOME"] = str(home)
    out = {}
    tmp = tmp_path_factory.mktemp("ref")
    try:
        for strategy in ("allreduce", "conv_model_parallel"):
            job = digits_job(tmp, digits, f"ref-{strategy.replace('_', '-')}", strategy)
            run, st = run_to_end(job)
            assert st["final"]["steps"] == 40 and st["final"]["resumed_from"] == 0
            out[strategy] = final_weights(job)
            assert_nothing_left(run.app_id)
    finally:
        if old is None:
            os.environ.pop("YARNAPP_HOME")
        else:
            os.environ["YARNAPP_HOME"] = old
    return out


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tb_steps(job, run):
    return [step for step, _ in tb_scalars(os.path.join(job["tensorboard"]["logdir"], run.app_id), "train/loss")]


def test_a_sigkilled_rank_of_conv_model_parallel_resumes_bit_identically(reference, digits, tmp_path, yarnapp_home):
    """Rank 1 of the conv-layer split (a kernel share of its own) SIGKILLed mid-run. Its next
    rank is forked from the container's warm process (launcher.warm: imports done once, in the
    application's zygote, launcher.zygote, which forked it); then that warm process is SIGKILLed
    too (as the kernel would kill it for memory), taking its rank with it, and the container has
    the zygote fork another: both resume exactly."""
    import psutil
    kill_at = random.Random("kill-conv_model_parallel").randint(12, 20)
    job = digits_job(tmp_path, digits, "killed", "conv_model_parallel")
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=1)
    warm = psutil.Process(pid).parent()
    zygote = warm.parent()
    assert "launcher.zygote" in warm.cmdline() and zygote.cmdline() == warm.cmdline(), warm.cmdline()
    kill_at = wait_step(run, rank=1, step=kill_at)     # (the step it reached: a busy host's status lags)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    pid1 = rank_pid(run, rank=1, generation=1)
    assert psutil.Process(pid1).ppid() == warm.pid           # forked by the same warm process
    wait_step(run, rank=1, step=kill_at + 8)
    warm.kill()
    warm2 = psutil.Process(rank_pid(run, rank=1, generation=2)).parent()
    assert warm2.ppid() == zygote.pid and warm2.pid != warm.pid    # a warm process forked again
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["generation"] for r in st["restarts"]] == [1, 2]
    assert all("rank 1 (small_0) killed by signal 9" in r["reason"] for r in st["restarts"]), st["restarts"]
    resumed = resumed_steps(run)
    assert kill_at - 10 <= resumed[0] <= kill_at + 2, (kill_at, resumed)   # at most one interval recomputed
    assert _equal(final_weights(job), reference["conv_model_parallel"])
    assert _tb_steps(job, run) == list(range(1, 41))     # one point a step: the resumed steps' were purged
    formed1 = json.loads(store_of(run).get(keys.formed(1)))
    print(f"conv: killed at step {kill_at}, resumed from {resumed}, world re-formed "
          f"{formed1['time'] - t_kill:.1f}s after the kill")
    assert_nothing_left(run.app_id)


def test_rank_0_sigkilled_then_the_master_killed_resume_bit_identically(reference, digits, tmp_path, yarnapp_home):
    """Rank 0 (the ring's first, the one that writes the checkpoints) SIGKILLed mid-run;
    then, in the generation that resumed, the application master. The local engine's
    answer to YARN's AM attempts: the supervisor starts a new master, which starts every
    container again, and the world's next generation resumes from the newest complete
    checkpoint, spending no restart (max_restarts: 1, spent on the rank)."""
    kill_at = random.Random("kill-allreduce").randint(12, 20)
    am_at = kill_at + 10
    job = dict(digits_job(tmp_path, digits, "killed"), max_restarts=1, am_attempts=2)
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=0)
    kill_at = wait_step(run, rank=0, step=kill_at)     # (the step it reached: a busy host's status lags)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    rank_pid(run, rank=0, generation=1)
    wait_step(run, rank=0, step=am_at)
    os.kill(run.status()["am_pid"], signal.SIGKILL)
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["generation"] for r in st["restarts"]] == [1, 2], st["restarts"]
    assert "rank 0 (big_0) killed by signal 9" in st["restarts"][0]["reason"], st["restarts"]
    assert "the application master (attempt 1) killed by signal 9 (SIGKILL); attempt 2 restarts every container" \
        in st["restarts"][1]["reason"], st["restarts"]
    assert [a["attempt"] for a in st["am_attempts"]] == [1, 2] and st["am_attempts"][0]["exit_code"] == -9
    # the second master's starts say so (its containers' counts start again: "attempt 1" twice)
    banners = re.findall(r"==== small_0 attempt .*? started", run.logs()["small_0"])
    assert banners[0] == "==== small_0 attempt 1 started" and \
        banners[-1] == "==== small_0 attempt 1, application master attempt 2 started", banners
    resumed = resumed_steps(run)
    assert len(resumed) == 2 and kill_at - 10 <= resumed[0] <= kill_at + 2, (kill_at, resumed)
    assert resumed[1] >= resumed[0] and resumed[1] == st["final"]["resumed_from"], resumed
    assert _equal(final_weights(job), reference["allreduce"])
    assert _tb_steps(job, run) == list(range(1, 41))
    # the model and optimizer, the same on every rank, are written once
    last = os.path.join(job["checkpoint"]["uri"], run.app_id, f"step-{st['final']['steps'] - 10:08d}")
    parts = [torch.load(os.path.join(last, f"rank-{r:05d}.pt"), weights_only=False)["strategy"] for r in range(3)]
    assert {"model", "optimizer"} <= set(parts[0]) and parts[1] == parts[2] == {}, [list(p) for p in parts]
    formed1 = json.loads(store_of(run).get(keys.formed(1)))
    print(f"allreduce: rank 0 killed at step {kill_at}, resumed from {resumed[0]}, world re-formed "
          f"{formed1['time'] - t_kill:.1f}s after the kill; master killed at step {am_at}, resumed from {resumed[1]}")
    assert_nothing_left(run.app_id)


def test_sigkill_with_augmentation_and_measured_shares_resumes_bit_identically(digits, tmp_path, yarnapp_home):
    """Random crops and flips drawn per (seed, epoch, row), shares measured at start
    (speed: 1 + 0.5 + 0.5 vcores), a rank killed mid-epoch: the resumed generation splits
    its batches by the shares the checkpoint's run measured (not measuring them again),
    and reads and augments exactly the rows the uninterrupted run did, so the final
    weights equal those of a run given those shares."""
    def job(name, shares):
        j = digits_job(tmp_path, digits, name, steps=45, every=10)
        j["training"]["shares"] = shares
        j["training"]["data"].update({"augment": [{"random_crop": {"size": 8, "padding": 1}}, "hflip"],
                                      "shuffle_window": "16 KiB"})     # windows of one block
        return j
    killed = job("aug-killed", "speed")
    run = yarnapp.submit(killed)
    pid = rank_pid(run, rank=2)
    kill_at = random.Random("kill-augment").randint(33, 42)          # in the second epoch (29 steps each)
    kill_at = wait_step(run, rank=2, step=kill_at)     # (the step it reached: a busy host's status lags)
    os.kill(pid, signal.SIGKILL)
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["generation"] for r in st["restarts"]] == [1]
    resumed = st["final"]["resumed_from"]
    assert resumed in (30, 40) and resumed <= kill_at + 2, (kill_at, resumed)
    logs = run.logs()["big_0"]                  # measured once: the resumed generation takes them
    assert "the checkpoint's measured shares" in logs and logs.count("shares 'speed': passes") == 1, logs
    ckpt = os.path.join(killed["checkpoint"]["uri"], run.app_id)
    shares = [torch.load(os.path.join(ckpt, f"step-{step:08d}", "rank-00000.pt"),
                         weights_only=False)["strategy"]["shares"] for step in (resumed, 45)]
    assert shares[0] == shares[1] and shares[0] != [1.0, 0.5, 0.5], shares   # gen 0's measured, kept by gen 1
    ref = job("aug-ref", shares[0])
    run_to_end(ref)
    assert _equal(final_weights(killed), final_weights(ref))
    print(f"augmented, shares {[round(w) for w in shares[0]]} measured: killed at step {kill_at}, resumed from {resumed}")
    assert_nothing_left(run.app_id)


def test_a_stopped_rank_then_a_frozen_container_are_named_and_training_resumes_bit_identically(
        reference, digits, tmp_path, yarnapp_home):
    """Two hangs, one a generation. First rank 2's process alone is SIGSTOPped: its agent
    sees its heartbeat stop and names it hung. Then, in the generation that resumed, a whole
    container (its agent and its rank: a frozen VM, a host cut off), so nobody is left
    inside it to say so: its peers see its agent's beat stop, name it (not a healthy rank,
    whose collective merely waits for it), and it is replaced. The job ends as the
    uninterrupted one does."""
    job = digits_job(tmp_path, digits, "stopped", heartbeat="4s")
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=2)
    wait_step(run, rank=2, step=15)
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.time()
    rank_pid(run, rank=1, generation=1)
    wait_step(run, rank=1, step=25)
    agent = next(c for c in run.status()["containers"] if c["id"] == "small_0")["pid"]
    os.killpg(agent, signal.SIGSTOP)             # the container's process group: agent and rank
    t_freeze = time.time()
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    hung = json.loads(store_of(run).get(keys.abort(0)))
    assert "hung" in hung["reason"] and hung["container"] == "small_1", hung
    assert hung["time"] - t_stop <= 4 + 2, hung["time"] - t_stop        # heartbeat timeout + 2 s
    frozen = json.loads(store_of(run).get(keys.abort(1)))
    assert frozen["container"] == "small_0" and "stopped responding" in frozen["reason"], frozen
    assert frozen["time"] - t_freeze <= 10 + 2, frozen["time"] - t_freeze     # beats.FROZEN_MIN_S + a beat
    assert [r["generation"] for r in st["restarts"]] == [1, 2], st["restarts"]
    attempts = {c["id"]: c["attempts"] for c in st["containers"]}
    assert attempts == {"big_0": 1, "small_0": 2, "small_1": 1}, attempts
    assert _equal(final_weights(job), reference["allreduce"])
    assert_nothing_left(run.app_id)


def test_an_agent_sent_sigterm_from_outside_is_one_restart_that_spends_none(reference, digits, tmp_path,
                                                                            yarnapp_home):
    """One SIGTERM to a container's agent (not yarnapp's): its agent records it and ends; the
    master replaces it. It was two restarts, the second spending one ("container small_0
    exited with status 143"), and the first blamed the resource manager."""
    job = digits_job(tmp_path, digits, "sigterm", max_restarts=1)
    run = yarnapp.submit(job)
    wait_step(run, rank=1, step=15)
    agent = next(c for c in run.status()["containers"] if c["id"] == "small_0")["pid"]
    os.kill(agent, signal.SIGTERM)
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["reason"] for r in st["restarts"]] == ["container small_0 was sent SIGTERM from outside yarnapp"], \
        st["restarts"]
    assert _equal(final_weights(job), reference["allreduce"])
    assert_nothing_left(run.app_id)


def test_an_agent_frozen_after_its_peers_ended_is_ended_by_the_master(reference, digits, tmp_path, yarnapp_home):
    """A container's agent SIGSTOPped near the end (its rank trains on and finishes): its peers
    end SUCCEEDED, and nobody watched its beat any more, so the application stayed RUNNING
    until someone sent SIGCONT. The master ends it past the frozen limit: its rank's code
    finished with the others', so the application SUCCEEDED, bit-identical, nothing left (a
    half-written store file of the stopped agent's neither)."""
    job = digits_job(tmp_path, digits, "frozen-late", heartbeat="4s")
    run = yarnapp.submit(job)
    wait_step(run, rank=1, step=37)
    agent = next(c for c in run.status()["containers"] if c["id"] == "small_0")["pid"]
    os.kill(agent, signal.SIGSTOP)
    t0 = time.monotonic()
    st = run.wait(timeout=120)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), st["containers"], run.logs())
    assert time.monotonic() - t0 < 10 + 8, time.monotonic() - t0         # the frozen limit (beats.FROZEN_MIN_S)
    small0 = next(c for c in st["containers"] if c["id"] == "small_0")
    assert "its agent was silent for" in small0["exits"][-1]["note"], small0
    assert st["restarts"] == [], st["restarts"]
    assert _equal(final_weights(job), reference["allreduce"])
    assert not [f for f in os.listdir(os.path.join(st["app_dir"], "store")) if f.startswith(".tmp.")]
    assert_nothing_left(run.app_id)


def test_a_container_frozen_as_it_starts_is_named_and_replaced_by_the_master(digits, tmp_path, yarnapp_home):
    """small_1 stops before its agent writes a single beat (a sitecustomize SIGSTOPs its
    first agent as the interpreter starts), so its peers have no beat to watch. The
    master, which started it, sees none within the limit, ends the generation naming it
    and replaces it, instead of every generation waiting out the rendezvous for it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal\n"
        "if os.environ.get('YARNAPP_CONTAINER_ID') == 'small_1' and os.environ.get('YARNAPP_ATTEMPT') == '1' \\\n"
        "        and 'YARNAPP_RANK' not in os.environ:\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n")
    job = digits_job(tmp_path, digits, "frozen-start", heartbeat="4s", env={"PYTHONPATH": str(hook)})
    run = yarnapp.submit(job)
    rank_pid(run, rank=0, generation=1)
    small_1 = run.status()["containers"][2]     # its second attempt runs: no exit of its own yet
    assert (small_1["state"], small_1["exit_code"], small_1["attempts"]) == ("RUNNING", None, 2), small_1
    assert [e["attempt"] for e in small_1["exits"]] == [1], small_1     # the first's, kept
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    abort = json.loads(store_of(run).get(keys.abort(0)))
    assert abort["container"] == "small_1" and "never reported" in abort["reason"], abort
    assert [r["generation"] for r in st["restarts"]] == [1] and st["final"]["steps"] == 40
    assert next(c for c in st["containers"] if c["id"] == "small_1")["attempts"] == 2
    assert_nothing_left(run.app_id)


def test_crashes_while_checkpointing_resume_from_the_newest_complete_one(reference, digits, tmp_path, yarnapp_home):
    """Three crashes in one application, one a generation: rank 1 with its part of step 20
    written but before the commit (step 20 never completed: back to 10); rank 0 right after
    committing step 30 (it did, just: 30); rank 0 half-way through removing step 10 once 40
    is done (keep: 3: 40). Each generation resumes from the newest complete checkpoint and
    the job ends as the uninterrupted one does."""
    faults = "crash_in_checkpoint:20:1:0,crash_after_commit:30:0:1,crash_in_cleanup:40:0:2"
    job = dict(digits_job(tmp_path, digits, "ckptcrash", env={"YARNAPP_FAULT": faults}), max_restarts=3)
    run, st = run_to_end(job)
    assert [(r["generation"], r["rank"]) for r in st["restarts"]] == [(1, 1), (2, 0), (3, 0)], st["restarts"]
    assert all("exited with status 99" in r["reason"] for r in st["restarts"]), st["restarts"]
    resumed = resumed_steps(run)
    assert resumed == [10, 30, 40] and st["final"]["resumed_from"] == 40, resumed
    assert _equal(final_weights(job), reference["allreduce"])
    steps = sorted(os.listdir(os.path.join(job["checkpoint"]["uri"], run.app_id)))
    assert steps == ["application.json", "final", "step-00000020", "step-00000030", "step-00000040"], steps
    # the store does not grow with restarts (each poll reads it): of a generation two back,
    # only what happened is kept (its abort and formed records)
    kept = store_of(run).get_prefix(keys.ABORT_PREFIX)
    assert {k for k in kept if k < "gen/0002/"} == {f"gen/{g:04d}/{k}" for g in (0, 1) for k in ("abort", "formed")}
    assert "gen/0002/joined/00001" in kept and "gen/0003/incarnation/00002" in kept, sorted(kept)
    assert_nothing_left(run.app_id)


def test_resubmitting_a_job_does_not_resume_another_applications_checkpoints_unless_asked(
        reference, digits, tmp_path, yarnapp_home):
    """One checkpoint.uri, several applications. Resubmitted as it is (resume: never, the
    default) the job starts over; with resume: latest it goes on from the most recent
    application of the same name and ends bit-identical to an uninterrupted run; an
    application id names whose checkpoint; a job of another name never takes one with
    latest; an unknown application id fails in one line, on the first attempt."""
    def job(name="shared", steps=40, resume="never", instances=(1, 2)):
        j = digits_job(tmp_path, digits, name, steps=steps, instances=instances)
        j["checkpoint"] = dict(j["checkpoint"], uri=str(tmp_path / "ckpt"), resume=resume)
        return j
    run1, st1 = run_to_end(job(steps=20))
    # 20 steps of a 29-step epoch: its records say 0.69 epochs (it said epoch=1, as if one were done)
    assert 0 < st1["progress"][0]["epoch"] < 1, st1["progress"]
    run2, st2 = run_to_end(job(steps=20))                    # resubmitted as it is
    assert st2["final"]["resumed_from"] == 0 and "resumed_app" not in st2["final"]
    run3, st3 = run_to_end(job(resume="latest"))
    assert st3["final"]["resumed_app"] == run2.app_id and st3["final"]["resumed_from"] == 20
    assert LocalBackend().job_of(run3.app_id).checkpoint.resume == run2.app_id      # decided at submit, as said
    assert _equal(final_weights(job()), reference["allreduce"])
    # The next two at once: run4 names run1's checkpoint, and the job of another name looks for
    # the latest of its own name, of which there is none (all the others are "shared"). It runs
    # on one rank: which checkpoint `latest` takes is rank 0's choice, whatever the world's size.
    run4 = yarnapp.submit(job(steps=20, resume=run1.app_id))
    with pytest.raises(yarnapp.WaitTimeout, match=rf"^{run4.app_id} still [A-Z]+ after 0.01s; it runs on"):
        run4.wait(timeout=0.01)                                 # a TimeoutError and a YarnappError alike
    assert issubclass(yarnapp.WaitTimeout, TimeoutError) and issubclass(yarnapp.WaitTimeout, yarnapp.YarnappError)
    run5 = yarnapp.submit(job(name="other-name", steps=2, resume="latest", instances=(1, 0)))
    st4, st5 = (r.wait(timeout=600) for r in (run4, run5))
    for r, st in ((run4, st4), (run5, st5)):
        assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), r.logs())
    assert st4["final"]["resumed_app"] == run1.app_id and st4["final"]["resumed_from"] == 20
    # run1 ended at step 20, its max_steps: resumed there, nothing is left to train, and no rate is made up
    assert st4["final"]["trained_steps"] == 0 and "samples_per_s" not in st4["final"], st4["final"]
    assert st3["final"]["trained_steps"] == 20 and st3["final"]["samples_per_s"] > 0
    assert st5["final"]["resumed_from"] == 0                   # latest never takes another job's
    assert LocalBackend().job_of(run5.app_id).checkpoint.resume == "never"
    runs = (run1, run2, run3, run4, run5)
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(r.app_id for r in runs)
    before = sorted(os.listdir(yarnapp_home / "apps"))
    with pytest.raises(yarnapp.YarnappError, match="checkpoint.resume: no checkpoints of application "
                                                   "app_20200101_000000_abcdef under "):
        yarnapp.submit(job(resume="app_20200101_000000_abcdef"))      # before anything starts
    assert sorted(os.listdir(yarnapp_home / "apps")) == before
    for r in runs:
        assert_nothing_left(r.app_id)
