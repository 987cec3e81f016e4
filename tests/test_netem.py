"""Emulated nodes on the local engine: real network namespaces, veths, tc qdiscs, MPI over TCP.

The tests that build networks need root and iproute2 (`ip netns`); elsewhere they are
skipped with the reason. After each of them no namespace, veth or qdisc of the
application is left (asserted), nor any process or cgroup.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import conf
import yarnapp
from launcher import keys
from launcher.store import FileStore
from util import app_id_from, apps, assert_nothing_left, write_job
from yarnapp.backends.local import netem

pytestmark = pytest.mark.e2e

CGROUPS = os.geteuid() == 0 and os.path.isfile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELLO = os.path.join(ROOT, "conf", "examples", "hello.yaml")


NETNS_REASON = netem.unavailable_reason(probe=True)
needs_netns = pytest.mark.skipif(NETNS_REASON is not None, reason=f"emulated nodes: {NETNS_REASON}")


@pytest.fixture
def nothing_of_the_network_left(yarnapp_home):
    """After the test: no namespace, veth or qdisc of any application it started."""
    yield
    for app in apps(yarnapp_home):
        p = netem.prefix(app)
        assert not [ns for ns in netem.namespaces() if ns.startswith(p)], f"namespaces of {app} remain"
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert p not in links, f"links of {app} remain:\n{links}"
        qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
        assert p not in qdiscs, f"qdiscs of {app} remain:\n{qdiscs}"
        assert_nothing_left(app)


# -- the job.yaml section (no root needed) -------------------------------------------

def _job(**network):
    return {"name": "n", "groups": [{"name": "a", "instances": 2}, {"name": "b", "instances": 2}],
            "run": {"function": "a:b"}, "network": network}


def test_network_section_defaults_off_and_parses_rates():
    assert conf.load_job(HELLO).network.nodes == 0          # no section: behaviour as before
    net = conf.load_job(_job(nodes=2, bandwidth="10 Gbit/s", latency="0.2ms")).network
    assert (net.nodes, net.bandwidth, net.latency, net.subnet) == (2, 10e9, 0.0002, "10.77.0.0/24")
    assert conf.load_job(_job(bandwidth="100mbit")).network.bandwidth == 100e6
    for bad, msg in [({"bandwidth": "1gb"}, "job: network.bandwidth: '1gb' is in bytes: a rate is in bits per "
                                            "second here, as tc writes it (say 8gbit)"),
                     ({"bandwidth": "100mbps"}, "job: network.bandwidth: '100mbps' is in bytes"),   # tc's mbps: MB/s
                     ({"bandwidth": "fast"}, "job: network.bandwidth: cannot parse 'fast' as a rate"),
                     ({"latency": "fast"}, "job: network.latency: cannot parse 'fast' as a duration"),
                     ({"subnet": "10.77.0.0/33"}, "job: network.subnet: '10.77.0.0/33' is not an IPv4 subnet"),
                     # node0 got 127.0.0.1, MPI chose `lo`, and the world never formed
                     ({"subnet": "127.0.0.0/24"}, "job: network.subnet: '127.0.0.0/24' is a loopback range, which "
                                                  "emulated nodes cannot use; give a private one such as 10.77.0.0/24"),
                     ({"subnet": "224.1.0.0/24"}, "job: network.subnet: '224.1.0.0/24' is a multicast range"),
                     ({"subnet": "169.254.0.0/24"}, "job: network.subnet: '169.254.0.0/24' is a link-local range"),
                     ({"placement": "random"}, "job: network.placement: "),
                     ({"nodes": -1}, "job: network.nodes: "),
                     ({"speed": 1}, "job: network.speed: unknown field")]:
        with pytest.raises(conf.JobError) as e:
            conf.load_job(_job(**bad))
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


def test_placement_spread_and_by_group():
    spread = conf.load_job(_job(nodes=3))
    assert netem.place(spread) == {"a_0": 0, "a_1": 1, "b_0": 2, "b_1": 0}
    by_group = conf.load_job(_job(nodes=2, placement="by-group"))
    assert netem.place(by_group) == {"a_0": 0, "a_1": 0, "b_0": 1, "b_1": 1}
    with pytest.raises(yarnapp.YarnappError, match="job: network.nodes: 5 nodes for 4 containers"):
        netem.check(conf.load_job(_job(nodes=5)))
    with pytest.raises(yarnapp.YarnappError, match="network.nodes: 3 nodes but placement by-group"):
        netem.check(conf.load_job(_job(nodes=3, placement="by-group")))
    with pytest.raises(yarnapp.YarnappError, match="job: network.bandwidth: 1e.12 bit/s cannot be emulated"):
        netem.check(conf.load_job(_job(nodes=2, bandwidth="1tbit")))
    net = netem.Network("app_20260101_000000_abc123", 3, "10.9.8.0/29", 1e9, None)
    assert (net.prefix, net.netns(2), net.port(2), net.addr(0), net.addr(2)) == \
        ("yaabc123", "yaabc123-n2", "yaabc123-h2", "10.9.8.1", "10.9.8.3")
    assert all(len(n) <= 15 for n in (net.iface(2), net.port(2), net.bridge, net.switch))


# -- real emulated clusters ------------------------------------------------------------

@needs_netns
def test_hello_on_three_nodes_forms_one_world_over_the_links(cli, yarnapp_home, nothing_of_the_network_left):
    out = cli("submit", HELLO, "--nodes", "3", "--wait", check=0).stdout
    app = app_id_from(out)
    final = dict(kv.split("=", 1) for kv in out.split("final: ", 1)[1].split())
    assert final["world_size"] == "3" and final["ok"] == "True" and float(final["allreduce"]) == 6.0
    st = yarnapp.status(app)
    assert st["state"] == "SUCCEEDED"
    # Three containers on three nodes with three addresses, as the engine placed them ...
    placed = {c["id"]: (c["node"], c["addr"]) for c in st["containers"]}
    assert placed == {"big_0": ("node0", "10.77.0.1"), "small_0": ("node1", "10.77.0.2"),
                      "small_1": ("node2", "10.77.0.3")}
    # ... and as each rank found itself from inside its node: the address is on an
    # interface of its own namespace, and MPI was bound to that interface.
    formed = json.loads(FileStore(os.path.join(st["app_dir"], "store")).get(keys.formed(0)))
    members = {m["container"]: m for m in formed["members"]}
    assert len({m["addr"] for m in members.values()}) == 3
    for cid, (node, addr) in placed.items():
        assert (members[cid]["node"], members[cid]["addr"]) == (node, addr)
        assert members[cid]["iface"] == f"{netem.prefix(app)}-n{node[-1]}"
    logs = yarnapp.Run(app).logs()
    assert "FI_PROVIDER=tcp" in logs["small_1"] and "MPIR_CVAR_NOLOCAL=1" in logs["small_1"]
    # The traffic went through the emulated links: every node's veth sent and received.
    counters = st["network"]["counters"]
    assert set(counters) == {"node0", "node1", "node2"}
    for node, c in counters.items():
        assert c["tx_bytes"] > 2000 and c["rx_bytes"] > 2000, counters
    if CGROUPS:     # only the network namespace changed: each container still sees its own cgroup
        assert final["quota"] == "1.0,0.5,0.5", final


LOOP = """\
import sys, time
import numpy as np
from mpi4py import MPI
from training.context import current

ctx = current()
steps = int(sys.argv[1])
x = np.full(65536, 1.0, np.float32)          # 256 KB a step
y = np.empty_like(x)
for step in range(steps):
    ctx.comm.Allreduce(x, y, op=MPI.SUM)
    assert y[0] == ctx.world_size
    ctx.report(step=step)
    time.sleep(0.05)
ctx.final(steps=steps, generation=ctx.generation)
"""


def _loop_job(tmp_path, steps, max_restarts, am_attempts=2, **network):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return write_job(tmp_path / "loop.yaml", {
        "name": "netloop", "max_restarts": max_restarts, "am_attempts": am_attempts,
        "groups": [{"name": "w", "instances": 3, "vcores": 0.5, "memory": "256 MiB"}],
        "run": {"script": str(script), "args": [str(steps)]},
        "launcher": {"heartbeat_timeout": "4s", "rendezvous_timeout": "30s"},
        "network": {"nodes": 3, **network}})


def _wait_for(predicate, run, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        st = run.status()
        if predicate(st):
            return st
        assert st["state"] not in ("SUCCEEDED", "FAILED", "KILLED"), f"{what}: ended {st['state']}: {st}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s: {run.logs()}"
        time.sleep(0.2)


def _step(st, rank=0):
    return ((st.get("progress") or {}).get(rank) or {}).get("step", -1)


@needs_netns
@pytest.mark.alone      # a cut link found within seconds of the heartbeat limit
def test_cut_link_is_detected_and_the_job_fails_naming_the_node(cli, yarnapp_home, tmp_path,
                                                                 nothing_of_the_network_left):
    app = cli("submit", _loop_job(tmp_path, 100_000, 0, bandwidth="1gbit"), check=0).stdout.strip()
    run = yarnapp.Run(app)
    _wait_for(lambda st: _step(st) >= 10, run, 90, "the world trains")
    qdiscs = netem.for_app(app).qdiscs(1)        # both ends of node1's link are shaped
    assert len(qdiscs) == 2 and all(q.startswith("qdisc tbf") and "rate 1Gbit" in q for q in qdiscs), qdiscs
    out = cli("netem", app, "--node", "1", "--cut", check=0).stdout
    assert out.strip() == f"{app} node1 (10.77.0.2): link cut; link down"
    t0 = time.monotonic()
    st = run.wait(timeout=60)
    assert st["state"] == "FAILED"
    assert time.monotonic() - t0 < 30            # heartbeat_timeout 4s + probes, not a TCP timeout
    msg = run.failure_message()
    assert ("hung" in msg or "exited" in msg) and "node1 (10.77.0.2) is cut off (`yarnapp netem --cut`)" in msg, msg
    assert "node0 (10.77.0.1) is" not in msg and "node2 (10.77.0.3) is" not in msg, msg
    # Before the cut, every step's 256 KB went over the veths of every node.
    steps = min(p["step"] for p in st["progress"].values()) + 1
    for node, c in st["network"]["counters"].items():
        assert c["tx_bytes"] > steps * 128 * 1024 and c["rx_bytes"] > steps * 128 * 1024, (node, steps, c)


@needs_netns
@pytest.mark.alone      # a cut link found within seconds of the heartbeat limit
def test_cut_link_restored_recovers_in_a_new_generation(cli, yarnapp_home, tmp_path, nothing_of_the_network_left):
    # One restart: the cut is found as a hang, and the next generation waits in its rendezvous
    # until the link is back (a port taken off the switch, its link up: when it went down, a
    # rank starting on the node failed MPI_Init at once, and each such start spent a restart).
    app = cli("submit", _loop_job(tmp_path, 60, 2), check=0).stdout.strip()
    run = yarnapp.Run(app)
    _wait_for(lambda st: _step(st) >= 5, run, 90, "the world trains")
    cli("netem", app, "--node", "node1", "--cut", check=0)
    st = _wait_for(lambda st: st.get("restarts"), run, 40, "the cut is detected")
    # the rank on the node cut off is named, not one on a healthy node waiting for it (an audit:
    # whichever agent's limit came first was)
    reason = st["restarts"][0]["reason"]
    assert reason.startswith("rank 1 (w_1) hung") and "node1 (10.77.0.2) is cut off" in reason, st["restarts"]
    time.sleep(3)                                # the new generation's ranks start while it is cut
    out = cli("netem", app, "--node", "1", "--restore", check=0).stdout
    assert out.strip().endswith("link restored; link up"), out
    st = run.wait(timeout=90)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert st["final"]["steps"] == 60 and st["final"]["generation"] == len(st["restarts"]) == 1, st["restarts"]


@needs_netns
def test_a_killed_ams_network_is_removed_by_the_supervisor(cli, yarnapp_home, tmp_path, nothing_of_the_network_left):
    app = cli("submit", _loop_job(tmp_path, 100_000, 0, am_attempts=1), check=0).stdout.strip()
    run = yarnapp.Run(app)
    st = _wait_for(lambda st: _step(st) >= 3, run, 90, "the world trains")
    p = netem.prefix(app)
    mine = lambda: sorted(ns for ns in netem.namespaces() if ns.startswith(p + "-"))  # noqa: E731
    assert mine() == [f"{p}-n0", f"{p}-n1", f"{p}-n2", f"{p}-sw"]
    os.kill(st["am_pid"], signal.SIGKILL)        # no shutdown runs: its containers die with it
    st = run.wait(timeout=60)                    # the supervisor cleans up after it (am_attempts: 1)
    assert st["state"] == "FAILED" and "application master (attempt 1" in st["diagnostics"], st
    assert mine() == []
    assert yarnapp.status(app)["state"] == "FAILED"


@needs_netns
def test_a_cut_outlives_a_masters_restart_and_a_master_killed_with_its_supervisor_leaves_no_network(
        cli, yarnapp_home, tmp_path, nothing_of_the_network_left):
    """An audit of emulated hosts: the second master attempt rebuilt the network whole, so a
    node cut with `yarnapp netem --cut` came back unsaid while its record stayed, and later
    failures named a healthy node cut off. And with the master and its supervisor both
    SIGKILLed, status ended the application FAILED but its namespaces stayed until a kill."""
    from yarnapp.backends.local import supervisor
    app = cli("submit", _loop_job(tmp_path, 100_000, 2, am_attempts=2), check=0).stdout.strip()
    run = yarnapp.Run(app)
    st = _wait_for(lambda st: _step(st) >= 3, run, 90, "the world trains")
    cli("netem", app, "--node", "1", "--cut", check=0)
    first = st["am_pid"]
    os.kill(first, signal.SIGKILL)
    st = _wait_for(lambda st: len(st["am_attempts"]) == 2 and st["am_pid"] != first, run, 60, "attempt 2 runs")
    net, deadline = netem.for_app(app), time.monotonic() + 30
    while True:         # attempt 2 builds its network
        with contextlib.suppress(netem.NetemError):
            if net.link_up(0) and net.link_up(2):
                break
        assert time.monotonic() < deadline, run.status()
        time.sleep(0.2)
    assert not net.link_up(1)
    os.kill(json.load(open(supervisor.record_path(st["app_dir"])))["pid"], signal.SIGKILL)
    os.kill(st["am_pid"], signal.SIGKILL)
    st = run.wait(timeout=60)           # status finds both gone: the end, and the network removed
    assert st["state"] == "FAILED" and st["diagnostics"].startswith("the application master died"), st
    p = netem.prefix(app)
    assert [ns for ns in netem.namespaces() if ns.startswith(p + "-")] == []


@needs_netns
def test_latency_needs_netem(cli, yarnapp_home, tmp_path, nothing_of_the_network_left):
    job = _loop_job(tmp_path, 100_000, 0, latency="20ms")
    if not netem.latency_supported():
        proc = cli("submit", job)
        assert proc.returncode == 1
        assert proc.stderr.strip() == (f"Error: {job}: network.latency: this kernel has no netem qdisc "
                                       "(CONFIG_NET_SCH_NETEM), so latency cannot be emulated here; "
                                       "remove network.latency")
        assert apps(yarnapp_home) == []
        return
    app = cli("submit", job, check=0).stdout.strip()   # untested here: this kernel has no netem
    run = yarnapp.Run(app)
    _wait_for(lambda st: _step(st) >= 3, run, 90, "the world trains")
    net = netem.for_app(app)
    assert any("netem" in q and "delay 20ms" in q for q in net.qdiscs(1)), net.qdiscs(1)
    cli("netem", app, "--node", "1", "--latency", "50ms", check=0)
    assert any("delay 50ms" in q for q in net.qdiscs(1)), net.qdiscs(1)
    run.kill()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_without_the_capabilities_submit_says_so_plainly(yarnapp_home):
    # Root, but without CAP_SYS_ADMIN/CAP_NET_ADMIN (as in an unprivileged container).
    proc = subprocess.run(["setpriv", "--bounding-set=-sys_admin,-net_admin", "--inh-caps=-sys_admin,-net_admin",
                           sys.executable, "-m", "yarnapp.cli", "submit", HELLO, "--nodes", "3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"Error: {HELLO}: network.nodes (given as --nodes 3): emulated nodes need root "
                                  "with CAP_SYS_ADMIN and CAP_NET_ADMIN, and here `ip netns add` fails: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and apps(yarnapp_home) == []


def test_netem_command_errors_in_one_line(cli, yarnapp_home, tmp_path):
    proc = cli("netem", "app_20260101_000000_abc123", "--node", "1", "--cut")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"Error: no application 'app_20260101_000000_abc123' on the local engine in "
                                   f"{yarnapp_home} (YARNAPP_HOME); `yarnapp list` shows its applications")
    if netem.unavailable_reason():
        proc = cli("submit", HELLO, "--nodes", "2")
        assert proc.returncode == 1 and "network.nodes (given as --nodes 2): emulated nodes need root" in proc.stderr
        return
    noop = tmp_path / "noop.py"
    noop.write_text("pass\n")
    job = write_job(tmp_path / "noop.yaml", {"name": "noop", "groups": [{"name": "a", "vcores": 0.5}],
                                             "run": {"script": str(noop)}})
    app = cli("submit", job, check=0).stdout.strip()    # an application without emulated nodes
    assert yarnapp.Run(app).wait(timeout=120)["state"] == "SUCCEEDED"
    proc = cli("netem", app, "--node", "0", "--cut")
    assert proc.returncode == 1 and "has no emulated nodes" in proc.stderr, proc.stderr
    assert_nothing_left(app)


@needs_netns
def test_a_ddp_script_across_two_nodes_gets_local_ranks_per_host(yarnapp_home, tmp_path, nothing_of_the_network_left):
    """torch.distributed's contract follows the hosts: LOCAL_RANK counts the application's
    containers on the same (emulated) node, GROUP_RANK is the node's index, MASTER_ADDR is
    rank 0's own address, and gloo trains over the links."""
    out = tmp_path / "out"
    out.mkdir()
    job = {"name": "ddp-nodes", "max_restarts": 0,
           "groups": [{"name": "a", "instances": 2, "vcores": 0.5, "memory": "2 GiB"},
                      {"name": "b", "instances": 1, "vcores": 0.5, "memory": "2 GiB"}],
           "network": {"nodes": 2, "placement": "spread"},
           "run": {"script": os.path.join(ROOT, "tests", "jobs", "ddp_train.py"),
                   "args": ["--out", str(out), "--epochs", "1"]}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    envs = [json.loads((out / f"rank{r}.json").read_text())["env"] for r in range(3)]
    nodes = {c["rank"]: c["node"] for c in st["containers"]}     # spread: rank r on node r mod 2
    assert nodes == {0: "node0", 1: "node1", 2: "node0"}, nodes
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == \
        [("0", "2", "0"), ("0", "1", "1"), ("1", "2", "0")]
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}                  # two nodes
    rank0_addr = next(c["addr"] for c in st["containers"] if c["rank"] == 0)
    assert {e["MASTER_ADDR"] for e in envs} == {rank0_addr} and rank0_addr != "127.0.0.1"
