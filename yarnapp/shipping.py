"""Ship the user's code into every container.

What goes (`plan`):
    run.files       the files and directories job.yaml names (null: a script's own
                    directory when run.script is given, else nothing); each lands
                    under its own name in the container's working directory
    editable        every package installed in editable mode (`pip install -e`) in this
                    environment, yarnapp's own excepted, as its top-level import
                    packages (found the way cluster-pack's get_editable_requirements
                    does: the distribution's direct_url.json, then find_packages)
    run.pickle      a function pickled with cloudpickle (the Python API writes it for
                    `yarnapp.submit(job, function=f)`: a notebook cell's function travels
                    by value, and so does what it uses of modules the containers cannot
                    import: `local_modules`)

The working directory is on PYTHONPATH in every container (launcher.agent), and a
script runs with its own directory first on sys.path, as `python script.py` does. A
script whose directory was shipped for it (run.files null), submitted from that directory,
runs in the directory's copy, so it opens the files beside it by their names; otherwise
it runs in the working directory, where the entries are.
On the local engine the shipment is staged in the application's directory at submit
and copied into each container's working directory; on YARN every entry is a skein
file that the NodeManager localizes (a directory travels as a zip archive, unpacked
under its name).

The job the containers read names the shipped copies: run.script and run.pickle
become paths relative to the working directory.
"""
import contextlib
import dataclasses
import functools
import importlib.machinery
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import types
import urllib.parse
import urllib.request

from conf import BUILTIN_RUNNER

from . import codecheck
from .errors import YarnappError

log = logging.getLogger(__name__)

LIMIT_BYTES = 200 * 2**20          # code, not data: more than this is refused
SKIP = {"__pycache__", ".git", ".hg", ".svn", ".ipynb_checkpoints", ".pytest_cache", ".mypy_cache",
        ".DS_Store", ".venv", "node_modules"}
PRODUCT = {"yarnapp"}              # distributions never shipped: the environment brings them
PICKLE_NAME = "function.pkl"


@dataclasses.dataclass
class Shipment:
    job: object                    # conf.JobSpec as the containers read it
    entries: dict                  # {name in the working directory: local source path}

    def total_bytes(self):
        return sum(_size(p) for p in self.entries.values())


def _skip(name):
    return name in SKIP or name.endswith((".pyc", ".pyo"))


def _private():
    """Directories of yarnapp's own that a shipped tree may contain but must never carry:
    the local engine's home (applications, their stores and copies) and the cache."""
    from .backends.local.state import home
    from .packaging import cache_dir
    return tuple(os.path.realpath(p) for p in (home(), cache_dir()))


def _ignore(root_dir, names):
    """shutil.copytree's ignore: junk, and yarnapp's private directories."""
    private = _private()
    return {n for n in names if _skip(n) or os.path.realpath(os.path.join(root_dir, n)) in private}


def _size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d not in _ignore(root, [d])]
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if not _skip(f) and os.path.isfile(os.path.join(root, f)))
    return total


def editable_packages(exclude=PRODUCT):
    """{top-level import package: its directory} of this environment's editable installs."""
    out = {}
    for dist in importlib.metadata.distributions():
        try:        # (read first: the few installs that have it; each METADATA parsed took a submit 0.1 s)
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if not info.get("dir_info", {}).get("editable") or (dist.metadata["Name"] or "").lower() in exclude:
            continue
        from setuptools import find_packages     # (0.2 s to import: only where there is one)
        url = urllib.parse.urlparse(info.get("url", ""))
        location = urllib.request.url2pathname(url.path) if url.scheme == "file" else None
        if not location or not os.path.isdir(location):
            continue
        for root in (location, os.path.join(location, "src")):
            for pkg in find_packages(root):
                if "." not in pkg:
                    out.setdefault(pkg, os.path.join(root, pkg))
    return out


def plan(job, where=None):
    """The Shipment of `job` (a conf.JobSpec with absolute local paths: conf.absolutize).

    Raises YarnappError naming the field (after `where`, the job's file) for anything
    missing, clashing or too big.
    """
    try:
        return _plan(job, where)
    except YarnappError as e:
        if where:
            raise YarnappError(f"{where}: {e}") from None
        raise


def _plan(job, where=None):
    run = job.run
    entries = {}

    def add(name, path, field):
        path = os.path.abspath(path)
        if not os.path.exists(path):
            fix = "list only files and directories that do" if field == "run.files" else "give the file's path"
            raise YarnappError(f"{field}: {path} does not exist; {fix}")
        if name in entries and entries[name] != path:
            raise YarnappError(f"{field}: {path} and {entries[name]} would both land as {name!r} in the "
                               f"container; rename one, or ship their common parent directory")
        entries[name] = path

    if run.script and not os.path.isfile(run.script):
        what = "is a directory" if os.path.isdir(run.script) else "does not exist"
        home = os.path.dirname(os.path.abspath(where)) if where and os.path.isfile(where) else None
        near = os.path.join(home, os.path.relpath(run.script)) if home else None
        hint = (f"; there is {near}, but paths in a job file are relative to the directory you submit from: "
                f"submit from {home} (the job file's directory), or give the path from here"
                if near and os.path.isfile(near) else "; name the Python file the job runs")
        raise YarnappError(f"run.script: {run.script} {what}{hint}")
    files = run.files
    if files is None and run.script:
        files = [os.path.dirname(run.script)]
    for f in files or []:
        add(os.path.basename(f.rstrip(os.sep)) or f, f, "run.files")
    script = None
    if run.script:
        script = _inside(run.script, entries)
        if script is None:
            add(os.path.basename(run.script), run.script, "run.script")
            script = os.path.basename(run.script)
    if run.editable:
        for name, path in sorted(editable_packages().items()):
            if name not in entries:
                entries[name] = path
    pickle = None
    if run.pickle:
        add(PICKLE_NAME, run.pickle, "run.pickle")
        if os.path.isfile(run.pickle):
            with open(run.pickle, "rb") as f:
                first = f.read(1)
            if first != b"\x80":           # protocol 2 and up, as cloudpickle writes
                raise YarnappError(f"run.pickle: {run.pickle} is not a pickle; give a file written with "
                                   f"cloudpickle.dump(function, f), or use run.function or run.script")
        pickle = PICKLE_NAME
    for name, path in entries.items():
        size = _size(path)
        if size > LIMIT_BYTES and run.files is None and run.script and path == os.path.dirname(run.script):
            raise YarnappError(f"run.script: its directory {path}, shipped whole as run.files is not set, holds "
                               f"{size / 2**20:.0f} MiB, more than the {LIMIT_BYTES // 2**20} MiB of code yarnapp "
                               f"ships; list the code it needs in run.files, and put data on a URI (training.data)")
        if size > LIMIT_BYTES:
            raise YarnappError(f"run.files: {path} holds {size / 2**20:.0f} MiB, more than the "
                               f"{LIMIT_BYTES // 2**20} MiB of code yarnapp ships; list only code in run.files "
                               f"and put data on a URI (training.data)")
    _check_stdlib_names(job, entries)
    _check_importable(job, entries, where)
    if run.script and not _other_interpreter(job):
        codecheck.syntax(run.script)        # (another interpreter may read other syntax)
        codecheck.warnings(run.script)
    codecheck.own_names(run, entries, "run.files" if run.files else "run.script")
    codecheck.unshipped_imports(Shipment(job=job, entries=entries), "run.files")
    # files null with a script: its directory was shipped for it and the job submitted from
    # that directory, so it runs in the copy (launcher.user_code.run_code), as `python script.py`
    # run there; otherwise in the working directory, where each entry lands by its name (as
    # `python dir/script.py` from the directory above it).
    in_its_dir = bool(run.files is None and run.script and
                      os.path.realpath(os.path.dirname(run.script)) == os.path.realpath(os.getcwd()))
    listed = sorted(entries) if entries and not in_its_dir else None
    shipped = job.model_copy(update={"run": run.model_copy(update={
        "script": script, "pickle": pickle, "files": listed})})
    return Shipment(job=shipped, entries=entries)


def _other_interpreter(job):
    """Whether the containers run an interpreter other than this environment's, whose
    modules and syntax are not known here: on YARN, environment.archive, or packer none
    (the cluster's python3)."""
    return job.backend == "yarn" and bool(job.environment.archive or job.environment.packer == "none")


def _named_code(job):
    """[(field, 'package.module:name')] of the code the job names for the containers to
    import: run.function, and what the built-in runner imports (None where a field is unset
    or names a built-in model)."""
    t = job.training
    named = [("run.function", job.run.function)]
    if t is not None and job.run.function == BUILTIN_RUNNER:
        named += [("training.model", t.model if ":" in t.model else None),
                  ("training.data.dataset", t.data.dataset), ("training.data.transform", t.data.transform)]
    return named


def _check_stdlib_names(job, entries):
    """Refuse Python code shipped under the name of a module of Python's own: a `random.py`
    or a package `code/__init__.py` would shadow it (the working directory comes first on
    the containers' sys.path, so every import of that name, torch's included, gets the
    user's), and a job naming `code.net:make` in a folder `code/` without __init__.py gets
    Python's ("No module named 'code.net'; 'code' is not a package")."""
    tops = {target.split(":")[0].split(".")[0] for _, target in _named_code(job) if target}
    for name, path in entries.items():
        mod = module_name(name)
        if mod not in sys.stdlib_module_names or name == PICKLE_NAME:
            continue
        if name.endswith(".py") or os.path.isfile(os.path.join(path, "__init__.py")) or mod in tops:
            raise YarnappError(f"run.files: {path} would be imported as {mod!r} in the containers, the name of "
                               f"Python's own module {mod}; rename it (every import of {mod}, torch's included, "
                               f"would meet it)")


def _check_importable(job, entries, where=None):
    """Refuse a 'module:function' (run.function, a model factory, a dataset or transform)
    whose top-level module the containers could not import: neither shipped (run.files, the
    editable packages; a .py file, a package, a compiled extension) nor on a PYTHONPATH a
    group sets (a relative entry is the container's working directory's, where the shipped
    entries land) nor installed in this environment, which the containers run in (the local
    engine's own, YARN's packed copy). Found without importing it (find_spec); a module that
    is there but fails as it imports is the container's to report. Where what the
    containers can import is not known here (YARN's containers running another environment:
    environment.archive, or packer none, the cluster's python3; an absolute PYTHONPATH on
    YARN's nodes), nothing is refused."""
    if _other_interpreter(job):
        return
    paths = _group_paths(job, entries)
    if paths is None:
        return
    shipped = {module_name(n): src for n, src in entries.items()}
    for field, target in _named_code(job):
        top = (target or "").split(":")[0].split(".")[0]
        if not top:
            continue
        if top in shipped:
            src = shipped[top]
            codecheck.attribute(field, target, None if os.path.isdir(src) else src,
                                [src] if os.path.isdir(src) else None)
            continue
        spec = _container_spec(top, paths, job.backend == "yarn")
        if spec is not None:
            codecheck.attribute(field, target, spec.origin if spec.has_location else None,
                                list(spec.submodule_search_locations or []) or None)
            continue
        beside = os.path.dirname(os.path.abspath(where)) if where and os.path.isfile(where) else None
        dirs = [(src, name) for name, src in entries.items() if os.path.isdir(src)]
        dirs += [(d, None) for d in dict.fromkeys((os.getcwd(), beside)) if d]
        found = next(((os.path.join(d, top + ext), name) for d, name in dirs for ext in (".py", "")
                      if os.path.exists(os.path.join(d, top + ext))), None)
        if top == "__main__":       # a notebook's or a script's own function, named as a module's
            hint = (f"; a function of a notebook or of the running script is shipped by value: "
                    f"yarnapp.submit(job, function={target.split(':')[-1]})")
        elif found and found[1]:    # inside a shipped directory, which is not itself on sys.path
            hint = f"; it is in the shipped {found[1]}/: name it {found[1]}.{target}, or ship {found[0]} itself"
        elif found:
            hint = f"; there is {found[0]}: add it to run.files"
        else:
            hint = "; install it, or ship it with the job (run.files: its .py file or package directory)"
        raise YarnappError(f"{field}: {target}: no module named {top!r} in this environment or in what the "
                           f"job ships{hint}")


@contextlib.contextmanager
def importable(shipment):
    """The job's own modules importable in this process, and in the processes it starts
    (the planner's probes), as the containers import them: the directory of each shipped
    entry and a group's PYTHONPATH first on sys.path and PYTHONPATH. The shipped modules
    are imported afresh from their files (a notebook's copy, imported before an edit, is
    not what the containers run), and afterwards sys.path, PYTHONPATH and those modules are
    as they were."""
    dirs = [os.path.dirname(src) for src in shipment.entries.values()]
    dirs = list(dict.fromkeys(dirs + (_group_paths(shipment.job, shipment.entries) or [])))
    tops = {module_name(n) for n in shipment.entries}

    def shipped():
        return {k: m for k, m in sys.modules.items() if k.partition(".")[0] in tops}
    saved_path, saved_env, saved_modules = list(sys.path), os.environ.get("PYTHONPATH"), shipped()
    for k in saved_modules:
        del sys.modules[k]
    sys.path[:0] = dirs
    os.environ["PYTHONPATH"] = os.pathsep.join(dirs + ([saved_env] if saved_env else []))
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
        for k in shipped():
            del sys.modules[k]
        sys.modules.update(saved_modules)


def module_name(entry):
    """The module a shipped entry is imported as: 'm' for m.py and m.cpython-311-....so."""
    for suffix in sorted(importlib.machinery.all_suffixes(), key=len, reverse=True):
        if entry.endswith(suffix):
            return entry[:-len(suffix)]
    return entry


def _group_paths(job, entries):
    """The local directories behind the PYTHONPATH the groups set (groups[].env), which the
    containers search too: an absolute one as it is (None on YARN: the nodes' own), a
    relative one inside the shipped entry it names (None where it names none)."""
    paths = []
    for group in job.groups:
        for p in (group.env.get("PYTHONPATH") or "").split(os.pathsep):
            if not p or p == ".":
                continue
            if os.path.isabs(p):
                if job.backend == "yarn":
                    return None
                paths.append(p)
                continue
            head, _, rest = os.path.normpath(p).partition(os.sep)
            if head not in entries:
                return None
            paths.append(os.path.join(entries[head], rest))
    return paths


def _container_spec(top, paths=(), yarn=False):
    """The spec under which the containers' interpreter finds top-level module `top`, found
    without importing it: a fresh interpreter's finders (built-ins, editable installs'
    hooks) over its sys.path and `paths`. What this process added is left out: the working
    directory that a notebook, `python -m` or a script's own directory puts first on
    sys.path, and entries added at run time; on YARN (`yarn`) the client's PYTHONPATH too,
    which its containers are not given (yarnapp.backends.yarn: the groups' env only)."""
    fresh_path, finders = _fresh_interpreter(yarn)
    try:
        for finder in sys.meta_path:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(top, [*fresh_path, *paths])
            elif getattr(finder, "__module__", None) in finders and hasattr(finder, "find_spec"):
                spec = finder.find_spec(top, None)
            else:
                continue
            if spec is not None:
                return spec
    except (ImportError, ValueError):
        pass
    return None


@functools.cache
def _fresh_interpreter(yarn=False):
    """(sys.path, the modules of the meta-path finders) of a fresh interpreter of this
    environment, as a container starts one, its own first entry ('' for -c) left out: the
    local engine's containers inherit this process's environment, YARN's get no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not (yarn and k == "PYTHONPATH")}
    code = ("import json, sys; print(json.dumps([sys.path[0 if sys.flags.safe_path else 1:], "
            "[getattr(f, '__module__', '') for f in sys.meta_path]]))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                             check=True, cwd=os.path.dirname(os.path.abspath(sys.executable))).stdout
        path, finders = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return tuple(sys.path[1:]), frozenset(getattr(f, "__module__", "") for f in sys.meta_path)
    return tuple(path), frozenset(finders)


def local_modules(shipment):
    """The imported top-level modules the containers of `shipment` cannot import as they are
    here (a notebook's helpers.py beside it, a directory it put on sys.path): files outside
    the environment, neither shipped nor found by their interpreter (a group's PYTHONPATH
    included), or found elsewhere. A function shipped from here is pickled with them by
    value (yarnapp.api)."""
    cannot = unimportable(shipment)
    out = []
    for name, module in list(sys.modules.items()):
        if name in ("__main__", "__mp_main__") or not isinstance(module, types.ModuleType) or module.__name__ != name:
            continue
        file = getattr(module, "__file__", None)
        if cannot(name, file) or file is None and _in_memory(name, module):
            out.append(module)
    return out


def _in_memory(name, module):
    """Whether top-level module `name` was made here with no file to import it from: code
    exec'd into a types.ModuleType (a notebook tool's cell module, generated code). A
    function of it went by name, and every rank failed: "No module named 'nbcell'".
    Cython's runtime modules have no file or spec either, and no Python function."""
    return (getattr(module, "__spec__", None) is None and name not in sys.builtin_module_names
            and any(isinstance(v, types.FunctionType) and v.__module__ == name for v in vars(module).values()))


def unimportable(shipment, unknown=True):
    """cannot(name, file): whether the containers of `shipment` cannot import top-level
    module `name` as it is here, from `file`: a file outside the environment, neither
    shipped nor found by their interpreter (a group's PYTHONPATH included), or found
    elsewhere. `unknown`: the answer where this client cannot tell (a group's PYTHONPATH of
    the nodes' own on YARN, an environment the job brings). What does not depend on the
    module is worked out once, here (local_modules asks for every module imported)."""
    yarn = shipment.job.backend == "yarn"
    environment = tuple(os.path.join(os.path.realpath(p), "") for p in _fresh_interpreter(yarn)[0] if p)
    shipped = {module_name(n) for n in shipment.entries}
    paths = _group_paths(shipment.job, shipment.entries)
    told = paths is not None and not _other_interpreter(shipment.job)

    def cannot(name, file):
        if ("." in name or not file or name in shipped
                or os.path.realpath(file).startswith(environment)):     # a file of the environment (vendored)
            return False
        if not told:
            return unknown
        spec = _container_spec(name, paths, yarn)
        return spec is None or spec.has_location and os.path.realpath(spec.origin) != os.path.realpath(file)
    return cannot


def _inside(path, entries):
    """`path` relative to the working directory if it lies inside a shipped directory."""
    path = os.path.abspath(path)
    for name, src in entries.items():
        if os.path.isdir(src) and path.startswith(src.rstrip(os.sep) + os.sep):
            return os.path.join(name, os.path.relpath(path, src))
    return None


def copy_into(entries, dest):
    """Copy every entry into directory `dest` under its name (the local engine's staging)."""
    os.makedirs(dest, exist_ok=True)
    for name, src in entries.items():
        target = os.path.join(dest, name)
        if os.path.isdir(src):
            shutil.copytree(src, target, ignore=_ignore, dirs_exist_ok=True, symlinks=True)
        else:
            shutil.copy2(src, target)


def archive_dir(src, staging, name):
    """A zip of directory `src` in `staging` (YARN unpacks it as directory `name`)."""
    tmp = os.path.join(staging, f".ship-{name}")
    shutil.copytree(src, tmp, ignore=_ignore, symlinks=True)
    try:
        return shutil.make_archive(os.path.join(staging, f"ship-{name}"), "zip", tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
