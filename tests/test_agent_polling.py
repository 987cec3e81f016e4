"""An agent's store traffic per poll does not grow with the world: the real Agent.monitor (launcher.monitor)
watching a real generation (every member joined, alive, the world formed) on a real
FileStore, whose calls a thin wrapper counts. On YARN every call is an RPC to skein's one
application master, so O(N) per agent per poll would be O(N^2) per poll for the job."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import conf
from launcher import keys
from launcher.agent import Agent, Outcome
from launcher.identity import Identity
from launcher.store import FileStore, Store

pytestmark = pytest.mark.unit


class Counting(Store):
    """Forwards every call to a real store and counts it (snapshot counts as one)."""

    def __init__(self, store):
        self.store = store
        self.calls = 0
        self.snapshots = 0

    def _count(self, name, *a, **k):
        self.calls += 1
        return getattr(self.store, name)(*a, **k)

    def put(self, key, value, owned=False):
        return self._count("put", key, value, owned)

    def get(self, key, default=None):
        return self._count("get", key, default)

    def put_if_absent(self, key, value, owned=False):
        return self._count("put_if_absent", key, value, owned)

    def get_prefix(self, prefix):
        return self._count("get_prefix", prefix)

    def delete(self, key):
        return self._count("delete", key)

    def snapshot(self, prefixes=(), keys=()):
        self.snapshots += 1
        return self._count("snapshot", prefixes, keys)


def calls_per_poll(tmp_path, containers, polls=15):
    job = conf.load_job({"name": "poll", "groups": [{"name": "w", "instances": containers}],
                         "run": {"function": "training.hello:main"},
                         "launcher": {"poll_interval": "20ms"}})
    store = FileStore(str(tmp_path / f"store{containers}"))
    gen = 0
    for m in job.ranks():                       # a formed world: everyone alive and joined
        store.put(keys.alive(m["container"]), json.dumps({"incarnation": f"inc{m['rank']}"}))
        store.put(keys.incarnation(gen, m["rank"]), f"inc{m['rank']}")
        store.put(keys.joined(gen, m["rank"]) if m["rank"] else keys.port(gen), "x")
    store.put(keys.formed(gen), json.dumps({"time": time.time(), "seconds": 0.1, "members": []}))
    ident = Identity(backend="local", app_id="a", container="w_0", group="w", instance=0, rank=0, job=job,
                     secret="s", app_dir=str(tmp_path))
    counting = Counting(store)
    agent = Agent(ident, counting)
    agent.incarnation = "inc0"
    agent.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent.spawned = time.monotonic()
    with open(agent.heartbeat, "w") as f:
        f.write("train 0")
    out = {}
    t = threading.Thread(target=lambda: out.update(result=agent.monitor(gen)))
    try:
        t.start()
        while counting.snapshots < polls:
            time.sleep(0.01)
        calls, snapshots = counting.calls, counting.snapshots      # at one moment, before the abort
        store.put(keys.abort(gen), json.dumps({"reason": "stop the test"}))
        t.join(10)
    finally:
        agent.child.kill()
        agent.child.wait()
    assert out["result"] == (Outcome.OTHER, None)
    # one put (this agent's incarnation) before the loop; every poll after it
    return (calls - 1) / snapshots


@pytest.mark.parametrize("small,large", [(3, 12)])
def test_store_calls_per_poll_do_not_grow_with_the_world(tmp_path, monkeypatch, small, large):
    monkeypatch.chdir(tmp_path)                  # the agent's heartbeat file goes to its working directory
    a, b = calls_per_poll(tmp_path, small), calls_per_poll(tmp_path, large)
    assert a == b == pytest.approx(1.0, abs=0.1), (a, b)


def test_the_masters_wait_between_looks_ends_when_a_container_does():
    """The local engine's master looked at its containers 20 times a second (4% of a core for
    an idle job of three); it now looks 4 times, and a container's end wakes it at once."""
    from launcher.procs import wait_exit
    ends = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    stays = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.monotonic()
        wait_exit([stays.pid, ends.pid], 30)
        assert time.monotonic() - t0 < 15 and ends.poll() == 0       # woken by its end, not the timeout
        t0 = time.monotonic()
        wait_exit([stays.pid], 0.3)
        assert time.monotonic() - t0 >= 0.3 and stays.poll() is None
        wait_exit([ends.pid], 30)               # reaped already: no wait
        assert time.monotonic() - t0 < 15
    finally:
        stays.kill()
        stays.wait()


@pytest.mark.parametrize("warm_fork", [False, True])
def test_an_agent_sees_its_rank_end_at_once_not_at_its_next_look(tmp_path, monkeypatch, warm_fork):
    """Between two looks (launcher.poll_interval) the agent slept, and saw its rank's end up to
    a look later; it now waits on the rank's end itself (its pidfd, or, for a rank forked by
    the warm process, that process's pipe), so a rank killed is acted on at once even with
    looks 10 s apart."""
    from launcher import warm
    monkeypatch.chdir(tmp_path)
    job = conf.load_job({"name": "poll", "groups": [{"name": "w", "instances": 2}],
                         "run": {"function": "training.hello:main"},
                         "launcher": {"poll_interval": "10s", "rendezvous_timeout": "60s"}})
    ident = Identity(backend="local", app_id="a", container="w_0", group="w", instance=0, rank=0, job=job,
                     secret="s", app_dir=str(tmp_path))
    store = FileStore(str(tmp_path / "store"))
    agent = Agent(ident, store)
    if warm_fork:       # a real rank, waiting for its peer to join, forked by a real warm process
        (tmp_path / "job.json").write_text(job.model_dump_json())
        env = dict(os.environ, YARNAPP_JOB=str(tmp_path / "job.json"), YARNAPP_CONTAINER_ID="w_0",
                   YARNAPP_APP_ID="a", YARNAPP_STORE=str(tmp_path / "store"), YARNAPP_SECRET="s")
        agent.warm = warm.Warm(env)
        agent.child = agent.warm.spawn(0, agent.heartbeat, [sys.executable, "-m", "launcher.rank"], env)
        pid = agent.child.pid           # (once forked: its imports done)
        assert agent.child.poll() is None and not agent.warm.failed
    else:
        agent.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pid = agent.child.pid
    agent.spawned, agent.memory_before, agent.log_start = time.monotonic(), None, 0
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        outcome, found = agent.monitor(0)
    finally:
        killer.cancel()
        agent.kill_child()
        if agent.warm:
            agent.warm.close()
    assert outcome is Outcome.OWN and found.exit_code == -signal.SIGKILL, found
    assert time.monotonic() - t0 < 8, "seen at the next look, 10 s on, not at the rank's end"
