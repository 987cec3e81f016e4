"""The embedded local engine end to end: real containers, real MPI world, real cgroups."""
import json
import os
import re
import time

import pytest

import yarnapp
from util import app_id_from, assert_nothing_left, write_job

HELLO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "examples", "hello.yaml")
CGROUPS = os.geteuid() == 0 and os.path.isfile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")


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
    proc = cli("kill", app, check=0)
    assert "KILLED" in proc.stdout
    assert yarnapp.status(app)["state"] == "KILLED"
    assert_nothing_left(app)
    # status/list/logs keep working from another process after the end
    assert app in cli("list", check=0).stdout
    assert "attempt 1 started" in cli("logs", app, "--container", "a_0", check=0).stdout


def test_failed_rank_names_container_exit_status_and_log(cli, yarnapp_home, tmp_path):
    bad = tmp_path / "boom.py"
    bad.write_text("import os, sys\nfrom training.context import current\n"
                   "ctx = current()\nif ctx.rank == 1:\n    print('boom on purpose', flush=True)\n    sys.exit(7)\n"
                   "import time\ntime.sleep(60)\n")
    job = write_job(tmp_path / "boom.yaml", {
        "name": "boom", "max_restarts": 0,
        "groups": [{"name": "w", "instances": 2, "vcores": 0.5, "memory": "256 MiB"}],
        "run": {"script": str(bad)}})
    t0 = time.monotonic()
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("Error: app_") and "FAILED" in err, err
    assert "w_1" in err and "exited with status 7" in err and "container.log" in err, err
    assert "boom on purpose" in proc.stderr          # the log tail is shown
    assert time.monotonic() - t0 < 30                # the survivor did not hang in its sleep
    app = app_id_from(err)
    st = yarnapp.status(app)
    assert st["state"] == "FAILED"
    assert_nothing_left(app)


def test_python_api_submit_and_wait(yarnapp_home):
    run = yarnapp.submit(HELLO)
    st = run.wait(timeout=120)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert run.final["ok"] is True and run.final["world_size"] == 3
    assert_nothing_left(run.app_id)
    with pytest.raises(yarnapp.YarnappError, match="groups\\[0\\].instances"):
        yarnapp.submit({"name": "x", "groups": [{"name": "a", "instances": 0}], "run": {"function": "a:b"}})
    raw = json.load(open(os.path.join(st["app_dir"], "job.json")))
    assert raw["groups"][1]["vcores"] == 0.5
