"""What the client reads of the user's code before anything starts, without running it:
mistakes the containers would otherwise find one by one after the application started.

- `syntax`: the script compiles (a SyntaxError in train.py);
- `attribute`: a 'module:function' the job names is defined in its module's source
  (`training.hello:mian`), where the source shows it;
- `own_names`: no shipped module of the user's that their code imports is named as one
  of yarnapp's own top-level packages, which every rank imports first;
- `unshipped_imports`: a script whose run.files leave out a module beside it that it
  imports (mynet.py beside train.py), and a function whose body imports a module the
  containers cannot (a notebook's helpers.py);
- `not_offered` (a warning: the use may be guarded, `hasattr(hvd, "join")`): a Horovod
  port's use of a name of Horovod's that training.dist does not offer (`hvd.join()`,
  reached only after the training).

Each raises YarnappError of one line naming the field; where the source cannot tell (a
compiled module, a module-level __getattr__, a star import), nothing is refused.
"""
import ast
import difflib
import functools
import logging
import os

import conf
from launcher.user_errors import never_ran

from .errors import YarnappError

MAX_SOURCE = 2**20                 # larger files are not read

log = logging.getLogger(__name__)


def _parse(path):
    """The AST of the Python file at `path`; None where it is not readable source."""
    try:
        if os.path.getsize(path) > MAX_SOURCE:
            return None
        with open(path, "rb") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def syntax(script, field="run.script"):
    """Refuse a script that does not compile (every rank failed with the user's SyntaxError
    under yarnapp's frames, after the application started)."""
    try:
        with open(script, "rb") as f:
            compile(f.read(), script, "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f" line {e.lineno}" if e.lineno else ""
        raise YarnappError(f"{field}: {script}{where}: {type(e).__name__}: {e.msg}; fix it, or run "
                           f"`python -m py_compile {script}`") from None
    except (OSError, ValueError):
        pass                        # unreadable, null bytes: the container reports it


def _bindings(tree):
    """Each name a module's top level binds (into if/try/with blocks, not into functions or
    classes), once per statement that binds it; "*" for a star import."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                yield "*" if a.name == "*" else a.asname or a.name.split(".")[0]
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)) or type(node).__name__ == "TryStar":
            for block in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, block, None) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            yield from {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}


def _defined(tree):
    """Names a module's source binds at its top level; None where it may bind others (a
    star import, __getattr__)."""
    names = set(_bindings(tree))
    return None if "*" in names or "__getattr__" in names else names


def _dynamic(init):
    """Whether a package's __init__.py may add submodules its directory does not hold."""
    try:
        with open(init, "rb") as f:
            text = f.read(MAX_SOURCE)
    except (OSError, TypeError):
        return False
    return b"__path__" in text or b"sys.modules" in text


def attribute(field, target, origin, locations):
    """Refuse `target` ('pkg.mod:attr') whose module, found under its top-level module's
    `origin` file or package `locations`, lacks `attr` in its source. A submodule not found
    on disk, or a source that cannot tell, is left to the containers."""
    module, _, attr = target.partition(":")
    parts = module.split(".")
    for part in parts[1:]:
        if not locations or _dynamic(origin):
            return
        found = [os.path.join(d, part) for d in locations if os.path.isdir(os.path.join(d, part))]
        files = [os.path.join(d, part + ".py") for d in locations if os.path.isfile(os.path.join(d, part + ".py"))]
        if files:
            origin, locations = files[0], None
        elif found:
            init = os.path.join(found[0], "__init__.py")
            origin, locations = (init if os.path.isfile(init) else None), found
        elif any(f.startswith(part + ".") for d in locations for f in os.listdir(d)):
            return                  # compiled (part.cpython-311-....so), or a .pyc: not read here
        else:
            raise YarnappError(f"{field}: {target}: no module {module} (no {part}.py or {part}/ in "
                               f"{', '.join(locations)}); check its name")
    if not origin or not origin.endswith(".py"):
        return
    tree = _parse(origin)
    names = _defined(tree) if tree is not None else None
    if names is not None and attr in names and field == "run.function":
        _called_with_the_context(field, target, tree, attr)
    if tree is not None and field == "run.function":
        not_offered(origin, field, tree)
    if names is None or attr in names:
        return
    close = difflib.get_close_matches(attr, sorted(n for n in names if not n.startswith("_")), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; define it there, or name one that is"
    raise YarnappError(f"{field}: {target}: module {module} ({origin}) has no {attr!r}{hint}")


def _yields(func):
    """Whether a def's own body (not a def or lambda inside it) yields: a generator."""
    todo = list(func.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _called_with_the_context(field, target, tree, name):
    """Refuse run.function's `def name(...)` (a plain one at its module's top level) that
    cannot be called with the RunContext alone: every rank calls name(ctx) (every rank
    failed with "TypeError: name() takes 0 positional arguments but 1 was given", as
    yarnapp.submit(job, function=f) already refuses)."""
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if len(defs) != 1 or defs[0].decorator_list or _bound(tree, name) != 1:
        return                      # defined twice, wrapped, rebound (functools.partial): the source does not tell
    yields = _yields(defs[0])
    if isinstance(defs[0], ast.AsyncFunctionDef) or yields:
        kind = ("async generator" if yields else "async def") if isinstance(defs[0], ast.AsyncFunctionDef) \
            else "generator"
        raise YarnappError(f"{field}: {target}: {never_ran(name, kind)}")
    a = defs[0].args
    positional = a.posonlyargs + a.args
    required = len(positional) - len(a.defaults)
    if (positional or a.vararg) and required <= 1 and all(d is not None for d in a.kw_defaults):
        return
    raise YarnappError(f"{field}: {target}: {name}({ast.unparse(a)}) cannot be called with the RunContext "
                       f"alone; every rank calls it as {name}(ctx): give it one parameter (def {name}(ctx): ...)")


def _bound(tree, name):
    """How many statements of a module's top level bind `name`."""
    return sum(1 for n in _bindings(tree) if n == name)


def own_names(run, entries, field):
    """Refuse a module of the user's named as one of yarnapp's top-level packages (a conf.py,
    a training/ package): shipped to the containers' working directory, it would shadow
    yarnapp's for the launcher itself; beside the script, every rank has imported yarnapp's
    before the user's code runs, so the user's `import conf` would get yarnapp's (every rank
    failed with an AttributeError), which is refused where the script or the .py files
    shipped or beside it import it (read, not run). A copy of yarnapp's own package is no
    clash."""
    from .shipping import module_name
    for n, src in entries.items():      # in the working directory, first on every process's sys.path
        importable = os.path.isfile(os.path.join(src, "__init__.py")) if os.path.isdir(src) else n != module_name(n)
        if module_name(n) in conf.PACKAGES and importable and not _is_own_package(module_name(n), src):
            raise YarnappError(f"{field}: {src} would land as {n!r} in the containers' working directory, "
                               f"where it would shadow yarnapp's own package {module_name(n)!r} for yarnapp's "
                               f"launcher itself; rename it (say, my_{n}), or ship the directory it is in")
    if not run.script:
        return
    beside, places = os.path.dirname(os.path.abspath(run.script)), {}
    for name in conf.PACKAGES:
        for path in (os.path.join(beside, name + ".py"), os.path.join(beside, name)):
            if os.path.isfile(path) or os.path.isfile(os.path.join(path, "__init__.py")):
                places.setdefault(name, path)
    places = {n: p for n, p in places.items() if not _is_own_package(n, p)}
    if not places:
        return
    files = [run.script]
    for d in dict.fromkeys([src for src in entries.values() if os.path.isdir(src)] + [beside]):
        files += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py"))
    files += [src for src in entries.values() if src.endswith(".py")]
    for path in dict.fromkeys(files):
        tree = _parse(path)
        for node in ast.walk(tree) if tree is not None else ():
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for top in {n.split(".")[0] for n in names} & set(places):
                raise YarnappError(f"{field}: {places[top]} is named as yarnapp's own package {top!r}, which every "
                                   f"rank imports before your code, so `import {top}` in {path} would get "
                                   f"yarnapp's; rename your module (say, my_{top})")


def _is_own_package(name, path):
    """Whether `path` is yarnapp's package `name`, or a copy of it (its __init__.py the same)."""
    import filecmp
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not os.path.isdir(path):
        return False
    ours, theirs = spec.origin, os.path.join(path, "__init__.py")
    return os.path.isfile(theirs) and filecmp.cmp(ours, theirs, shallow=False)


def _imported(tree, main=False):
    """Top-level names a module's source imports absolutely, outside `try` blocks (an
    optional import, handled where it fails), `if TYPE_CHECKING:` and, unless the module
    runs as the main one (`main`), `if __name__ == "__main__":`."""
    names, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Try):
            todo += node.handlers + node.orelse + node.finalbody
            continue
        if isinstance(node, ast.If) and _never_runs(node.test, main):
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
        todo += list(ast.iter_child_nodes(node))
    return list(dict.fromkeys(names))


def _never_runs(test, main):
    """Whether an `if`'s body does not run: `if TYPE_CHECKING:`, or `if __name__ ==
    "__main__":` in a module imported (not `main`)."""
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(test)
             if isinstance(n, (ast.Name, ast.Attribute))}
    return "TYPE_CHECKING" in names or not main and "__name__" in names


def unshipped_imports(shipment, field):
    """Refuse a script whose run.files leave out a module beside it that it, or a shipped
    .py file beside it, imports: every rank failed with ModuleNotFoundError after the
    application started."""
    from .shipping import _inside, unimportable
    run = shipment.job.run
    if not run.script or run.files is None or _inside(run.script, shipment.entries):
        return              # the script's whole directory is shipped (files null, or listed), first on sys.path
    beside = os.path.dirname(os.path.abspath(run.script))
    sources = [run.script] + [src for src in shipment.entries.values()
                              if src.endswith(".py") and os.path.dirname(src) == beside]
    cannot = unimportable(shipment, unknown=False)      # False for a module shipped under its name
    for path in dict.fromkeys(sources):
        tree = _parse(path)
        for name in _imported(tree, main=path == run.script) if tree is not None else ():
            local = next((p for p in (os.path.join(beside, name + ".py"), os.path.join(beside, name, "__init__.py"))
                          if os.path.isfile(p)), None)
            if local and not _inside(local, shipment.entries) and cannot(name, local):
                what = os.path.dirname(local) if local.endswith("__init__.py") else local
                raise YarnappError(f"{field}: {path} imports {name!r}, and {what} beside it is not shipped, so "
                                   f"every rank would fail with ModuleNotFoundError; add it to run.files (or "
                                   f"leave run.files out: the script's directory is shipped)")


def _code_imports(code):
    """Top-level names the bytecode of `code` (and of the functions defined in it) imports."""
    import dis
    names, todo = [], [code]
    while todo:
        c = todo.pop()
        names += [i.argval.split(".")[0] for i in dis.get_instructions(c) if i.opname == "IMPORT_NAME"]
        todo += [k for k in c.co_consts if hasattr(k, "co_code")]
    return list(dict.fromkeys(names))


def function_imports(function, shipment):
    """Refuse a function whose body imports a module the containers cannot import (a
    notebook's helpers.py, imported inside the function): pickled by value, the function
    runs its `import` in every rank, which failed there with ModuleNotFoundError."""
    import importlib.util
    import sys

    from .shipping import unimportable
    cannot = unimportable(shipment, unknown=False)
    code = getattr(getattr(function, "__func__", function), "__code__", None) or \
        getattr(getattr(function, "__call__", None), "__code__", None)
    for name in _code_imports(code) if code is not None else ():
        module = sys.modules.get(name)
        try:
            file = getattr(module, "__file__", None) if module else \
                getattr(importlib.util.find_spec(name), "origin", None)
        except (ImportError, ValueError):
            continue
        if file and cannot(name, file):
            qual = getattr(function, "__qualname__", None) or type(function).__name__
            raise YarnappError(f"function: {qual} imports {name!r} inside its body, and the containers cannot import "
                               f"it ({file}); import it at the top of your notebook or script instead (what the "
                               f"function uses of it then travels with it), or add {file} to run.files")


@functools.lru_cache(maxsize=1)
def _horovod_not_offered(name="NOT_OFFERED"):
    """training.dist_horovod's `name` table, read from its source (the client imports no torch)."""
    tree = _parse(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training",
                               "dist_horovod.py"))
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    return {}


def not_offered(path, field, tree=None):
    """Warn of code that uses one of Horovod's names training.dist does not offer, through
    `import training.dist as hvd` (or `from training import dist`, `from training.dist
    import join`): the rank fails at that line, maybe after the whole training (a port's
    closing `hvd.join()`). One line naming the line and what to do instead; a warning, not
    a refusal: the use may never run (`if hasattr(hvd, "join")`, a branch not taken)."""
    tree = tree if tree is not None else _parse(path)
    table = _horovod_not_offered()
    if tree is None or not table:
        return
    aliases, used = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "training.dist" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "training" and not node.level:
            aliases |= {a.asname or a.name for a in node.names if a.name == "dist"}
        elif isinstance(node, ast.ImportFrom) and node.module == "training.dist" and not node.level:
            used += [(node.lineno, a.name, a.name) for a in node.names if a.name in table]
    uses = _horovod_not_offered("NOT_OFFERED_USES")
    refused = []            # values it has and refuses where passed; a keyword taken at its default only
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr in table:
                used.append((node.lineno, f"{node.value.id}.{node.attr}", node.attr))
            elif node.attr in uses:
                refused.append((node.lineno, f"{node.value.id}.{node.attr}", node.attr))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id in aliases and \
                f"{node.value.attr}.{node.attr}" in uses:
            refused.append((node.lineno, f"{node.value.value.id}.{node.value.attr}.{node.attr}",
                            f"{node.value.attr}.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in aliases:
            refused += [(k.value.lineno, f"{node.func.value.id}.{node.func.attr}({k.arg}=...)", k.arg)
                        for k in node.keywords if k.arg in uses and
                        not (isinstance(k.value, ast.Constant) and k.value.value == 1)]
    for line, what, name in sorted(set(used))[:MAX_WARNED]:
        log.warning("%s: %s:%d: %s: training.dist has no %s (Horovod's): %s (docs/own-code.md); the rank fails "
                    "there if it runs it", field, path, line, what, name, table[name])
    for line, what, name in sorted(set(refused))[:MAX_WARNED]:
        log.warning("%s: %s:%d: %s: training.dist does not offer Horovod's %s: %s (docs/own-code.md); the rank "
                    "fails there if it runs it", field, path, line, what, name, uses[name])


MAX_WARNED = 5      # warnings of one kind for a script (a port may use a name on many lines)


def horovod_itself(path, field, tree):
    """Warn of a script that imports Horovod itself: each rank here starts alone, and
    Horovod's init() without horovodrun makes every rank a world of one (N models trained
    apart, or a ModuleNotFoundError where it is not installed), where its port is one line."""
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        if any(n == "horovod" or n.startswith("horovod.") for n in names):
            log.warning("%s: %s:%d: imports Horovod, whose init() here (no horovodrun) makes each rank a world of "
                        "one; yarnapp's Horovod-style API takes the same calls: `import training.dist as hvd` "
                        "(docs/own-code.md)", field, path, node.lineno)
            return


def warnings(script, field="run.script"):
    """What a run.script's source is warned of, read once: Horovod names and values
    training.dist does not offer (not_offered), a snapshot by a relative path."""
    tree = _parse(script)
    if tree is not None:
        horovod_itself(script, field, tree)
        not_offered(script, field, tree)
        relative_snapshot(script, field, tree)


SNAPSHOT_SUFFIXES = (".pt", ".pth", ".ckpt", ".tar")


def relative_snapshot(path, field, tree=None):
    """Warn of a script that torch.saves and torch.loads a snapshot by a relative path (the
    PyTorch fault-tolerance tutorial's "snapshot.pt"): each container runs in a work
    directory of its own, so a restarted rank does not find another rank's snapshot and the
    ranks resume from different epochs (their DDP steps pair across epochs, then one ends
    early). A script that saves and loads, and names a relative file of a checkpoint's
    suffix: the snapshot's path, by the tutorial's pattern."""
    tree = tree if tree is not None else _parse(path)
    if tree is None:
        return
    calls = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
             and node.func.value.id == "torch" and node.func.attr in ("save", "load")}
    if calls != {"save", "load"}:
        return
    joined = set()      # a name put under a directory: os.path.join(base, "x.pt"), Path(base) / "x.pt"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("join",
                                                                                                    "joinpath"):
            joined |= {id(a) for a in node.args[1 if node.func.attr == "join" else 0:]}
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Add, ast.Mod)):
            joined.add(id(node.right))
        elif isinstance(node, ast.JoinedStr):
            joined |= {id(v) for v in node.values}
    names = sorted((node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and id(node) not in joined and isinstance(node.value, str) and node.value.endswith(SNAPSHOT_SUFFIXES)
                   and not os.path.isabs(node.value) and "$" not in node.value and "://" not in node.value)
    if names:
        line, name = names[0]
        log.warning("%s: %s:%d: %r is a relative path: each container runs in its own work directory, so a "
                    "restarted rank would not find another rank's snapshot there; keep it under "
                    "$YARNAPP_CHECKPOINT_URI, e.g. os.path.join(os.environ[\"YARNAPP_CHECKPOINT_URI\"], %r) "
                    "(docs/own-code.md)", field, path, line, name, name)

