"""Faults around recovery, with real processes and real kernels: a container over its
memory limit (the cgroup's OOM killer), named as such with the limit to raise; a
checkpoint directory that turns read-only or fills up (a real tmpfs) mid-run."""
import os
import re
import shutil
import time
import subprocess
import sys

import pytest
import torch

import yarnapp
from recovery_util import digits_job, rank_pid, run_to_end, wait_step
from util import app_id_from, assert_nothing_left, write_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CGROUPS = os.geteuid() == 0 and os.path.isfile("/sys/fs/cgroup/memory/memory.oom_control")


@pytest.mark.skipif(not CGROUPS, reason="memory limits need root and cgroup v1")
def test_a_container_over_its_memory_limit_is_named_with_the_limit_to_raise(cli, tmp_path):
    (tmp_path / "hog.py").write_text(
        "import time\nfrom training.context import current\nctx = current()\nchunks = []\n"
        "while ctx.rank == 1:\n    chunks.append(bytearray(32 * 2**20))\n    time.sleep(0.01)\n"
        "ctx.comm.Barrier()\n")
    job = write_job(tmp_path / "hog.yaml", {
        "name": "hog", "max_restarts": 0, "run": {"script": str(tmp_path / "hog.py")},
        "groups": [{"name": "big", "instances": 1, "vcores": 1, "memory": "512 MiB"},
                   {"name": "small", "instances": 1, "vcores": 0.5, "memory": "256 MiB"}]})
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert ("rank 1 (small_0) was killed by the kernel: small_0 exceeded its memory limit of 256 MiB "
            "(peak 256 MiB): raise groups[1].memory") in err, err
    app = app_id_from(err)
    status = cli("status", app, check=0).stdout
    assert "exceeded its memory limit of 256 MiB" in status.splitlines()[0], status
    assert "(peak 256 MiB)" in status, status
    assert_nothing_left(app)


@pytest.mark.skipif(not CGROUPS, reason="memory limits need root and cgroup v1")
def test_a_container_too_small_for_its_own_agent_is_named_as_over_its_memory(cli, tmp_path):
    """10 MiB: the container's agent itself is OOM-killed as it starts, so no agent ends the
    application. It said "container a_0 killed by signal 9", not a word of memory."""
    job = write_job(tmp_path / "tiny.yaml", {
        "name": "tiny", "max_restarts": 0, "run": {"function": "training.hello:main"},
        "groups": [{"name": "a", "instances": 1, "vcores": 0.5, "memory": "10 MiB"}]})
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "container a_0 was killed by the kernel: a_0 exceeded its memory limit of 10 MiB" in err, err
    assert "raise groups[0].memory" in err, err
    assert_nothing_left(app_id_from(err))


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MiB tmpfs mounted for the test (root only), unmounted after it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(disk, chunk):
    """Fill `disk` (ENOSPC from then on), writing `chunk` bytes at a time to its file "filler"."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * chunk)
        except OSError:
            pass


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_checkpoint_that_cannot_be_written_fails_in_one_line_and_the_previous_stays(
        fault, small_disk, digits, tmp_path, yarnapp_home):
    job = digits_job(tmp_path, digits, f"ckpt-{fault}", steps=60, every=10, max_restarts=3)
    job["checkpoint"]["uri"] = str(small_disk / "ckpt")
    run = yarnapp.submit(job)
    wait_step(run, rank=0, step=12)                    # step 10's checkpoint is complete
    mine = small_disk / "ckpt" / run.app_id              # one directory per application
    assert sorted(os.listdir(mine)) == ["application.json", "step-00000010"]
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    else:
        fill_up(small_disk, 2**20)
    st = run.wait(timeout=300)
    assert st["state"] == "FAILED", run.logs()
    reason = st["failure"]["reason"]
    why = "Read-only file system" if fault == "read-only" else "No space left on device"
    assert f"checkpoint.uri {small_disk}/ckpt: cannot write the checkpoint of step 20" in reason, reason
    assert why in reason, reason
    assert len(reason.splitlines()) == 1
    # every rank raises it, rank 0 last (it removes the half-written directory first): the rank
    # at fault is named, not the first to end
    assert reason.startswith("rank 0 ("), reason
    # retried once, from step 10, and not again: the same storage, the same line (it spent every restart)
    assert [r["generation"] for r in st["restarts"]] == [1], [r["reason"] for r in st["restarts"]]
    assert "cannot write the checkpoint of step 20" in st["restarts"][0]["reason"]
    assert "the same error in two attempts in a row, so it was not retried again" in reason, reason
    # the previous complete checkpoint is intact and loads on every rank; nothing half-written is left
    assert sorted(os.listdir(mine)) == ["application.json", "step-00000010"]
    for r in range(3):
        state = torch.load(mine / "step-00000010" / f"rank-{r:05d}.pt", weights_only=False)
        assert state["step"] == 10
    assert_nothing_left(run.app_id)


def test_a_final_model_the_disk_cannot_hold_is_one_line_and_never_a_truncated_model(small_disk):
    """A resource audit: the final model.pt was written in place, so a disk full left a
    truncated one (and a 0-byte model.json) that load_final took as the newest final model,
    failing in torch's zip reader; and the failure was pyarrow's traceback, retried until
    every restart was spent."""
    code = ("import sys, torch\nfrom mpi4py import MPI\n"
            "from training.checkpoint import Checkpointer, CheckpointError, load_final\n"
            "c = Checkpointer(sys.argv[1], MPI.COMM_SELF, app_id='app_b', name='j')\nc.latest()\n"
            "model = torch.nn.Linear(1000, 1000)\n"
            "try:\n    c.save_model(model, {'model': 'x'})\n"
            "except CheckpointError as e:\n    print(e, e.repeats)\n"
            "print(sorted(load_final(sys.argv[1])))\n")
    uri = small_disk / "ckpt"
    with open(small_disk / "filler", "wb") as f:       # room for one model of two
        f.write(b"\0" * (16 - 6) * 2**20)

    def run(room):
        return subprocess.run([sys.executable, "-c", code, str(uri), room], capture_output=True, text=True,
                              timeout=120)
    out = run("room")
    assert out.stdout.splitlines() == ["['bias', 'weight']"], (out.stdout, out.stderr[-2000:])
    assert os.path.getsize(uri / "app_b" / "final" / "model.pt") > 4 * 1000 * 1001
    os.rename(uri / "app_b", uri / "app_a")            # an earlier application's final model
    out = run("full")
    assert out.stdout.startswith(f"checkpoint.uri {uri}: cannot write the final model: "), (out.stdout, out.stderr)
    assert "No space left on device" in out.stdout and out.stdout.splitlines()[0].endswith(
        "; free space or fix its permissions (its last complete checkpoint is kept: --resume goes on from it) True")
    # nothing half-written: the final model loaded is the earlier application's, whole
    assert out.stdout.splitlines()[1:] == ["['bias', 'weight']"], out.stdout
    assert sorted(os.listdir(uri / "app_b")) == ["application.json"]


def test_yarnapp_home_filling_up_mid_run_is_one_line_and_said_as_it_was(small_disk, digits, tmp_path,
                                                                         monkeypatch):
    """A resource audit: YARNAPP_HOME's disk filling mid-run ended `submit --wait` and
    `status` in a bare traceback, left .tmp files, and once space was freed said the master
    and its supervisor "were both killed from outside"; they had failed on the full disk."""
    home = small_disk / "home"
    monkeypatch.setenv("YARNAPP_HOME", str(home))
    job = write_job(tmp_path / "full.yaml", digits_job(tmp_path, digits, "full", steps=100000, every=1000))
    submit = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "submit", job, "--wait"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        app = None
        while app is None:
            app = next(iter(os.listdir(home / "apps")), None) if (home / "apps").is_dir() else None
            time.sleep(0.1)
        wait_step(yarnapp.Run(app), rank=0, step=5)
        fill_up(small_disk, 2**16)
        out, err = submit.communicate(timeout=180)
    finally:
        submit.kill()
    lines = err.strip().splitlines()
    assert submit.returncode == 1, err[-3000:]
    assert lines[-1].startswith("Error: ") and "No space left on device: free space there" in lines[-1], err[-3000:]
    os.unlink(small_disk / "filler")
    st = yarnapp.Run(app).status()
    assert st["state"] == "FAILED", st
    assert st["diagnostics"].startswith("the application master died (OSError: [Errno 28] No space left on device)") \
        and "killed from outside" not in st["diagnostics"], st
    assert not [f for f in os.listdir(home / "apps" / app) if f.endswith(".tmp")]
    assert_nothing_left(app)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a /dev/shm")
def test_a_full_dev_shm_trains_on_without_its_shared_memory(digits, tmp_path):
    """A resource audit: with /dev/shm full, the ranks' wait flags (a file sized there, not
    reserved) killed a rank with SIGBUS on its first write; now they are reserved, and the
    ranks train on without them, as they do without the shared-memory all-reduce."""
    job = write_job(tmp_path / "shm.yaml", digits_job(tmp_path, digits, "shm", steps=6, every=100, max_restarts=0))
    script = (f"mount -t tmpfs -o size=64k tmpfs /dev/shm && (cat /dev/zero > /dev/shm/fill 2>/dev/null; "
              f"{sys.executable} -m yarnapp.cli submit {job} --wait)")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "final: accuracy=" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert_nothing_left(app_id_from(proc.stdout + proc.stderr))


def test_a_limit_on_open_files_is_named_not_blamed_on_the_data(digits, tmp_path):
    """A resource audit: under `ulimit -n 24`, a rank said its Parquet file was "corrupt or
    unreadable ... re-import the dataset"; the file was fine, the limit too low."""
    import resource
    job = write_job(tmp_path / "fds.yaml", digits_job(tmp_path, digits, "fds", steps=3, every=100, max_restarts=0))
    proc = subprocess.run([sys.executable, "-m", "yarnapp.cli", "submit", job, "--wait"], capture_output=True,
                          text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "cannot open it: too many open files (this container may open 24: `ulimit -n`); " \
        "raise that limit where yarnapp submit runs" in out, out[-3000:]
    assert "re-import" not in out, out[-3000:]
    # the failure's line has it too: the rank could not record it (no descriptor for the
    # store's file either), and its agent read it from its log (it said "exited with status 1")
    assert re.search(r"FAILED after 1 attempt\(s\): rank \d \(\w+\) exited with status 1: .*cannot open it: too many "
                     r"open files", out.strip().splitlines()[-1]), out[-3000:]
    assert_nothing_left(app_id_from(out))


def test_a_checkpoint_uri_the_containers_cannot_write_is_one_line(tmp_path):
    """What a container meets when its checkpoint.uri cannot be written at the start (on
    YARN, a local path is the nodes' own and not checked at submit). Before, the error
    string was spread into _written_by_fewer's arguments: a TypeError of 144 of them. With
    checkpoint.uri unset, the line named that field, which the user never set."""
    code = ("import sys\nfrom mpi4py import MPI\nfrom training.checkpoint import Checkpointer, CheckpointError\n"
            "for siblings in (None, '/proc/nope'):\n"
            "    try:\n        Checkpointer('/proc/nope/ckpt', MPI.COMM_SELF, siblings=siblings).latest()\n"
            "    except CheckpointError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("checkpoint.uri /proc/nope/ckpt: cannot write to it: "), \
        (out.stdout, out.stderr)
    assert lines[1].startswith("/proc/nope/ckpt (checkpoint.uri unset: the application's own): cannot write to it")


def test_resume_latest_takes_no_application_that_started_after_this_one(tmp_path):
    """Two applications of one job with resume: latest: the first one's restarted world took
    the checkpoint of the second, started a moment after it (an audit's two submits at once:
    the first was told "starting from step 0" and ended resumed_from=50 of the other)."""
    code = ("import sys, time\nfrom mpi4py import MPI\nfrom training.checkpoint import Checkpointer\n"
            "def c(app, gen=0):\n"
            "    return Checkpointer(sys.argv[1], MPI.COMM_SELF, app_id=app, name='j', resume='latest', "
            "generation=gen)\n"
            "print(c('app_a').latest()[0]); time.sleep(0.01)\n"
            "open(sys.argv[1] + '/app_a/application.json', 'w').write('{\"app_id\": \"app_a\", \"cre')\n"
            "b = c('app_b'); print(b.latest()[0]); b.save(5, {'w': 1})\n"
            "print(c('app_a', gen=1).latest()[0], c('app_c').latest()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0", "0", "0", "5"], (out.stdout, out.stderr)


def test_a_resume_removes_what_a_kill_mid_checkpoint_left_in_the_application_it_names(tmp_path):
    """A long-run audit: `yarnapp kill` during a checkpoint left step-N.tmp-0 (a rank's 1.2 MB)
    for good: only the killed application's own next start tidied it, and a resume is another
    application."""
    code = ("import sys\nfrom mpi4py import MPI\nfrom training.checkpoint import Checkpointer\n"
            "a = Checkpointer(sys.argv[1], MPI.COMM_SELF, app_id='app_a', name='j')\na.latest()\n"
            "a.save(5, {'w': 1})\n"
            "import os\nos.makedirs(sys.argv[1] + '/app_a/step-00000010.tmp-0')\n"
            "open(sys.argv[1] + '/app_a/step-00000010.tmp-0/rank-00000.pt', 'w').write('half')\n"
            "print(Checkpointer(sys.argv[1], MPI.COMM_SELF, app_id='app_b', name='j', resume='app_a').latest()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["5"], (out.stdout, out.stderr)
    assert sorted(os.listdir(tmp_path / "app_a")) == ["application.json", "step-00000005"]


def test_steps_past_eight_digits_are_kept_pruned_and_resumed_in_order(tmp_path):
    """Checkpoints are step-00000050; one of step 100000000 (nine digits: a small model at
    300 steps/s reaches it in four days) was not seen as one: never pruned, a restart resumed
    from the last of eight digits, and every later commit failed on a directory not empty."""
    code = ("import os, sys\nfrom mpi4py import MPI\nfrom training.checkpoint import Checkpointer\n"
            "c = Checkpointer(sys.argv[1], MPI.COMM_SELF, keep=2, app_id='app_a', name='j')\nc.latest()\n"
            "for step in (99999998, 99999999, 100000000, 100000001):\n    c.save(step, {'w': step})\n"
            "print(sorted(os.listdir(sys.argv[1] + '/app_a')))\n"
            "step, state = Checkpointer(sys.argv[1], MPI.COMM_SELF, app_id='app_a', name='j', generation=1).latest()\n"
            "print(step, state['w'])\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['application.json', 'step-100000000', 'step-100000001']",
                                       "100000001 100000001"], (out.stdout, out.stderr)


def test_a_resume_that_cannot_load_is_refused_before_anything_starts(tmp_path):
    """What a client sees before starting a world (Checkpointer.refusal, as submit asks it):
    a ps_sharded checkpoint of 2 ranks into 1 (each rank holds a segment of the server), and
    SGD's state into Adam, were taken and failed in every rank ("does not fit this job's
    model or strategy", KeyError 'step'); fewer ranks under allreduce still resume."""
    code = ("import sys\nfrom mpi4py import MPI\nimport conf\n"
            "from training.checkpoint import Checkpointer, what_it_trains\n"
            "def job(strategy, optimizer='sgd'):\n"
            "    return conf.offline_job([1.0], name='j', strategy=strategy, model='digits_cnn', batch_size=8,\n"
            "                            optimizer=optimizer).training\n"
            "data = {'batch_size': 8, 'train_rows': 100}\n"
            "for app, strategy in (('app_ps', 'ps_sharded'), ('app_ring', 'allreduce')):\n"
            "    c = Checkpointer(sys.argv[1], MPI.COMM_SELF, app_id=app, name='j', data=data,\n"
            "                     trains=what_it_trains(job(strategy)))\n"
            "    c.latest()\n"
            "    c.save(10, {'w': 1})\n"
            "    c._dir(10) and open(c._dir(10) + '/rank-00001.pt', 'wb').write(b'')  # a second rank's file\n"
            "for app, strategy, optimizer in (('app_ps', 'ps_sharded', 'sgd'), ('app_ring', 'allreduce', 'sgd'),\n"
            "                                 ('app_ring', 'allreduce', 'adam')):\n"
            "    look = Checkpointer(sys.argv[1], None, name='j', resume=app)\n"
            "    print(look.refusal(look.earlier(), 1, data, what_it_trains(job(strategy, optimizer))))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, (out.stdout, out.stderr)
    assert lines[0] == ("checkpoint.resume: the checkpoint of step 10 (application app_ps) was written by 2 ranks, "
                        "and this job has 1 (groups[].instances); ps_sharded keeps a part of the model on each "
                        "rank: resume it with 2 ranks, or start afresh (checkpoint.resume: never)"), lines
    assert lines[1] == "None", lines                                     # allreduce: rank 0's state is all of it
    assert "was written with training.optimizer 'sgd' (this job: 'adam')" in lines[2], lines


def test_a_central_parameter_server_resumes_on_fewer_ranks_and_speed_shares_are_measured_anew(tmp_path, digits,
                                                                                               yarnapp_home):
    """A checkpoint audit: the docs let ps_central resume on fewer ranks (every rank keeps the
    whole model), and submit told a user asking for more "resume it with at most 3"; the
    ranks then refused it as "not this job's model or strategy", in a traceback. And
    shares: speed resumed from a checkpoint whose shares were vcores' kept those, calling
    them "the checkpoint's measured shares" (measured now, on the ranks they are for)."""
    first = digits_job(tmp_path, digits, "central", strategy="ps_central", steps=10, every=10)
    first["training"]["shares"] = "vcores"
    run1, _ = run_to_end(first)
    again = digits_job(tmp_path, digits, "central", strategy="ps_central", steps=20, every=10, instances=(1, 1))
    again["training"]["shares"] = "speed"
    again["checkpoint"]["resume"] = run1.app_id
    run2, st = run_to_end(again)
    assert st["final"]["resumed_from"] == 10 and st["final"]["trained_steps"] == 10, st["final"]
    log = run2.logs("big_0")["big_0"]
    assert "shares 'speed': passes" in log and "the checkpoint's measured shares" not in log, log[-3000:]


def test_a_training_set_changed_under_a_job_fails_once_a_restart_meets_it_in_words_about_the_data(tmp_path, digits,
                                                                                                  yarnapp_home):
    """A data audit: a file added to the training set while a job ran, then a rank killed: the
    restart planned on the new files and failed, "checkpoint.resume: the checkpoint of step 440
    was written with ... 1438 rows; this job has ... 2157", which the user never set, naming no
    cause. Now it says the training set changed while the job ran, and is not retried."""
    import signal
    train = tmp_path / "train"
    shutil.copytree(f"{digits}/train", train)
    job = digits_job(tmp_path, str(tmp_path), "changed", steps=400, every=5, instances=(1, 1))
    job["training"]["data"] = {"train": str(train)}
    run = yarnapp.submit(job)
    try:
        wait_step(run, rank=0, step=8)
        first = sorted(train.iterdir())[0]
        shutil.copy(first, train / ("x-" + first.name))     # another file of rows, as another writer's
        os.kill(rank_pid(run, 1), signal.SIGKILL)
        st = run.wait(timeout=300)
    finally:
        run.kill()
    assert st["state"] == "FAILED", st
    line = run.failure_message()
    assert "training.data.train: the training set changed while the job ran (1438 rows when it started, " in line, line
    assert "put it back as it was to resume from the job's checkpoints" in line, line
    assert "so it was not retried" in line, line          # (every rank meets it as the restart begins)
    assert "checkpoint.resume: the checkpoint" not in line, line
    assert_nothing_left(run.app_id)


@pytest.mark.unit
def test_measured_shares_are_kept_only_for_the_ranks_they_were_measured_on():
    """What a resumed shares: speed keeps (AllReduceStrategy._measured_shares): a checkpoint's
    shares where they were measured on ranks of the same vcores and GPUs; not shares that were
    given (vcores, equal), nor measured on other ranks. A checkpoint from before they were
    recorded keeps its shares, as before."""
    from types import SimpleNamespace
    from training.context import RankInfo
    from training.strategies.allreduce.strategy import AllReduceStrategy

    def strategy(shares, vcores):
        s = AllReduceStrategy.__new__(AllReduceStrategy)
        s.spec = SimpleNamespace(shares=shares)
        s.ctx = SimpleNamespace(ranks=[RankInfo(r, "g", r, f"g_{r}", v, 1024, 0) for r, v in enumerate(vcores)])
        s.world_size = len(vcores)
        return s

    written = strategy("speed", [1, 0.5, 0.5])
    measured = {"shares": [2.0, 1.0, 1.0], "shares_measured_on": written.measured_on()}
    given = {"shares": [1.0, 0.5, 0.5], "shares_measured_on": strategy("vcores", [1, 0.5, 0.5]).measured_on()}
    assert given["shares_measured_on"] is None
    assert strategy("speed", [1, 0.5, 0.5])._measured_shares(measured) == [2.0, 1.0, 1.0]
    assert strategy("speed", [1, 1, 1])._measured_shares(measured) is None            # other vcores
    assert strategy("speed", [1, 0.5, 0.5])._measured_shares(given) is None           # never measured
    assert strategy("speed", [1, 0.5])._measured_shares(measured) is None             # another world
    assert strategy("speed", [1, 0.5, 0.5])._measured_shares({"shares": [2.0, 1.0, 1.0]}) == [2.0, 1.0, 1.0]


RESUMING = """
import os, resource, sys, torch
import pyarrow.fs as pafs
from training import fsutil
m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])      # 50 MB of weights
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
m(torch.ones(2, 1024)).sum().backward()
opt.step()
path = sys.argv[1]
torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, path)
want = [p.detach().clone() for p in m.parameters()]
with torch.no_grad():
    for p in m.parameters():
        p.zero_()
fs = pafs.LocalFileSystem() if sys.argv[2] == "local" else pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
state = fsutil.torch_load_file(fs, path)
m.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
del state
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
assert all(torch.equal(a, b) for a, b in zip(want, m.parameters()))
print(grew / os.path.getsize(path))
"""


@pytest.mark.parametrize("where", ["local", "remote"])
def test_resuming_needs_little_memory_beyond_the_model_it_trains(tmp_path, where):
    """A rank resuming holds its model and optimizer already: the checkpoint's bytes and the
    tensors made of them came on top (~1.9x the file at the peak), and a job that trained
    in 715 MiB of its 1 GiB container was killed for memory at every restart. Its tensors
    are now mapped from the file (a remote one streamed to a local file first)."""
    out = subprocess.run([sys.executable, "-c", RESUMING, str(tmp_path / "rank-00000.pt"), where],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.8, f"resuming grew the peak by {float(out.stdout):.2f}x the checkpoint"


def test_allreduce_resumes_bit_for_bit_without_the_checkpoint_twice_in_memory(tmp_path):
    """Rank 0 sent the whole state pickled through one bcast: the checkpoint's size twice
    more on rank 0, three times on the others. Now rank 0 loads it (mapped from the file)
    and sends it tensor by tensor into place."""
    import worlds
    out = worlds.run("resume_memory", 2, {"dir": str(tmp_path)})
    assert all(r["same"] for r in out), out
    # peak RSS over the checkpoint's size, was [3.67, 2.63]: rank 0's counts the file's
    # pages it mapped and read (~1x, which the kernel can drop), the others' nearly nothing
    grew = [round(r["grew"], 2) for r in out]
    assert grew[0] < 1.5 and grew[1] < 1.0, grew


def test_a_checkpoint_of_another_strategy_or_split_layers_is_named_by_its_field():
    """An audit's resumes across strategies started every container, then failed in the
    ranks (a hypergraph rank's "checkpoint of rank None of None", retried; conv-MP's bare
    KeyError 'conv1' for other layers). What a checkpoint's states are of is recorded with
    it, and the line names the field that differs."""
    import conf
    from training.checkpoint import other_model, what_it_trains

    def trains(**strategy):
        job = {"name": "t", "groups": [{"name": "g", "instances": 1, "vcores": 1}],
               "training": {"strategy": strategy, "data": {"train": "x"}}}
        return what_it_trains(conf.load_job(job).training)
    conv = trains(name="conv_model_parallel", layers=["conv2"])
    assert other_model(7, "app_a", conv, conv) is None and other_model(7, "app_a", None, conv) is None
    line = other_model(7, "app_a", conv, trains(name="conv_model_parallel"))
    assert line.startswith("checkpoint.resume: the checkpoint of step 7 (application app_a) was written with "
                           "training.strategy.layers ['conv2'] (this job: None); its states load only"), line
    line = other_model(7, "app_a", conv, trains(name="hypergraph"))
    assert "training.strategy 'conv_model_parallel' (this job: 'hypergraph')" in line and "\n" not in line


@pytest.mark.unit
def test_a_rank_slowed_down_is_named_against_its_best_window_not_its_first(caplog):
    """The tracker's CI: a host busy as training began (all-reduces of 100 ms) made the first
    window's step slow, and a rank throttled to a tenth later was never named: its steps were
    not 4x that first window's. Measured against its best since the warm-up (the least median
    of three windows in a row), it is; one slow window (a pause) is not named, nor a rank whose
    compute grew while the step did not (it waits less; nobody waits for it), nor every rank
    after one window of a fast step (a review: log_every 1 makes a window one step)."""
    from types import SimpleNamespace
    from training.runner import Slowdown
    ranks = [SimpleNamespace(container="big_0"), SimpleNamespace(container="small_0")]

    def window(c0, c1, wall):
        return [[c0, 0.0, 0.0, wall], [c1, 0.0, 0.0, wall]]

    seen = Slowdown(ranks)
    with caplog.at_level("WARNING", logger="training.runner"):
        seen.look(window(0.02, 0.02, 0.2))          # the warm-up
        seen.look(window(0.012, 0.018, 0.15))       # the busy host: all-reduces of 100 ms
        for _ in range(3):
            seen.look(window(0.002, 0.010, 0.012))  # the host quiet again
        seen.look(window(0.0004, 0.002, 0.003))     # one step of a window, fast by chance: no standard
        seen.look(window(0.002, 0.010, 0.012))
        seen.look(window(0.002, 0.010, 0.012))
        seen.look(window(0.002, 0.080, 0.090))      # a pause: one window
        seen.look(window(0.002, 0.010, 0.012))
        seen.look(window(0.009, 0.010, 0.013))      # rank 0's compute grew 4.5x, the step did not:
        seen.look(window(0.009, 0.010, 0.013))      # nobody waits for it
        assert [r.getMessage() for r in caplog.records] == [], "one slow window, or a rank the step does not wait on"
        seen.look(window(0.002, 0.100, 0.105))      # rank 1 throttled to a tenth
        seen.look(window(0.002, 0.100, 0.105))
        seen.look(window(0.002, 0.100, 0.105))      # (named once)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("rank 1 (small_0) slowed down: its compute takes 100 ms a step, "
                                                 "10x its best since it began (10.0 ms), and every step 9x longer"), said


@pytest.mark.skipif(not CGROUPS, reason="CPU quotas need root and cgroup v1")
def test_a_container_throttled_from_outside_is_named_as_slowed_down(tmp_path, digits, yarnapp_home):
    """A drift audit: a container's CPU quota cut to 0.01 CPU mid-run made every step ~70x
    slower, and nothing said which rank (only TensorBoard's per-group times showed it), while
    status went on calling its quota "enforced: 0.5 CPU"."""
    # (steps enough never to end first: on the tracker's busy host 370 steps at 0.1 CPU took 37 s,
    # and the job ended before two slow windows in a row; it is killed once named)
    job = digits_job(tmp_path, digits, "throttled", steps=2500, instances=(1, 1))
    job["training"]["log_every"] = 5
    run = yarnapp.submit(job)
    try:
        wait_step(run, rank=0, step=30)
        cg = f"/sys/fs/cgroup/cpu/yarnapp/{run.app_id}/small_0/cpu.cfs_quota_us"
        # (at 0.01 CPU its agent's own looks took half of it, and the rank stalled: replaced as
        # silent, not named as slow; at 0.05, steps of 14 s on a busy host: a window a minute)
        with open(cg, "w") as f:
            f.write("10000")
        deadline = time.monotonic() + 180
        while True:
            st = run.status()
            said = [n["text"] for n in st.get("notices") or [] if "slowed down" in n["text"]]
            if said:
                break
            assert time.monotonic() < deadline and st["state"] == "RUNNING", st
            time.sleep(1)
        assert said[0].startswith("rank 1 (small_0) slowed down: its compute takes "), said
        assert "its container gets less CPU than when training began" in said[0], said
        small = next(c for c in st["containers"] if c["id"] == "small_0")
        assert small["resources"].endswith("; cpu quota now 0.1 CPU: changed from outside yarnapp"), small
        big = next(c for c in st["containers"] if c["id"] == "big_0")
        assert "changed" not in big["resources"], big
    finally:
        run.kill()
    assert_nothing_left(run.app_id)
