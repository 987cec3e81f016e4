"""The job's own code in a rank: its entry point (run.function, run.pickle, or run.script),
loaded or named in one line where it cannot be; how it is run (a script as `python
script.py` in a private copy of its directory; a function called with the RunContext);
and rank 0's return value kept as the run's final (launcher.rank calls these)."""
import importlib
import inspect
import logging
import os
import runpy
import shutil
import stat
import sys

from conf.errors import YarnappError

from .user_errors import function_kind, never_ran

log = logging.getLogger("launcher.rank")


class UserCodeError(YarnappError):
    """The job's code could not be found or loaded; str() is the one-line reason."""


def entry_point(job, workdir):
    """The callable(ctx) of run.function / run.pickle, or None for run.script (whose file
    is checked). Raises UserCodeError naming the field and the cause."""
    run = job.run
    if run.function:
        module = run.function.split(":")[0]
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise UserCodeError(f"run.function {run.function}: {type(e).__name__}: {e}; install it, or ship it "
                                f"with the job (run.files)") from e
        except Exception as e:  # noqa: BLE001 - the module's own top level raised
            from training.context import NoContext
            if isinstance(e, NoContext) or (isinstance(e, KeyError) and e.args and e.args[0] in WORLD_ENV):
                return Later(run.function)      # it needs the world (a Horovod-style init())
            raise UserCodeError(f"run.function {run.function}: importing {module} raised "
                                f"{type(e).__name__}: {e}") from e
        return _function(run.function, mod)
    if run.pickle:
        import cloudpickle
        path = os.path.join(workdir, run.pickle)
        try:
            with open(path, "rb") as f:
                return cloudpickle.load(f)
        except Exception as e:  # noqa: BLE001 - any unpickling error is the job's
            hint = ""
            if isinstance(e, ModuleNotFoundError) and e.name:   # imported by the function: not by value
                hint = (f"; install it in the environment, or ship it: yarnapp.submit(job, function=f, "
                        f"run={{'files': ['{e.name.split('.')[0]}.py']}}) (or its package directory)")
            raise UserCodeError(f"run.pickle {run.pickle}: cannot load the shipped function: "
                                f"{type(e).__name__}: {e}{hint}") from e
    path = script_path(job, workdir)
    if not os.path.isfile(path):
        raise UserCodeError(f"run.script {run.script}: no such file in the container ({path})")
    return None


def _function(spec, mod):
    """run.function `spec`'s callable in its imported module `mod`."""
    module, func = spec.split(":")
    try:
        fn = getattr(mod, func)
    except AttributeError:
        raise UserCodeError(f"run.function {spec}: module {module} has no {func!r}") from None
    if not callable(fn):
        raise UserCodeError(f"run.function {spec}: {func} is not callable")
    return fn


WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


class Later:
    """run.function's module, whose top-level code needed the world as it was imported
    before the MPI world formed (training.dist.init() at the top, as under Horovod: it
    raised "no yarnapp RunContext" inside one; os.environ["RANK"], set with the world):
    imported again once this rank's RunContext and environment are set (run_code), as a
    script's top level runs. Its top level up to that line runs twice. What it raises then
    is the job's own error."""

    def __init__(self, spec):
        self.spec = spec

    def load(self):
        return _function(self.spec, importlib.import_module(self.spec.split(":")[0]))


def _never_ran_kind(fn, result):
    """"async def", "generator", "async generator" where calling `fn` ran none of its body, or
    None: a coroutine returned is one never awaited; a generator only where `fn` (through its
    wrappers) is a generator function (a plain def may return a generator as its result)."""
    inner = inspect.unwrap(fn) if callable(fn) else fn
    if not inspect.isfunction(inner) and not inspect.ismethod(inner):    # an object's __call__, a partial
        inner = getattr(inner, "func", None) or getattr(type(inner), "__call__", inner)
    if inspect.iscoroutine(result):
        return "async def"
    kind = function_kind(inner)
    return kind if kind != "async def" and (inspect.isgenerator(result) or inspect.isasyncgen(result)) else None


def script_path(job, workdir):
    return os.path.join(workdir, job.run.script)


def run_code(job, ctx, fn):
    from training import context as context_mod
    context_mod._set_current(ctx)
    if os.environ.get("YARNAPP_UMASK"):     # the local engine's submitter's (its own files are under 077)
        os.umask(int(os.environ["YARNAPP_UMASK"], 8))
    if isinstance(fn, Later):
        fn = fn.load()
    if fn is not None:
        result = fn(ctx)
        kind = _never_ran_kind(fn, result)
        if kind:            # (a wrapped run.function: submit could not tell from its source)
            getattr(result, "close", lambda: None)()         # (no "never awaited" warning besides)
            raise YarnappError(never_ran(getattr(fn, "__qualname__", "run.function"), kind))
        if result is not None and not ctx.finished:    # a notebook function's result, as Hopsworks keeps it
            keep_result(ctx, result)
        return result
    path = script_path(job, ctx.workdir)
    here = os.path.dirname(os.path.abspath(path))
    sys.argv = [path] + list(job.run.args)
    sys.path.insert(0, here)                    # as `python script.py` does
    if job.run.files is None:                   # its directory was shipped for it (yarnapp.shipping):
        os.chdir(private_copy(here, ctx.workdir))   # run in the copy, as `python script.py` there
    runpy.run_path(path, run_name="__main__")


def keep_result(ctx, result):
    """Rank 0's return value as its final, when it called no ctx.final: a dict's scalar
    values (numbers, booleans, short text; numpy and torch numbers too), or a scalar as
    {"result": value}. Anything larger (a state_dict, an array) is left out with a warning:
    the final is a few numbers in the store, not a channel for tensors."""
    from training.context import plain

    def scalar(v):
        if not (isinstance(v, (bool, int, float, str)) or hasattr(v, "item")):
            return False, v     # a model, a list, an object: its text is no result (plain() would give it)
        v = plain(v)
        return isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200), v
    items = result.items() if isinstance(result, dict) else [("result", result)]
    kept, left = {}, []
    for k, given in items:
        ok, v = scalar(given) if isinstance(k, str) else (False, given)
        if ok:
            kept[k] = v
        else:
            try:
                shape = f" of shape {tuple(given.shape)}" if hasattr(given, "shape") else ""
            except Exception:  # noqa: BLE001 - a .shape of another kind: its type says enough
                shape = ""
            left.append(f"{k} ({type(given).__name__}{shape})")
    if left and ctx.rank == 0:
        log.warning("the function's return value: %s not kept (only numbers and short text are; pass "
                    "what you need to ctx.final, or save it under ctx.checkpoint_uri)", ", ".join(left[:5]))
    if kept:
        try:
            ctx.final(**kept)
        except Exception as e:  # noqa: BLE001 - the code is done; its result is a courtesy
            log.warning("the function's return value was not kept: %s", e)


def private_copy(here, workdir):
    """`here` if this container owns it (the local engine copies the files into each
    container), else a copy of it in the working directory: YARN localizes a shipped
    directory once per node, read-only, and links it into every container, where a
    script's relative writes would fail or meet the other ranks' on the node."""
    real = os.path.realpath(here)
    if real == here or real.startswith(os.path.realpath(workdir) + os.sep):
        return here
    mine = os.path.join(workdir, f".run-{os.path.basename(here)}")
    if not os.path.isdir(mine):
        shutil.copytree(real, mine, symlinks=True)
        for root, dirs, files in os.walk(mine):     # localized files are read-only (0500)
            for path in [root] + [os.path.join(root, n) for n in dirs + files]:
                if not os.path.islink(path):
                    os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)
    return mine
