"""The YARN backend: a job becomes one skein application, one service per worker group.

Thin by design. `build_spec` translates a JobSpec into skein's own model (which
validates it); `YarnBackend` forwards to `skein.Client`. A container learns everything
from its environment and files, so the client never talks to it directly.

Container contract (every worker service):
    YARNAPP_BACKEND=yarn
    YARNAPP_GROUP=<group name>           the service name is the group name
    YARNAPP_JOB=job.json                 the resolved job (JobSpec JSON), a localized file
    YARNAPP_SECRET_FILE=.yarnapp-secret  a localized file (0600 in the staging directory)
                                         holding the per-application secret. Not in the
                                         environment: YARN shows a container's environment to
                                         every user who may view the application (its
                                         launch_container.sh is among the aggregated logs).
    YARNAPP_STORAGE=<URI>                where applications keep what outlives them; the
                                         application's directory is <storage>/<app id>
                                         (default checkpoints, TensorBoard logdir, result.json)
    SKEIN_CONTAINER_ID=<group>_<instance>  set by skein; SKEIN_APPLICATION_ID likewise
    environment/                         the shipped Python environment (yarnapp.packaging),
                                         absent with packer: none (the cluster's python3 runs)
The coordination store is skein's key-value store (launcher.store.SkeinStore). It lives
in skein's application master and ends with it, so the results of a finished
application are read from its final diagnostics or result.json (launcher.results).

ACLs are on by default: only the submitting user (and job.yaml's yarn.acls lists) may
view or kill the application.

Restarts: `max_restarts` caps each service's container restarts. Skein replaces a failed
container by a *new instance number* (a group of 2 gets `worker_2` after `worker_1`
fails), so the container side must not assume instance < group.instances.
"""
import contextlib
import getpass
import logging
import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import warnings

import skein

import conf
from launcher import memory, results
from launcher.identity import checkpoint_dir, code

from .. import advice, packaging, preflight, shipping
from .local.state import home, read_json, write_json
from ..errors import BackendUnavailable, YarnappError
from . import capacity, yarn_cluster
from .base import Backend, check_resumed_ended
from .yarn_reports import (MARKER, TENSORBOARD_PAGE, app_record, app_state, container_record, kv_fields,
                           name_memory_kills, named_logs, proxied, with_formed_s, with_ranks)

log = logging.getLogger(__name__)

TAG = "yarnapp"                    # every application we submit carries it; list() filters on it
TENSORBOARD_SERVICE = conf.TENSORBOARD_SERVICE
TENSORBOARD_RESOURCES = {"memory": 1024, "vcores": 1}
CLUSTER_PYTHON = "python3"         # packer: none
CONTRACT_KEYS = ("YARNAPP_BACKEND", "YARNAPP_GROUP", "YARNAPP_JOB", "YARNAPP_SECRET", "YARNAPP_SECRET_FILE",
                 "YARNAPP_STORAGE")
SECRET_FILE = ".yarnapp-secret"
UNAVAILABLE = "N/A"     # what YARN reports in place of what a user outside the view ACL may not see


def submitting_user():
    """Who YARN takes us for with simple authentication (with Kerberos: the ticket's user)."""
    return os.environ.get("HADOOP_USER_NAME") or getpass.getuser()


BASELINE_MIB = 700      # an agent and a rank that imported torch and joined MPI (hello-yarn's rank 0: 666 MiB)


def check_job(job, where=None):
    """Refuse what YARN cannot run before anything is packed or uploaded."""
    pre = f"{where}: " if where else ""
    for i, g in enumerate(job.groups):
        if not float(g.vcores).is_integer():
            raise YarnappError(f"{pre}groups[{i}].vcores: YARN allocates whole vcores; got {g.vcores:g} "
                               f"— use an integer")
        for key in CONTRACT_KEYS:
            if key in g.env:
                raise YarnappError(f"{pre}groups[{i}].env.{key}: set by yarnapp for every container; remove it")


def warn_small(job, where=None):
    """A warning for each group whose containers are smaller than an agent and its rank hold
    before any model or data. Said once the job passed every check (a refused job is its one line)."""
    pre = f"{where}: " if where else ""
    for i, g in enumerate(job.groups):
        if g.memory < BASELINE_MIB:
            log.warning("%sgroups[%d].memory: %d MiB: on YARN a container's agent and its rank (torch) hold about "
                        "%d MiB before any model or data, and the NodeManager kills a container over its memory "
                        "(it counts both processes); give it 1 GiB or more", pre, i, g.memory, BASELINE_MIB)


def stage_files(job, staging_dir, cache=None, shipped=None, pack=True):
    """Write job.json into `staging_dir` and resolve the environment archive.

    Returns the `files` for build_spec: {"job.json": File, "environment": File (archive),
    and one File per shipped entry of the user's code (`shipped`: yarnapp.shipping's
    {name: local path}; a directory goes as a zip archive YARN unpacks under its name)}.
    Packing (venv-pack/conda-pack) happens here, cached by yarnapp.packaging (`pack=False`:
    the archive's path only, packing nothing). The application's secret is written here too,
    as a 0600 file localized as .yarnapp-secret.
    """
    path = os.path.join(staging_dir, "job.json")
    with open(path, "w") as f:
        f.write(job.model_dump_json())
    secret = os.path.join(staging_dir, SECRET_FILE)
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    files = {"job.json": skein.File(path, type="file"), SECRET_FILE: skein.File(secret, type="file")}
    for name, src in (shipped or {}).items():
        if name in files or name == "environment":
            raise YarnappError(f"run.files: {src} would land as {name!r}, a name yarnapp uses; rename it")
        files[name] = (skein.File(shipping.archive_dir(src, staging_dir, name), type="archive")
                       if os.path.isdir(src) else skein.File(src, type="file"))
    archive = packaging.environment_archive(job.environment, cache=cache, pack=pack)
    if archive is not None:
        files["environment"] = skein.File(archive, type="archive")
    return files


def build_spec(job, files, user=None, storage=None, memory_step=None):
    """The skein ApplicationSpec of a job (pure: no cluster, no files written).

    `files` maps localized names to skein.File (or source strings), as stage_files returns:
    it must hold "job.json" and the secret file; with "environment" the containers run
    its bin/python, without it the cluster's python3. `user` is the submitting user (the
    ACLs' owner; default: submitting_user()), `storage` the applications' storage URI
    (yarn.storage, else the cluster's default; None: containers keep nothing outside),
    `memory_step` the MiB YARN rounds a container's memory up to a multiple of
    (yarn.scheduler.minimum-allocation-mb; None: YARN's default, 1024), which the agents
    need to tell a container stopped for its memory (launcher.memory.stopped_for_memory).
    """
    check_job(job)
    for name in ("job.json", SECRET_FILE):
        if name not in files:
            raise ValueError(f"files must include {name!r} (see stage_files)")
    files = {k: v if isinstance(v, skein.File) else skein.File(v) for k, v in files.items()}
    python = "environment/bin/python" if "environment" in files else CLUSTER_PYTHON
    user = user or submitting_user()
    services = {}
    for g in job.groups:
        services[g.name] = skein.Service(
            resources=skein.Resources(memory=g.memory, vcores=int(g.vcores), gpus=g.gpus),
            instances=g.instances,
            node_label=g.node_label or "",
            max_restarts=job.max_restarts,
            env={**g.env, **_contract(g.name, storage),
                 **({memory.STEP_ENV: str(memory_step)} if memory_step else {})},
            files=dict(files),
            script=_script(python, "launcher.agent", "environment" in files))
    if job.tensorboard.service:
        # What every group sets alike (e.g. the libhdfs variables of docs/yarn.md) it needs too.
        common = {k: v for k, v in job.groups[0].env.items() if all(g.env.get(k) == v for g in job.groups)}
        env = {**common, **_contract(TENSORBOARD_SERVICE, storage)}
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
                                 max_attempts=job.am_attempts, acls=acls(job.yarn.acls, user))


def acls(spec, user):
    """skein ACLs: the submitting user and job.yaml's yarn.acls (owner-only by default)."""
    if not spec.enable:
        return skein.ACLs(enable=False)
    view = sorted({user, *spec.view_users, *spec.modify_users})
    return skein.ACLs(enable=True, view_users=view, view_groups=sorted({*spec.view_groups, *spec.modify_groups}),
                      modify_users=sorted({user, *spec.modify_users}), modify_groups=sorted(spec.modify_groups),
                      ui_users=view)


def _contract(group, storage):
    env = {"YARNAPP_BACKEND": "yarn", "YARNAPP_GROUP": group, "YARNAPP_JOB": "job.json",
           "YARNAPP_SECRET_FILE": SECRET_FILE,
           # The agent (a gRPC client of skein's master) forks its rank: with gRPC's fork
           # support on, the child's poller can hit the fd Popen closed before exec and abort
           # it (grpc/grpc#43055: ranks died of SIGABRT here).
           "GRPC_ENABLE_FORK_SUPPORT": "false",
           "YARNAPP_CODE": code()}             # the containers' ranks say where theirs differs
    if storage:
        env["YARNAPP_STORAGE"] = storage
    return env


def _script(python, module, shipped):
    lines = ["set -e",
             f'echo "{MARKER} $SKEIN_CONTAINER_ID (YARN $CONTAINER_ID)"']
    if shipped:
        lines.append('export PATH="$PWD/environment/bin:$PATH"')
    lines.append(f"exec {shlex.quote(python)} -m {module}")
    return "\n".join(lines) + "\n"


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
        with warnings.catch_warnings(record=True) as said:     # the filters as they are: what would show
            client = skein.Client(log=driver_log)
        for w in said:
            if str(w.message).startswith("Skein global security credentials not found"):
                log.info("skein: %s", w.message)      # a note that it wrote them, not a warning
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        return client
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
            down = yarn_cluster.resourcemanager_unreachable()
            if down:
                raise BackendUnavailable(f"YARN backend unavailable: {down}")
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
        except skein.exceptions.DriverError as e:       # (a kill refused by its ACL was a traceback)
            if "AccessControlException" in str(e) or "cannot perform operation" in str(e):
                raise YarnappError(f"{app_id}: YARN refused user {submitting_user()}: {_first(e)}; its owner may "
                                   f"add you to the job's yarn.acls.modify_users") from None
            raise YarnappError(f"{app_id}: YARN refused: {_first(e)}") from None

    def _report(self, app_id, need):
        """The application's report, where its details are this user's to see: YARN answers a
        user outside its view ACL with its state alone (its diagnostics "N/A"), and `logs`
        printed nothing, `status` "N/A", both as if all were well."""
        report = self._call(self.client.application_report, app_id)
        if report.diagnostics == UNAVAILABLE and report.user != submitting_user():
            raise YarnappError(f"{app_id} is {report.user}'s ({app_state(report)}): YARN shows user "
                               f"{submitting_user()} no more than its state, not its {need}; its owner may add you to "
                               f"the job's yarn.acls (view_users to see it, modify_users to kill it too)")
        return report

    def submit(self, job, where=None, setting=()):
        capacity.check_fits(self.client.get_nodes, job, where, TENSORBOARD_RESOURCES,
                            child_queues=self.client.get_child_queues, counts_vcores=yarn_cluster.counts_vcores())
        self._check_resumed_ended(job, where)
        with prepared(job, where) as (spec, storage):
            warn_small(job, where)
            try:
                app_id = self.client.submit(spec)      # skein uploads local files during submit
            except (skein.exceptions.DriverError, ValueError) as e:
                raise YarnappError(f"YARN refused the application: {_first(e)}") from None
        log.info("submitted %s as %s to queue %s; its storage: %s/%s", job.name, app_id, job.queue, storage,
                 app_id)
        _remember(app_id, where, setting)
        return app_id

    def _check_resumed_ended(self, job, where):
        """checkpoint.resume naming an application still running, refused before anything is
        uploaded (base.check_resumed_ended)."""
        app = job.checkpoint.resume
        if app.startswith("application_"):
            check_resumed_ended(app, app_state(self._call(self.client.application_report, app)), where or "job")

    def status(self, app_id):
        report = self._report(app_id, "status")
        record = app_record(report)
        if record["state"] == "RUNNING":
            try:
                app = self.client.connect(app_id, wait=False)
                containers = app.get_containers(states=list(skein.model.ContainerState))
                record["containers"] = [container_record(c) for c in containers]
                record.update(kv_fields(app.kv))
                name_memory_kills(with_formed_s(with_ranks(record)))
                if record["tensorboard"]:      # reachable through the ResourceManager's proxy
                    record["tensorboard_node"] = record["tensorboard"]
                    record["tensorboard"] = proxied(report.tracking_url, TENSORBOARD_PAGE)
                    record["tensorboard_open"] = record["tensorboard"] + yarn_cluster.signed_in(report.user)
                return _with_submission(record)
            except skein.exceptions.ConnectionError as e:   # finished between the two calls
                log.debug("status of %s from the report only: %s", app_id, e)
                report = self._call(self.client.application_report, app_id)
                record = app_record(report)
        if record["state"] in ("SUCCEEDED", "FAILED"):
            stored = self._stored_results(app_id, report.user)
            if "results" not in record:
                record.update(stored)
            record["progress"] = stored.get("progress") or {}    # (the diagnostics keep no progress)
        if record["state"] == "FAILED" and not record.get("failure") and \
                record["diagnostics"].startswith(yarn_cluster.SERVICE_FAILED):
            record["failure"] = yarn_cluster.service_failure(app_id, report.user)
            record["diagnostics"] = (record["failure"] or {}).get("reason") or record["diagnostics"]
        return _with_submission(with_formed_s(record))

    def checkpoints_of(self, app_id, job):
        """checkpoint.uri unset: <storage>/<app id>/checkpoints/<app id>, as the containers write."""
        if job.checkpoint.uri:
            root = super().checkpoints_of(app_id, job)
        else:
            storage = job.yarn.storage or yarn_cluster.default_storage(submitting_user())
            root = checkpoint_dir(app_id, siblings=storage) if storage else None
        return yarn_cluster.python_uri(root) if root else None     # webhdfs:// where libhdfs is not here

    def _stored_results(self, app_id, user):
        """The results a finished application wrote to its storage (default storage only)."""
        storage = yarn_cluster.default_storage(user)
        if not storage:
            return {}
        try:
            found = results.read(f"{storage}/{app_id}")
        except Exception as e:      # not written (killed, or failed before any agent ran)
            log.debug("no stored results of %s: %s", app_id, e)
            return {}
        return {"final": found.get("final"), "failure": found.get("failure"),
                "restarts": found.get("restarts") or [], "world_formed_time": found.get("world_formed_time"),
                "notices": found.get("notices") or [],
                "progress": {int(k): v for k, v in (found.get("progress") or {}).items()},
                "results": f"{storage}/{app_id}/{results.RESULT_FILE}"}

    def logs(self, app_id, container=None):
        """{container id: text}: while the application runs, each container's live log from
        its NodeManager; once it has finished, the aggregated logs."""
        report = self._report(app_id, "logs")
        out = {}
        if app_state(report) in ("NEW", "RUNNING"):
            try:
                app = self.client.connect(app_id, wait=False)
                for c in app.get_containers(states=list(skein.model.ContainerState)):
                    text = yarn_cluster.live_log(c, report.user)
                    out[c.id] = text if text is not None else (
                        f"(still running: YARN serves this log at http://{c.yarn_container_logs})\n"
                        if c.yarn_container_logs else "(not started yet: no log)\n")
            except skein.exceptions.ConnectionError:
                pass
        else:
            out = named_logs(self._finished_logs(app_id, report.user))
        if container is None:
            return out
        if container not in out:
            raise YarnappError(f"application {app_id} has no container {container!r}; "
                               f"it has {', '.join(sorted(out)) or 'none yet'}")
        return {container: out[container]}

    def _finished_logs(self, app_id, user):
        try:
            return dict(self.client.application_logs(app_id))
        except (ValueError, skein.exceptions.DriverError) as e:   # skein reads Hadoop < 3.3's layout only
            log.debug("skein has no logs of %s (%s); asking `yarn logs`", app_id, e)
        try:
            return yarn_cluster.aggregated_logs(app_id, user)
        except (OSError, subprocess.SubprocessError, TimeoutError) as e:
            raise YarnappError(f"the logs of {app_id} are not available: {_first(e)} (YARN log aggregation "
                               f"must be enabled: yarn.log-aggregation-enable)") from None

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


@contextlib.contextmanager
def prepared(job, where=None, pack=True):
    """(spec, storage) of a job, its staged files (0700 directory) alive while the block runs."""
    check_job(job, where)
    user = submitting_user()
    storage = job.yarn.storage or yarn_cluster.default_storage(user)
    if storage is None:
        for field, value in (("checkpoint.uri", job.checkpoint.uri),
                             ("tensorboard.logdir", job.tensorboard.logdir)):
            if value is None:
                log.warning("%s is unset and no Hadoop configuration (HADOOP_CONF_DIR) names the cluster's "
                            "default filesystem: it defaults to a directory inside each container; set "
                            "yarn.storage or %s to shared storage (hdfs://...)", field, field)
    job = conf.absolutize(job, os.getcwd())
    preflight.check_model(job, where)
    found = preflight.check_data(job, where, on_cluster=True)
    preflight.check_outputs(job, where, on_cluster=True)
    shipment = shipping.plan(job, where)
    preflight.check_strategy(job, found, shipment, where)
    advice.warn_little_beside_data(job, where)
    advice.warn_idle_gpus(job, where)
    with tempfile.TemporaryDirectory(prefix="yarnapp-stage-") as staging:
        os.chmod(staging, 0o700)
        files = stage_files(shipment.job, staging, shipped=shipment.entries, pack=pack)
        step = yarn_cluster.hadoop_conf(("yarn-site.xml",)).get("yarn.scheduler.minimum-allocation-mb")
        yield build_spec(shipment.job, files, user=user, storage=storage,
                         memory_step=int(step) if step and step.isdigit() else None), storage


def dry_run(job, where=None):
    """The skein.ApplicationSpec YAML `submit` would send (nothing started, nothing packed;
    the staged files it names exist only while this runs)."""
    with prepared(job, where, pack=False) as (spec, _):
        return spec.to_yaml()


def _submission_path(app_id):
    return os.path.join(home(), "yarn", "submitted", f"{app_id}.json")


def _with_submission(record):
    """`record` with how its application was submitted, where this machine submitted it."""
    record.update(read_json(_submission_path(record["app_id"])) or {})
    return record


def _remember(app_id, where, setting):
    """How `app_id` was submitted, kept on this machine: its job file, from where, and the
    command line's fields (status's job_file, submit_dir, setting, as the local engine keeps
    them), so that a kill's or a failure's resume hint gives the whole `yarnapp submit` line."""
    try:
        path = _submission_path(app_id)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        write_json(path, {"job_file": os.path.abspath(where) if where and os.path.isfile(where) else None,
                          "submit_dir": os.getcwd(), "setting": list(setting)})
    except OSError as e:        # (only a hint is lost; the application runs)
        log.debug("not kept how %s was submitted: %s", app_id, e)


def _first(exc):
    """One line of an exception: skein's driver errors put the cause on the line after
    "..., exception:" (e.g. "... submitted by user alice to unknown queue: nope")."""
    raw = exc.args[0] if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) else str(exc)
    text = raw.strip()     # (a KeyError's str() quotes its message: stripping its quotes cut the id's own)
    text = text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith("exception:"):
        return lines[1].split(" : ", 1)[-1]
    return lines[0] if lines else type(exc).__name__
