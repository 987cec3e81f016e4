"""The YARN backend: a job becomes one skein application, one service per worker group.

Thin by design. `build_spec` translates a JobSpec into skein's own model (which
validates it); `YarnBackend` forwards to `skein.Client`. A container learns everything
from its environment and files, so the client never talks to it directly.

Container contract (every worker service):
    YARNAPP_BACKEND=yarn
    YARNAPP_GROUP=<group name>           the service name is the group name
    YARNAPP_JOB=job.json                 the resolved job (JobSpec JSON), a localized file
    YARNAPP_SECRET=<32 hex digits>       random per application
    SKEIN_CONTAINER_ID=<group>_<instance>  set by skein; SKEIN_APPLICATION_ID likewise
    environment/                         the shipped Python environment (yarnapp.packaging),
                                         absent with packer: none (the cluster's python3 runs)
The coordination store is skein's key-value store (launcher.store.SkeinStore).

Restarts: `max_restarts` caps each service's container restarts. Skein replaces a failed
container by a *new instance number* (a group of 2 gets `worker_2` after `worker_1`
fails), so the container side must not assume instance < group.instances.
"""
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile

import skein

import conf
from launcher import keys

from .. import packaging, shipping
from ..errors import BackendUnavailable, YarnappError
from .base import Backend

log = logging.getLogger(__name__)

TAG = "yarnapp"                    # every application we submit carries it; list() filters on it
TENSORBOARD_SERVICE = "tensorboard"
TENSORBOARD_RESOURCES = {"memory": 1024, "vcores": 1}
CLUSTER_PYTHON = "python3"         # packer: none
_MARKER = "yarnapp container"      # first log line of every container: maps YARN ids to ours
CONTRACT_KEYS = ("YARNAPP_BACKEND", "YARNAPP_GROUP", "YARNAPP_JOB", "YARNAPP_SECRET")


def check_job(job, where=None):
    """Refuse what YARN cannot run before anything is packed or uploaded."""
    pre = f"{where}: " if where else ""
    for i, g in enumerate(job.groups):
        if not float(g.vcores).is_integer():
            raise YarnappError(f"{pre}groups[{i}].vcores: YARN allocates whole vcores; got {g.vcores:g} "
                               f"— use an integer")
        if job.tensorboard.service and g.name == TENSORBOARD_SERVICE:
            raise YarnappError(f"{pre}groups[{i}].name: {TENSORBOARD_SERVICE!r} names the TensorBoard service "
                               f"when tensorboard.service is true; rename the group")
        for key in CONTRACT_KEYS:
            if key in g.env:
                raise YarnappError(f"{pre}groups[{i}].env.{key}: set by yarnapp for every container; remove it")


def stage_files(job, staging_dir, cache=None, shipped=None):
    """Write job.json into `staging_dir` and resolve the environment archive.

    Returns the `files` for build_spec: {"job.json": File, "environment": File (archive),
    and one File per shipped entry of the user's code (`shipped`: yarnapp.shipping's
    {name: local path}; a directory goes as a zip archive YARN unpacks under its name)}.
    Packing (venv-pack/conda-pack) happens here, cached by yarnapp.packaging.
    """
    path = os.path.join(staging_dir, "job.json")
    with open(path, "w") as f:
        f.write(job.model_dump_json())
    files = {"job.json": skein.File(path, type="file")}
    for name, src in (shipped or {}).items():
        if name in files or name == "environment":
            raise YarnappError(f"run.files: {src} would land as {name!r}, a name yarnapp uses; rename it")
        files[name] = (skein.File(shipping.archive_dir(src, staging_dir, name), type="archive")
                       if os.path.isdir(src) else skein.File(src, type="file"))
    archive = packaging.environment_archive(job.environment, cache=cache)
    if archive is not None:
        files["environment"] = skein.File(archive, type="archive")
    return files


def build_spec(job, files):
    """The skein ApplicationSpec of a job (pure: no cluster, no files written).

    `files` maps localized names to skein.File (or source strings), as stage_files returns:
    it must hold "job.json"; with "environment" the containers run its bin/python,
    without it the cluster's python3.
    """
    check_job(job)
    if "job.json" not in files:
        raise ValueError("files must include 'job.json' (see stage_files)")
    files = {k: v if isinstance(v, skein.File) else skein.File(v) for k, v in files.items()}
    python = "environment/bin/python" if "environment" in files else CLUSTER_PYTHON
    secret = secrets.token_hex(16)
    services = {}
    for g in job.groups:
        services[g.name] = skein.Service(
            resources=skein.Resources(memory=g.memory, vcores=int(g.vcores), gpus=g.gpus),
            instances=g.instances,
            node_label=g.node_label or "",
            max_restarts=job.max_restarts,
            env={**g.env, **_contract(g.name, secret)},
            files=dict(files),
            script=_script(python, "launcher.agent", "environment" in files))
    if job.tensorboard.service:
        env = _contract(TENSORBOARD_SERVICE, secret)
        del env["YARNAPP_GROUP"]
        services[TENSORBOARD_SERVICE] = skein.Service(
            resources=skein.Resources(**TENSORBOARD_RESOURCES),
            instances=1,
            max_restarts=job.max_restarts,
            allow_failures=True,            # losing TensorBoard must not fail the training
            env=env,
            files=dict(files),
            script=_script(python, "launcher.tensorboard_service", "environment" in files))
    return skein.ApplicationSpec(name=job.name, queue=job.queue, tags={TAG}, services=services,
                                 max_attempts=job.am_attempts)


def _contract(group, secret):
    return {"YARNAPP_BACKEND": "yarn", "YARNAPP_GROUP": group, "YARNAPP_JOB": "job.json",
            "YARNAPP_SECRET": secret}


def _script(python, module, shipped):
    lines = ["set -e",
             f'echo "{_MARKER} $SKEIN_CONTAINER_ID (YARN $CONTAINER_ID)"']
    if shipped:
        lines.append('export PATH="$PWD/environment/bin:$PATH"')
    lines.append(f"exec {shlex.quote(python)} -m {module}")
    return "\n".join(lines) + "\n"


# ---- reports: skein's model -> the backend's plain dicts (see base.Backend) ----

def app_state(report):
    """NEW | RUNNING | SUCCEEDED | FAILED | KILLED from a skein ApplicationReport."""
    state = str(report.state)
    if state == "FINISHED":
        final = str(report.final_status)
        return final if final in ("SUCCEEDED", "FAILED", "KILLED") else "FAILED"
    if state in ("RUNNING", "FAILED", "KILLED"):
        return state
    return "NEW"                    # NEW, NEW_SAVING, SUBMITTED, ACCEPTED


def app_record(report):
    start = report.start_time
    return {"app_id": report.id, "name": report.name, "state": app_state(report), "containers": [],
            "final": None, "restarts": [], "diagnostics": report.diagnostics or "", "progress": {},
            "tensorboard": None, "world_formed_s": None, "failure": None,
            "submitted": start.timestamp() if start else None, "tracking_url": report.tracking_url}


def container_record(c):
    m = re.search(r"exit code:?\s*(-?\d+)", c.exit_message or "", re.IGNORECASE)
    return {"id": c.id, "group": c.service_name, "instance": c.instance, "state": str(c.state),
            "exit_code": int(m.group(1)) if m else None, "attempts": 1,
            "log": c.yarn_container_logs, "diagnostics": c.exit_message or ""}


def named_logs(logs):
    """{yarn container id: text} -> {our container id: text}, by each container's first line.

    The application master (no marker) is named "master".
    """
    out = {}
    for yarn_id, text in sorted(logs.items()):
        m = re.search(rf"^{_MARKER} (\S+)", text, re.MULTILINE)
        name = m.group(1) if m else ("master" if "application.master.log" in text else yarn_id)
        out[name if name not in out else yarn_id] = text
    return out


def kv_fields(kv):
    out = {"progress": {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in kv.get_prefix("progress/").items()},
           "restarts": [json.loads(v) for v in kv.get_prefix(keys.RESTARTS).values()]}
    final = kv.get(keys.FINAL)
    out["final"] = json.loads(final) if final else None
    failed = kv.get(keys.FAILED)
    out["failure"] = json.loads(failed) if failed else None      # the root cause, first failure wins
    tb = kv.get(keys.TENSORBOARD)
    out["tensorboard"] = tb.decode() if tb else None
    formed = sorted(k for k in kv.get_prefix(keys.ABORT_PREFIX) if k.endswith("/formed"))
    out["world_formed_s"] = json.loads(kv.get(formed[-1])).get("seconds") if formed else None
    return out


# ---- the backend ----

def _missing_prerequisite():
    if shutil.which("yarn") is None:
        return ("YARN backend unavailable: no `yarn` command on PATH (the Hadoop/YARN client skein "
                "needs); install a Hadoop client configured for your cluster (HADOOP_CONF_DIR), "
                "or use backend: local")
    java = (os.path.join(os.environ["JAVA_HOME"], "bin", "java") if "JAVA_HOME" in os.environ
            else shutil.which("java"))
    if not java or not os.path.exists(java):
        return ("YARN backend unavailable: no Java found (skein's driver runs on it); "
                "set JAVA_HOME or put `java` on PATH")
    return None


def _start_client():
    try:
        return skein.Client.from_global_driver()
    except skein.exceptions.DriverNotRunningError:
        pass
    except skein.exceptions.ConnectionError as e:
        log.warning("skein global driver unreachable (%s); starting a private one", e)
    os.makedirs(packaging.cache_dir(), exist_ok=True)
    driver_log = os.path.join(packaging.cache_dir(), "skein-driver.log")
    try:
        return skein.Client(log=driver_log)
    except (OSError, subprocess.CalledProcessError, skein.exceptions.SkeinError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BackendUnavailable(f"YARN backend unavailable: skein's driver did not start ({first}); "
                                 f"check that `yarn classpath` works here and see {driver_log}") from None


class YarnBackend(Backend):
    """Submits and observes yarnapp applications through skein.

    `client` reuses an existing skein.Client; otherwise one is started on first use (the
    global driver if `skein driver start` runs one, else a private driver).
    """

    name = "yarn"

    def __init__(self, client=None):
        self._client = client
        if client is None:
            problem = _missing_prerequisite()
            if problem:
                try:
                    self._client = skein.Client.from_global_driver()
                except skein.exceptions.ConnectionError:   # includes DriverNotRunningError
                    raise BackendUnavailable(problem) from None

    @property
    def client(self):
        if self._client is None:
            self._client = _start_client()
        return self._client

    def _call(self, fn, app_id, *args):
        try:
            return fn(app_id, *args)
        except (KeyError, ValueError) as e:
            raise YarnappError(f"no application {app_id!r} on YARN ({_first(e)}); "
                               f"`yarnapp list --backend yarn` shows them") from None
        except skein.exceptions.ConnectionError as e:
            raise BackendUnavailable(f"lost the connection to skein's driver ({_first(e)})") from None

    def submit(self, job, where=None):
        check_job(job, where)
        for field, value in (("checkpoint.uri", job.checkpoint.uri),
                             ("tensorboard.logdir", job.tensorboard.logdir)):
            if value is None:
                log.warning("%s is unset: on YARN it defaults to a directory inside each container, which "
                            "other containers cannot read and which is deleted with it; set it to shared "
                            "storage (hdfs://...)", field)
        shipment = shipping.plan(conf.absolutize(job, os.getcwd()))
        with tempfile.TemporaryDirectory(prefix="yarnapp-stage-") as staging:
            spec = build_spec(shipment.job, stage_files(shipment.job, staging, shipped=shipment.entries))
            try:
                app_id = self.client.submit(spec)      # skein uploads local files during submit
            except (skein.exceptions.DriverError, ValueError) as e:
                raise YarnappError(f"YARN refused the application: {_first(e)}") from None
        log.info("submitted %s as %s to queue %s", job.name, app_id, job.queue)
        return app_id

    def status(self, app_id):
        report = self._call(self.client.application_report, app_id)
        record = app_record(report)
        if record["state"] != "RUNNING":
            return record
        try:
            app = self.client.connect(app_id, wait=False)
            containers = app.get_containers(states=list(skein.model.ContainerState))
            record["containers"] = [container_record(c) for c in containers]
            record.update(kv_fields(app.kv))
        except skein.exceptions.ConnectionError as e:   # finished between the two calls
            log.debug("status of %s from the report only: %s", app_id, e)
        return record

    def logs(self, app_id, container=None):
        """{container id: text}. YARN hands logs out once the application finishes; while it
        runs each entry says where the live log is served."""
        report = self._call(self.client.application_report, app_id)
        if app_state(report) in ("NEW", "RUNNING"):
            out = {}
            try:
                app = self.client.connect(app_id, wait=False)
                for c in app.get_containers(states=list(skein.model.ContainerState)):
                    out[c.id] = (f"(still running: YARN serves this log at http://{c.yarn_container_logs} "
                                 f"and hands it out here once the application finishes)")
            except skein.exceptions.ConnectionError:
                pass
        else:
            out = named_logs(self._call(self.client.application_logs, app_id))
        if container is None:
            return out
        if container not in out:
            raise YarnappError(f"application {app_id} has no container {container!r}; "
                               f"it has {', '.join(sorted(out)) or 'none yet'}")
        return {container: out[container]}

    def kill(self, app_id):
        self._call(self.client.kill_application, app_id)
        log.info("killed %s", app_id)
        return self.status(app_id)

    def list(self):
        try:
            reports = self.client.get_applications(states=list(skein.model.ApplicationState))
        except skein.exceptions.ConnectionError as e:
            raise BackendUnavailable(f"lost the connection to skein's driver ({_first(e)})") from None
        mine = [r for r in reports if TAG in r.tags]
        mine.sort(key=lambda r: (r.start_time is not None, r.start_time), reverse=True)
        return [app_record(r) for r in mine]


def _first(exc):
    text = str(exc).strip().strip("'\"")
    return text.splitlines()[0] if text else type(exc).__name__
