"""Failed and hung workers are restarted and training resumes exactly from the last
complete checkpoint (real processes, real signals, real MPI worlds)."""
import json
import os
import random
import re
import signal
import socket
import time

import pytest
import torch

import yarnapp
from launcher import keys
from yarnapp.backends.local.engine import LocalBackend
from recovery_util import digits_job, final_weights, rank_pid, run_to_end, store_of, wait_step
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


def _resumed(run):
    """The step each generation after the first resumed from, as rank 0 logged it."""
    return [int(line.rsplit(" ", 1)[1]) for line in run.logs()["big_0"].splitlines()
            if "resumed from the checkpoint of step" in line]


def test_a_sigkilled_rank_of_conv_model_parallel_resumes_bit_identically(reference, digits, tmp_path, yarnapp_home):
    """Rank 1 of the conv-layer split (a kernel share of its own) SIGKILLed mid-run. Its next
    rank is forked from the container's warm process (launcher.warm: imports done once); then
    that warm process is SIGKILLed too (as the kernel would kill it for memory), taking its rank
    with it, and the container starts another: both resume exactly."""
    import psutil
    kill_at = random.Random("kill-conv_model_parallel").randint(12, 20)
    job = digits_job(tmp_path, digits, "killed", "conv_model_parallel")
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=1)
    warm = psutil.Process(pid).parent()
    assert "launcher.warm" in warm.cmdline(), warm.cmdline()
    kill_at = wait_step(run, rank=1, step=kill_at)     # (the step it reached: a busy host's status lags)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    pid1 = rank_pid(run, rank=1, generation=1)
    assert psutil.Process(pid1).ppid() == warm.pid           # forked by the same warm process
    wait_step(run, rank=1, step=kill_at + 8)
    warm.kill()
    warm2 = psutil.Process(rank_pid(run, rank=1, generation=2)).parent()
    assert "launcher.warm" in warm2.cmdline() and warm2.pid != warm.pid    # a warm process started again
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["generation"] for r in st["restarts"]] == [1, 2]
    assert all("rank 1 (small_0) killed by signal 9" in r["reason"] for r in st["restarts"]), st["restarts"]
    resumed = _resumed(run)
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
    resumed = _resumed(run)
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
    resumed = _resumed(run)
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


def test_a_rank_that_always_fails_spends_the_budget_then_fails(tmp_path, cli, yarnapp_home):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfrom training.context import current\ncurrent().report(step=0)\n"   # (training)
                      "if current().rank == 1:\n    sys.exit(5)\nimport time\ntime.sleep(120)\n")
    job = tmp_path / "fail.yaml"
    import yaml
    job.write_text(yaml.safe_dump({
        "name": "always-fails", "max_restarts": 1, "run": {"script": str(script)},
        "groups": [{"name": "w", "instances": 3, "vcores": 0.5, "memory": "256 MiB"}]}))
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert "FAILED after 2 attempt(s)" in err and "w_1" in err and "exited with status 5" in err, err
    app = err.split()[1]
    st = yarnapp.status(app)
    store = store_of(yarnapp.Run(app))
    assert [g for g in range(5) if store.get(keys.abort(g))] == [0, 1]     # exactly max_restarts + 1
    assert [r["generation"] for r in st["restarts"]] == [1]
    assert "restart 1" in cli("status", app).stdout
    assert_nothing_left(app)


def test_an_application_that_trained_no_step_gets_no_resume_hint_for_checkpoints_out_of_reach(
        digits, tmp_path, yarnapp_home):
    """A notebook audit on YARN: a job failed as it started, on a checkpoint.uri it could not
    write, and its line ended "its checkpoints (...) cannot be read now: once they can,
    submit(..., resume) goes on from the last complete one", of checkpoints never written.
    (Here a container too small to import torch fails it as it starts.)"""
    job = digits_job(tmp_path, digits, "no-step", max_restarts=0)
    for group in job["groups"]:
        group["memory"] = "120 MiB"
    run = yarnapp.submit(job)
    st = run.wait(timeout=120)
    assert st["state"] == "FAILED" and not any(p.get("step") for p in st["progress"].values()), st
    stored = yarnapp_home / "apps" / run.app_id / "job.json"
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                                # nothing listens there now
    stored.write_text(json.dumps({**json.loads(stored.read_text()), "checkpoint": {
        **json.loads(stored.read_text())["checkpoint"], "uri": f"webhdfs://127.0.0.1:{port}/ckpt"}}))
    message = yarnapp.Run(run.app_id).failure_message()
    assert "exceeded its memory limit" in message and "checkpoints" not in message, message
    assert_nothing_left(run.app_id)


def test_a_failed_application_says_how_to_go_on_from_its_last_checkpoint(digits, tmp_path, cli, yarnapp_home):
    """Out of restarts with a complete checkpoint behind it, the failure's line names the
    checkpoint and the command that goes on from it; that command, run as written once
    the fault is gone, resumes there; `yarnapp kill` says the same of the run it stops.
    (Before, they said how it ended and nothing else.)"""
    import shlex

    import yaml
    faults = "crash_in_checkpoint:20:1:0,crash_in_checkpoint:20:1:1"    # step 10 complete, 20 never
    job = digits_job(tmp_path, digits, "resume-hint", steps=30, max_restarts=1, instances=(1, 1),
                     env={"YARNAPP_FAULT": faults})
    path = tmp_path / "resume-hint.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = cli("submit", path, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    app = line.split()[1]
    assert "FAILED after 2 attempt(s)" in line and "exited with status 99" in line, line
    assert "\nresumed from the checkpoint of step 10\n" in proc.stderr, proc.stderr     # (its restart)
    again = f"yarnapp submit {path} --resume {app}"
    assert line.endswith(f"; its last complete checkpoint is step 10: `{again}` goes on from it"), line
    from_notebook = yarnapp.Run(app).failure_message()          # a handle from its id alone, in any kernel
    assert from_notebook.endswith(f"step 10: submit(..., checkpoint={{'resume': '{app}'}}) goes on from it")
    # its checkpoints on a filesystem out of reach as it is asked (HDFS down as it failed: the
    # hint was missing when it mattered most, an HDFS audit): where they are, and the command
    stored = yarnapp_home / "apps" / app / "job.json"
    kept = stored.read_text()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                                # nothing listens there now
    stored.write_text(json.dumps({**json.loads(kept), "checkpoint": {**json.loads(kept)["checkpoint"],
                                                                      "uri": f"webhdfs://127.0.0.1:{port}/ckpt"}}))
    assert yarnapp.Run(app).failure_message().endswith(
        f"; its checkpoints (webhdfs://127.0.0.1:{port}/ckpt/{app}) cannot be read now: once they can, "
        f"submit(..., checkpoint={{'resume': '{app}'}}) goes on from the last complete one")
    stored.write_text(kept)
    for group in job["groups"]:
        group["env"] = {}
    path.write_text(yaml.safe_dump(job))
    # the command as given, without --wait, and a field set on it (the kill's hint below keeps it:
    # it left out what the command line set, --nodes, an audit found)
    app2 = cli(*shlex.split(again)[1:], "training.max_steps=1000", check=0).stdout.strip()
    run2 = yarnapp.Run(app2)
    wait_step(run2, rank=0, step=23)
    assert _resumed(run2) == [10], run2.logs()["big_0"][-2000:]
    import io

    from yarnapp.progress import Progress
    said = io.StringIO()
    Progress(run2, file=said).update(run2.status())         # what submit --wait says as it starts
    assert f"resumed from the checkpoint of step 10 of {app}\n" in said.getvalue(), said.getvalue()
    # `yarnapp kill` says where it can go on from; run from another directory, the command
    # goes back to the one it was submitted from (the job's relative paths are from there)
    import subprocess
    import sys
    submitted_from = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # the cli fixture's
    killed = subprocess.run([sys.executable, "-m", "yarnapp.cli", "kill", app2], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120).stdout.strip()
    step = int(killed.split("checkpoint is step ")[1].split(":")[0])
    assert step >= 20 and killed == (f"{app2} KILLED; its last complete checkpoint is step {step}: `cd "
                                     f"{shlex.quote(submitted_from)} && yarnapp submit {path} training.max_steps=1000 --resume {app2}` goes "
                                     f"on from it"), killed
    assert_nothing_left(app)
    assert_nothing_left(app2)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_with_no_attempts_left_a_killed_master_fails_the_application_naming_it(digits, tmp_path, yarnapp_home, how):
    """...and so does a stopped one, after launcher.heartbeat_timeout: before, a master
    stopped (SIGSTOP) was never judged, and the application stayed RUNNING though its
    training had ended."""
    job = dict(digits_job(tmp_path, digits, "am-once", steps=400), am_attempts=1)
    job["launcher"] = dict(job.get("launcher") or {}, heartbeat_timeout="4s")
    run = yarnapp.submit(job)
    wait_step(run, rank=0, step=5)
    os.kill(run.status()["am_pid"], how)
    st = run.wait(timeout=120)
    assert st["state"] == "FAILED"
    assert "the application master (attempt 1, pid" in st["diagnostics"], st["diagnostics"]
    assert re.search(r"killed by signal 9" if how == signal.SIGKILL else
                     r"was stopped for ([4-9]|\d\d)s \(limit 4s: launcher.heartbeat_timeout\), so it was killed; no "
                     r"application master attempts left", st["diagnostics"]), st["diagnostics"]
    assert "no application master attempts left (am_attempts: 1)" in st["diagnostics"]
    assert "FAILED" in run.failure_message() and "application master" in run.failure_message()
    assert_nothing_left(run.app_id)


def test_a_master_killed_with_its_supervisor_fails_the_application_and_leaves_nothing(
        digits, tmp_path, yarnapp_home):
    """A double fault: the supervisor, which would start a new master, and the master are
    both SIGKILLed. The containers die with their master; status says the master died and
    removes the application's cgroups, which nobody was left to remove."""
    from yarnapp.backends.local import supervisor
    job = dict(digits_job(tmp_path, digits, "double", steps=400), am_attempts=2)
    run = yarnapp.submit(job)
    wait_step(run, rank=0, step=12)         # past its checkpoint of step 10
    # Resuming it while it trains is refused (the ranks failed on a checkpoint it had rotated
    # away since, "remove the broken step directories"), by its id or as the job's latest
    before = sorted(os.listdir(yarnapp_home / "apps"))
    for resume, chosen in ((run.app_id, f"application {run.app_id}"),
                           ("latest", f"the latest application of this job, {run.app_id},")):
        with pytest.raises(yarnapp.YarnappError, match=re.escape(
                f"job: checkpoint.resume: {chosen} is RUNNING: its checkpoints change while it trains; wait for "
                f"it to end, or stop it first with `yarnapp kill {run.app_id}`")):
            yarnapp.submit(dict(job, checkpoint=dict(job["checkpoint"], resume=resume)))
    assert sorted(os.listdir(yarnapp_home / "apps")) == before
    st = run.status()
    os.kill(json.load(open(supervisor.record_path(st["app_dir"])))["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10            # the master notices, and its status says so (it did not)
    while not run.status().get("supervisor_lost"):
        assert time.monotonic() < deadline and run.state == "RUNNING", run.status()
        time.sleep(0.1)
    os.kill(st["am_pid"], signal.SIGKILL)
    st = run.wait(timeout=120)
    assert st["state"] == "FAILED" and st["diagnostics"].startswith(
        "the application master died, and so had its supervisor, which would have started attempt 2 (am_attempts: "
        "2): both were killed from outside; see "), st      # (it said nothing of the lost attempt)
    log = st["diagnostics"].split("; see ")[1]      # a log that is there (it named am.log where none was)
    assert os.path.isfile(log) and st["failure"]["log"] == log, st
    assert [c["state"] for c in st["containers"]] == ["FAILED"] * 3, st["containers"]    # not RUNNING
    assert yarnapp.status(run.app_id)["finished"] == st["finished"]       # written once, not per status
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


def test_resume_finds_other_applications_when_checkpoint_uri_is_unset(digits, tmp_path, yarnapp_home):
    """checkpoint.uri unset (the default): each application checkpoints in its own
    directory, and `resume` (latest, or an application id) finds the others there. Before,
    it looked only in the new application's own directory: `--resume latest` started from
    step 0 and an application id failed. Resumed into a job of another model (mlp), the
    checkpoint is refused in one line, not retried: before, a torch 'Error(s) in loading
    state_dict for MLP' cut off at its first line, after a traceback, and a restart spent."""
    def job(steps, resume="never", model="digits_cnn", batch=48, **training):
        j = digits_job(tmp_path, digits, "default-uri", steps=steps, instances=(1, 0))
        j["checkpoint"] = {"every_steps": 10, "resume": resume}
        j["tensorboard"] = {}           # (unset too: each application logs in its own directory)
        j["training"].update(model=model, batch_size=batch, **training)
        return j
    run1, _ = run_to_end(job(20))
    run2, st2 = run_to_end(job(30, resume="latest"))
    assert st2["final"]["resumed_app"] == run1.app_id and st2["final"]["resumed_from"] == 20
    # its TensorBoard run goes on from the resumed one's curves (a long-run audit: it began at
    # step 21, and the steps before were only in the other application's directory)
    tb = yarnapp_home / "apps" / run2.app_id / "tensorboard" / run2.app_id
    assert [step for step, _ in tb_scalars(str(tb), "train/loss")] == list(range(1, 31))
    # Another batch size: step 20 would mean another epoch. Refused at submit, nothing started
    # (its application recorded its batch size and rows); a checkpoint whose application did
    # not record them (written by an earlier yarnapp) is refused by the ranks, not retried.
    before = sorted(os.listdir(yarnapp_home / "apps"))
    with pytest.raises(yarnapp.YarnappError, match=(
            rf"^job: checkpoint.resume: the checkpoint of step 20 \(application {run1.app_id}\) was written with "
            rf"training.batch_size 48 and 1438 rows of training.data.train; this job has 24 and 1438, so its steps "
            rf"would be other places in the data; resume with the batch size")):
        yarnapp.submit(job(30, resume=run1.app_id, batch=24))
    with pytest.raises(yarnapp.YarnappError, match=(                    # another model: refused at submit too
            rf"^job: checkpoint.resume: the checkpoint of step 20 \(application {run1.app_id}\) was written with "
            rf"training.model 'digits_cnn' \(this job: 'mlp'\); its states load only into the job that wrote them")):
        yarnapp.submit(job(30, resume=run1.app_id, model="mlp"))
    # Step 20 is mid-epoch (29 steps an epoch): another seed or shuffle window orders the rest
    # of its rows otherwise (the client digests the order as the ranks record it: run2's
    # unchanged resume was taken)
    with pytest.raises(yarnapp.YarnappError, match=(
            rf"^job: checkpoint.resume: the checkpoint of step 20 \(application {run1.app_id}\) is 20 steps into "
            rf"epoch 1 \(of 29 steps\), and this job orders that epoch's rows otherwise \(training.seed 4 \(it "
            rf"was written with 3\)\): the rest of the epoch would repeat some rows and skip others")):
        yarnapp.submit(job(30, resume=run1.app_id, seed=4))
    shuffled = job(30, resume=run1.app_id)
    shuffled["training"]["data"]["shuffle_window"] = "1 MiB"
    with pytest.raises(yarnapp.YarnappError, match=r"\(training.data.shuffle_window, or the training set's row "
                                                   r"groups, changed; training.data.memory and groups\[\].memory "
                                                   r"keep the order\)"):
        yarnapp.submit(shuffled)
    assert sorted(os.listdir(yarnapp_home / "apps")) == before
    # an application recorded by an earlier yarnapp (no data, no model): the ranks refuse, not retried
    card = yarnapp_home / "apps" / run1.app_id / "checkpoints" / run1.app_id / "application.json"
    card.write_text(json.dumps({k: v for k, v in json.loads(card.read_text()).items() if k not in ("data", "trains")}))
    run3 = yarnapp.submit(job(30, resume=run1.app_id))                  # these three at once
    run4 = yarnapp.submit(job(30, resume=run1.app_id, model="mlp"))
    run5 = yarnapp.submit(job(30, resume=run1.app_id, batch=24))
    st3, st, st5 = run3.wait(timeout=300), run4.wait(timeout=300), run5.wait(timeout=300)
    assert st3["state"] == "SUCCEEDED", (st3.get("diagnostics"), run3.logs())
    assert st3["final"]["resumed_app"] == run1.app_id and st3["final"]["resumed_from"] == 20
    assert st["state"] == "FAILED" and st["failure"]["attempts"] == 1, st
    reason = st["failure"]["reason"]
    assert (f"the checkpoint of step 20 (application {run1.app_id}) was written with training.model 'digits_cnn' "
            f"(this job: 'mlp')") in reason, reason
    assert "\n" not in reason and "not retried" in reason, reason
    assert st5["state"] == "FAILED" and st5["failure"]["attempts"] == 1, st5
    assert (f"the checkpoint of step 20 (application {run1.app_id}) was written with training.batch_size 48 and "
            f"1438 rows of training.data.train; this job has 24 and 1438, so its steps would be other places in "
            f"the data") in st5["failure"]["reason"], st5["failure"]["reason"]
    for r in (run1, run2, run3, run4, run5):
        assert_nothing_left(r.app_id)


def _flip_a_tensor_byte(path):
    """Invert a byte in the middle of the largest tensor record of a torch.save file."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        rec = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(rec.header_offset + 26)
        name, extra = struct.unpack("<HH", f.read(4))
        at = rec.header_offset + 30 + name + extra + rec.file_size // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_file_whose_bytes_changed_after_it_was_written_is_not_loaded(tmp_path):
    """torch.load takes it (its tensors other than saved); its CRC-32s do not, from a local
    file or from bytes read (a remote file's fallback)."""
    import io

    import pyarrow.fs as pafs

    from training import fsutil
    path = tmp_path / "rank-00000.pt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    assert torch.equal(fsutil.torch_load_file(pafs.LocalFileSystem(), str(path))["w"], torch.arange(4096.0))
    _flip_a_tensor_byte(path)
    assert not torch.equal(torch.load(path)["w"], torch.arange(4096.0))      # loads, other than saved
    for load in (lambda: fsutil.torch_load_file(pafs.LocalFileSystem(), str(path)),
                 lambda: fsutil.check_crcs(io.BytesIO(path.read_bytes()))):
        with pytest.raises(fsutil.ChecksumError, match=r"^its record \S+/data/0 does not match its CRC-32"):
            load()


def test_a_checkpoint_with_an_unreadable_file_is_passed_over_for_the_one_before(digits, tmp_path, yarnapp_home, cli):
    """Rank 1's file of the newest checkpoint truncated: every restart failed on it
    (PytorchStreamReader ... a traceback naming no file) and the intact checkpoint before it
    was never tried. Now it resumes from that one; when none can be read, one line, not retried."""
    first = digits_job(tmp_path, digits, "ckpt", steps=20, instances=(1, 1))
    run1, _ = run_to_end(first)
    # its training ended: a kill a moment later offered `--resume` of its last step (0 steps to train)
    assert run1.resume_hint("yarnapp submit j.yaml") == "; its training had ended (step 20): its model and final " \
                                                         "metrics are kept"
    root = tmp_path / "ckpt" / "ckpt" / run1.app_id
    with open(root / "step-00000020" / "rank-00001.pt", "r+b") as f:
        f.truncate(1000)
    again = digits_job(tmp_path, digits, "ckpt", steps=30, instances=(1, 1))
    again["checkpoint"]["resume"] = run1.app_id
    again["training"]["lr"] = 0.02          # (it trained on with the checkpoint's 0.05, saying nothing)
    wider = digits_job(tmp_path, digits, "ckpt", steps=30, instances=(1, 2))       # 3 ranks: no file for rank 2
    wider["checkpoint"]["resume"] = run1.app_id
    with pytest.raises(yarnapp.YarnappError, match=rf"^job: checkpoint.resume: the checkpoint of step 20 "
                                                   rf"\(application {run1.app_id}\) was written by 2 ranks, and "
                                                   rf"this job has 3 \(groups\[\]\.instances\); resume it with at "
                                                   rf"most 2"):
        yarnapp.submit(wider)                                                       # nothing started
    run2 = yarnapp.submit(again)
    st2 = run2.wait(timeout=300)
    assert st2["state"] == "SUCCEEDED", (st2.get("diagnostics"), run2.logs())
    assert st2["final"]["resumed_app"] == run1.app_id and st2["final"]["resumed_from"] == 10
    assert "the checkpoint of step 20 cannot be read" in run2.logs()["big_0"]
    assert any(n["text"] == "resumed with this job's training.lr 0.02 (the checkpoint of step 10 was trained with "
                            "0.05)" for n in st2["notices"]), st2["notices"]
    last = torch.load(tmp_path / "ckpt" / "ckpt" / run2.app_id / "step-00000030" / "rank-00000.pt", weights_only=False)
    assert {g["lr"] for g in last["strategy"]["optimizer"]["param_groups"]} == {0.02}
    # ... and said where the user looks, not only in rank 0's log: status and submit --wait
    said = [n for n in st2["notices"] if n["text"].startswith("the checkpoint of step 20 cannot be read (")]
    assert len(said) == 1 and said[0]["ranks"] == [0] and "rank-00001.pt: RuntimeError: " in said[0]["text"], st2
    assert said[0]["text"].endswith("; trying the one before it") and len(said[0]["text"]) < 400, said
    assert f"  warning (rank 0): {said[0]['text']}\n" in cli("status", run2.app_id, check=0).stdout
    # Bytes of a tensor changed in place (a disk's fault): the file loads, and a resume took its
    # other weights without a word. Its records' CRC-32s say so.
    _flip_a_tensor_byte(root / "step-00000010" / "rank-00000.pt")
    run3 = yarnapp.submit(again)
    st3 = run3.wait(timeout=300)
    assert st3["state"] == "FAILED" and st3["failure"]["attempts"] == 1, st3
    assert f"no complete checkpoint of application {run1.app_id} can be read (step 20: " in st3["failure"]["reason"]
    assert "rank-00001.pt" in st3["failure"]["reason"] and "not retried" in st3["failure"]["reason"]
    said = [n["text"] for n in st3["notices"] if n["text"].startswith("the checkpoint of step 10 cannot be read (")]
    assert len(said) == 1 and "rank-00000.pt: ChecksumError: its record " in said[0] and \
        "does not match its CRC-32 (its bytes changed after it was written)" in said[0], st3["notices"]
    for r in (run1, run2, run3):
        assert_nothing_left(r.app_id)
