"""A failed application's way on: what it says of its last checkpoint, resuming another
application's, a master that dies, a rank that always fails, checkpoints whose bytes
changed or cannot be read (real processes, real signals, real MPI worlds). Restarts and
bit-identical resumes within one application: test_recovery."""
import json
import os
import re
import signal
import socket
import time

import pytest
import torch

import yarnapp
from launcher import keys
from recovery_util import digits_job, resumed_steps, run_to_end, store_of, wait_step
from util import assert_nothing_left, tb_scalars

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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


def test_a_job_whose_loss_goes_to_nan_fails_once_naming_the_learning_rate(digits, tmp_path, cli, yarnapp_home):
    """A scripting audit: `submit --wait` of a job at lr 1e12 exited 0, SUCCEEDED, "final:
    accuracy=0.1003 loss=nan": a pipeline went green on a model of chance accuracy, and
    `status --json` printed `NaN`, which is not JSON. Now three steps of a non-finite loss fail
    the job at once, not retried (a restart would diverge again from its checkpoint)."""
    import yaml
    job = digits_job(tmp_path, digits, "diverged", steps=30, max_restarts=2, instances=(1, 1))
    job["training"]["lr"] = 1e12
    path = tmp_path / "diverged.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = cli("submit", path, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"FAILED after 1 attempt\(s\): rank \d \(\w+\) exited with status 1: training diverged: the loss "
                     r"was nan for 3 steps in a row \(steps \d+-\d+ of 30\): lower training\.lr \(1e\+12 now\), or look "
                     r"for nan or inf in the features of training\.data\.train; a restart would resume .* so it was "
                     r"not retried", err), err
    app = err.split()[1]
    st = json.loads(cli("status", app, "--json").stdout,      # strict JSON: no NaN where the loss was
                    parse_constant=lambda c: pytest.fail(f"{c} in status --json"))
    assert st["state"] == "FAILED" and not st["restarts"], st
    assert_nothing_left(app)
    # a checkpoint due once the weights are nan is not written (a review: the line offered to
    # resume from a checkpoint of nan weights): the job fails there, its last checkpoint finite
    job["checkpoint"]["every_steps"] = 2
    path.write_text(yaml.safe_dump(job))
    proc = cli("submit", path, "--wait")
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and re.search(r"training diverged: its weights held nan or inf at step (\d+) \(of 30\), "
                                              r"where a checkpoint was due \(none was written\): lower training\.lr",
                                              err), err
    app, step = err.split()[1], int(re.search(r"at step (\d+)", err).group(1))
    ckpts = tmp_path / "diverged" / "ckpt" / app
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) if ckpts.is_dir() else []
    assert f"step-{step:08d}" not in kept, kept
    for name in kept:           # every checkpoint written holds finite weights
        for f in (ckpts / name).glob("rank-*.pt"):
            state = torch.load(f, weights_only=False)
            assert all(torch.isfinite(t).all() for t in _tensors(state)), (name, f)
    assert_nothing_left(app)


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


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
    assert resumed_steps(run2) == [10], run2.logs()["big_0"][-2000:]
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
