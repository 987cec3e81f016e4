"""The embedded local engine, client side: submit starts a detached application
master (am.py); status/logs/kill work from any shell through the app directory."""
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil

import conf

from launcher import interrupts, keys
from launcher.results import notices
from launcher.identity import checkpoint_dir
from training import fsutil
from launcher.failure import Failure, read_tail
from launcher.store import FileStore

from ... import advice, logview, preflight, shipping
from ...errors import YarnappError
from ..base import TERMINAL, Backend, check_resumed_ended
from . import cgroups, gpus, leases, netem, supervisor
from .leases import machine_memory_mib
from .state import (app_processes, apps_dir, home, no_application, private, read_json, request_kill, tree_bytes,
                    umask, wait_ended, write_json)

log = logging.getLogger(__name__)


REMOVING = ".removing-"      # an application's directory being deleted (LocalBackend.remove)


def _last_error(log_file):
    """The exception line a log ends with (`OSError: [Errno 28] No space left on device`), or
    None: a master killed after an earlier attempt's error did not end with it."""
    lines = [ln.strip() for ln in read_tail(log_file, size=8192).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", last) else None


def _new_app_id():
    return time.strftime("app_%Y%m%d_%H%M%S_") + secrets.token_hex(3)


# The local engine is one NodeManager: the machine's memory, and YARN's default vcores
# (yarn.nodemanager.resource.cpu-vcores: 8) or the machine's cores where it has more. A CPU
# quota is a cap, so containers may share the cores (1 + 0.5 + 0.5 + 1 on 2 cores); memory
# is not shared, as on YARN: the applications running hold it (leases.py), the others wait.
NODE_VCORES = 8


def check_resources(job, where="job"):
    """Refuse requests this machine can never satisfy (YARN would refuse them too): a
    container larger than the machine, or containers that together ask for more than it
    offers (YARN would wait for ever for the rest of the world's containers)."""
    cores = os.cpu_count() or 1
    mem_mib = machine_memory_mib()
    ledger = leases.Leases()
    try:
        ledger.held()       # the machine's ledger of GPUs and memory every master leases from
    except OSError as e:
        raise YarnappError(f"the local engine's ledger {ledger.path}: {e.strerror or e}; set YARNAPP_LEDGER to a "
                           f"file this user can write") from None
    node_vcores = max(cores, NODE_VCORES)
    want = sum(g.gpus * g.instances for g in job.groups)
    have = gpus.inventory() if want else []
    for i, g in enumerate(job.groups):
        if g.vcores > cores:
            raise YarnappError(f"{where}: groups[{i}].vcores: {g.vcores:g} requested but this machine has "
                               f"{cores} cores; ask for at most {cores}")
        if g.memory > mem_mib:
            raise YarnappError(f"{where}: groups[{i}].memory: {g.memory} MiB requested but this machine has "
                               f"{mem_mib} MiB; ask for at most {mem_mib} MiB")
        if g.gpus and want > len(have):
            raise YarnappError(f"{where}: groups[{i}].gpus: the job asks for {want} GPU(s) in all "
                               f"({', '.join(f'{x.instances} x {x.gpus}' for x in job.groups if x.gpus)}) but this "
                               f"machine has {len(have)} ({gpus.source()}{'' if have else ' finds none'}); "
                               f"ask for at most "
                               f"{len(have)}, set gpus: 0, or submit to a cluster with --backend yarn")
    instances = sum(g.instances for g in job.groups)
    vcores = round(sum(g.vcores * g.instances for g in job.groups), 6)      # 7 x 1.1 + 0.3 is 8
    memory = sum(g.memory * g.instances for g in job.groups)
    each = ", ".join(f"{g.instances} x {{}}" for g in job.groups)
    if vcores > node_vcores:
        raise YarnappError(f"{where}: groups: the job's {instances} containers ask for {vcores:g} vcores in all "
                           f"({each.format(*(f'{g.vcores:g}' for g in job.groups))}) but the local engine offers "
                           f"{node_vcores} on this {cores}-core machine; ask for fewer instances or vcores, "
                           f"or submit to a cluster with --backend yarn")
    if memory > mem_mib:
        raise YarnappError(f"{where}: groups: the job's {instances} containers ask for {memory} MiB of memory in "
                           f"all ({each.format(*(f'{g.memory} MiB' for g in job.groups))}) but this machine has "
                           f"{mem_mib} MiB; ask for fewer instances or less memory, or submit to a cluster with "
                           f"--backend yarn")


def _written_elsewhere(app, uri):
    """Where application `app` of this home wrote its checkpoints, if not under `uri` (the
    resuming job's checkpoint.uri): "set checkpoint.uri ..." (the line said "give an id
    `yarnapp list` shows", and list showed that very id: a checkpoint audit), or None."""
    saved = read_json(os.path.join(apps_dir(), app, "job.json")) if re.fullmatch(r"app_[\w]+", app) else None
    if not saved:
        return None
    theirs = (saved.get("checkpoint") or {}).get("uri")
    if theirs == uri or (theirs and not fsutil.is_local(theirs)):
        return None
    root = checkpoint_dir(app, fsutil.local_path(theirs)) if theirs else checkpoint_dir(app, siblings=apps_dir())
    if not os.path.isdir(root):
        return None
    return (f"it wrote them under {theirs}, its checkpoint.uri: set checkpoint.uri to it (checkpoint.uri={theirs})"
            if theirs else "it kept them in its own directory (its checkpoint.uri unset): unset checkpoint.uri "
                           "(checkpoint.uri=null)")


def check_resume(job, found, where="job"):
    """checkpoint.resume naming an application whose checkpoints are not on this machine
    (its own directory here, or a local checkpoint.uri), or a checkpoint the job could not
    go on from (written by fewer ranks, by another strategy, model or split layers, with
    another batch size or training set): one line before anything starts (else the
    containers start, then report it; `latest` with nothing to resume is said here too).
    found: check_data's. Returns what the job resumes from: `latest` decided here, as said
    (the application it names, or never: one submitted a moment later, started first, is
    not taken for an earlier one); else as given."""
    app, uri = job.checkpoint.resume, job.checkpoint.uri
    if app == "never" or (uri and not fsutil.is_local(uri)):
        return app
    if app != "latest":
        root = checkpoint_dir(app, fsutil.local_path(uri)) if uri else checkpoint_dir(app, siblings=apps_dir())
        if not os.path.isdir(root):
            under = uri or apps_dir()
            raise YarnappError(f"{where}: checkpoint.resume: no checkpoints of application {app} under {under}; "
                               + (_written_elsewhere(app, uri) or "give an application id `yarnapp list` shows, "
                                  "latest or never"))
    from training.checkpoint import CheckpointError, Checkpointer, what_it_trains
    look = Checkpointer(uri or apps_dir(), None, name=job.name, resume=app, siblings=None if uri else apps_dir())
    try:
        earlier = look.earlier()
        line = look.refusal(earlier, sum(g.instances for g in job.groups),
                            {"batch_size": job.training.batch_size, "train_rows": found and found.rows,
                             "seed": job.training.seed, "order": found and found.order},
                            what_it_trains(job.training))
    except CheckpointError as e:
        line = str(e)
    if line:
        raise YarnappError(f"{where}: {line}")
    _check_ended(earlier[1], app == "latest", where)
    return earlier[1] or "never"


def _check_ended(app, latest, where):
    """An application resumed from must have ended (base.check_resumed_ended)."""
    if app and os.path.isfile(os.path.join(apps_dir(), app, "app.json")):     # (else another machine's)
        check_resumed_ended(app, LocalBackend().status(app)["state"], where, latest)


def checked(job, where="job"):
    """What submit (and `submit --dry-run`) checks before anything is written or started;
    the job's Shipment (its job with absolute paths, and the files it ships)."""
    check_resources(job, where)
    netem.check(job, where)
    job = conf.absolutize(job, os.getcwd())
    preflight.check_model(job, where)
    found = preflight.check_data(job, where)
    preflight.check_outputs(job, where)
    resume = check_resume(job, found, where)
    if resume != job.checkpoint.resume:
        job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"resume": resume})})
    shipment = shipping.plan(job, where)
    preflight.check_strategy(job, found, shipment, where)
    advice.warn_little_beside_data(job, where)       # (after every refusal: one line each)
    advice.warn_idle_gpus(job, where)
    why_not = cgroups.unavailable()     # (status said it of each container; a `submit --wait` never did)
    if why_not:
        log.warning("the local engine cannot enforce the groups' vcores and memory here (%s): containers share "
                    "this machine's CPUs and memory, unlimited, and one over its memory is not named as such", why_not)
    return shipment


def _stop(pid, timeout):
    """SIGTERM `pid` and wait up to `timeout` for it to end; SIGCONT with it (a process
    stopped by SIGSTOP takes no signal but SIGKILL: the application stayed RUNNING, its
    memory leased, after a kill), and SIGKILL where it does not end."""
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:          # it ended meanwhile
            return
    if not wait_ended(pid, timeout):
        log.warning("pid %d did not end within %gs of SIGTERM: killed", pid, timeout)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_ended(pid, 5)


def _stop_just_started(app_id, proc):
    """Stop a supervisor started a moment ago (its record may not be written): its process
    group (it is a session leader; its master starts in that group), then, should any have
    started already, what its master would have left (supervisor.clean_up)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    supervisor.clean_up(app_id)


def _abandoned(d, min_age_s=60):
    """Whether `d` is an application's directory whose submit ended before it was whole: no
    app.json, and the submitting process its record names is gone (no record: an hour old)."""
    if not re.fullmatch(r"app_\d{8}_\d{6}_[0-9a-f]{6}", os.path.basename(d)) or not os.path.isdir(d) or \
            os.path.lexists(os.path.join(d, "app.json")):
        return False
    try:
        age = time.time() - os.lstat(d).st_mtime
    except OSError:
        return False
    record = read_json(supervisor.record_path(d)) or {}
    if not record.get("starting"):
        return age >= 3600 and not os.path.lexists(supervisor.record_path(d))
    if record.get("host") != socket.gethostname():      # a submit on another machine sharing the home
        return False
    return age >= min_age_s and not supervisor.alive(d)     # (its pid: the submitting process's)


class LocalBackend(Backend):
    name = "local"

    @staticmethod
    def _new_dir(d):
        """Make an application's directory (owner-only) under $YARNAPP_HOME/apps; one line
        naming YARNAPP_HOME where it cannot be written (read-only, full, not ours)."""
        try:
            os.makedirs(apps_dir(), exist_ok=True)
            os.makedirs(d, mode=0o700)
            os.chmod(d, 0o700)
        except OSError as e:
            raise YarnappError(f"YARNAPP_HOME ({home()}): cannot create {d}: {e.strerror or e}; set YARNAPP_HOME "
                               f"to a directory you can write to") from None

    def _dir(self, app_id):
        # one name under apps/ (a path, ../../x or /tmp/x, made status write there, kill remove
        # empty directories there, and clean remove another application: a security audit)
        d = os.path.join(apps_dir(), app_id)
        if not app_id or "/" in app_id or app_id.startswith(".") or not os.path.isfile(os.path.join(d, "app.json")):
            raise YarnappError(no_application(app_id))
        return d

    def job_of(self, app_id):
        job = read_json(os.path.join(self._dir(app_id), "job.json"))
        return conf.load_job(job, stored=True) if job else None

    def checkpoints_of(self, app_id, job):
        """checkpoint.uri unset: in the application's own directory."""
        return super().checkpoints_of(app_id, job) or checkpoint_dir(app_id, siblings=apps_dir())

    def submit(self, job, where="job", setting=()):
        shipment = checked(job, where)
        job = shipment.job
        app_id = _new_app_id()
        d = os.path.join(apps_dir(), app_id)
        # Owner-only: the directory, and app.json (the application's secret), the store (its
        # coordination), job.json by their modes; everything the application writes later is
        # created under umask 077 (its supervisor's), but for the job's own code, which runs
        # under the submitter's (launcher.user_code.run_code): what it writes outside is as
        # `python train.py` would write it. (This process's umask is left alone: os.umask is
        # every thread's, and a notebook's two submits at once left it 077.)
        self._new_dir(d)
        submitter_umask, proc = umask(), None
        try:
            # Until its supervisor is started, this process stands for it (`starting`: not to be
            # signalled): a status meanwhile (another user's `yarnapp list`) found neither and
            # ended the application FAILED, for a moment; written before app.json makes it listed.
            supervisor.write_record(d, {"pid": os.getpid(), "starting": True, "attempts": [],
                                        "host": socket.gethostname()})      # (whose pid it is: _abandoned)
            os.makedirs(os.path.join(d, "containers"))
            shipping.copy_into(shipment.entries, os.path.join(d, "files"))   # copied into each container
            with private(os.path.join(d, "job.json")) as f:
                f.write(job.model_dump_json(indent=1))
            submitted = time.time()
            write_json(os.path.join(d, "app.json"), {"app_id": app_id, "secret": secrets.token_hex(16),
                                                      "submitted": submitted, "name": job.name,
                                                      "job_file": os.path.abspath(where) if os.path.isfile(where)
                                                      else None, "submit_dir": os.getcwd(),
                                                      "setting": list(setting)})
            FileStore(os.path.join(d, "store"))
            env = dict(os.environ, PYTHONUNBUFFERED="1", YARNAPP_UMASK=f"{submitter_umask:o}")   # the job's code's
            env.pop("YARNAPP_APP_ID", None)     # the supervisor is not a process of the application
            with interrupts.deferred():     # a supervisor started is a supervisor recorded
                with open(os.path.join(d, "supervisor.log"), "ab") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "yarnapp.backends.local.supervisor", d],
                                            env=env, cwd=d, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True, umask=0o077)
                if (read_json(supervisor.record_path(d)) or {}).get("starting"):       # not yet its own
                    supervisor.write_record(d, {"pid": proc.pid, "attempts": []})
        except BaseException:
            # Ctrl-C or a failure (a disk full while copying the files) part way: nothing is
            # left, neither half-written nor started.
            if proc is not None:
                _stop_just_started(app_id, proc)
            shutil.rmtree(d, ignore_errors=True)
            raise
        log.info("submitted %s", app_id)
        return app_id

    def status(self, app_id):
        d = self._dir(app_id)
        meta = read_json(os.path.join(d, "app.json"))
        st = read_json(os.path.join(d, "state.json")) or {
            "app_id": app_id, "name": meta["name"], "state": "ACCEPTED", "containers": [],
            "submitted": meta["submitted"], "diagnostics": ""}
        if not st.get("submitted"):     # (an end the supervisor wrote mid-start: listed last, not by its time)
            st["submitted"] = meta.get("submitted")
        masters = read_json(supervisor.record_path(d)) or {}     # the master attempts its supervisor started
        if st["state"] not in TERMINAL and not supervisor.alive(d) and \
                not (st.get("am_pid") and psutil.pid_exists(st["am_pid"])):
            # Neither the master nor the supervisor that restarts it runs (both were killed). The
            # containers died with the master; their cgroups, empty, are left for us to remove,
            # and the end for us to write (its containers ended with it, not RUNNING).
            log_file = next((os.path.join(d, f) for f in ("am.log", "supervisor.log")
                             if os.path.isfile(os.path.join(d, f))), os.path.join(d, "am.log"))
            tried, allowed = len(masters.get("attempts") or []), masters.get("am_attempts") or 1
            crashed = _last_error(log_file)     # (a disk full under YARNAPP_HOME: not killed from outside)
            also = (f", and so had its supervisor, which would have started attempt {tried + 1} (am_attempts: "
                    f"{allowed}): both were killed from outside" if tried < allowed and not crashed else "")
            why = f" ({crashed})" if crashed else ""
            st = supervisor.end(d, st, "FAILED", f"the application master died{why}{also}; see {log_file}",
                                log=log_file)
            # (a cgroup still holding a container's process, ending with its master, is not removed,
            # and nobody looks again: those ending are waited for)
            psutil.wait_procs(app_processes(app_id), timeout=10)
            cgroups.Limits.remove_app(app_id)
            if netem.unavailable_reason() is None:      # its emulated nodes (namespaces stayed until a kill)
                netem.sweep(app_id)
        st["am_attempts"] = masters.get("attempts", [])
        st["job_file"] = meta.get("job_file")     # the job.yaml it was submitted from, if any
        st["submit_dir"] = meta.get("submit_dir")  # where: its relative paths are from there
        st["setting"] = meta.get("setting") or []  # the arguments after the file that set its fields
        store = FileStore(os.path.join(d, "store"))
        st["progress"] = keys.progress_records(store.get_prefix(keys.PROGRESS_PREFIX))
        final = store.get(keys.FINAL)
        st["final"] = json.loads(final) if final else None
        st["restarts"] = [Failure.record(v) for _, v in sorted(store.get_prefix(keys.RESTARTS).items())]
        st["notices"] = notices(store.get_prefix(keys.NOTICES))
        tb = store.get(keys.TENSORBOARD) if st["state"] not in TERMINAL else None   # (its service ended with it)
        st["tensorboard"] = tb.decode() if tb else None
        if st["state"] == "RUNNING":       # its limits as the kernel has them now
            for c in st.get("containers") or []:
                if c.get("state") == "RUNNING" and str(c.get("resources", "")).startswith("enforced"):
                    now = cgroups.Limits.changed(app_id, c["id"], c["vcores"], c["memory_mib"])
                    c["resources"] += f"; {now}" if now else ""
        st["app_dir"] = d
        return st

    def _containers(self, d):
        """The application's containers: those its job names (a container just submitted
        may not have its directory yet, and logs as empty), and any other that has one."""
        root = os.path.join(d, "containers")
        job = read_json(os.path.join(d, "job.json"))
        named = [r["container"] for r in conf.load_job(job, stored=True).ranks()] if job else []
        return root, sorted(set(named) | set(os.listdir(root) if os.path.isdir(root) else ()))

    def logs(self, app_id, container=None):
        return logview.read_logs(self.log_files(app_id, container))

    def log_files(self, app_id, container=None):
        """{container id: the path of its log} (`container`: that one's; master: the
        application master's own log, which a failure may name)."""
        d = self._dir(app_id)
        if container == "master":
            return {"master": os.path.join(d, "am.log")}
        root, names = self._containers(d)
        if container is not None:
            if container not in names:
                raise YarnappError(f"application {app_id} has no container {container!r}; "
                                   f"it has {', '.join(names)} (and master, the application master's log)")
            names = [container]
        return {n: os.path.join(root, n, "container.log") for n in names}

    def kill(self, app_id, timeout=15):
        st = self.status(app_id)
        d = st["app_dir"]
        deadline = time.monotonic() + timeout       # a submit still starting its supervisor: not signalled
        while (read_json(supervisor.record_path(d)) or {}).get("starting") and supervisor.alive(d) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        record = read_json(supervisor.record_path(d)) or {}
        sup = None if record.get("starting") else record.get("pid")
        # The supervisor passes SIGTERM on to the master and starts no new attempt. One of an
        # application that ended, still alive, is stopped too (kill said "nothing to kill",
        # clean "stop it first with yarnapp kill"); a master's pid, once ended, may be another's.
        alive = bool(sup) and supervisor.alive(d)
        target = sup if alive else st.get("am_pid") if st["state"] not in TERMINAL else None
        if target and psutil.pid_exists(target):
            request_kill(d)
            _stop(target, timeout)
        # Backstop: nothing of the application may survive a kill (its processes, cgroups,
        # emulated nodes, as its master would have left them), waited for, so that a
        # supervisor killed here counts as gone below (else the application stayed ACCEPTED).
        supervisor.clean_up(app_id)
        raw = read_json(os.path.join(d, "state.json"))
        if st["state"] not in TERMINAL and (raw or {}).get("state") not in TERMINAL and not supervisor.alive(d):
            # Killed before its master could end it (still starting); a supervisor still
            # alive ends it itself, once the master it waits for is gone.
            supervisor.end(d, raw, "KILLED", "killed by the user", app_id=app_id, name=st["name"],
                           submitted=st["submitted"])
        return self.status(app_id)

    def list(self):
        out = []
        root = apps_dir()
        for app_id in os.listdir(root) if os.path.isdir(root) else ():
            if not app_id.startswith(".") and os.path.isfile(os.path.join(root, app_id, "app.json")):
                st = self.status(app_id)
                out.append({k: st.get(k) for k in ("app_id", "name", "state", "submitted", "diagnostics")})
        return sorted(out, key=lambda a: (a["submitted"] or 0, a["app_id"]), reverse=True)     # (ids: to the second)

    def ended(self, app_id):
        """When a finished application ended, or None while it runs: its state not final, or
        any of its processes (supervisor, master, containers) alive."""
        st = self.status(app_id)
        if st["state"] not in TERMINAL or supervisor.alive(st["app_dir"]) or app_processes(app_id):
            return None
        return st.get("finished") or os.path.getmtime(os.path.join(st["app_dir"], "state.json"))

    def resumed_by(self, listed=None):
        """{application: the live applications that resume from the checkpoints kept in its
        directory (their checkpoint.uri unset; checkpoint.resume as decided at submit)};
        listed: list()'s records, where the caller has them."""
        out = {}
        for a in self.list() if listed is None else listed:
            job = self.job_of(a["app_id"]) if a["state"] not in TERMINAL else None
            if job is not None and not job.checkpoint.uri and job.checkpoint.resume not in ("never", "latest"):
                out.setdefault(job.checkpoint.resume, []).append(a["app_id"])
        return out

    def check_finished(self, app_id, resumed_by=None):
        """Raise YarnappError unless the application ended, nothing of it runs, and no live
        application resumes from the checkpoints in its directory (resumed_by: resumed_by()'s)."""
        if self.ended(app_id) is None:
            state = self.status(app_id)["state"]
            still = " but something of it still runs (or is ending)" if state in TERMINAL else ""
            raise YarnappError(f"{app_id} is {state}{still}: stop it first with `yarnapp kill {app_id}`")
        self.check_not_resumed(app_id, resumed_by)

    def check_not_resumed(self, app_id, resumed_by=None):
        """Raise YarnappError where a live application resumes from the checkpoints in the
        directory of `app_id` (resumed_by: resumed_by()'s)."""
        users = (self.resumed_by() if resumed_by is None else resumed_by).get(app_id)
        if users:
            raise YarnappError(f"{app_id}: application {users[0]} resumes from its checkpoints: wait for it to "
                               f"end, or stop it with `yarnapp kill {users[0]}`")

    def size(self, app_id):
        """The bytes of the application's directory."""
        return tree_bytes(self._dir(app_id))

    def remove(self, app_id, resumed_by=None):
        """Delete a finished application's directory (its logs, store, staged files, and the
        checkpoints and TensorBoard runs kept there; a checkpoint.uri or tensorboard.logdir of
        the job's own is not touched). Returns the bytes freed; refused as check_finished
        says. Renamed out of sight first, at once (a `list` meanwhile does not read it half
        deleted; a second clean finds it gone), then deleted (what is left, swept next time)."""
        d = self._dir(app_id)
        self.check_finished(app_id, resumed_by)
        size = self.size(app_id)
        gone = os.path.join(os.path.dirname(d), f"{REMOVING}{app_id}")
        try:
            os.rename(d, gone)
        except FileNotFoundError:
            raise YarnappError(no_application(app_id)) from None
        shutil.rmtree(gone, ignore_errors=True)
        return size

    @staticmethod
    def sweep_removed():
        """Delete what an interrupted remove left (its renamed directories), and what a submit
        killed part way left (SIGKILL, or SIGHUP from a dropped session, while it copied the
        job's files: a directory without app.json, which nothing listed or removed)."""
        root = apps_dir()
        for name in os.listdir(root) if os.path.isdir(root) else ():
            if name.startswith(REMOVING) or _abandoned(os.path.join(root, name)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
