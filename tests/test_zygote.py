"""The local engine's zygote (launcher.zygote): the containers whose ranks import alike get
their warm processes forked from one process that imported once, each in its own container;
the rest start their own. Real `yarnapp submit`s: real containers, cgroups, processes."""
import json
import os
import signal
import time

import psutil
import pytest

import yarnapp
from launcher import zygote
from util import assert_nothing_left

pytestmark = [pytest.mark.e2e]

PROBE = '''
import json, os, sys, time
import torch
from training.context import current

ctx = current()
out = os.environ["OUT"]
with open(os.path.join(out, f"{os.environ['YARNAPP_CONTAINER_ID']}-{ctx.generation}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "pgid": os.getpgid(0),
               "cgroup": open("/proc/self/cgroup").read(), "threads": torch.get_num_threads()}, f)
for step in range(10_000):
    ctx.report(step=step)
    if os.path.exists(os.path.join(out, "stop")):
        break
    time.sleep(0.2)
'''


def test_an_environment_alike_is_one_whose_imports_read_the_same():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/z:/lib"}
    mine = dict(base, PYTHONPATH="/work:/lib", YARNAPP_CONTAINER_ID="small_1", CUDA_VISIBLE_DEVICES="1")
    assert zygote.key(base, "/z") == zygote.key(mine, "/work")       # a container's own: not read by imports
    assert zygote.differs(zygote.key(base, "/z"), zygote.key(dict(mine, OMP_NUM_THREADS="2"), "/work")) == [
        "OMP_NUM_THREADS"]                                             # read as libgomp loads
    assert zygote.differs(zygote.key(base, "/z"), zygote.key(dict(mine, PYTHONPATH="/elsewhere:/lib"), "/work")) == [
        "PYTHONPATH"]


def _wait_files(out, names, run, timeout=120):
    deadline = time.monotonic() + timeout
    while not all((out / n).exists() for n in names):
        assert run.state in ("ACCEPTED", "RUNNING") and time.monotonic() < deadline, run.logs()
        time.sleep(0.1)
    return [json.loads((out / n).read_text()) for n in names]


def test_containers_alike_fork_from_one_zygote_each_into_its_own_container_and_die_with_their_agent(
        tmp_path, yarnapp_home):
    """Two containers whose group sets OMP_NUM_THREADS=2 share a zygote; the third, whose
    ranks would import under 1 thread, starts its own warm process. Each rank runs in its own
    container's cgroups and working directory with its own threads; an agent SIGKILLed takes its
    warm process and rank along (they are not its children), and the job goes on."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    env = {"OUT": str(out)}
    job = {"name": "zygote", "max_restarts": 1, "run": {"script": str(tmp_path / "probe.py")},
           "groups": [{"name": "big", "instances": 1, "vcores": 1, "memory": "1 GiB", "env": env},
                      {"name": "small", "instances": 2, "vcores": 0.5, "memory": "1 GiB",
                       "env": dict(env, OMP_NUM_THREADS="2")}]}
    run = yarnapp.submit(job)
    names = ["big_0", "small_0", "small_1"]
    ranks = dict(zip(names, _wait_files(out, [f"{n}-0.json" for n in names], run)))
    app_dir = run.status()["app_dir"]
    warms = {n: psutil.Process(r["pid"]).parent() for n, r in ranks.items()}
    assert "launcher.warm" in warms["big_0"].cmdline(), warms["big_0"].cmdline()
    z = {warms[n].ppid() for n in ("small_0", "small_1")}
    assert len(z) == 1 and "launcher.zygote" in psutil.Process(z.pop()).cmdline()
    for n, r in ranks.items():
        assert r["cwd"].startswith(os.path.join(app_dir, "containers", n, "work")), r
        for ctl in ("cpu", "memory"):
            assert any(line.split(":")[1] == ctl and line.endswith(f"/yarnapp/{run.app_id}/{n}")
                       for line in r["cgroup"].splitlines()), (n, r["cgroup"])
    assert [ranks[n]["threads"] for n in names] == [1, 2, 2]
    containers = {c["id"]: c for c in run.status()["containers"]}
    assert all(ranks[n]["pgid"] == containers[n]["pid"] for n in names)     # its agent's process group

    os.kill(containers["small_1"]["pid"], signal.SIGKILL)        # its agent alone
    gone, alive = psutil.wait_procs([psutil.Process(ranks["small_1"]["pid"]), warms["small_1"]], timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    _wait_files(out, ["small_1-1.json"], run)          # replaced: forked from the zygote again
    (out / "stop").touch()
    st = run.wait(timeout=120)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert_nothing_left(run.app_id)


def _zygote(tmp_path):
    """A zygote of a job whose script imports scikit-learn at its top (which sets KMP_*
    variables in its environment as it is imported: the zygote compares an agent's with its
    own as it started, and refused every agent before)."""
    import conf
    (tmp_path / "train.py").write_text("import sklearn\n")
    job = conf.load_job({"name": "z", "groups": [{"name": "a", "instances": 2, "vcores": 1, "memory": "1 GiB"}],
                         "run": {"script": "train.py"}})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    env = dict(os.environ, YARNAPP_JOB=str(tmp_path / "job.json"), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return zygote.Zygote(env, str(tmp_path)), env


def test_an_agent_asks_only_a_zygote_alike_and_its_fork_ends_with_the_agents_pipe(tmp_path):
    """The protocol at its boundary, with this process as the agent: an environment that
    differs where imports read it is not sent (the agent starts its own warm process); one
    alike gets a fork of the zygote that says its pid on the pipe, and ends once the pipe closes."""
    import select
    z, env = _zygote(tmp_path)
    try:
        sock = z.connect()
        client = zygote.Client(os.dup(sock.fileno()), z.pid)
        sock.close()
        r, w = os.pipe()
        assert not client.fork_warm(dict(env, OMP_NUM_THREADS="2"), str(tmp_path), r, w)
        os.close(r)
        os.close(w)
        r_cmd, w_cmd = os.pipe()
        r_out, w_out = os.pipe()
        assert client.fork_warm(dict(env, YARNAPP_CONTAINER_ID="a_1"), str(tmp_path), r_cmd, w_out)
        os.close(r_cmd)
        os.close(w_out)
        assert select.select([r_out], [], [], 60)[0], "the zygote never forked"
        word, pid = os.read(r_out, 100).decode().split()
        warm = psutil.Process(int(pid))
        assert word == "warm" and warm.ppid() == z.pid
        os.close(w_cmd)                                  # the agent gone
        assert select.select([r_out], [], [], 10)[0] and os.read(r_out, 100) == b""
        warm.wait(timeout=10)
        os.close(r_out)
    finally:
        z.stop()


def test_a_rank_killed_while_the_zygote_imports_leaves_its_agent_a_warm_process_to_replace(tmp_path):
    """A generation ended before the zygote had forked this container's warm process (a peer
    failed as the world formed): the rank is killed, and the agent's next look at its warm
    process finds it gone, to start another (it raised a TypeError, and the agent died)."""
    from launcher import warm
    z, env = _zygote(tmp_path)
    try:
        sock = z.connect()
        client = zygote.Client(os.dup(sock.fileno()), z.pid)
        sock.close()
        w = warm.Warm(dict(env, YARNAPP_CONTAINER_ID="a_0"), client)
        assert w.zygote is client and w.proc is None
        rank = w.spawn(0, str(tmp_path / "hb"), ["true"], env)
        assert rank.started_pid is None                # the zygote still imports
        rank.kill()
        assert rank.poll() == -signal.SIGKILL and not w.alive()
        w.close()
    finally:
        z.stop()
