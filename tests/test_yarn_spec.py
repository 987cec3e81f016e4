"""The YARN backend at its boundary: the generated skein ApplicationSpec, validated by
skein's own model, the shipped environment (a real venv-pack run), and the backend's
refusal to start without Hadoop. The real-cluster test runs only with YARNAPP_TEST_YARN=1."""
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
import skein

import conf
from launcher import identity, keys, results
from launcher.store import FileStore
from yarnapp import packaging
from yarnapp.backends import get as get_backend
from yarnapp.backends.base import TERMINAL
from yarnapp.backends.yarn import YarnBackend, build_spec, check_job, stage_files, warn_small
from yarnapp.backends.yarn_reports import (app_record, app_state, container_record, kv_fields, name_memory_kills,
                                           named_logs, with_ranks)
from yarnapp.errors import BackendUnavailable, YarnappError

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELLO = os.path.join(conf.EXAMPLES_DIR, "hello.yaml")
CONTRACT = ("YARNAPP_BACKEND", "YARNAPP_GROUP", "YARNAPP_JOB", "YARNAPP_SECRET_FILE", "YARNAPP_STORAGE")
SECRET = ".yarnapp-secret"


def three_groups(**environment):
    return conf.load_job({
        "name": "mixed", "queue": "ml", "backend": "yarn", "max_restarts": 2,
        "groups": [
            {"name": "gpu", "instances": 1, "memory": "8 GiB", "vcores": 4, "gpus": 1,
             "node_label": "gpu", "env": {"NCCL_DEBUG": "WARN"}},
            {"name": "cpu", "instances": 2, "memory": "4 GiB", "vcores": 2,
             "env": {"OMP_PROC_BIND": "close"}},
            {"name": "edge", "instances": 3, "memory": 1536, "vcores": 1, "node_label": "edge"},
        ],
        "run": {"function": "training.hello:main"},
        "tensorboard": {"service": True},
        "environment": {"packer": "none", **environment},
    })


def assert_skein_round_trips(spec):
    """What skein itself would accept: YAML, JSON and the protobuf Client.submit sends."""
    assert skein.ApplicationSpec.from_yaml(spec.to_yaml()).to_dict() == spec.to_dict()
    assert skein.ApplicationSpec.from_json(spec.to_json()).to_dict() == spec.to_dict()
    # skein 0.8.2's from_protobuf clamps max_attempts with min(1, n) (it meant max), so
    # compare that field on the protobuf Client.submit sends, and the rest after the trip.
    proto = spec.to_protobuf()
    assert proto.max_attempts == spec.max_attempts
    assert skein.ApplicationSpec.from_protobuf(proto).to_dict() == dict(spec.to_dict(), max_attempts=1)


def test_spec_for_three_unequal_groups_with_cluster_python(tmp_path):
    job = three_groups()
    files = stage_files(job, str(tmp_path))
    assert set(files) == {"job.json", SECRET}          # packer: none ships no environment
    assert files["job.json"].type == skein.FileType.FILE
    assert files["job.json"].source == f"file://{tmp_path}/job.json"
    with open(tmp_path / "job.json") as f:
        assert conf.load_job(json.load(f)) == job       # what the container reloads is the job

    spec = build_spec(job, files, user="alice", storage="webhdfs://nn:9870/user/alice/.yarnapp")
    assert isinstance(spec, skein.ApplicationSpec)
    assert (spec.name, spec.queue, spec.tags) == ("mixed", "ml", {"yarnapp"})
    assert list(spec.services) == ["gpu", "cpu", "edge", "tensorboard"]
    # Owner-only ACLs: only the submitting user may view or modify it.
    assert spec.acls.enable is True
    assert (spec.acls.view_users, spec.acls.modify_users, spec.acls.ui_users) == (["alice"], ["alice"], ["alice"])
    assert (spec.acls.view_groups, spec.acls.modify_groups) == ([], [])

    expected = {"gpu": (8192, 4, 1, 1, "gpu"), "cpu": (4096, 2, 0, 2, ""), "edge": (1536, 1, 0, 3, "edge")}
    for name, (memory, vcores, gpus, instances, label) in expected.items():
        svc = spec.services[name]
        r = svc.resources
        assert (r.memory, r.vcores, r.gpus) == (memory, vcores, gpus)
        assert type(r.vcores) is int
        assert (svc.instances, svc.node_label, svc.max_restarts) == (instances, label, 2)
        assert svc.allow_failures is False
        assert {k: svc.env[k] for k in CONTRACT} == {
            "YARNAPP_BACKEND": "yarn", "YARNAPP_GROUP": name, "YARNAPP_JOB": "job.json",
            "YARNAPP_SECRET_FILE": SECRET, "YARNAPP_STORAGE": "webhdfs://nn:9870/user/alice/.yarnapp"}
        assert "YARNAPP_SECRET" not in svc.env          # YARN shows the environment to viewers
        assert svc.env["YARNAPP_CODE"] == identity.code() == f"{identity.code().split()[0]} {ROOT}"  # checked there
        assert set(svc.files) == {"job.json", SECRET}
        assert svc.files["job.json"].type == skein.FileType.FILE
        assert svc.files[SECRET].source == f"file://{tmp_path}/{SECRET}"
        assert svc.script.rstrip().splitlines()[-1] == "exec python3 -m launcher.agent"
        assert "environment/" not in svc.script
    assert spec.services["gpu"].env["NCCL_DEBUG"] == "WARN"
    assert spec.services["cpu"].env["OMP_PROC_BIND"] == "close"
    assert "NCCL_DEBUG" not in spec.services["cpu"].env

    # One secret per application, in a file only its owner reads, never in the spec.
    secret = (tmp_path / SECRET).read_text()
    assert len(secret) == 32 and int(secret, 16) >= 0
    assert os.stat(tmp_path / SECRET).st_mode & 0o777 == 0o600
    assert secret not in spec.to_yaml()
    other = tmp_path / "again"
    other.mkdir()
    stage_files(job, str(other))
    assert (other / SECRET).read_text() != secret

    tb = spec.services["tensorboard"]
    assert tb.instances == 1 and tb.allow_failures is True
    assert tb.resources.vcores == 1 and tb.resources.gpus == 0
    assert tb.script.rstrip().splitlines()[-1] == "exec python3 -m launcher.tensorboard_service"
    assert tb.env["YARNAPP_SECRET_FILE"] == SECRET and "YARNAPP_GROUP" not in tb.env

    shared = conf.load_job({**job.model_dump(mode="json"), "yarn": {"acls": {
        "view_users": ["bob"], "modify_users": ["carol"], "view_groups": ["ml"]}}})
    a = build_spec(shared, files, user="alice").acls
    assert (a.view_users, a.modify_users, a.view_groups) == (["alice", "bob", "carol"], ["alice", "carol"], ["ml"])
    assert build_spec(conf.load_job({**job.model_dump(mode="json"), "yarn": {"acls": {"enable": False}}}),
                      files).acls.enable is False
    assert_skein_round_trips(spec)


def test_spec_ships_a_ready_archive_as_environment(tmp_path):
    archive = tmp_path / "team-env.tar.gz"
    archive.write_bytes(b"not unpacked by this test")
    job = three_groups(archive=str(archive))
    spec = build_spec(job, stage_files(job, str(tmp_path)))
    for name in ("gpu", "cpu", "edge", "tensorboard"):
        files = spec.services[name].files
        assert set(files) == {"job.json", SECRET, "environment"}
        assert files["environment"].type == skein.FileType.ARCHIVE
        assert files["environment"].source == f"file://{archive}"
        assert files["job.json"].type == skein.FileType.FILE
    assert spec.services["cpu"].script.rstrip().splitlines()[-1] == \
        "exec environment/bin/python -m launcher.agent"
    assert_skein_round_trips(spec)

    remote = three_groups(archive="hdfs:///envs/team.tar.gz")   # a URI is referenced in place
    files = stage_files(remote, str(tmp_path))
    assert files["environment"].source == "hdfs:///envs/team.tar.gz"
    assert files["environment"].type == skein.FileType.ARCHIVE


def test_container_script_runs_the_agent_from_the_environment(tmp_path):
    """Run the generated script with bash as a container would: cwd holds the localized files."""
    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"")
    job = three_groups(archive=str(archive))
    svc = build_spec(job, stage_files(job, str(tmp_path))).services["cpu"]
    work = tmp_path / "container"
    (work / "environment" / "bin").mkdir(parents=True)
    fake_python = work / "environment" / "bin" / "python"
    fake_python.write_text('#!/bin/sh\necho "argv: $*"\necho "group: $YARNAPP_GROUP job: $YARNAPP_JOB"\n'
                           'echo "path0: ${PATH%%:*}"\n')
    fake_python.chmod(0o755)
    env = {**os.environ, **svc.env, "SKEIN_CONTAINER_ID": "cpu_1", "CONTAINER_ID": "container_1_0001_01_000003"}
    out = subprocess.run(["bash", "-c", svc.script], cwd=work, env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "yarnapp container cpu_1 (YARN container_1_0001_01_000003)",
        "argv: -m launcher.agent",
        "group: cpu job: job.json",
        f"path0: {work}/environment/bin"]


def test_fractional_vcores_are_refused_naming_the_field(tmp_path):
    job = conf.load_job(HELLO)                          # small: vcores 0.5 (fine on the local engine)
    with pytest.raises(YarnappError) as e:
        build_spec(job, {"job.json": str(tmp_path / "job.json"), SECRET: str(tmp_path / SECRET)})
    assert str(e.value) == "groups[1].vcores: YARN allocates whole vcores; got 0.5 — use an integer"
    with pytest.raises(YarnappError, match=r"^hello.yaml: groups\[1\]\.vcores: "):
        check_job(job, where="hello.yaml")


def test_names_and_env_the_contract_owns_are_refused():
    job = three_groups()
    with pytest.raises(YarnappError, match=r"^job: groups\[0\]\.name: 'tensorboard' names the TensorBoard"):
        conf.load_job({**job.model_dump(mode="json"), "groups": [{**job.groups[0].model_dump(), "name": "tensorboard"}]})
    clash = conf.load_job({**job.model_dump(mode="json"),
                           "groups": [{**job.groups[0].model_dump(), "env": {"YARNAPP_SECRET": "x"}}]})
    with pytest.raises(YarnappError, match=r"^groups\[0\]\.env\.YARNAPP_SECRET: set by yarnapp"):
        check_job(clash)


def test_a_container_smaller_than_an_agent_and_its_rank_is_warned_of(caplog):
    """hello-yarn's 512 MiB containers: rank 0 peaked at 666 MiB (the agent and a rank with
    torch, both counted by the NodeManager), which killed it once its memory check ran."""
    import logging
    job = conf.load_job({"name": "x", "backend": "yarn", "run": {"function": "training.hello:main"},
                         "groups": [{"name": "w", "instances": 1, "vcores": 1, "memory": "1 GiB"},
                                    {"name": "v", "instances": 1, "vcores": 1, "memory": "512 MiB"}]})
    with caplog.at_level(logging.WARNING, logger="yarnapp.backends.yarn"):
        check_job(job, where="job.yaml")            # refusals only: a job refused is its one line
        assert caplog.records == []
        warn_small(job, where="job.yaml")
    assert [r.getMessage() for r in caplog.records] == [
        "job.yaml: groups[1].memory: 512 MiB: on YARN a container's agent and its rank (torch) hold about 700 MiB "
        "before any model or data, and the NodeManager kills a container over its memory (it counts both "
        "processes); give it 1 GiB or more"]


@pytest.mark.skipif(shutil.which("yarn") is not None, reason="this machine has a YARN client")
def test_backend_without_hadoop_is_unavailable_with_one_clear_line():
    skein_dir_existed = os.path.exists(skein.properties.config_dir)
    for make in (YarnBackend, lambda: get_backend("yarn")):
        with pytest.raises(BackendUnavailable) as e:
            make()
        msg = str(e.value)
        assert "\n" not in msg
        assert "no `yarn` command on PATH" in msg and "backend: local" in msg
    assert os.path.exists(skein.properties.config_dir) == skein_dir_existed   # no driver, no credentials made


def test_a_resourcemanager_that_is_down_is_one_line_not_a_silent_wait(tmp_path, monkeypatch):
    """`yarnapp list --backend yarn` with the local Hadoop stopped printed nothing for 100 s:
    skein's driver retried the ResourceManager as Hadoop's client does (15 minutes). The
    client now tries the address of yarn-site.xml first, with a real socket."""
    import socket

    from yarnapp.backends.yarn_cluster import resourcemanager_unreachable
    monkeypatch.delenv("HADOOP_CONF_DIR", raising=False)
    assert resourcemanager_unreachable() is None                       # no configuration: not checked
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    up = listening.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    down = closed.getsockname()[1]          # bound, never listening: refused
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))

    def site(*props):
        (tmp_path / "yarn-site.xml").write_text("<configuration>" + "".join(
            f"<property><name>{k}</name><value>{v}</value></property>" for k, v in props) + "</configuration>")
    try:
        site(("yarn.resourcemanager.address", f"127.0.0.1:{up}"))
        assert resourcemanager_unreachable() is None
        site(("yarn.resourcemanager.hostname", "127.0.0.1"),
             ("yarn.resourcemanager.address", f"${{yarn.resourcemanager.hostname}}:{down}"))
        assert resourcemanager_unreachable() == (
            f"cannot reach YARN's ResourceManager at 127.0.0.1:{down} (yarn.resourcemanager.address in "
            f"{tmp_path}/yarn-site.xml): Connection refused; is it running? (the local one: `yarnapp hadoop status`)")
        site(("yarn.resourcemanager.ha.enabled", "true"), ("yarn.resourcemanager.address", f"127.0.0.1:{down}"))
        assert resourcemanager_unreachable() is None                   # HA: the client tries each one
        backend = YarnBackend.__new__(YarnBackend)     # past the prerequisites (no `yarn` here), no client yet
        backend._client = None
        site(("yarn.resourcemanager.address", f"127.0.0.1:{down}"))
        with pytest.raises(BackendUnavailable, match=r"^YARN backend unavailable: cannot reach YARN's "):
            backend.client
    finally:
        listening.close()
        closed.close()


def _report(state, final="UNDEFINED", diagnostics=""):
    usage = skein.model.ResourceUsageReport(memory_seconds=0, vcore_seconds=0, num_used_containers=0,
                                            needed_resources=skein.Resources(0, 0),
                                            reserved_resources=skein.Resources(0, 0),
                                            used_resources=skein.Resources(0, 0))
    return skein.model.ApplicationReport(
        id="application_1_0007", name="mixed", user="u", queue="ml", tags={"yarnapp"}, host="", port=0,
        tracking_url="", state=state, final_status=final, progress=0.1, usage=usage,
        diagnostics=diagnostics, start_time=datetime.datetime(2024, 5, 1, 12, 0), finish_time=None)


def test_skein_reports_become_backend_records():
    assert app_state(_report("ACCEPTED")) == "NEW"
    assert app_state(_report("RUNNING")) == "RUNNING"
    assert app_state(_report("FINISHED", "SUCCEEDED")) == "SUCCEEDED"
    assert app_state(_report("FINISHED", "FAILED")) == "FAILED"
    assert app_state(_report("FINISHED", "UNDEFINED")) == "FAILED"
    assert app_state(_report("KILLED", "KILLED")) == "KILLED"
    rec = app_record(_report("FAILED", "FAILED", "cpu_1 failed"))
    assert (rec["app_id"], rec["name"], rec["state"], rec["diagnostics"]) == \
        ("application_1_0007", "mixed", "FAILED", "cpu_1 failed")
    assert rec["submitted"] == datetime.datetime(2024, 5, 1, 12, 0).timestamp()
    java = ("Failure in container allocator:\nInvalid resource request, node label not enabled but request contains "
            "label expression\n\tat org.apache.hadoop.yarn.server.resourcemanager.scheduler.SchedulerUtils.normalize"
            "AndValidateRequest(SchedulerUtils.java:289)\n\tat org.apache.hadoop.Foo.bar(Foo.java:1)\n\t... 9 more\n")
    assert app_record(_report("FAILED", "FAILED", java))["diagnostics"] == (       # its message, not its 24 frames
        "Failure in container allocator: Invalid resource request, node label not enabled but request contains "
        "label expression")

    c = skein.model.Container(service_name="cpu", instance=1, state="FAILED",
                              yarn_container_id="container_1_0007_01_000003",
                              yarn_node_http_address="node3:8042", start_time=None, finish_time=None,
                              exit_message="Exception from container-launch.\nExit code: 137")
    rec = container_record(c)
    assert (rec["id"], rec["group"], rec["instance"], rec["state"], rec["exit_code"]) == \
        ("cpu_1", "cpu", 1, "FAILED", 137)
    assert rec["exit"] == "exited with status 137 (signal 9)"        # launcher.exitcodes says what it means
    for code, text in ((-102, "preempted by the scheduler (PREEMPTED, exit -102)"),
                       (3, "ended because the application failed elsewhere (exit 3)")):
        assert container_record(skein.model.Container(
            service_name="cpu", instance=1, state="FAILED", yarn_container_id="c", yarn_node_http_address="n:1",
            start_time=None, finish_time=None, exit_message=f"Exit code: {code}"))["exit"] == text
    assert rec["log"].startswith("node3:8042/node/containerlogs/container_1_0007_01_000003/")

    # The NodeManager's words for a container over its memory (Hadoop 3.4's ContainersMonitorImpl).
    c = skein.model.Container(service_name="cpu", instance=0, state="FAILED",
                              yarn_container_id="container_1_0007_01_000002",
                              yarn_node_http_address="node3:8042", start_time=None, finish_time=None,
                              exit_message="Container [pid=4242,containerID=container_1_0007_01_000002] is running "
                              "12582912B beyond the 'PHYSICAL' memory limit. Current usage: 524.0 MB of 512 MB "
                              "physical memory used; 2.6 GB of 1.0 GB virtual memory used. Killing container.\n"
                              "Container killed on request. Exit code is 143")
    rec = container_record(c)
    assert rec["memory_kill"] == rec["diagnostics"] == \
        "cpu_0 exceeded its memory limit of 512 MiB (peak 524 MiB): raise the memory of group cpu"
    running = {"containers": [rec, container_record(skein.model.Container(
        service_name="cpu", instance=1, state="RUNNING", yarn_container_id="container_1_0007_01_000003",
        yarn_node_http_address="node3:8042", start_time=None, finish_time=None, exit_message=""))],
        "restarts": [{"generation": 1, "reason": "lost cpu_0: its container exited"},
                     {"generation": 2, "reason": "lost cpu_1: its container exited"}], "failure": None}
    assert [r["reason"] for r in name_memory_kills(running)["restarts"]] == \
        [rec["memory_kill"], "lost cpu_1: its container exited"]

    logs = skein.model.ApplicationLogs("application_1_0007", {
        "container_1_0007_01_000001": "LogType:application.master.log\nstarted",
        "container_1_0007_01_000002": "LogType:gpu.log\nyarnapp container gpu_0 (YARN x)\nrank 0",
        "container_1_0007_01_000003": "LogType:cpu.log\nyarnapp container cpu_1 (YARN y)\nboom"})
    named = named_logs(logs)
    assert set(named) == {"master", "gpu_0", "cpu_1"}
    assert named["cpu_1"].endswith("boom")


def test_running_application_fields_come_from_the_coordination_keys(tmp_path):
    """status() reads these through skein's kv; FileStore answers get/get_prefix the same way."""
    store = FileStore(str(tmp_path / "store"))
    store.put(keys.progress(1), json.dumps({"step": 7}))
    store.put(keys.restart(0), json.dumps({"generation": 0, "reason": "rank 1 exited 1"}))
    store.put(keys.formed(0), json.dumps({"seconds": 3.5, "time": 1000.5}))
    store.put(keys.formed(1), json.dumps({"seconds": 1.25, "time": 1200.0}))
    store.put(keys.TENSORBOARD, "http://node1:6006")
    for slot, engine_id, rank in (("big_0", "big_0", 0), ("small_0", "small_2", 1)):    # small_2 replaced small_0
        store.put(keys.beat(slot), json.dumps({"incarnation": "i", "group": slot[:-2], "rank": rank,
                                               "engine_id": engine_id, "n": 3}))
    for rank, n, text, t in ((1, 0, "rank 1 is slow", 7.0), (0, 0, "data warning", 5.0), (2, 0, "data warning", 6.0)):
        store.put(keys.notice(0, rank, n), json.dumps({"rank": rank, "generation": 0, "time": t, "text": text}))
    fields = kv_fields(store)
    ranks = {"big_0": {"rank": 0, "slot": "big_0"}, "small_2": {"rank": 1, "slot": "small_0"}}
    notices = [{"text": "data warning", "ranks": [0, 2], "generation": 0, "time": 5.0},     # one per text, oldest first
               {"text": "rank 1 is slow", "ranks": [1], "generation": 0, "time": 7.0}]
    assert fields == {"progress": {1: {"step": 7}}, "restarts": [{"generation": 0, "reason": "rank 1 exited 1"}],
                      "final": None, "failure": None, "tensorboard": "http://node1:6006",
                      "world_formed_time": 1000.5, "ranks": ranks, "notices": notices}   # world: submit -> formed
    assert results.collect(store)["notices"] == notices
    said = results.from_diagnostics(results.diagnostics(results.collect(store)))     # what YARN keeps after the end
    assert said["notices"] == notices
    containers = [{"id": i, "rank": None} for i in ("big_0", "small_1", "small_2")]
    assert with_ranks({"containers": containers, "ranks": ranks})["containers"] == [
        {"id": "big_0", "rank": 0}, {"id": "small_1", "rank": None}, {"id": "small_2", "rank": 1, "slot": "small_0"}]
    store.put(keys.FINAL, json.dumps({"accuracy": 0.9}))
    store.put(keys.FAILED, json.dumps({"reason": "rank 2 exited 1", "container": "edge_0"}))
    fields = kv_fields(store)
    assert fields["final"] == {"accuracy": 0.9} and fields["failure"]["container"] == "edge_0"


def _venv(path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    (site,) = (path / "lib").glob("python*/site-packages")
    return site


def _fake_dist(site, name, version, direct_url=None):
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{name}-{version}.dist-info/METADATA,,\n")
    if direct_url:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_venv_pack_packs_a_real_venv_once_per_content(tmp_path):
    venv, cache = tmp_path / "env", tmp_path / "cache"
    site = _venv(venv)
    t0 = time.monotonic()
    path = packaging.pack_venv(str(venv), cache=str(cache))
    assert time.monotonic() - t0 < 20
    assert path.startswith(str(cache)) and path.endswith(".tar.gz")
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    assert "bin/python" in names and "pyvenv.cfg" in names
    assert os.listdir(cache) == [os.path.basename(path)]   # no temporary left behind

    mtime = os.path.getmtime(path)
    assert packaging.pack_venv(str(venv), cache=str(cache)) == path   # unchanged: cached
    assert os.path.getmtime(path) == mtime

    _fake_dist(site, "extra", "1.0")                       # installing something repacks
    again = packaging.pack_venv(str(venv), cache=str(cache))
    assert again != path and os.path.isfile(again)

    _fake_dist(site, "yarnapp", "0.1.0", {"url": "file:///src/yarnapp", "dir_info": {"editable": True}})
    with pytest.raises(YarnappError, match=r"editable installs .*yarnapp from file:///src/yarnapp.*pip install \."):
        packaging.pack_venv(str(venv), cache=str(cache))


def test_packing_failures_say_what_to_do(tmp_path):
    with pytest.raises(YarnappError, match=r"is not a virtual environment .*environment\.archive"):
        packaging.pack_venv(str(tmp_path), cache=str(tmp_path / "c"))
    with pytest.raises(YarnappError, match=r"is not a conda environment"):
        packaging.pack_conda(str(tmp_path), cache=str(tmp_path / "c"))
    with pytest.raises(YarnappError, match=r"^environment\.archive: no such file"):
        packaging.ready_archive(str(tmp_path / "missing.tar.gz"))
    with pytest.raises(YarnappError, match=r"^environment\.archive: YARN unpacks only"):
        packaging.ready_archive("hdfs:///envs/env.7z")
    if sys.prefix == sys.base_prefix:                      # this interpreter is no venv: say so
        with pytest.raises(YarnappError) as e:
            packaging.environment_archive(conf.load_job(HELLO).environment)   # default packer: venv-pack
        assert "is not one" in str(e.value) and "environment.archive" in str(e.value) \
            and "packer: none" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.yarn
@pytest.mark.skipif(os.environ.get("YARNAPP_TEST_YARN") != "1", reason="set YARNAPP_TEST_YARN=1 to use a real cluster")
def test_hello_on_a_real_cluster():
    """hello.yaml on YARN. Its 0.5-vcore group is raised to 1 (YARN allocates whole vcores).
    The environment is YARNAPP_TEST_ENV_ARCHIVE when set, else this venv packed by venv-pack."""
    raw = conf.resolve(conf.load_job(HELLO).model_dump(mode="json"))
    raw["backend"] = "yarn"
    raw["groups"] = [{**g, "vcores": 1} for g in raw["groups"]]
    if os.environ.get("YARNAPP_TEST_ENV_ARCHIVE"):
        raw["environment"]["archive"] = os.environ["YARNAPP_TEST_ENV_ARCHIVE"]
    backend = get_backend("yarn")
    app_id = backend.submit(conf.load_job(raw))
    deadline = time.monotonic() + 600
    while (st := backend.status(app_id))["state"] not in TERMINAL:
        assert time.monotonic() < deadline, f"{app_id} still {st['state']} after 600 s"
        time.sleep(2)
    logs = backend.logs(app_id)
    assert st["state"] == "SUCCEEDED", (st["diagnostics"], logs)
    assert {"big_0", "small_0", "small_1"} <= set(logs)


def test_logs_follow_prints_a_real_log_from_its_first_byte_after_a_placeholder():
    from yarnapp.logview import follow_increment
    placeholder = "(still running: YARN serves this log at http://node:8042/...)\n"
    real = "yarnapp container w_0 (YARN c_1)\nfirst line\n"
    assert follow_increment("", placeholder) == placeholder
    assert follow_increment(placeholder, real) == real          # was real[len(placeholder):]: nothing
    assert follow_increment(real, real + "more\n") == "more\n"
    assert follow_increment(real + "more\n", real + "more\n") == ""


def test_yarn_logs_output_becomes_logs_per_container():
    from yarnapp.backends.yarn_cluster import parse_yarn_logs
    text = ("Container: container_1_0001_01_000002 on host_1\nLogAggregationType: AGGREGATED\n====\n"
            "LogType:w.log\nLogLastModifiedTime:Mon\nLogLength:20\nLogContents:\nyarnapp container w_0 (YARN x)\n"
            "line two\nEnd of LogType:w.log\n*****\n\n"
            "Container: container_1_0001_01_000001 on host_1\n====\n"
            "LogType:application.master.log\nLogContents:\nStarting Skein\nEnd of LogType:application.master.log\n")
    logs = parse_yarn_logs(text)
    assert logs == {"container_1_0001_01_000002": "LogType:w.log\nyarnapp container w_0 (YARN x)\nline two",
                    "container_1_0001_01_000001": "LogType:application.master.log\nStarting Skein"}
    assert named_logs(logs) == {"w_0": logs["container_1_0001_01_000002"],
                                "master": logs["container_1_0001_01_000001"]}


def test_the_default_filesystem_as_python_opens_it(monkeypatch):
    from yarnapp.backends import yarn_cluster as yc
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    monkeypatch.delenv("HADOOP_HOME", raising=False)
    monkeypatch.setattr(yc.ctypes.util, "find_library", lambda name: None)   # libhdfs: not here
    conf_ = {"fs.defaultFS": "hdfs://nn.example:8020", "dfs.namenode.http-address": "0.0.0.0:9870"}
    assert yc.default_fs_uri(conf_) == "webhdfs://nn.example:9870"
    assert yc.default_storage("alice", conf_) == "webhdfs://nn.example:9870/user/alice/.yarnapp"
    assert yc.python_uri("hdfs://nn.example:8020/user/alice/.skein/x/job.json", conf_) == \
        "webhdfs://nn.example:9870/user/alice/.skein/x/job.json"
    assert yc.python_uri("s3://bucket/x", conf_) == "s3://bucket/x"
    assert yc.default_fs_uri({"fs.defaultFS": "s3a://bucket/"}) == "s3a://bucket"
    assert yc.default_fs_uri({}) is None and yc.default_storage("alice", {}) is None
    monkeypatch.setattr(yc.ctypes.util, "find_library", lambda name: "libhdfs.so")   # where it loads
    assert yc.default_fs_uri(conf_) == "hdfs://nn.example:8020"


def test_hadoop_conf_is_read_from_hadoop_conf_dir(tmp_path, monkeypatch):
    from yarnapp.backends import yarn_cluster as yc
    (tmp_path / "core-site.xml").write_text(
        "<configuration><property><name>fs.defaultFS</name><value> hdfs://nn:8020 </value></property>"
        "</configuration>")
    (tmp_path / "hdfs-site.xml").write_text("<configuration><broken")
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    assert yc.hadoop_conf() == {"fs.defaultFS": "hdfs://nn:8020"}
    monkeypatch.delenv("HADOOP_CONF_DIR")
    assert yc.hadoop_conf() == {}


def test_dry_run_without_a_cluster_starts_and_packs_nothing(tmp_path, monkeypatch, caplog):
    from yarnapp.backends.yarn import dry_run
    monkeypatch.delenv("HADOOP_CONF_DIR", raising=False)
    monkeypatch.setenv("YARNAPP_HOME", str(tmp_path / "home"))
    job = three_groups()
    with caplog.at_level("WARNING"):
        spec = skein.ApplicationSpec.from_yaml(dry_run(job))
    assert "YARNAPP_STORAGE" not in spec.services["cpu"].env          # no default filesystem known
    assert "checkpoint.uri is unset and no Hadoop configuration" in caplog.text
    staged = spec.services["cpu"].files["job.json"].source[len("file://"):]
    assert not os.path.exists(os.path.dirname(staged))                 # the staging directory is gone
    assert not os.path.exists(tmp_path / "home")                       # nothing packed or cached
    with pytest.raises(ValueError, match="'.yarnapp-secret'"):
        build_spec(job, {"job.json": "/x/job.json"})


def test_results_survive_in_one_line_of_diagnostics(tmp_path):
    from launcher import results
    store = FileStore(str(tmp_path / "store"))
    store.put(keys.FINAL, json.dumps({"accuracy": 0.98}))
    store.put(keys.formed(0), json.dumps({"time": 100.0}))
    store.put(keys.restart(1), json.dumps({"generation": 1, "reason": "lost w_1", "log_tail": "x" * 5000}))
    store.put(keys.progress(1), json.dumps({"step": 9, "memory_peak_mib": 300}))
    for n in range(12):       # warnings of 12 ranks, the last one long: the diagnostics keep 10, each cut
        store.put(keys.notice(0, n, 0), json.dumps({"rank": n, "generation": 0, "time": n, "text": f"w{n}" * 200}))
    got = results.collect(store)
    notices = got.pop("notices")
    assert got == {"final": {"accuracy": 0.98}, "failure": None, "world_formed_time": 100.0,
                   "restarts": [{"generation": 1, "reason": "lost w_1", "log_tail": "x" * 5000}],
                   "progress": {1: {"step": 9, "memory_peak_mib": 300}}}         # result.json's alone
    assert [n["text"] for n in notices] == [f"w{n}" * 200 for n in range(12)]
    got["notices"] = notices
    line = results.diagnostics({**got, "state": "SUCCEEDED"})
    assert "\n" not in line and "log_tail" not in line and "progress" not in line and len(line) < 5000
    assert results.from_diagnostics(f"some text\n{line}")["restarts"] == [{"generation": 1, "reason": "lost w_1"}]
    assert [n["text"] for n in results.from_diagnostics(line)["notices"]] == [
        (f"w{n}" * 200)[:results.NOTICE_CHARS] for n in range(results.NOTICES_KEPT)]
    assert results.from_diagnostics("Application killed by user.") is None
    # which master attempt a container is of: the first reads no earlier attempt's results
    assert [results.master_attempt(c) for c in ("container_1795852724187_0012_02_000002",
                                                "container_e17_1795852724187_0012_01_000001", "")] == [2, 1, None]
    assert results.from_diagnostics(results.DIAGNOSTICS_PREFIX + "{not json") is None
    results.write(str(tmp_path / "app"), got)
    assert results.read(str(tmp_path / "app")) == {**got, "progress": {"1": {"step": 9, "memory_peak_mib": 300}}}


def test_a_proxied_page_is_signed_in_where_the_clusters_web_uis_refuse_anonymous_requests():
    """The TensorBoard URL `status` printed for the local Hadoop answered 401 (its web UIs take
    who asks from ?user.name= and refuse anonymous requests); with Kerberos the browser signs in."""
    from yarnapp.backends.yarn_cluster import signed_in
    simple = {"hadoop.http.authentication.type": "simple",
              "hadoop.http.authentication.simple.anonymous.allowed": "false"}
    assert signed_in("ann", simple) == "?user.name=ann"
    assert signed_in("ann", {**simple, "hadoop.http.authentication.simple.anonymous.allowed": "true"}) == ""
    assert signed_in("ann", {"hadoop.http.authentication.type": "kerberos"}) == ""
    assert signed_in("ann", {}) == ""


def test_a_running_containers_log_is_the_log_alone_not_the_nodemanagers_page():
    """`logs --follow` prints what is new after what it printed: the page's header and footer
    (LogLength grows) made it print all of it again at every look. With rolling log
    aggregation the page goes on, after the footer, with the copy aggregated so far."""
    from yarnapp.backends.yarn_cluster import log_contents
    page = (b"Container: container_1_0001_01_000002 on host_1\nLogAggregationType: LOCAL\n====\n"
            b"LogType:w.log\nLogLastModifiedTime:Sun Nov 29\nLogLength:14\nLogContents:\nstep 1\nstep 2\n"
            b"End of LogType:w.log.This log file belongs to a running container (c) and so may not be complete.\n"
            b"****\n\nContainer: container_1_0001_01_000002 on host_1\nLogAggregationType: AGGREGATED\n"
            b"LogType:w.log\nLogLength:7\nLogContents:\nstep 1\nEnd of LogType:w.log\n")
    assert log_contents(page) == b"step 1\nstep 2\n"
    assert log_contents(page.replace(b"LogLength:14\n", b"")) == b"step 1\nstep 2\n"     # by its footer
    assert log_contents(b"(a page of another kind)") == b"(a page of another kind)"


def test_a_nodemanagers_memory_kill_is_named_from_its_words_or_skeins():
    """The NodeManager's diagnostics of a container's exit, its exit status alone, and skein's
    master's log line ("FAILED: w_0 - 1.6 GB of 512 MB physical memory used"), each named as
    the local engine names a memory kill; any other failure is not one."""
    from launcher.memory import yarn_memory_kill
    nm = ("Container [pid=21291,containerID=container_1_0001_01_000002] is running 1221967872B beyond the "
          "'PHYSICAL' memory limit. Current usage: 1.6 GB of 512 MB physical memory used; 2.9 GB of 1.0 GB "
          "virtual memory used. Killing container.")
    said = "w_0 exceeded its memory limit of 512 MiB (peak 1638 MiB): raise the memory of group w"
    assert yarn_memory_kill(nm, -104, "w_0", "w") == said
    assert yarn_memory_kill("1.6 GB of 512 MB physical memory used", None, "w_0", "w") == said
    assert yarn_memory_kill("", -104, "w_0", "w") == "w_0 exceeded its memory limit: raise the memory of group w"
    assert yarn_memory_kill("Exception from container-launch. Exit code: 1", 1, "w_0", "w") is None


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/memory"),
                    reason="needs root and cgroup v1's memory controller")
def test_only_a_memory_cgroup_with_a_limit_is_taken_for_the_containers(tmp_path):
    """On YARN without cgroups enforcement a rank's memory cgroup is the host's or a
    session's: its peaks were every process's there (status said a 1 GiB container peaked at
    2679 MiB), and its OOM kills anybody's. A cgroup without a limit is not the container's."""
    from launcher import memory
    d = os.path.join(memory.ROOT, f"yarnapp-test-{os.getpid()}")
    os.mkdir(d)
    try:
        proc = tmp_path / "cgroup"
        proc.write_text(f"12:cpu,cpuacct:/elsewhere\n4:memory:/{os.path.basename(d)}\n")
        assert memory.own_cgroup(str(proc)) is None
        with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 * 2**20))
        assert memory.own_cgroup(str(proc)) == d
    finally:
        os.rmdir(d)


def test_a_sigterm_is_a_memory_stop_only_above_the_containers_allocation(monkeypatch, tmp_path):
    """A preempted container holding more than its group asked, but within what YARN allocated
    (the request rounded up to the scheduler's minimum allocation), was stopped by the resource
    manager, not for its memory: counted as a memory kill, two preemptions would fail the job.
    The client passes the rounding from its yarn-site.xml to the containers."""
    from launcher.memory import stopped_for_memory
    mib = 2**20
    assert stopped_for_memory(700 * mib, 512, 1) is None                     # 512 MiB allocated as 1024
    assert stopped_for_memory(1100 * mib, 512, 1) == ("was stopped by YARN holding 1100 MiB, above its memory of "
                                                      "512 MiB (the NodeManager's memory check): raise groups[1].memory")
    assert stopped_for_memory(700 * mib, 512, 1, step_mib=64).startswith("was stopped by YARN holding 700 MiB")
    assert stopped_for_memory(None, 512, 1) is None
    (tmp_path / "yarn-site.xml").write_text("<configuration><property><name>yarn.scheduler.minimum-allocation-mb"
                                            "</name><value>256</value></property></configuration>")
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    from yarnapp.backends import yarn
    with yarn.prepared(three_groups(packer="none"), pack=False) as (spec, _):
        assert {s.env.get("YARNAPP_MEMORY_STEP_MB") for s in spec.services.values() if "YARNAPP_GROUP" in s.env} \
            == {"256"}


def test_a_rank_stopped_between_two_samples_is_counted_at_its_own_peak():
    """The tracker's run: a rank grew to 900 MiB and YARN's NodeManager (it looks every 3 s)
    stopped its container with SIGTERM before the agent's once-a-second sample saw it; the
    rank was gone when the agent looked, the container was taken for a preempted one (no
    restart spent) and the job ran 4 attempts, not 2. The agent now reaps the ended rank and
    counts its own peak (wait4's, not the largest of every child reaped before: a bigger one
    was) with what the rest of the container holds. Played in a fresh interpreter, the agent's
    place: a pytest worker's own children (other tests' processes) would count in its tree."""
    script = '''if True:
        import json, os, subprocess, sys, time
        from launcher.agent import RANK_END_WAIT_S
        from launcher.memory import Held
        from launcher.procs import resident_bytes
        mib = 2**20

        def grown(size_mib, on_term="None"):
            p = subprocess.Popen([sys.executable, "-c", f"import signal, time\\nx = bytearray({size_mib} * 2**20)\\n"
                                  "for i in range(0, len(x), 4096):\\n    x[i] = 1\\n"
                                  f"signal.signal(signal.SIGTERM, lambda *a: {on_term})\\n"
                                  "print('grown', flush=True)\\ntime.sleep(60)\\n"], stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline() == "grown\\n"
            return p

        bigger = grown(600, on_term="exit()")       # an earlier generation's rank, bigger, reaped
        bigger.terminate()
        bigger.wait()
        held = Held(os.getpid())
        held.sample()                               # the agent's last sample: before the rank grew
        rank = grown(300, on_term="exit()")
        rank.terminate()                            # as the NodeManager's SIGTERM to the process group
        while open(f"/proc/{rank.pid}/stat").read().split()[2] != "Z":
            time.sleep(0.01)                        # gone (a zombie) when the agent looks
        out = {"rest": resident_bytes(os.getpid()), "samples": held.peak()}
        out["peak"] = held.at_stop(rank, RANK_END_WAIT_S, enough=200 * mib + out["rest"])
        out["returncode"], out["polled"] = rank.returncode, rank.poll()
        alive = grown(300)                          # one that runs on (a handler of the user's)
        alive.terminate()
        began = time.monotonic()
        out["alive"] = held.at_stop(alive, RANK_END_WAIT_S, enough=200 * mib)
        out["alive_s"], out["alive_polled"] = time.monotonic() - began, alive.poll()
        alive.kill()
        alive.wait()
        print(json.dumps(out))
    '''
    from launcher.agent import RANK_END_WAIT_S
    mib = 2**20
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    rest = got["rest"]
    assert got["samples"] < rest + 100 * mib, got         # what the samples alone saw: not the rank's 300 MiB
    assert got["returncode"] == 0 and got["polled"] == 0, got      # reaped there, its Popen told
    assert rest + 290 * mib <= got["peak"] <= rest + 400 * mib, got
    assert got["alive"] >= 300 * mib and got["alive_polled"] is None, got     # (sampled then: alive)
    assert got["alive_s"] < RANK_END_WAIT_S + 0.5, got
