"""The local engine's GPUs, on a machine without any: the inventory read from a fake
`nvidia-smi` on PATH (the adapter's boundary: the CSV the real one prints) or from
YARNAPP_GPUS; each container gets exactly its own through CUDA_VISIBLE_DEVICES; an
impossible request is refused at submit; an application whose GPUs another holds waits
and never shares them."""
import json
import os
import shutil
import stat
import tempfile
import time

import pytest

import yarnapp
from util import assert_nothing_left
from yarnapp.backends.local import gpus, leases
from yarnapp.errors import YarnappError

pytestmark = pytest.mark.e2e

FAKE_SMI = """#!/bin/sh
# what `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits` prints
echo "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559"
echo "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559"
"""


@pytest.fixture
def two_fake_gpus(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("YARNAPP_GPUS", raising=False)


def test_the_inventory_reads_nvidia_smi_and_honours_cuda_visible_devices(two_fake_gpus, monkeypatch):
    found = gpus.inventory()
    assert [(g.index, g.uuid, g.memory_mib) for g in found] == [(0, "GPU-aaaa", 81559), (1, "GPU-bbbb", 81559)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert [g.index for g in gpus.inventory()] == [1]
    monkeypatch.setenv("YARNAPP_GPUS", "0,1,2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert [g.index for g in gpus.inventory()] == [1, 3]
    for bad in ("all", "0,0", "0,a"):       # a traceback; one GPU given to two containers
        monkeypatch.setenv("YARNAPP_GPUS", bad)
        with pytest.raises(YarnappError, match=rf"^YARNAPP_GPUS={bad!r}: not a list of distinct GPU indices"):
            gpus.inventory()


def test_no_nvidia_smi_means_no_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("YARNAPP_GPUS", raising=False)
    assert gpus.inventory() == []


def _submit(name, groups, seconds=0):
    job = {"name": name, "max_restarts": 0, "launcher": {"poll_interval": "100ms"},
           "groups": [dict(g, env={"HOLD_S": str(seconds), **g.get("env", {})}) for g in groups],
           "run": {"function": "gpu_env:main",
                   "files": [os.path.join(os.path.dirname(__file__), "jobs", "gpu_env.py")]}}
    return yarnapp.submit(job)


def test_every_container_sees_only_its_own_gpus(two_fake_gpus, yarnapp_home):
    """... and, seeing only its own, is a host of its own for torch's contract (LOCAL_RANK 0,
    as a Kubernetes pod): the tutorial's set_device(LOCAL_RANK) was "invalid device ordinal"
    in the second GPU container of a host; the CPU containers share theirs."""
    run = _submit("gpu", [{"name": "gpu", "instances": 2, "gpus": 1, "vcores": 0.5, "memory": "512 MiB"},
                          {"name": "cpu", "instances": 2, "vcores": 0.5, "memory": "512 MiB"}])
    st = run.wait(timeout=120)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert st["final"]["visible"] == ["0", "1", "", ""]         # rank order: gpu_0, gpu_1, cpu_0, cpu_1
    assert {c["id"]: c["gpu_devices"] for c in st["containers"]} == {"gpu_0": [0], "gpu_1": [1], "cpu_0": [],
                                                                     "cpu_1": []}
    # (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE)
    assert st["final"]["local"] == [["0", "1", "0", "3"], ["0", "1", "1", "3"], ["0", "2", "2", "3"],
                                    ["1", "2", "2", "3"]], st["final"]["local"]
    assert leases.Leases().held() == {}                            # released at the end
    assert_nothing_left(run.app_id)


def test_gpus_are_leased_machine_wide_in_the_order_applications_asked(tmp_path, monkeypatch):
    """The ledger was $YARNAPP_HOME/gpus.json: two users (two homes) were both given GPU 0.
    And a waiting application was passed over by later ones that fit (a 2-GPU job waited
    while 1-GPU jobs submitted after it took each GPU freed). Real processes hold the leases."""
    import subprocess
    import sys
    monkeypatch.delenv("YARNAPP_LEDGER", raising=False)
    assert leases.Leases().path == os.path.join(tempfile.gettempdir(), "yarnapp-leases", "leases.json")   # not the home's
    ledger = str(tmp_path / "ledger" / "gpus.json")
    two = [gpus.Gpu(0, "GPU-0", "x", 0), gpus.Gpu(1, "GPU-1", "x", 0)]
    masters = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        a, b, c, d = (m.pid for m in masters)
        mine, theirs = leases.Leases(ledger), leases.Leases(ledger)     # two engines (homes) of one machine
        assert mine.acquire("app_a", 1, two, pids=[a]) == ([0], [], [], [])
        assert theirs.acquire("app_big", 2, two, pids=[b]) == (None, ["app_a"], [], ["gpus"])       # waits for 2
        assert theirs.acquire("app_c", 1, two, pids=[c]) == (None, ["app_a"], ["app_big"], ["gpus"])  # GPU 1 free, in line
        mine.release("app_a")
        assert theirs.acquire("app_c", 1, two, pids=[c]) == (None, [], ["app_big"], ["gpus"])
        assert theirs.acquire("app_big", 2, two, pids=[b]) == ([0, 1], [], [], [])
        assert theirs.acquire("app_c", 1, two, pids=[c]) == (None, ["app_big"], [], ["gpus"])
        masters[1].kill()
        masters[1].wait()                            # its master died: its GPUs are free again
        assert theirs.acquire("app_c", 1, two, pids=[c]) == ([0], [], [], [])
        assert mine.acquire("app_d", 1, two, pids=[d]) == ([1], [], [], [])
        assert mine.held() == {"app_c": {"gpus": [0], "memory": 0}, "app_d": {"gpus": [1], "memory": 0}}
    finally:
        for m in masters:
            m.kill()
            m.wait()


def test_memory_is_leased_in_the_order_asked_and_held_while_any_of_its_processes_lives(tmp_path):
    """An application waiting only behind another held no place of its own: a later one passed
    it. A lease recorded under the supervisor alone went when the supervisor was killed (its
    master ran on), and one recorded under an orphaned master's parent (pid 1) never went."""
    import subprocess
    import sys
    ledger = leases.Leases(str(tmp_path / "ledger.json"))
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(5)]
    try:
        a, b, d, f, m = (p.pid for p in procs)
        assert ledger.acquire("A", memory=50, capacity=100, pids=[a]) == ([], [], [], [])
        assert ledger.acquire("B", memory=60, capacity=100, pids=[b]) == (None, ["A"], [], ["memory"])
        assert ledger.acquire("D", memory=30, capacity=100, pids=[d]) == (None, ["A"], ["B"], ["memory"])
        assert ledger.acquire("F", memory=30, capacity=100, pids=[f]) == (None, ["A"], ["B", "D"], ["memory"])
        ledger.release("A")
        assert ledger.acquire("B", memory=60, capacity=100, pids=[b])[0] == []
        assert ledger.acquire("F", memory=30, capacity=100, pids=[f]) == (None, ["B"], ["D"], ["memory"])   # D first
        assert ledger.acquire("D", memory=30, capacity=100, pids=[d])[0] == []
        procs[1].kill()                     # B's supervisor killed: its master (m) holds on
        procs[1].wait()
        for app in ("B", "F"):
            ledger.release(app)
        assert ledger.acquire("M", memory=60, capacity=100, pids=[b, 1, m])[0] == []     # (b is gone, 1 is no one)
        assert ledger.held()["M"]["memory"] == 60
        procs[4].kill()
        procs[4].wait()
        assert "M" not in ledger.held()         # its last process gone: free
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_two_users_engines_share_the_machines_ledger():
    """Each user's engine writes the ledger: the first made the file and, in the sticky
    folder, the second could not rename its copy over it (PermissionError, its master
    crashed). Written in place under the lock, the three users' leases stand side by side."""
    shared = tempfile.mkdtemp(prefix="yarnapp-test-")     # (pytest's tmp_path is the root's alone)
    os.chmod(shared, 0o1777)                               # as /tmp is
    try:
        _three_users(os.path.join(shared, "yarnapp-leases", "leases.json"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _three_users(ledger):
    two = [gpus.Gpu(0, "GPU-0", "x", 0), gpus.Gpu(1, "GPU-1", "x", 0)]
    said = []
    for uid in (1001, 1002, 1003):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                        # a user's engine (their master: this test's process)
            os.close(r)
            try:
                os.setgid(uid)
                os.setuid(uid)
                got = list(leases.Leases(ledger).acquire(f"app_{uid}", 1, two, pids=[os.getppid()]))
                got[1] = leases.Leases(ledger).whose(got[1])     # as its wait says them
            except Exception as e:  # noqa: BLE001 - reported to the parent
                got = repr(e)
            os.write(w, json.dumps(got).encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            said.append(json.loads(f.read()))
    # the third waits for the other two users' applications, named so that it can find them
    # (an audit: "held by app_..." alone, which the waiting user's `yarnapp status` did not know)
    def user(uid):
        import pwd
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"
    assert said == [[[0], [], [], []], [[1], [], [], []],
                    [None, [f"app_1001 ({user(1001)}'s)", f"app_1002 ({user(1002)}'s)"], [], ["gpus"]]], said
    assert leases.Leases(ledger).held() == {"app_1001": {"gpus": [0], "memory": 0},
                                            "app_1002": {"gpus": [1], "memory": 0}}


def test_asking_for_more_gpus_than_the_machine_has_is_refused_at_submit(two_fake_gpus, cli, tmp_path):
    import yaml
    job = tmp_path / "greedy.yaml"
    job.write_text(yaml.safe_dump({"name": "greedy", "run": {"function": "a:b"},
                                   "groups": [{"name": "w", "instances": 3, "gpus": 1}]}))
    proc = cli("submit", str(job))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"Error: {job}: groups[0].gpus: the job asks for 3 GPU(s) in all (3 x 1) but this machine has 2 "
        f"(nvidia-smi); ask for at most 2, set gpus: 0, or submit to a cluster with --backend yarn")
    apps = os.path.join(os.environ["YARNAPP_HOME"], "apps")
    assert not os.path.isdir(apps) or not os.listdir(apps)          # nothing was started


def _second_waits_for_the_first(gpus_each, env=None, third=False):
    """Two applications asking for the same GPUs: the second waits (ACCEPTED, saying
    whose they are) until the first ends, and its ranks start only then."""
    group = {"name": "g", "instances": 1, "gpus": gpus_each, "vcores": 0.5, "memory": "512 MiB",
             "env": dict(env or {})}
    first = _submit("first", [dict(group, env=dict(group["env"], HOLD_S="6"))])
    # its rank holds on 6 s: the GPU is still held when the second asks
    deadline = time.monotonic() + 60
    while first.state != "RUNNING" or not leases.Leases().held():
        assert time.monotonic() < deadline, first.logs()
        time.sleep(0.1)
    second = _submit("second", [group])
    deadline = time.monotonic() + 30
    while True:
        running, st2 = first.state == "RUNNING", second.status()
        if st2["diagnostics"] or not running or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert running, "the first ended before the second's master looked for a GPU"
    assert st2["state"] == "ACCEPTED" and st2["diagnostics"] == f"waiting for {gpus_each} GPU(s): held by {first.app_id}"
    if third:       # a third waits in line after the second; killed there, it ends KILLED, all of it
        third = _submit("third", [group])
        deadline = time.monotonic() + 30
        while not third.status()["diagnostics"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert third.status()["diagnostics"] == (f"waiting for {gpus_each} GPU(s): held by {first.app_id}; in line "
                                                 f"after {second.app_id}, which asked first")
        third.kill()
        st3 = third.wait(timeout=60)
        assert st3["state"] == "KILLED" and [c["state"] for c in st3["containers"]] == ["KILLED"], st3
    st1 = first.wait(timeout=120)
    assert st1["state"] == "SUCCEEDED", first.logs()
    st2 = second.wait(timeout=120)
    assert st2["state"] == "SUCCEEDED", second.logs()
    # the second's ranks started only after the first had ended: never two on one GPU
    assert st2["final"]["started"] >= first.status()["finished"] - 1.0
    for r in (first, second):
        assert_nothing_left(r.app_id)
    return st1, st2


def test_an_application_whose_gpu_another_holds_waits_and_never_shares_it(monkeypatch, yarnapp_home):
    monkeypatch.setenv("YARNAPP_GPUS", "0")                      # one GPU on this machine
    _, st2 = _second_waits_for_the_first(1, third=True)
    assert st2["final"]["visible"] == ["0"]


# The same on a machine with real GPUs (the device tool's): nvidia-smi's inventory, and
# what CUDA finds in each container.
REAL_GPUS = [] if "YARNAPP_GPUS" in os.environ else gpus.inventory()
NO_GPU = "no GPU that nvidia-smi lists here: runs on the GPU machine (the device tool)"


@pytest.mark.skipif(not REAL_GPUS, reason=NO_GPU)
def test_on_real_gpus_each_container_finds_only_its_own_in_cuda(yarnapp_home):
    n = len(REAL_GPUS)
    run = _submit("real", [{"name": "gpu", "instances": n, "gpus": 1, "vcores": 1, "memory": "2 GiB",
                            "env": {"REPORT_CUDA": "1"}},
                           {"name": "cpu", "instances": 1, "vcores": 1, "memory": "2 GiB",
                            "env": {"REPORT_CUDA": "1"}}])
    st = run.wait(timeout=180)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert st["final"]["visible"] == [str(g.index) for g in REAL_GPUS] + [""]
    assert st["final"]["cuda"] == [[g.name] for g in REAL_GPUS] + [[]]
    assert_nothing_left(run.app_id)


@pytest.mark.skipif(not REAL_GPUS, reason=NO_GPU)
def test_on_real_gpus_more_than_there_are_is_refused_and_a_second_application_waits(cli, tmp_path):
    import yaml
    n = len(REAL_GPUS)
    job = tmp_path / "greedy.yaml"
    job.write_text(yaml.safe_dump({"name": "greedy", "run": {"function": "a:b"},
                                   "groups": [{"name": "w", "instances": n + 1, "gpus": 1}]}))
    proc = cli("submit", str(job))
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith(f"but this machine has {n} (nvidia-smi); ask for at most {n}, "
                                        "set gpus: 0, or submit to a cluster with --backend yarn"), proc.stderr
    st1, st2 = _second_waits_for_the_first(n, {"REPORT_CUDA": "1"})
    assert st1["final"]["cuda"] == st2["final"]["cuda"] == [[g.name for g in REAL_GPUS]]


@pytest.mark.skipif(not REAL_GPUS, reason=NO_GPU)
def test_on_real_gpus_an_unmodified_nccl_ddp_script_trains_on_its_containers_gpu(tmp_path, yarnapp_home):
    """The tutorial's GPU script (nccl, set_device(LOCAL_RANK), DDP(device_ids=...)) runs as
    written: LOCAL_RANK names the container's own GPU, whichever the machine gave it."""
    import json
    import torch
    n = len(REAL_GPUS)
    out = tmp_path / "out"
    out.mkdir()
    jobs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
    run = yarnapp.submit({"name": "nccl", "max_restarts": 0,
                          "groups": [{"name": "gpu", "instances": n, "gpus": 1, "vcores": 1, "memory": "4 GiB"}],
                          "run": {"script": os.path.join(jobs, "ddp_train.py"),
                                  "args": ["--out", str(out), "--epochs", "2", "--backend", "nccl"]}})
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    info = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    assert [i["device"] for i in info] == ["cuda:0"] * n         # set_device(LOCAL_RANK): each its own first
    assert [i["env"]["CUDA_VISIBLE_DEVICES"] for i in info] == [str(g.index) for g in REAL_GPUS]
    weights = [torch.load(out / f"rank{r}.pt") for r in range(n)]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights for k in w)
    assert all(torch.isfinite(v).all() for v in weights[0].values())
    assert_nothing_left(run.app_id)


@pytest.mark.skipif(not REAL_GPUS, reason=NO_GPU)
def test_on_real_gpus_a_loop_on_training_dist_with_a_gpu_and_cpu_ranks_clips_the_worlds_gradient(tmp_path,
                                                                                                  yarnapp_home):
    """tests/jobs/user_loop.py with its gradient clipped between backward and step, on one GPU
    rank and two CPU ranks: the sum over the world is finished when backward returns (on
    autograd's device thread for the GPU rank), and every rank ends at one process's weights."""
    import sys
    import torch
    jobs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
    sys.path.insert(0, jobs)
    try:
        import user_loop
        expected = user_loop.reference(steps=20, batch=48, clip=0.05)
    finally:
        sys.path.remove(jobs)
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "SHARES": "equal", "STEPS": "20", "BATCH": "48", "CLIP": "0.05"}
    run = yarnapp.submit({"name": "gpu-loop", "max_restarts": 0,
                          "groups": [{"name": "gpu", "instances": 1, "gpus": 1, "vcores": 1, "memory": "4 GiB",
                                      "env": env},
                                     {"name": "cpu", "instances": 2, "vcores": 1, "memory": "2 GiB", "env": env}],
                          "run": {"function": "user_loop:main", "files": [os.path.join(jobs, "user_loop.py")]}})
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    for r in range(3):
        got = torch.load(out / f"rank{r}.pt")
        worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
        assert worst < 1e-4, (r, worst)
    assert_nothing_left(run.app_id)


def test_a_ledger_this_user_cannot_write_is_refused_at_submit(cli, monkeypatch):
    """Every master failed at its lease (a FileNotFoundError in am.log), both attempts."""
    monkeypatch.setenv("YARNAPP_LEDGER", "/proc/no-such/leases.json")
    hello = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "examples", "hello.yaml")
    proc = cli("submit", hello)
    assert proc.returncode == 1 and proc.stderr == (
        "Error: the local engine's ledger /proc/no-such/leases.json: No such file or directory; set YARNAPP_LEDGER "
        "to a file this user can write\n"), proc.stderr
    apps = os.path.join(os.environ["YARNAPP_HOME"], "apps")
    assert not os.path.isdir(apps) or not os.listdir(apps)


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_ledger_planted_as_a_link_to_another_file_is_refused_and_that_file_left_alone(cli, monkeypatch, tmp_path,
                                                                                         link):
    """Any user may make the shared ledger's folder first: a leases.json linked to a file of
    root's made the engine rewrite it, and chmod it 0666 (a security audit)."""
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    victim.chmod(0o600)
    ledger = tmp_path / "shared" / "leases.json"
    ledger.parent.mkdir()
    (os.symlink if link == "symbolic" else os.link)(victim, ledger)
    monkeypatch.setenv("YARNAPP_LEDGER", str(ledger))
    hello = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "examples", "hello.yaml")
    proc = cli("submit", hello)
    what = "a symbolic link, not a file of its own (remove it)" if link == "symbolic" else \
        "not a file of its own (a link: 2 names; remove it)"
    assert proc.returncode == 1 and proc.stderr == (
        f"Error: the local engine's ledger {ledger}: {what}; set YARNAPP_LEDGER to a file this user can write\n"), \
        proc.stderr
    assert victim.read_text() == "root's own\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    apps = os.path.join(os.environ["YARNAPP_HOME"], "apps")
    assert not os.path.isdir(apps) or not os.listdir(apps)


def test_another_name_of_the_ledger_itself_does_not_stop_the_engines(cli, monkeypatch, tmp_path):
    """The ledger is 0666 (every user's engine writes it), so anyone may hard-link it: a link
    of the ledger itself refused every user's submit (a review)."""
    ledger = tmp_path / "shared" / "leases.json"
    monkeypatch.setenv("YARNAPP_LEDGER", str(ledger))
    leases.Leases().held()                              # made by the first engine
    os.link(ledger, tmp_path / "elsewhere")
    assert leases.Leases().held() == {}
