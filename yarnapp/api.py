"""The Python API (notebooks) and what the CLI is built on."""
import functools
import logging
import os
import sys
import time
import types
import warnings

import conf

from . import backends, codecheck, interrupts, logview, shipping
from . import overrides as overrides_mod
from .backends.base import TERMINAL
from .errors import Interrupted, JobFailed, WaitTimeout, YarnappError

interrupts.install()     # SIGTERM kills what submit(wait=True) waits for, from any thread

log = logging.getLogger(__name__)


def backend_for(app_id):
    """Applications ids tell their backend: YARN's are application_<cluster ts>_<n>."""
    return backends.get("yarn" if str(app_id).startswith("application_") else "local")


def _one_line(fn):
    """A call of the API whose own errors read as their one line: a YarnappError (the user's
    mistake, said whole in its message) or our interrupt's KeyboardInterrupt leave with their
    traceback cut at this call, whose frame pytest hides (__tracebackhide__); IPython and
    Jupyter show their one line alone (conf.errors: _render_traceback_). Any other error
    keeps its whole traceback: a bug of ours needs it."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - read from the frame by IPython's and pytest's tracebacks
        try:
            return fn(*args, **kwargs)
        except (YarnappError, KeyboardInterrupt) as e:
            raise e.with_traceback(None)
    return call


def load(job, where=None, **overrides):
    """A validated JobSpec from a path, dict or JobSpec (a user's: checked for what users
    get wrong, conf.check_bare_memory); raises YarnappError (one line; where an override set
    the field, it says so)."""
    overrides = overrides_mod.plain(overrides)
    try:
        return spec_of(job, where, overrides)
    except YarnappError as e:
        raise YarnappError(overrides_mod.said_as_given(str(e), overrides)) from None


def spec_of(job, where, overrides):
    """load's JobSpec, its errors naming the file (the command line says what set a field:
    yarnapp.cli_job.flagged)."""
    try:
        conf.check_bare_memory(where or "job", overrides)
        if isinstance(job, conf.JobSpec):
            return conf.load_job(job, overrides, where=where)
        name, raw = conf.read_raw(overrides_mod.plain(job))      # read once: checked, then validated
        conf.check_bare_memory(where or name, raw)
        return conf.load_job(raw, overrides, where=where or name)
    except conf.JobError as e:
        raise YarnappError(str(e)) from None


@_one_line
def submit(job, backend=None, wait=False, progress=True, function=None, **overrides):
    """Start a job; return its Run. `job` is a job.yaml path, a dict or a conf.JobSpec.

    backend: 'local' or 'yarn' (default: the job's `backend`, else the defaults file's).
    wait: block until it ends (showing progress), raising JobFailed if it fails (its app_id:
        the application's); interrupted (Ctrl-C, or SIGTERM in a script, waiting in any
        thread: a sweep's pool), it kills the application, as `yarnapp submit --wait` does. A notebook's
        kernel restarted or shut down while it waits leaves the application running (as a
        closed terminal does): list_apps() finds it, kill(app_id) stops it.
    function: a callable(ctx) to run on every rank instead of the job's `run` (say, one
        defined in a notebook cell): it is pickled with cloudpickle and shipped.
    overrides: top-level job fields, e.g. max_restarts=1; a section given as a dict merges
    into the job's, e.g. checkpoint={"resume": "latest"}.
    """
    if not wait:
        return _submit(job, backend, wait, progress, function, overrides)
    with interrupts.submitting():       # (none starts while SIGTERM kills those waited for)
        return _submit(job, backend, wait, progress, function, overrides)


def _submit(job, backend, wait, progress, function, overrides):
    where = str(job) if isinstance(job, (str, os.PathLike)) else "job"
    if callable(backend):           # submit(JOB, train): the function taken for the backend
        name = getattr(backend, "__name__", None) or type(backend).__name__
        raise YarnappError(f"submit: backend: got {name}, a callable; pass the function by name: "
                           f"submit(job, function={name})")
    _check_keywords(overrides)
    if function is None:
        return _started(start(load(job, backend=backend, **overrides), where=where,
                              setting=overrides_mod.as_setting(overrides_mod.plain(overrides))), wait, progress)
    if not callable(function):
        raise YarnappError(f"function: expected a callable taking the RunContext, got {type(function).__name__}")
    _check_signature(function)
    import tempfile

    import cloudpickle
    try:
        where, raw = conf.read_raw(job)
    except conf.JobError as e:
        raise YarnappError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="yarnapp-fn-") as tmp:
        path = os.path.join(tmp, "function.pkl")
        user_run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
        if raw.get("training") or overrides.get("training"):
            log.warning("%s: training: not used: every rank runs the function given (function=%s), not the "
                        "built-in runner the section configures; drop it", where,
                        getattr(function, "__qualname__", None) or type(function).__name__)
        if user_run.get("args"):        # its script's command line (refused beside a function in a job.yaml)
            log.warning("%s: run.args: not used: the function given takes no command line; drop them", where)
        raw["run"] = {**user_run, "function": None, "script": None, "pickle": path, "args": []}
        spec = load(raw, where, backend=backend, **overrides)
        with open(path, "wb") as f:         # planned before it is written: what the job ships besides
            f.write(b"\x80")                # (a pickle's first byte, which the plan checks)
        shipment = shipping.plan(spec, where)
        codecheck.function_imports(function, shipment)
        _pickle(cloudpickle, function, path, shipping.local_modules(shipment))
        run = start(spec, where=where)      # ships it before tmp goes
    return _started(run, wait, progress)


def _check_keywords(overrides):
    """A keyword that is no job field but close to one of submit's own (wiat=True): said so,
    where the job's check would call it an unknown field of the job."""
    import difflib
    import inspect
    own = [p for p in inspect.signature(submit).parameters if p not in ("job", "overrides")]
    for key in overrides:
        close = difflib.get_close_matches(key, own, n=1) if key not in conf.JobSpec.model_fields else None
        if close:
            raise YarnappError(f"submit: {key}=: neither an argument of submit nor a field of the job; "
                               f"did you mean {close[0]}=?")


def _check_signature(function):
    """Refuse a function that cannot be called with the RunContext alone (every rank failed
    with "TypeError: f() takes 0 positional arguments but 1 was given")."""
    import inspect
    never_runs = _never_runs(function)
    if never_runs:
        raise YarnappError(f"function: {never_runs}")
    try:
        sig = inspect.signature(function)
    except (TypeError, ValueError):         # a builtin without a signature: left to the ranks
        return
    try:
        sig.bind(None)
    except TypeError:
        name = getattr(function, "__qualname__", None) or type(function).__name__
        raise YarnappError(f"function: {name}{sig} cannot be called with the RunContext alone; every rank "
                           f"calls it as {name}(ctx): give it one parameter (def {name.split('.')[-1]}(ctx): ...)"
                           ) from None


def _never_runs(function):
    """What is wrong with a function whose call runs none of its body (async def, a
    generator: every rank "succeeded" at once, a coroutine never awaited), or None."""
    from launcher.user_errors import function_kind, never_ran
    kind = function_kind(function)          # (not unwrapped: a wrapper may run its coroutine itself)
    return never_ran(getattr(function, "__qualname__", None) or type(function).__name__, kind) if kind else None


def _pickle(cloudpickle, function, path, local=()):
    """Pickle `function` to `path`, or say in one line why it cannot be shipped: what it
    captures (its closure, the globals it uses) goes with it. What it uses from `local`,
    modules the containers cannot import (a notebook's helpers.py beside it, not shipped),
    goes by value too (cloudpickle's register_pickle_by_value): by name it would fail to
    load in every container."""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    already = getattr(getattr(cloudpickle, "cloudpickle", None), "_PICKLE_BY_VALUE_MODULES", set())
    added = []
    if local:
        log.info("function: %s from this machine's %s travel by value", name, ", ".join(m.__name__ for m in local))
    try:
        for module in local:
            if module.__name__ not in already:
                cloudpickle.register_pickle_by_value(module)
                added.append(module)
        with open(path, "wb") as f:
            cloudpickle.dump(function, f)
    except Exception as e:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError...
        used = _used(function, local)
        also = (f"; or ship {', '.join(used)} in run.files: what the function uses of it goes "
                f"with it by value, module-level objects and all" if used else "")
        raise YarnappError(f"function: {name} cannot be pickled to ship it ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}): what it captures, its closure and the "
                           f"globals it uses, goes with it; create such objects (locks, open files, "
                           f"connections) inside the function{also}") from None
    finally:
        for module in added:
            cloudpickle.unregister_pickle_by_value(module)
    size = os.path.getsize(path)
    if size > shipping.LIMIT_BYTES:
        raise YarnappError(f"function: {name} pickles to {size / 2**20:.0f} MiB with what it captures (its closure "
                           f"and the globals it uses), more than the {shipping.LIMIT_BYTES // 2**20} MiB of code yarnapp "
                           f"ships; load large data inside the function (from a URI) instead of capturing it")


def _used(function, local):
    """The names of the `local` modules that `function`'s globals and closure come from
    (what it reaches further in is not looked into: a lock of the notebook's own named none)."""
    names = {m.__name__ for m in local}
    found = set()
    used = [getattr(function, "__globals__", {}).get(attr)
            for attr in getattr(getattr(function, "__code__", None), "co_names", ())]
    for cell in getattr(function, "__closure__", None) or ():
        try:
            used.append(cell.cell_contents)
        except ValueError:          # a cell not yet filled
            pass
    for value in used:
        module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(module, str) and module.split(".")[0] in names:
            found.add(module.split(".")[0])
    return sorted(found)


def _started(run, wait, progress):
    if wait:
        terminated = []
        restore = interrupts.sigterm_interrupts(terminated)
        try:
            with interrupts.waited(run):    # (SIGTERM kills it, waited for off the main thread too)
                st = run.wait(progress=progress, summary=False)    # a failure is raised, not said twice
        except KeyboardInterrupt:   # as `yarnapp submit --wait`: the caller never got the Run to stop it
            if interrupts.kernel_shutting_down():
                raise Interrupted(f"the kernel is shutting down; {run.app_id} runs on: "
                                  f"yarnapp.kill({run.app_id!r}) stops it", app_id=run.app_id) from None
            interrupts.shielded(run.kill)
            if terminated:          # then ends as SIGTERM's default would, the applications stopped first
                restore()
                print(f"terminated: killed {run.app_id}", file=sys.stderr, flush=True)
                interrupts.kill_waited()        # (other threads': its own left `waited` as it was interrupted)
                interrupts.terminate()
            raise Interrupted(f"interrupted: killed {run.app_id}", app_id=run.app_id) from None
        finally:
            restore()
        if st["state"] != "SUCCEEDED":
            raise JobFailed(run.failure_message(), app_id=run.app_id)
        if progress:                # (its warnings were said while it waited)
            from .progress import Progress
            shown = Progress(run)
            shown.end(st, notices=False)
            shown.close()
    return run


def dry_run(spec, where="job"):
    """What submitting `spec` would send, as text, starting and writing nothing: on YARN the
    skein.ApplicationSpec YAML; on the local engine (which runs no skein spec) the resolved job."""
    if spec.backend == "yarn":
        from .backends import yarn
        return yarn.dry_run(spec, where)
    import yaml

    from .backends.local.engine import checked
    spec = checked(spec, where).job         # as submit would: relative paths resolved, `latest` decided
    return (f"# {where}: the resolved job the local engine would run (no skein spec: it runs its own "
            f"application master)\n" + yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))


def start(spec, where="job", setting=()):
    """Start a validated JobSpec on its backend; `where` names its source in errors.
    `setting`: the command line's arguments after the job's file that set its fields
    (KEY=VALUE, --nodes N), kept to say how to submit it again (a kill's resume hint)."""
    be = backends.get(spec.backend)
    return Run(be.submit(spec, where=where, setting=setting), be, spec)


class Run:
    """Handle of a submitted application: status(), wait(), logs(), kill()."""

    def __init__(self, app_id, backend=None, spec=None):
        if not isinstance(app_id, str) or not app_id.strip():
            raise YarnappError(f"Run({app_id!r}): give an application id, as submit's Run.app_id or "
                               f"`yarnapp list` shows it")
        if app_id.endswith("/") and app_id.strip("/"):
            app_id = app_id.rstrip("/")     # (a shell's completion of apps/app_.../)
        self.app_id = app_id
        self.backend = backend or backend_for(app_id)
        self.spec = spec
        self._last = None

    def __repr__(self):
        return f"Run({self.app_id!r}, state={self.state!r})"

    @_one_line
    def status(self):
        """The application's record, as `yarnapp status --json` prints it. Always: app_id,
        name, state (NEW | ACCEPTED | RUNNING | SUCCEEDED | FAILED | KILLED), submitted (epoch
        seconds), diagnostics (one line), containers (id, group, instance, rank, state,
        exit_code, resources...), restarts (each: generation, reason, ...), progress ({rank:
        its last record: step, total_steps, epoch, loss, accuracy...}), final (None until it
        SUCCEEDED: the run's metrics, and the built-in runner's model_uri), notices (the
        ranks' warnings). Where known: failure (the root cause: container, rank, reason),
        tensorboard (its URL), world_formed_s, finished. Numbers a run could not compute
        are nan here, null in the JSON."""
        self._last = self.backend.status(self.app_id)
        return self._last

    @property
    def state(self):
        return self.status()["state"]

    @property
    def final(self):
        return self.status().get("final")

    @_one_line
    def logs(self, container=None, tail=None):
        """Each container's log ({container id: its text}; `container`: that one's only), where
        what the code prints goes, beside the launcher's lines; `tail`: its last lines only
        (read from the end of a local log, not the whole of it)."""
        files = self.log_files(container) if tail is not None else None
        if files is None:
            return {c: logview.tail_text(t, tail) for c, t in self.backend.logs(self.app_id, container).items()}
        return logview.read_logs(files, tail)

    @_one_line
    def log_files(self, container=None):
        """{container id: the path of its log} where the logs are files here (the local
        engine), else None."""
        return self.backend.log_files(self.app_id, container)

    @_one_line
    def kill(self):
        return self.backend.kill(self.app_id)

    @_one_line
    def tensorboard(self, port=0):
        """Start TensorBoard on this application's logdir (its runs side by side with the
        experiment's others); returns a handle with `.url` and `.stop()`. In a Jupyter
        notebook it is also displayed inline."""
        from . import tensorboard
        tb = tensorboard.for_app(self.app_id, port=port, backend=self.backend)
        tensorboard.show_in_notebook(tb)
        return tb

    @_one_line
    def wait(self, timeout=None, progress=False, interval=0.2, summary=True):
        """Block until the application ends; return its last status. progress: show a bar
        (a widget in a notebook) and what rank 0's code prints (the local engine), and, with
        summary, a last line of how it ended: the final metrics, or why it failed. Interrupted (Ctrl-C, a notebook's interrupt), it stops
        waiting and leaves the application running: kill() stops it. (submit(..., wait=True)
        interrupted kills it, as `yarnapp submit --wait`.)"""
        from .progress import Progress
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise YarnappError(f"wait(timeout={timeout!r}): give seconds, a number of 0 or more (or None: no limit)",
                               app_id=self.app_id)
        display = Progress(self) if progress else None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                st = self.status()
                if display:
                    display.update(st)
                if st["state"] in TERMINAL:
                    if display and summary:
                        display.end(st)
                    elif not display:       # said nowhere else: a notebook shows Python's warnings
                        from .progress import notice
                        for n in st.get("notices") or []:
                            warnings.warn(f"{self.app_id}: {notice(n)}", RuntimeWarning, stacklevel=3)   # (_one_line)
                    return st
                if deadline and time.monotonic() > deadline:
                    late = WaitTimeout(f"{self.app_id} still {st['state']} after {timeout:g}s; it runs on "
                                       f"(Run.kill() stops it)", app_id=self.app_id)
                    late.state = st["state"]
                    raise late
                time.sleep(interval)
        except KeyboardInterrupt:
            raise Interrupted(f"stopped waiting for {self.app_id}, which runs on: "
                              f"Run({self.app_id!r}).kill() stops it", app_id=self.app_id) from None
        finally:
            if display:
                display.close()

    def failure_message(self, resubmit=None):
        """Why the application failed, in one line; None while it runs or once it succeeded.
        Where it left a complete checkpoint, the line ends with how to go on from it:
        `RESUBMIT --resume APP_ID` (resubmit: the command that submitted it, e.g.
        "yarnapp submit job.yaml"), else submit's checkpoint={"resume": APP_ID}."""
        st = self._last if self._last and self._last["state"] in TERMINAL else self.status()
        if st["state"] not in ("FAILED", "KILLED"):
            return None
        if st["state"] == "KILLED":
            return f"{self.app_id} was killed{self.resume_hint(resubmit)}"
        f = st.get("failure") or {}
        where = f" — log: {f['log']}" if f.get("log") else ""
        attempts = f" after {f['attempts']} attempt(s)" if f.get("attempts") else ""
        return (f"{self.app_id} FAILED{attempts}: {f.get('reason') or st.get('diagnostics') or 'unknown'}"
                f"{where} (see `yarnapp logs {self.app_id} --container {f.get('container', '<id>')}`)"
                f"{self.resume_hint(resubmit)}")

    def _checkpoints(self):
        """(its job, where it checkpoints): (None, None) where this handle cannot tell. The job
        the backend kept first: its paths were made absolute at submit, where spec's relative
        checkpoint.uri would be read from wherever the client runs now."""
        job = self.backend.job_of(self.app_id) or self.spec
        return job, (self.backend.checkpoints_of(self.app_id, job) if job is not None else None)

    @_one_line
    def model(self):
        """The model this application trained (training.trained.TrainedModel: `.module`,
        `.classes`, `.predict(images)` with the run's test transforms and normalisation).
        The built-in runner's applications; one that ended its training."""
        from training import trained
        state = self.state
        if state not in TERMINAL:
            raise YarnappError(f"{self.app_id} is still {state}: its final model is written as its training ends; "
                               f"wait() for it first", app_id=self.app_id)
        job, root = self._checkpoints()
        if root is None:
            raise YarnappError(f"{self.app_id}: where it checkpoints is not known here (a YARN application's job is "
                               f"not kept); use yarnapp.Run(app_id, spec=its job), or training.trained.load(<its "
                               f"checkpoint.uri>/{self.app_id})")
        if job.run.function != conf.BUILTIN_RUNNER:
            raise YarnappError(f"{self.app_id}: ran its own code ({job.run.script or job.run.function or 'a function'}"
                               f"), which saves its models itself; Run.model() is the built-in runner's")
        try:
            return trained.load(root)
        except (OSError, ValueError) as e:      # pyarrow's filesystem errors are OSErrors and ValueErrors
            if isinstance(e, YarnappError):
                raise
            raise YarnappError(f"{self.app_id}: cannot read its final model under {root}: "
                               f"{' '.join(str(e).split())[:200]}") from None

    def last_checkpoint(self):
        """The step of this application's newest complete checkpoint; None where it has none,
        or where this handle cannot tell (made from a YARN application id alone: its job is
        not kept)."""
        return self._last_checkpoint()[0]

    def _last_checkpoint(self):
        """(step or None, where its checkpoints are that could not be read now, or None)."""
        from conf.paths import is_local
        from launcher.identity import complete_steps
        root = None
        try:
            from training import fsutil         # (pyarrow: a client environment may lack it)
            job, root = self._checkpoints()
            if root is None or job.run.function != conf.BUILTIN_RUNNER:     # (own code resumes its own way)
                return None, None
            fs, path = fsutil.resolve(root)
            steps = complete_steps(fsutil.listdir(fs, path))
        except Exception as e:          # unreachable storage, a job kept that no longer loads: the
            log.debug("no checkpoints of %s readable: %s", self.app_id, e)   # failure's line stands
            return None, root if root and not is_local(root) else None
        return (steps[-1] if steps else None), None

    def resume_hint(self, resubmit=None):
        """'; its last complete checkpoint is step N: ... goes on from it', or '' (see failure_message).
        Where its training had ended (rank 0's final record: a kill a moment after), it says so
        instead: resuming would train 0 steps."""
        try:
            st = self._last if self._last and self._last["state"] in TERMINAL else self.status()
        except Exception:  # noqa: BLE001 - a hint never hides the line it ends
            st = {}
        final = st.get("final")
        if final and final.get("steps") is not None:
            return f"; its training had ended (step {final['steps']}): its model and final metrics are kept"
        step, unread = self._last_checkpoint()      # None on any error: a hint never hides the line it ends
        how = (f"`{resubmit} --resume {self.app_id}`" if resubmit else
               f"submit(..., checkpoint={{'resume': '{self.app_id}'}})")
        progress = st.get("progress") or {}
        # Known where the local engine keeps it, or YARN's storage held it (not for a kill, nor with HDFS down)
        untrained = (progress or self.backend.name == "local") and not any((p or {}).get("step")
                                                                         for p in progress.values())
        if unread and not untrained:    # (HDFS down as it failed: the hint was lost when it mattered most;
            # not where no step was trained: an unreachable checkpoint.uri failed it as it started)
            return f"; its checkpoints ({unread}) cannot be read now: once they can, {how} goes on from the last " \
                   f"complete one"
        if step is None:
            return ""
        return f"; its last complete checkpoint is step {step}: {how} goes on from it"


@_one_line
def status(app_id):
    return Run(app_id).status()


@_one_line
def list_apps(backend="local"):
    return backends.get(backend).list()


@_one_line
def kill(app_id):
    return Run(app_id).kill()


@_one_line
def clean(apps=(), older_than=None, dry_run=False):
    """Remove finished applications of the local engine (their directories under
    YARNAPP_HOME: logs, store, staged files, and the checkpoints and TensorBoard runs kept
    there; a job's own checkpoint.uri and tensorboard.logdir are left alone): those named
    (an id, or several), or every one that ended more than `older_than` ago (a duration:
    '7d', '12h', seconds; 0: every finished one). All named are checked before any is
    removed: one still running, or whose checkpoints a live application resumes from,
    refuses the lot; by age, such a one is kept, with a warning. Returns [(app_id, name,
    state, bytes)], removed (or, dry_run, that would be), bytes the disk freed; what one
    wrote under the job's own checkpoint.uri or tensorboard.logdir on this machine is left,
    with a warning naming it. A directory a submit killed part way left (no app.json) goes
    too. YARN keeps and deletes its applications' logs itself (its log-aggregation retention)."""
    from . import cleaning
    return cleaning.clean(apps, older_than, dry_run)
