"""Job specification: schema, defaults and loading. Imports nothing else of yarnapp."""
import collections.abc
import copy
import difflib
import os
import re
import typing

import yaml
from pydantic import BaseModel, ValidationError

from . import paths
from .errors import YarnappError
from .schema import (BUILTIN_RUNNER, PACKAGES, TENSORBOARD_SERVICE, JobSpec, StrategyConfig, container_id,  # noqa: F401
                     strategy_fields, strategy_names)
from .units import parse_duration_s, parse_memory_mib  # noqa: F401

DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "defaults.yaml")
EXAMPLES_DIR = os.path.join(os.path.dirname(__file__), "examples")
_TEMPLATES = ("group", "training", "strategies")


class JobError(YarnappError, ValueError):
    """A job.yaml that cannot run. str() is one line naming the file and field."""


def defaults():
    with open(DEFAULTS_PATH) as f:
        return yaml.safe_load(f)


def _merge(base, over):
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return copy.deepcopy(over)


def resolve(raw, overrides=None):
    """Merge the overrides (CLI flags, submit's keywords) over a raw job dict, then
    defaults.yaml under it: an overriding `groups=[{"name": "big"}]` gets the group
    defaults as the job's own groups do (it was taken as it came, its instances missing)."""
    d = defaults()
    templates = {k: d.pop(k) for k in _TEMPLATES}
    raw = dict(raw)
    for k, v in (overrides or {}).items():
        if v is not None:           # a section's override merges into it (--resume: checkpoint.resume)
            raw[k] = _merge(raw[k], v) if isinstance(raw.get(k), dict) and isinstance(v, dict) else v
    job = _merge(d, raw)
    user_run = raw.get("run")
    if isinstance(user_run, dict) and (user_run.get("script") or user_run.get("pickle")) \
            and "function" not in user_run:
        job["run"]["function"] = None   # the default function applies only when nothing else is given
    if isinstance(job.get("groups"), list):
        job["groups"] = [_merge(templates["group"], g) if isinstance(g, dict) else g
                         for g in job["groups"]]
    if isinstance(job.get("training"), dict):
        job["training"] = _merge(templates["training"], job["training"])
        job["training"]["strategy"] = _strategy_block(job["training"]["strategy"], templates["strategies"])
    else:
        job.setdefault("training", None)
    return job


def _strategy_block(value, defaults):
    """training.strategy as a block: a bare name becomes {name: NAME}; the named strategy's
    defaults are merged under it (an unknown or missing name is left for the schema to refuse)."""
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] in defaults:
        return _merge(dict(defaults[value["name"]] or {}, name=value["name"]), value)
    return value


def strategy_config(name, job=None):
    """The configuration of strategy `name` (a conf.schema StrategyConfig): the job's own
    training.strategy where `job` runs that strategy, else the strategy's defaults."""
    if job is not None and job.training is not None and job.training.strategy.name == name:
        return job.training.strategy
    if name not in strategy_names():
        raise JobError(f"unknown strategy {name!r}; choose one of {', '.join(strategy_names())}")
    from pydantic import TypeAdapter
    return TypeAdapter(StrategyConfig).validate_python(_strategy_block(name, defaults()["strategies"]))


def offline_job(vcores=(1.0,), name="offline", gpus=None, **training):
    """A validated JobSpec for driving strategies outside an application (tests, benchmarks,
    the planner's probes): one rank per entry of `vcores` (and of `gpus`, default none;
    consecutive ranks alike form one group, g0, g1, ...), and a training section of the
    given fields over the defaults (data.train defaults to a path nothing reads)."""
    groups = []
    for v, count in zip(vcores, gpus or [0] * len(vcores)):
        if groups and (groups[-1]["vcores"], groups[-1]["gpus"]) == (v, count):
            groups[-1]["instances"] += 1
        else:
            groups.append({"name": f"g{len(groups)}", "instances": 1, "vcores": v, "gpus": count})
    training.setdefault("data", {"train": "file:///unused"})
    return load_job({"name": name, "groups": groups, "training": training})


def _path(loc):
    out = ""
    if tuple(loc[:2]) == ("training", "strategy") and len(loc) > 2 and loc[2] in strategy_names():
        loc = tuple(loc[:2]) + tuple(loc[3:])     # the union's tag is no field
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after[_module_function(), nullable[str]]",) or "[" in str(part):
            continue  # pydantic's names for union/validator branches, not fields
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fields_at(loc):
    """The field names of the block at `loc` (a path of names and list indices from the top
    of the job), for a misspelt field's "did you mean"; [] where it is not one model."""
    model = JobSpec
    for part in loc:
        if isinstance(part, int):
            continue            # an entry of a list: the list's model, found from its field
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        models = _models_in(field.annotation)
        if len(models) != 1:
            return []
        model = models[0]
    return list(model.model_fields)


def _is_list(loc):
    """Whether the field at `loc` (names from the top of the job) holds a list."""
    model = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        models = _models_in(field.annotation) if field is not None else []
        if len(models) != 1:
            return False
        model = models[0]
    field = model.model_fields.get(loc[-1])
    return field is not None and "List[" in str(field.annotation)


def _models_in(annotation):
    """The pydantic models an annotation names (through Optional, List, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _message(err):
    kind, msg, inp, loc = err["type"], err["msg"], err.get("input"), tuple(err["loc"])
    if tuple(loc[:2]) == ("training", "strategy"):
        if kind == "extra_forbidden" and len(loc) > 3:
            fields = strategy_fields(loc[2])
            have = f"its fields are {', '.join(fields)}" if fields else "it has no fields of its own"
            return f"not a field of strategy {loc[2]}; {have} (see docs/job-reference.md)"
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            got = f"got {inp.get('name')!r}; " if kind == "union_tag_invalid" else ""
            return f"{got}give a strategy name: {' | '.join(strategy_names())}, or a block with name: and its fields"
        if kind == "model_attributes_type":
            return f"give a strategy name ({' | '.join(strategy_names())}) or a block with name: and its fields"
    if kind == "extra_forbidden":
        here = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), here, n=1)
        if close:
            return f"unknown field; did you mean {close[0]!r}? (see docs/job-reference.md)"
        inside = [s for s in here if str(loc[-1]) in _fields_at(tuple(loc[:-1]) + (s,))]   # a section's field
        if inside:
            where = _path(tuple(loc[:-1]) + (inside[0], loc[-1]))
            if _is_list(tuple(loc[:-1]) + (inside[0],)):        # groups: a list of blocks
                where = where.replace(f"{inside[0]}.", f"{inside[0]}[].", 1)
            return f"unknown field here; it is {where} (see docs/job-reference.md)"
        return "unknown field; remove it or check its spelling (see docs/job-reference.md)"
    if kind == "too_short":
        return "must have at least one entry"
    if kind == "missing":
        return "required field is missing"
    if kind == "finite_number":
        return f"must be a finite number (got {inp!r})"
    if kind == "string_pattern_mismatch":
        return f"{inp!r} must be lower-case letters, digits and '-', starting with a letter (at most 31)"
    msg = msg.removeprefix("Value error, ")
    return f"{msg} (got {inp!r})" if kind.endswith("_type") or kind.startswith(("greater", "less", "too_")) else msg


def absolutize(job, base):
    """Make the job's local relative paths absolute against `base` (the submit directory),
    since containers run in directories of their own. URIs with a scheme are kept."""
    d = job.model_dump(mode="python")

    def fix(v):
        if v is None:
            return v
        v = paths.normal(v)         # ~ expanded; file:/path is file:///path
        return v if "://" in v or os.path.isabs(v) else os.path.normpath(os.path.join(base, v))
    for k in ("script", "pickle"):
        d["run"][k] = fix(d["run"][k])
    if d["run"]["files"]:
        d["run"]["files"] = [fix(f) for f in d["run"]["files"]]
    if d["training"]:
        d["training"]["data"]["train"] = fix(d["training"]["data"]["train"])
        d["training"]["data"]["test"] = fix(d["training"]["data"]["test"])
    d["checkpoint"]["uri"] = fix(d["checkpoint"]["uri"])
    d["tensorboard"]["logdir"] = fix(d["tensorboard"]["logdir"])
    return JobSpec.model_validate(d)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error, not the last one
    silently winning (two `run:` blocks: which one runs?); numbers as YAML 1.2 reads them
    (below). (load_yaml keeps the numbers of a group's env and of run.args as the text
    written: `PYVER: 3.10` is "3.10", `UMASK: 0022` "0022"; str() of the number gave "3.1"
    and "18".)"""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, collections.abc.Hashable):
                raise yaml.constructor.ConstructorError(None, None, f"a key must be a name, not a "
                                                        f"{type(key).__name__}", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def numbers_as_text(node):
    """A plain number in `node` (a scalar, a list's entries or a mapping's values) read as the
    text written: a copy of its node retagged (an alias's anchor elsewhere stays a number)."""
    def text(n):
        if isinstance(n, yaml.ScalarNode) and n.tag in _NUMBER_TAGS and n.style is None:
            return yaml.ScalarNode("tag:yaml.org,2002:str", n.value, n.start_mark, n.end_mark)
        return n
    if isinstance(node, yaml.MappingNode):
        node.value = [(k, text(v)) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        node.value = [text(v) for v in node.value]
    elif isinstance(node, yaml.ScalarNode):
        node.tag = text(node).tag


# Numbers as YAML 1.2 (and every user) reads them; PyYAML reads YAML 1.1's: `epochs: 010`
# was the octal 8, `1:30` (sexagesimal) 90, and `lr: 1e-3` without a dot the string '1e-3',
# which the schema refused ("Input should be a valid number"). `1_000` stays a number, as in
# Python.
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:int",
                                       re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                       list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                       re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                                                  r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
                                       list("-+.0123456789"))


class _Constructor12:
    """YAML 1.2's ints: 0o17 octal, 0x1F hex, 0123 decimal (PyYAML's 1.1 reader: 0123 octal)."""

    @staticmethod
    def int(loader, node):
        text = loader.construct_scalar(node)
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _Constructor12.int)


def _text_fields(job):
    """The nodes of a job document whose numbers are text: each group's env, run.args (not a
    model_options' `args` or `env`, which the user's code takes as YAML gives them)."""
    def field(node, key):
        return next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None) \
            if isinstance(node, yaml.MappingNode) else None
    groups = field(job, "groups")
    for group in groups.value if isinstance(groups, yaml.SequenceNode) else ():
        yield field(group, "env")
    yield field(field(job, "run"), "args")


def load_yaml(text, numbers_text=False, job=False):
    """A YAML value as a job file's reader reads it (conf.overrides' values); numbers_text:
    a number, or a mapping's or list's, as the text written (a value for an env or run.args);
    job: a job file, whose env and run.args numbers are text."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        for n in [node] if numbers_text else _text_fields(node) if job else ():
            if n is not None:
                numbers_as_text(n)
        return loader.construct_document(node)
    finally:
        loader.dispose()


BARE_MIB_MIN = 64      # a container's memory given as a bare number below this is most likely GiB meant


def check_bare_memory(where, raw):
    """Refuse a container memory a user wrote as a bare number under BARE_MIB_MIN (`memory: 2`
    meaning 2 GiB, read as 2 MiB: the container died in 2 s). The user's job only (read_raw's
    dict): a resolved job (job.json) holds every memory as a bare number of MiB."""
    groups = raw.get("groups") if isinstance(raw, dict) else None
    for i, g in enumerate(groups if isinstance(groups, list) else []):
        value = g.get("memory") if isinstance(g, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < BARE_MIB_MIN:
            raise JobError(f"{where}: groups[{i}].memory: {value:g} is read as {value:g} MiB (a bare number is MiB, "
                           f"as on YARN), too little for a container; write {value:g} GiB, or '{value:g} MiB' if "
                           f"you mean it")


def read_raw(source):
    """(where, the job as a plain dict) from a job.yaml path, a dict or a JobSpec, before
    defaults are merged; raises JobError for a file that cannot be read as a mapping."""
    if isinstance(source, JobSpec):
        return "job", source.model_dump(mode="python")
    where = "job"
    if isinstance(source, (str, os.PathLike)):
        where = str(source)
        if where.endswith(".py") and os.path.isfile(where):
            raise JobError(f"{where}: a Python script, not a job file; name it in a job.yaml as run.script: "
                           f"{os.path.basename(where)} (with groups: of containers; docs/own-code.md shows one)")
        try:
            with open(source, encoding="utf-8") as f:
                raw = load_yaml(f, job=True)
        except FileNotFoundError:
            raise JobError(f"{where}: no such file") from None
        except IsADirectoryError:
            raise JobError(f"{where}: is a directory, expected a job.yaml file") from None
        except UnicodeDecodeError as e:
            raise JobError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                           f"save it as UTF-8") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            pos = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise JobError(f"{where}{pos}: not valid YAML: {problem}") from None
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        raise JobError(f"job: expected a job.yaml path, a dict of job fields or a conf.JobSpec, got "
                       f"{type(source).__name__}")
    if not isinstance(raw, dict):
        raise JobError(f"{where}: expected a mapping of job fields at the top level")
    return where, raw


def load_job(source, overrides=None, where=None, stored=False):
    """Return a validated JobSpec from a path, a dict or a JobSpec (`where`: what errors
    call a dict, say the file it was read from; by default its path, or "job"). stored:
    an application's own job.json, read back (its logs, status, restarts): the checks
    only a submit makes (schema.submitting) are not made again.

    Raises JobError with one line `FILE: FIELD: what is wrong`.
    """
    if isinstance(source, JobSpec) and not overrides:
        return source
    name, raw = read_raw(source)
    where = where or name
    resolved = resolve(raw, overrides)
    try:
        return JobSpec.model_validate(resolved, context={"stored": stored})
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        msg = _message(first)
        path = _path(first["loc"])
        run = resolved.get("run") if isinstance(resolved.get("run"), dict) else {}
        if first["loc"][:1] == ("training",) and run.get("function") != BUILTIN_RUNNER:
            raise JobError(f"{where}: training: only the built-in runner (run.function: {BUILTIN_RUNNER}) reads "
                           f"this section, and your own code runs; remove it (it said {path}: {msg})") from None
        if msg.startswith(("groups", "training", "checkpoint", "run.", "give ")) and ":" in msg and first["loc"] == ():
            path, msg = msg.split(": ", 1)
        elif msg.startswith("[") and "]" in msg.split(": ", 1)[0]:     # a list entry: field[i].key
            where_in, msg = msg.split(": ", 1)
            path += where_in
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise JobError(f"{where}: {path}: {msg}{more}") from None
