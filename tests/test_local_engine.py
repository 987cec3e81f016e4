"""The embedded local engine end to end: real containers, real MPI world, real cgroups."""
import glob
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
import yaml

import conf
import yarnapp
from yarnapp.backends.local.engine import LocalBackend
from util import app_id_from, apps, assert_nothing_left, until, write_job

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HELLO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "examples", "hello.yaml")
CGROUPS = os.geteuid() == 0 and os.path.isfile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")


def _tiny(tmp_path):
    """A job.yaml of one container whose script prints a line (no torch imported: seconds)."""
    (tmp_path / "hi.py").write_text("print('hi')\n")
    return write_job(tmp_path / "tiny.yaml", {"name": "tiny", "run": {"script": str(tmp_path / "hi.py")},
                                              "groups": [{"name": "w", "instances": 1, "vcores": 0.5,
                                                          "memory": "256 MiB"}]})


def test_wait_waits_for_an_application_submitted_without_it_and_says_how_it_ended(cli, tmp_path, yarnapp_home):
    """A scripting audit: a job submitted without --wait (`app=$(yarnapp submit job.yaml)`)
    could be waited for only by polling status or following every log. `yarnapp wait APP`
    ends as submit --wait does (0 if it SUCCEEDED, 1 if not, the same lines), 124 after
    --timeout, and an interrupted or timed-out wait leaves the application running."""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(15)\nprint('slept')\n")
    slow = write_job(tmp_path / "slow.yaml", {"name": "slow", "run": {"script": str(tmp_path / "slow.py")},
                                              "groups": [{"name": "w", "instances": 1, "vcores": 0.5,
                                                          "memory": "256 MiB"}]})
    app = cli("submit", slow, check=0).stdout.strip()
    proc = cli("wait", app, "--timeout", "1s", check=124)
    assert proc.stderr.strip().splitlines()[-1] == (f"Error: {app} still RUNNING after --timeout 1s; it runs on "
                                                    f"(`yarnapp kill {app}` stops it)"), proc.stderr
    assert yarnapp.status(app)["state"] == "RUNNING"
    waiting = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "wait", app], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    shown = waiting.stderr.readline()               # its progress (stderr) begun: waiting
    waiting.terminate()                             # (`timeout 9 yarnapp wait APP`): the wait stops, not the job
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 143 and f"stopped waiting for {app}, which runs on" in err, (shown, out, err)
    assert yarnapp.status(app)["state"] == "RUNNING"
    proc = cli("wait", app, check=0)
    assert re.match(rf"{app} SUCCEEDED in [0-9.]+s", proc.stdout), proc.stdout        # stdout: how it ended alone
    proc = cli("wait", app, check=0)                  # ended already: at once, without a time it did not watch
    assert proc.stdout.startswith(f"{app} SUCCEEDED (world formed in "), proc.stdout
    (tmp_path / "fail.py").write_text("raise SystemExit(3)\n")
    failing = write_job(tmp_path / "fail.yaml", {"name": "fails", "max_restarts": 0,
                                                 "run": {"script": str(tmp_path / "fail.py")},
                                                 "groups": [{"name": "w", "instances": 1, "vcores": 0.5,
                                                             "memory": "256 MiB"}]})
    bad = cli("submit", failing, check=0).stdout.strip()
    proc = cli("wait", bad, check=1)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"Error: {bad} FAILED after 1 attempt(s): "), proc.stderr
    assert cli("wait", "app_0_nope", check=1).stderr.startswith("Error: no application 'app_0_nope'")
    assert cli("wait", app, "--timeout", "soon", check=2).stderr.startswith("Error: --timeout soon: ")
    assert_nothing_left(app)
    assert_nothing_left(bad)


def test_a_python_submits_overrides_are_kept_as_the_command_lines_fields(tmp_path, yarnapp_home):
    """An API audit: `yarnapp kill` of a sweep's job gave `yarnapp submit job.yaml --resume
    APP`, its overrides (batch size, learning rate) left out: that command resumed another
    job, or was refused. They are kept as KEY=VALUE fields, and give the same job."""
    import numpy as np

    from yarnapp import cli_job
    tiny = _tiny(tmp_path)
    given = {"max_restarts": np.int64(1), "launcher": {"poll_interval": "200ms"},
             "groups": [{"name": "w", "vcores": 0.5, "memory": "256 MiB", "env": {"A": "0.10"}}]}
    run = yarnapp.submit(tiny, **given)
    st = run.wait(timeout=120)
    assert st["setting"] == ["max_restarts=1", "launcher.poll_interval=200ms",
                             'groups=[{"name": "w", "vcores": 0.5, "memory": "256 MiB", "env": {"A": "0.10"}}]']
    assert cli_job.submitted_as(st).endswith(f"yarnapp submit {tiny} max_restarts=1 launcher.poll_interval=200ms "
                                             f"'groups=[{{\"name\": \"w\", \"vcores\": 0.5, \"memory\": \"256 MiB\", "
                                             f"\"env\": {{\"A\": \"0.10\"}}}}]'")
    import conf
    _, raw = conf.read_raw(tiny)
    again, _ = conf.overrides.apply(raw, st["setting"], tiny)
    assert conf.load_job(again, where=tiny) == yarnapp.load(tiny, **given)
    assert_nothing_left(run.app_id)


def test_hello_forms_one_world_across_two_groups(cli, yarnapp_home):
    proc = cli("submit", HELLO, "--wait", check=0)
    out = proc.stdout
    app = app_id_from(out)
    m = re.search(r"world formed in ([0-9.]+)s after submit", out)
    assert m, out
    assert float(m.group(1)) < 60          # no timeout was waited for (speed: benchmarks, not tests)
    final = dict(kv.split("=", 1) for kv in re.search(r"^final: (.*)$", out, re.M).group(1).split())
    assert final["world_size"] == "3" and final["ok"] == "True"
    assert float(final["allreduce"]) == 6.0 == float(final["expected"])     # 1 + 2 + 3
    assert final["groups"] == "big,small,small"                           # group order, then instance

    st = yarnapp.status(app)
    assert st["state"] == "SUCCEEDED"
    assert [(c["id"], c["rank"]) for c in st["containers"]] == [("big_0", 0), ("small_0", 1), ("small_1", 2)]
    assert [c["vcores"] for c in st["containers"]] == [1, 0.5, 0.5]
    logs = yarnapp.Run(app).logs()
    for c in st["containers"]:
        assert f"world generation 0 formed: rank {c['rank']} of 3" in logs[c["id"]]
        assert f"group={c['id'].rsplit('_', 1)[0]}" in logs[c["id"]]
    cpu = [float(x) for x in final["cpu"].split(",")]
    if CGROUPS:
        assert all(c["resources"].startswith("enforced") for c in st["containers"])
        # Each container sees its own quota, and it is really applied: half a vcore
        # spins at most ~half a CPU, however idle the machine is.
        assert final["quota"] == "1.0,0.5,0.5", final
        assert cpu[1] <= 0.6 and cpu[2] <= 0.6, cpu
    else:
        assert all(c["resources"].startswith("not enforced") for c in st["containers"])
    assert_nothing_left(app)


def _sleeper(tmp_path, **extra):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "sleeper.py")
    return write_job(tmp_path / "sleeper.yaml", {
        "name": "sleeper", "groups": [{"name": "a", "instances": 1, "vcores": 0.5, "memory": "256 MiB"},
                                      {"name": "b", "instances": 1, "vcores": 0.5, "memory": "256 MiB"}],
        "run": {"script": script}, **extra})


def test_clean_removes_finished_applications_and_keeps_what_runs_or_is_resumed_from(cli, yarnapp_home, tmp_path,
                                                                                     digits):
    """Every application's directory (logs, store, staged files, checkpoints kept there)
    stayed under YARNAPP_HOME for ever: `yarnapp clean` removes finished ones, named or by
    age. It refuses the lot where one named still runs, or is one whose checkpoints a live
    application resumes from (by age, that one is kept, said in a warning)."""
    def job(name, steps, resume="never"):
        return write_job(tmp_path / f"{name}.yaml", {
            "name": name, "groups": [{"name": "a", "instances": 1, "vcores": 1}],
            "training": {"model": "digits_cnn", "data": {"train": f"{digits}/train"}, "batch_size": 32,
                         "epochs": 1000, "max_steps": steps}, "checkpoint": {"every_steps": 5, "resume": resume}})
    first, second = (cli("submit", job(n, 10), "--wait", check=0).stdout.split()[1] for n in ("first", "second"))
    running = cli("submit", job("running", 10**6, resume=first), check=0).stdout.strip()
    try:
        until("it trains", lambda: (yarnapp.status(running).get("progress") or {}).get(0))
        refused = cli("clean", second, running, check=1)
        assert refused.stderr == f"Error: {running} is RUNNING: stop it first with `yarnapp kill {running}`; " \
                                 "nothing was removed\n", refused.stderr
        refused = cli("clean", second, first, check=1)
        assert refused.stderr == f"Error: {first}: application {running} resumes from its checkpoints: wait for " \
                                 f"it to end, or stop it with `yarnapp kill {running}`; nothing was removed\n"
        assert apps(yarnapp_home) == sorted([first, second, running])
        assert cli("clean", "--older-than", "1h", check=0).stderr.startswith("nothing to remove")
        dry = cli("clean", "--older-than", "0", "--dry-run", check=0)
        assert [line.split()[:4] for line in dry.stdout.splitlines()] == [["would", "remove", second, "second"]]
        assert f"kept {first}: application {running} resumes from its checkpoints" in dry.stderr, dry.stderr
        assert apps(yarnapp_home) == sorted([first, second, running])
        out = cli("clean", second, check=0).stdout
        assert re.fullmatch(rf"removed {second}  second +SUCCEEDED +\d+\.\d MiB\n", out), out
        assert cli("status", second, check=1).stderr.startswith(f"Error: no application {second!r}")
        assert yarnapp.status(running)["state"] == "RUNNING"
    finally:
        cli("kill", running)
    (yarnapp_home / "apps" / f".removing-{second}").mkdir()      # what a remove interrupted leaves: swept
    # what a submit SIGKILLed (or SIGHUPed) while it copied the job's files leaves: its record
    # names the submitting process, gone; no app.json, so nothing listed or removed it
    from yarnapp.backends.local import supervisor
    killed, live = (yarnapp_home / "apps" / "app_20261130_000000_abcdef",
                    yarnapp_home / "apps" / "app_20261130_000001_abcdef")
    gone = subprocess.Popen(["true"])
    gone.wait()
    for d, pid in ((killed, gone.pid), (live, os.getpid())):      # (live: a submit still copying)
        (d / "files").mkdir(parents=True)
        (d / "files" / "weights.bin").write_bytes(b"w" * 100_000)
        supervisor.write_record(str(d), {"pid": pid, "starting": True, "attempts": [], "host": socket.gethostname()})
        os.utime(d, (time.time() - 120, time.time() - 120))
    out = cli("clean", "--older-than", "0", check=0).stdout.splitlines()
    assert [line.split()[:3] for line in out[:2]] == [["removed", running, "running"], ["removed", first, "first"]]
    assert out[2].startswith("removed 2 applications, ") and len(out) == 3, out
    assert os.listdir(yarnapp_home / "apps") == [live.name]


def test_clean_names_what_an_application_left_outside_the_home(cli, yarnapp_home, tmp_path, digits):
    """A job's own checkpoint.uri and tensorboard.logdir are left by clean, which said
    "removed ... 0.0 MiB" while 9 MB stayed there, growing unseen (a long-use audit)."""
    job = write_job(tmp_path / "outside.yaml", {
        "name": "outside", "groups": [{"name": "a", "instances": 1, "vcores": 1}],
        "training": {"model": "digits_cnn", "data": {"train": f"{digits}/train"}, "batch_size": 32,
                     "max_steps": 2}, "checkpoint": {"uri": str(tmp_path / "ckpt")},
        "tensorboard": {"logdir": str(tmp_path / "tb")}})
    app = app_id_from(cli("submit", job, "--wait", check=0).stdout)
    proc = cli("clean", app, check=0)
    assert proc.stdout.startswith(f"removed {app}"), proc.stdout
    for field, d in (("checkpoint.uri", tmp_path / "ckpt"), ("tensorboard.logdir", tmp_path / "tb")):
        assert f"left {d / app} of {app}: the job's own {field} (remove it yourself" in proc.stderr, proc.stderr
        assert (d / app).is_dir()


def test_a_supervisor_pid_another_process_took_since_is_not_the_supervisor(tmp_path):
    """A finished application's supervisor pid, taken days later by another process, kept the
    application "running" (clean refused it, kill had nothing to kill): the record keeps the
    supervisor's start time, and a process of that pid started at another time is not it."""
    import psutil
    from yarnapp.backends.local import supervisor
    d = str(tmp_path / "app")
    os.mkdir(d)
    first = subprocess.Popen(["sleep", "60"])
    later = subprocess.Popen(["sleep", "60"])
    try:
        supervisor.write_record(d, {"pid": first.pid, "attempts": []})
        assert supervisor.alive(d)
        with open(supervisor.record_path(d), "w") as f:     # the pid now another's, started later
            json.dump({"pid": later.pid, "started": psutil.Process(first.pid).create_time() - 5, "attempts": []}, f)
        assert not supervisor.alive(d)
    finally:
        for p in (first, later):
            p.kill()
            p.wait()
    supervisor.write_record(d, {"pid": first.pid, "attempts": []})
    assert not supervisor.alive(d)


def test_an_application_whose_memory_others_hold_waits_in_line_and_runs_once_they_end(cli, yarnapp_home,
                                                                                       tmp_path):
    """Three applications asking for 60% of the machine's memory each (a cap per container,
    not a reservation) ran side by side, the machine's memory promised three times over. As
    a NodeManager would, the engine now leases memory: the second waits, saying for whom,
    and a small third waits in line after it (it would keep the large one waiting for ever)."""
    from yarnapp.backends.local.leases import machine_memory_mib
    big = f"{int(machine_memory_mib() * 0.6)} MiB"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "sleeper.py")

    def job(name, memory):
        return write_job(tmp_path / f"{name}.yaml", {"name": name, "run": {"script": script}, "groups": [
            {"name": "a", "instances": 1, "vcores": 0.5, "memory": memory}]})
    first = cli("submit", job("first", big), check=0).stdout.strip()
    until("the first trains", lambda: (yarnapp.status(first).get("progress") or {}).get(0))
    second = cli("submit", job("second", big), check=0).stdout.strip()
    third = None
    try:
        until("the second waits", lambda: yarnapp.status(second)["diagnostics"])      # in line before the third asks
        third = cli("submit", job("third", "256 MiB"), check=0).stdout.strip()
        until("the third waits", lambda: yarnapp.status(third)["diagnostics"])
        st2, st3 = yarnapp.status(second), yarnapp.status(third)
        assert st2["state"] == "ACCEPTED" and re.fullmatch(
            rf"waiting for \d+ MiB of memory \(this machine's \d+ MiB\): held by {first}", st2["diagnostics"]), st2
        assert st3["state"] == "ACCEPTED" and st3["diagnostics"].startswith("waiting for 256 MiB of memory") \
            and st3["diagnostics"].endswith(f": held by {first}; in line after {second}, which asked first"), st3
        assert "waiting for" in cli("status", second, check=0).stdout
        cli("kill", first, check=0)
        until("the second trains", lambda: (yarnapp.status(second).get("progress") or {}).get(0))
        until("the third runs", lambda: yarnapp.status(third)["state"] == "RUNNING")        # it fits beside the second
    finally:
        for app in (first, second, third):
            if app:
                cli("kill", app)
    for app in (first, second, third):
        assert_nothing_left(app)


def test_kill_leaves_nothing_running(cli, yarnapp_home, tmp_path):
    app = cli("submit", _sleeper(tmp_path), check=0).stdout.strip()
    run = yarnapp.Run(app)
    deadline = time.monotonic() + 60
    while not (run.status().get("progress") or {}).get(1):
        assert time.monotonic() < deadline, run.logs()
        time.sleep(0.2)
    st = run.status()
    assert st["state"] == "RUNNING"
    pids = [c["pid"] for c in st["containers"]]
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    # Owner-only: the application's directory (nothing in it is reachable by others), and
    # app.json (its secret), the store and the logs are the owner's alone anyway.
    d = st["app_dir"]
    secret = json.load(open(os.path.join(d, "app.json")))["secret"]
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    written = [os.path.join(d, "app.json"), os.path.join(d, "state.json"), os.path.join(d, "am.log")]
    written += [os.path.join(sub, f) for sub, _, fs in os.walk(os.path.join(d, "store")) for f in fs
                if not f.startswith(".tmp.")]      # a write in flight, renamed into place a moment later
    written += [os.path.join(d, "containers", c, "container.log") for c in ("a_0", "b_0")]
    for p in written:
        assert not stat.S_IMODE(os.stat(p).st_mode) & 0o077, (p, oct(os.stat(p).st_mode))
    for sub, _, files in os.walk(d):
        for f in files:
            try:
                text = open(os.path.join(sub, f), "rb").read()
            except FileNotFoundError:       # a store's write in flight, renamed since
                continue
            if secret.encode() in text:
                assert f == "app.json", os.path.join(sub, f)
    # `logs --follow` from the first byte of each log (it once skipped as many as a placeholder had)
    follow = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "logs", app, "--follow"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    proc = cli("kill", app, check=0)
    assert "KILLED" in proc.stdout
    assert yarnapp.status(app)["state"] == "KILLED"
    again = cli("kill", app, check=0)           # (said "KILLED" again, as if it had done it)
    assert again.stdout.strip() == f"{app} had already ended KILLED; nothing of it runs", again.stdout
    out, said = follow.communicate(timeout=60)
    assert said.strip().splitlines()[-1] == f"{app} was killed", said         # how it ended (it said nothing)
    assert follow.returncode == 1           # as submit --wait's (it was 0: CI could not tell)
    first = {c: open(p).readline().rstrip("\n") for c, p in LocalBackend().log_files(app).items()}
    for c in ("a_0", "b_0"):
        assert f"{c}| {first[c]}" in out.splitlines(), (first[c], out[:500])
    assert_nothing_left(app)
    # status/list/logs keep working from another process after the end
    assert app in cli("list", check=0).stdout
    assert "attempt 1 started" in cli("logs", app, "--container", "a_0", check=0).stdout


def test_logs_tail_and_stream_a_log_larger_than_what_the_command_holds(cli, yarnapp_home, tmp_path):
    """A chatty rank's log grows without bound: `yarnapp logs` read it whole into memory (a
    200 MB log took 475 MB to print) and had no --tail; --follow read it all again every
    half second, and printed a line cut mid-write as two."""
    script = tmp_path / "chatty.py"
    script.write_text("for i in range(3000):\n    print(f'line {i}')\nprint('no newline', end='')\n")
    job = write_job(tmp_path / "chatty.yaml", {"name": "chatty", "groups": [{"name": "a", "instances": 1,
                    "vcores": 1, "memory": "1 GiB"}], "run": {"script": str(script)}})
    app = app_id_from(cli("submit", job, "--wait", check=0).stdout)
    (log,) = LocalBackend().log_files(app).values()
    tail = cli("logs", app, "--tail", "3", check=0).stdout
    assert tail.splitlines() == ["==> a_0 <==", *open(log).read().splitlines()[-3:]], tail
    assert "no newline" in tail.splitlines()[-1] and tail.endswith("\n")
    assert cli("logs", app, "-n", "0", check=0).stdout == "==> a_0 <==\n"
    assert yarnapp.Run(app).logs(tail=2) == {"a_0": "".join(open(log).readlines()[-2:])}
    followed = cli("logs", app, "--follow", "--tail", "2", check=0).stdout.splitlines()
    assert followed == [f"a_0| {line}" for line in open(log).read().splitlines()[-2:]], followed
    assert "--tail -1: give a number of lines" in cli("logs", app, "--tail", "-1", check=2).stderr
    # 60 MB more: printed in pieces, the command's memory as for the small log
    small = _max_rss_of([sys.executable, "-m", "yarnapp.cli", "logs", app])
    with open(log, "a") as f:
        for _ in range(60):
            f.write(("x" * 99 + "\n") * 10_000)
    big = _max_rss_of([sys.executable, "-m", "yarnapp.cli", "logs", app])
    assert big < small + (20 << 20), (small >> 20, big >> 20)     # it held the log: 60 MB and more
    assert cli("logs", app, "--tail", "1", check=0).stdout.splitlines()[-1] == "x" * 99
    assert_nothing_left(app)
    # submit --wait read 64 KiB of rank 0's output a look, and fell ever further behind: far
    # behind, it goes on from the end, saying what it left out
    script.write_text("import sys\nfor i in range(160_000):\n    print('y' * 99)\nprint('END')\n")   # 16 MB
    proc = cli("submit", job, "--wait", check=0)
    said = (proc.stdout + proc.stderr).splitlines()
    assert any("MB of its output left out here, to keep up: `yarnapp logs app_" in line for line in said)
    assert "a_0| END" in said, proc.stderr[-500:]
    assert said.count("a_0| " + "y" * 99) < 120_000         # of 160,000: some left out (as slow as CI is)


def _max_rss_of(argv):
    """The peak resident bytes of a command run to its end, its output discarded."""
    code = ("import resource, subprocess, sys\n"
            "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True)
    return int(out.stdout) << 10


def test_failed_rank_names_container_exit_status_and_log(cli, yarnapp_home, tmp_path):
    """The failed rank's log tail follows its line; rank 0's output, shown as it came, is not
    shown again (its traceback showed twice)."""
    bad = tmp_path / "boom.py"
    bad.write_text("import os, sys\nfrom training.context import current\n"      # (training: no setup grace)
                   "ctx = current()\nctx.report(step=0)\nif ctx.rank == int(sys.argv[1]):\n"
                   "    print('boom on purpose', flush=True)\n    sys.exit(7)\nimport time\ntime.sleep(60)\n")
    job = write_job(tmp_path / "boom.yaml", {
        "name": "boom", "max_restarts": 0,
        "groups": [{"name": "w", "instances": 2, "vcores": 0.5, "memory": "256 MiB"}],
        "run": {"script": str(bad), "args": ["1"]}})
    t0 = time.monotonic()
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("Error: app_") and "FAILED" in err, err
    assert "w_1" in err and "exited with status 7" in err and "container.log" in err, err
    assert re.search(r"--- last lines of w_1's log ---\n(.*\n)*boom on purpose\n", proc.stderr), proc.stderr
    assert time.monotonic() - t0 < 30                # the survivor did not hang in its sleep
    app = app_id_from(err)
    st = yarnapp.status(app)
    assert st["state"] == "FAILED"
    assert_nothing_left(app)

    raw = yaml.safe_load(open(job))
    raw["run"]["args"] = ["0"]
    proc = cli("submit", write_job(job, raw), "--wait")
    assert proc.returncode == 1 and "w_0" in proc.stderr.strip().splitlines()[-1], proc.stdout + proc.stderr
    assert "w_0| boom on purpose" in proc.stderr and proc.stderr.count("boom on purpose") == 1, proc.stderr
    assert "--- last lines of" not in proc.stderr, proc.stderr
    assert_nothing_left(app_id_from(proc.stderr.strip().splitlines()[-1]))


def test_python_api_submit_and_wait(yarnapp_home):
    run = yarnapp.submit(HELLO)
    st = run.wait(timeout=120)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert run.final["ok"] is True and run.final["world_size"] == 3
    assert run.failure_message() is None         # it did not fail (was "FAILED: unknown")
    assert_nothing_left(run.app_id)
    with pytest.raises(yarnapp.YarnappError, match="groups\\[0\\].instances"):
        yarnapp.submit({"name": "x", "groups": [{"name": "a", "instances": 0}], "run": {"function": "a:b"}})
    raw = json.load(open(os.path.join(st["app_dir"], "job.json")))
    assert raw["groups"][1]["vcores"] == 0.5


def test_a_status_while_another_submit_starts_its_supervisor_leaves_it_accepted(yarnapp_home, monkeypatch, tmp_path):
    """Another user's `yarnapp list` between an application's app.json and its supervisor's
    record (a loaded machine's fork takes seconds) found no master and no supervisor, and
    ended it FAILED ("the application master died"), which it then left for RUNNING."""
    import threading
    started = threading.Event()
    popen = subprocess.Popen

    def slow(argv, **kw):
        if "yarnapp.backends.local.supervisor" in argv:
            started.set()
            time.sleep(2)
        return popen(argv, **kw)
    monkeypatch.setattr(subprocess, "Popen", slow)
    backend = LocalBackend()
    out = {}
    (tmp_path / "hi.py").write_text("print('hi')\n")
    job = conf.load_job({"name": "hi", "groups": [{"name": "w", "instances": 1, "vcores": 1, "memory": "256 MiB"}],
                         "run": {"script": str(tmp_path / "hi.py")}})
    t = threading.Thread(target=lambda: out.update(app=backend.submit(job)))
    t.start()
    try:
        assert started.wait(30)
        [app] = apps(yarnapp_home)
        assert backend.status(app)["state"] == "ACCEPTED"
    finally:
        t.join()
    st = yarnapp.Run(out["app"]).wait(timeout=120)
    assert st["state"] == "SUCCEEDED", st
    assert_nothing_left(out["app"])


def test_ctrl_c_while_submit_copies_the_files_leaves_no_application(yarnapp_home, tmp_path):
    """Ctrl-C while `yarnapp submit` copies the job's files into the application: one
    line, status 130, and no application left half-written (before, its directory stayed,
    and `yarnapp list` showed an application that had never started)."""
    import signal
    code = tmp_path / "project"
    code.mkdir()
    for i in range(20000):                      # slow enough to copy to be interrupted in it
        (code / f"part{i}.txt").write_text("x")
    (code / "train.py").write_text("print('never runs')\n")
    job = write_job(tmp_path / "big.yaml", {
        "name": "big", "groups": [{"name": "a", "instances": 1, "vcores": 0.5, "memory": "256 MiB"}],
        "run": {"script": str(code / "train.py")}})
    submit = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "submit", job], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(str(yarnapp_home / "apps" / "*" / "files" / "project" / "*")) \
                and submit.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert submit.poll() is None, "submit ended before it copied the files"
        submit.send_signal(signal.SIGINT)
        out, err = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert apps(yarnapp_home) == []


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c_twice"])
def test_kill_of_submit_wait_stops_the_application_as_ctrl_c_does(yarnapp_home, tmp_path, how):
    """`timeout 1h yarnapp submit job.yaml --wait` or a `kill` of it: SIGTERM stops the
    application as Ctrl-C does (before, the command died and its application ran on). Ctrl-C
    twice quickly: the second cut the kill's line short, "interrupted" alone."""
    import signal
    submit = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "submit", _sleeper(tmp_path), "--wait"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ))
    app = app_id_from(submit.stdout.readline())
    run, deadline = yarnapp.Run(app), time.monotonic() + 60
    try:
        while not (run.status().get("progress") or {}).get(1):
            assert time.monotonic() < deadline and submit.poll() is None, run.logs()
            time.sleep(0.2)
        if how == "sigterm":
            submit.terminate()
        else:
            submit.send_signal(signal.SIGINT)
            time.sleep(0.02)
            submit.send_signal(signal.SIGINT)
        out, err = submit.communicate(timeout=60)
        assert submit.returncode == (143 if how == "sigterm" else 130), (out, err)   # as a shell gives
        # (on stderr, as an error's line: a script's captured stdout holds the job's lines alone)
        assert f"interrupted: killed {app}" in err and "interrupted" not in out and "Traceback" not in err, (out, err)
        assert run.status()["state"] == "KILLED"
    finally:
        if submit.poll() is None:
            submit.kill()
        if run.status()["state"] not in ("SUCCEEDED", "FAILED", "KILLED"):
            run.kill()                      # a failed test leaves nothing running either
    assert_nothing_left(app)


def test_a_shells_submit_wait_does_not_import_ipython(yarnapp_home, tmp_path):
    """Asking whether it ran in a notebook imported IPython (half a CPU-second, a third of
    what a whole `submit --wait` took): a kernel has IPython imported already."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "yarnapp.cli", "submit", _tiny(tmp_path),
                           "--wait"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "w_0| hi" in proc.stderr, proc.stdout + proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "yarnapp.progress" in imported and "IPython" not in imported, [m for m in imported if "IPython" in m]


def test_submit_wait_piped_into_head_waits_for_the_job_to_its_end(yarnapp_home, tmp_path):
    """`yarnapp submit job.yaml --wait 2>&1 | head -1`: the reader goes after one line. The
    command waits on, silently, and ends with the job's own status (before, the next line
    raised BrokenPipeError: status 141, and the application ran on with no command waiting)."""
    submit = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "submit", _tiny(tmp_path), "--wait"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        app = app_id_from(submit.stdout.readline().decode())
        submit.stdout.close()                       # as `head -1` exits
        assert submit.wait(timeout=120) == 0
    finally:
        if submit.poll() is None:
            submit.kill()
    assert yarnapp.Run(app).status()["state"] == "SUCCEEDED"
    assert_nothing_left(app)


def test_kill_right_after_submit_ends_the_application_killed(yarnapp_home, tmp_path):
    """A kill the moment `submit` returns, while the supervisor is still starting: KILLED
    (before, a supervisor stopped before it could pass the signal on left the application
    FAILED, "the application master died", naming a log never written)."""
    run = yarnapp.submit(_sleeper(tmp_path))
    st = run.kill()
    assert st["state"] == "KILLED" and st["diagnostics"] == "killed by the user", st
    assert run.status()["state"] == "KILLED"
    assert_nothing_left(run.app_id)


def test_a_supervisor_signalled_from_elsewhere_is_not_said_to_be_killed_by_the_user(yarnapp_home, tmp_path):
    """A SIGTERM to the supervisor from outside yarnapp (a host shutting down, an operator's
    kill) ended the application "killed by the user", though nobody ran `yarnapp kill`."""
    import signal

    from yarnapp.backends.local import supervisor
    run = yarnapp.submit(_sleeper(tmp_path))
    deadline = time.monotonic() + 60
    while not (run.status().get("progress") or {}).get(1) and time.monotonic() < deadline:
        time.sleep(0.2)
    d = run.status()["app_dir"]
    pid = json.load(open(supervisor.record_path(d)))["pid"]
    os.kill(pid, signal.SIGTERM)
    st = run.wait(timeout=60)
    assert st["state"] == "KILLED" and st["diagnostics"] == (
        f"killed: its supervisor (pid {pid}) was sent SIGTERM from outside yarnapp (not by `yarnapp kill`)"), st
    assert_nothing_left(run.app_id)


def test_kill_ends_an_application_whose_supervisor_is_stopped(cli, yarnapp_home, tmp_path):
    """A supervisor stopped (SIGSTOP, a frozen process) takes no SIGTERM: `yarnapp kill`
    waited 15 s, said RUNNING, exited 0, and the application stayed RUNNING, its memory
    leased, clean refusing it. One stopped as its application ended: kill said "nothing to
    kill", clean "stop it first with yarnapp kill"."""
    import signal

    from yarnapp.backends.local import supervisor

    def started_then_stop_its_supervisor(job):
        app = cli("submit", job, check=0).stdout.strip()
        run = yarnapp.Run(app)
        until("its rank 0's first report", lambda: (run.status().get("progress") or {}).get(0))
        os.kill(json.load(open(supervisor.record_path(run.status()["app_dir"])))["pid"], signal.SIGSTOP)
        return app, run

    app, run = started_then_stop_its_supervisor(_sleeper(tmp_path))
    t0 = time.monotonic()
    proc = cli("kill", app, check=0)
    assert proc.stdout.startswith(f"{app} KILLED") and time.monotonic() - t0 < 14, proc.stdout
    assert run.status()["state"] == "KILLED"
    assert_nothing_left(app)
    script = tmp_path / "short.py"
    script.write_text("import time\nfrom training.context import current\n\ncurrent().report(step=1)\ntime.sleep(2)\n")
    app, run = started_then_stop_its_supervisor(write_job(tmp_path / "short.yaml", {
        "name": "short", "groups": [{"name": "a", "instances": 1, "vcores": 0.5, "memory": "256 MiB"}],
        "run": {"script": str(script)}}))
    until("its end", lambda: run.status()["state"] == "SUCCEEDED")
    assert "but something of it still runs" in cli("clean", app, check=1).stderr
    proc = cli("kill", app, check=0)
    assert proc.stdout.strip() == f"{app} had already ended SUCCEEDED; nothing of it runs", proc.stdout
    assert run.status()["state"] == "SUCCEEDED" and not supervisor.alive(run.status()["app_dir"])
    cli("clean", app, check=0)
    assert_nothing_left(app)


def test_submit_leaves_the_callers_umask_alone(yarnapp_home, tmp_path, monkeypatch):
    """submit set the process's umask to 077 while it wrote the application's files: every
    thread's (os.umask is the process's), and two submits from two threads of a notebook
    left it 077 for good. Its files are owner-only by their own modes now."""
    from yarnapp.backends.local import supervisor
    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
    old = real(0o022)
    try:
        run = yarnapp.submit(_sleeper(tmp_path))
        assert real(0o022) == 0o022 and calls == [], calls
    finally:
        real(old)
    d = run.status()["app_dir"]
    for name in ("app.json", "job.json", os.path.basename(supervisor.record_path(d))):
        assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o600, name
    run.kill()
    assert_nothing_left(run.app_id)


def _first_progress(home):
    """The first application's progress at step 1, or None while it is not yet readable."""
    if not apps(home) or not os.path.exists(os.path.join(home, "apps", apps(home)[0], "app.json")):
        return None
    return (yarnapp.Run(apps(home)[0]).status().get("progress") or {}).get(1)


@pytest.mark.parametrize("how", ["submit_wait", "run_wait", "submit_wait_sigterm", "submit_wait_sigterm_twice"])
def test_ctrl_c_in_the_python_api(how, yarnapp_home, tmp_path):
    """yarnapp.submit(job, wait=True) interrupted kills the application, as `submit --wait`
    does (before, it ran on and the caller never got its Run); Run.wait() interrupted only
    stops waiting, and says how to stop it. SIGTERM (`timeout`, a cancelled CI job) too: the
    script ended and every process of the application ran on (a signals audit); it still
    ends as SIGTERM ends it, after the kill."""
    import signal
    code = {"submit_wait": "yarnapp.submit(sys.argv[1], wait=True, progress=False)",
            "submit_wait_sigterm": "yarnapp.submit(sys.argv[1], wait=True, progress=False)",
            "submit_wait_sigterm_twice": "yarnapp.submit(sys.argv[1], wait=True, progress=False)",
            "run_wait": "run = yarnapp.submit(sys.argv[1])\n    run.wait()"}[how]
    script = tmp_path / "nb.py"
    script.write_text("import sys\nimport yarnapp\ntry:\n    " + code + "\nexcept KeyboardInterrupt as e:\n"
                      "    print('caught:', e, flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script), _sleeper(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not _first_progress(yarnapp_home):   # the app directory exists before its app.json
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        app = apps(yarnapp_home)[0]
        proc.send_signal(signal.SIGINT if how in ("submit_wait", "run_wait") else signal.SIGTERM)
        if how.endswith("twice"):           # (the second cut the kill short: 130 and a traceback)
            time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    run = yarnapp.Run(app)
    if how.startswith("submit_wait_sigterm"):
        assert proc.returncode == -signal.SIGTERM and err.strip().endswith(f"terminated: killed {app}"), (out, err)
        assert run.status()["state"] == "KILLED"
    elif how == "submit_wait":
        assert out.strip() == f"caught: interrupted: killed {app}", (out, err)
        assert run.status()["state"] == "KILLED"
    else:
        assert out.strip() == f"caught: stopped waiting for {app}, which runs on: Run('{app}').kill() stops it"
        assert run.status()["state"] == "RUNNING"
        run.kill()
    assert_nothing_left(app)


def _signalled_once_running(proc, yarnapp_home, sig, name=None, running=2):
    """Send `sig` to a sweep script's process once `running` of its applications (named
    `name`, where given) run; (its stdout, its stderr) once it ended."""
    try:
        deadline = time.monotonic() + 240

        def now_running():
            try:            # (an application's directory is there a moment before its app.json)
                return [a for a in apps(yarnapp_home) if name in (None, yarnapp.Run(a).status().get("name"))
                        and yarnapp.Run(a).state == "RUNNING"]
            except yarnapp.YarnappError:
                return []
        while len(now_running()) < running:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate() if proc.poll() else ""
            time.sleep(0.2)
        proc.send_signal(sig)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sweep_from_threads_sigterm_kills_every_application_it_waits_for(yarnapp_home, tmp_path, digits):
    """A sweep audit, with submit(wait=True) in a thread pool as sweeps are written: its
    lines tell whose they are (two waits' step lines were interleaved, anonymous); numpy's
    scalars are taken as overrides (np.int64 from ParameterGrid was refused); a failure
    carries its application's id (e.app_id: parsed out of the line before); and SIGTERM
    (`timeout`, a cancelled task) kills the applications the threads wait for (they ran on,
    nothing watching them), then ends the script as SIGTERM does."""
    import signal
    job = write_job(tmp_path / "d.yaml", {
        "name": "sweep", "max_restarts": 0, "groups": [{"name": "w", "instances": 1, "vcores": 0.5, "memory": "1 GiB"}],
        "training": {"model": "digits_cnn", "data": {"train": f"{digits}/train", "test": f"{digits}/test"},
                     "max_steps": 4, "log_every": 1, "batch_size": 32}})
    script = tmp_path / "sweep.py"
    script.write_text(
        "import concurrent.futures as cf, sys\nimport numpy as np\nimport yarnapp\n"
        "def one(bs):\n    return yarnapp.submit(sys.argv[1], wait=True, training={'batch_size': bs}).final['steps']\n"
        "with cf.ThreadPoolExecutor(2) as ex:\n    print('finals', list(ex.map(one, [np.int64(16), np.int64(32)])))\n"
        "try:\n    yarnapp.submit(sys.argv[1], wait=True, progress=False, training={'model': 'mlp', 'batch_size': -1})\n"
        "except yarnapp.YarnappError as e:\n    print('refused', e.app_id)\n"
        "try:\n    yarnapp.submit(sys.argv[1], wait=True, progress=False, run={'script': sys.argv[3]}, training=None)\n"
        "except yarnapp.JobFailed as e:\n    print('failed', e.app_id)\n"
        "print('lr', yarnapp.load(sys.argv[1], training={'lr': np.float32(0.1)}).training.lr)\n"
        "print('sleeping', flush=True)\n"
        "with cf.ThreadPoolExecutor(2) as ex:\n    list(ex.map(lambda _: yarnapp.submit(sys.argv[2], wait=True), range(6)))\n")
    (tmp_path / "fails.py").write_text("raise SystemExit(3)\n")
    proc = subprocess.Popen([sys.executable, str(script), job, _sleeper(tmp_path), str(tmp_path / "fails.py")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    out, err = _signalled_once_running(proc, yarnapp_home, signal.SIGTERM, name="sleeper")
    assert proc.returncode == -signal.SIGTERM, (out, err)
    first, second, failed, *sleepers = apps(yarnapp_home)
    assert "finals [4, 4]" in out and "refused None" in out and f"failed {failed}" in out, (out, err)
    assert "lr 0.1\n" in out, out          # (np.float32(0.1) was 0.10000000149011612)
    # the pool hands its threads the next jobs as the first are killed: none of them starts, or
    # each one that did is killed too (a review: the third ran on)
    assert 2 <= len(sleepers) <= 4, sleepers
    steps = [line for line in err.splitlines() if re.search(r"step \d/4 ", line)]
    assert steps and {line.split(": step ")[0] for line in steps} == {first, second}, err
    for app in sleepers:
        assert yarnapp.Run(app).status()["state"] == "KILLED" and f"terminated: killed {app}" in err, err
        assert_nothing_left(app)


def test_ctrl_c_in_a_sweep_kills_the_applications_its_threads_wait_for(yarnapp_home, tmp_path):
    """An API audit: Ctrl-C in a script whose thread pool waited in submit(wait=True) raised
    KeyboardInterrupt on the main thread alone; the pool's `with` then waited 34 s for both
    jobs to SUCCEED (a third Ctrl-C left them RUNNING, nobody watching). Now the threads'
    applications are killed, the pool's next jobs start none, and the script ends as Ctrl-C
    ends it."""
    import signal
    script = tmp_path / "sweep.py"
    script.write_text(
        "import concurrent.futures as cf, sys\nimport yarnapp\n"
        "with cf.ThreadPoolExecutor(2) as ex:\n    list(ex.map(lambda _: yarnapp.submit(sys.argv[1], wait=True), range(6)))\n")
    proc = subprocess.Popen([sys.executable, str(script), _sleeper(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    out, err = _signalled_once_running(proc, yarnapp_home, signal.SIGINT)
    assert proc.returncode in (1, -signal.SIGINT), (proc.returncode, out, err)     # (a thread's error, or Ctrl-C's)
    started = apps(yarnapp_home)
    # every line a thread's wait shows names its application (an audit: a sweep's last job, the
    # only one left waiting, showed its lines anonymous)
    shown = [line for line in err.splitlines() if "state ACCEPTED" in line or "containers, state" in line]
    assert shown and all(line.split(":")[0] in started for line in shown), err
    assert 2 <= len(started) <= 4, started          # the pool's next jobs started none, or were killed too
    for app in started:
        assert yarnapp.Run(app).status()["state"] == "KILLED", (app, err)
        assert f"interrupted: killed {app}" in err, err
        assert_nothing_left(app)


def test_a_sigterm_handler_that_calls_the_one_before_it_still_decides_the_end(tmp_path):
    """yarnapp puts its SIGTERM handler in place of the default at import (it kills what a
    sweep's threads wait for). A handler installed later that calls the one before it (a
    training library's graceful stop) decides itself whether the process ends: ours ended
    it at once."""
    import signal
    script = tmp_path / "graceful.py"
    script.write_text(
        "import signal, sys, time\nimport yarnapp\nprev = signal.getsignal(signal.SIGTERM)\nstop = []\n"
        "def graceful(signum, frame):\n    stop.append(signum)\n    if callable(prev):\n        prev(signum, frame)\n"
        "signal.signal(signal.SIGTERM, graceful)\nprint('ready', flush=True)\n"
        "while not stop:\n    time.sleep(0.01)\nprint('stopped gracefully', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "stopped gracefully\n", (proc.returncode, out, err)
    plain = subprocess.run([sys.executable, "-c", "import os, signal, yarnapp; os.kill(os.getpid(), signal.SIGTERM); "
                            "print('alive')"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == -signal.SIGTERM and plain.stdout == "", plain     # as SIGTERM's default


def test_logs_of_a_container_right_after_submit_are_empty_not_an_error(yarnapp_home, tmp_path):
    """`yarnapp logs APP --container b_0 --follow` the moment submit returned said "has no
    container 'b_0'; it has " (its directory did not exist yet)."""
    run = yarnapp.submit(_sleeper(tmp_path))
    try:
        assert set(run.logs("b_0")) == {"b_0"}
        assert {"a_0", "b_0"} <= set(run.logs())
        with pytest.raises(yarnapp.YarnappError, match="has no container 'c_0'; it has a_0, b_0 "):
            run.logs("c_0")
        deadline = time.monotonic() + 30          # the master's own log: what a failure of it names
        while "started a_0" not in run.logs("master")["master"]:
            assert time.monotonic() < deadline, run.logs("master")
            time.sleep(0.1)
    finally:
        run.kill()
    assert_nothing_left(run.app_id)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a read-only mount")
def test_a_read_only_yarnapp_home_is_one_line_naming_it(tmp_path):
    """A read-only (or full) YARNAPP_HOME ended submit and list in an OSError's traceback."""
    home = tmp_path / "home"
    home.mkdir()
    script = (f"mount --bind {home} {home} && mount -o remount,bind,ro {home} && "
              f"{sys.executable} -m yarnapp.cli submit {HELLO}; echo rc=$?; {sys.executable} -m yarnapp.cli list; "
              f"echo rc=$?")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, YARNAPP_HOME=str(home)), cwd=ROOT)
    assert proc.stdout.split() == ["rc=1", "rc=0"], proc
    assert re.fullmatch(rf"Error: YARNAPP_HOME \({home}\): cannot create {home}/apps/app_\w+: Read-only file system; "
                        r"set YARNAPP_HOME to a directory you can write to\n", proc.stderr), proc.stderr
    assert os.listdir(home) == []


@pytest.mark.skipif(not CGROUPS or not shutil.which("unshare"),
                    reason="needs root, unshare to hide cgroups, and cgroup v1 (where they enforce limits)")
def test_a_machine_whose_cgroups_cannot_limit_containers_is_said_at_submit(tmp_path):
    """A non-root audit: limits not enforced (cgroups need root, or none mounted) were said by
    `yarnapp status` of each container, never by `submit --wait`: vcores and memory silently
    unlimited, a memory kill not named."""
    script = f"mount -t tmpfs tmpfs /sys/fs/cgroup && {sys.executable} -m yarnapp.cli submit {HELLO} --dry-run"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, YARNAPP_HOME=str(tmp_path / "home")), cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr.splitlines() == [
        "WARNING yarnapp.backends.local.engine: the local engine cannot enforce the groups' vcores and memory here "
        "(no cgroup v1 cpu and memory controllers at /sys/fs/cgroup): containers share this machine's CPUs and "
        "memory, unlimited, and one over its memory is not named as such"], proc.stderr
    assert "WARNING" not in subprocess.run([sys.executable, "-m", "yarnapp.cli", "submit", HELLO, "--dry-run"],
                                           capture_output=True, text=True, timeout=120, cwd=ROOT).stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to start a process as another user")
def test_another_users_process_naming_an_application_is_not_of_it():
    """A process of another user's that set YARNAPP_APP_ID to one of ours kept root's `clean`
    from removing the application ("something of it still runs"), and root's `kill` killed
    it (a security audit): an application's processes are its owner's."""
    from yarnapp.backends.local.state import app_processes
    env = dict(os.environ, YARNAPP_APP_ID="app_20990101_000000_abcdef")
    theirs = subprocess.Popen(["sleep", "30"], env=env, preexec_fn=lambda: os.setuid(65534))
    ours = subprocess.Popen(["sleep", "30"], env=env)
    try:
        until("our process to be found", lambda: ours.pid in [p.pid for p in app_processes(env["YARNAPP_APP_ID"])],
              timeout=10)
        assert theirs.pid not in [p.pid for p in app_processes(env["YARNAPP_APP_ID"])]
    finally:
        for p in (theirs, ours):
            p.kill()
            p.wait()


def test_an_application_id_that_is_a_path_is_no_application(cli, tmp_path, yarnapp_home):
    """kill /tmp/x removed empty directories there (its cgroup clean-up), status ../../x wrote
    a store there, and clean ../../x removed the application its state.json named (a
    security audit): an id is one name under the home's apps/."""
    outside = tmp_path / "outside" / "x"
    (outside / "emptydir").mkdir(parents=True)
    (outside / "app.json").write_text("{}")
    rel = os.path.relpath(outside, os.path.join(yarnapp_home, "apps"))
    for command, app in (("kill", str(outside)), ("status", rel), ("clean", rel), ("logs", rel)):
        proc = cli(command, app, check=1)
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"Error: no application {app!r} on the local engine in {yarnapp_home} (YARNAPP_HOME); "
                               f"`yarnapp list` shows its applications"), (command, line)
    assert sorted(os.listdir(outside)) == ["app.json", "emptydir"]


def test_list_orders_an_application_whose_end_lacks_its_submit_time_by_that_time(cli, yarnapp_home, tmp_path):
    """The supervisor's end of an application killed mid-start wrote no submit time: `list`
    put it after applications submitted minutes before it (a signals audit)."""
    tiny = _tiny(tmp_path)                           # (two ended applications, cheaply)
    cli("submit", tiny, "--wait", check=0)
    time.sleep(1.1)                                  # (ids and times to the second)
    cli("submit", tiny, "--wait", check=0)
    first, newest = apps(yarnapp_home)
    path = os.path.join(yarnapp_home, "apps", newest, "state.json")
    with open(path) as f:
        st = json.load(f)
    st.pop("submitted", None)
    with open(path, "w") as f:
        json.dump(st, f)
    assert [a["app_id"] for a in yarnapp.list_apps()][:2] == [newest, first]
    assert yarnapp.status(newest)["submitted"]
    # for scripts (an automation audit: only status had --json; list's last column is free text)
    listed = json.loads(cli("list", "--json", check=0).stdout)
    assert [a["app_id"] for a in listed][:2] == [newest, first] and listed[0]["state"] == "SUCCEEDED"
    # a shell's completion of apps/ adds a slash: the same application (refused with paths, d5c60c0)
    assert cli("status", newest + "/", check=0).stdout.startswith(newest)
