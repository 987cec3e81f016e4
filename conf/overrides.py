"""Job fields set on the command line: `yarnapp submit job.yaml training.epochs=3
groups.big.instances=2` (as Hydra and torchrun users set a config's fields, and TonY's
`--conf key=value`).

A KEY is a dotted path into the job: a section's field (`optimizer.lr`), a list's entry by
index or, for groups, by name (`groups.0.vcores`, `groups.big.memory`). A VALUE is read as
YAML reads it in a job file: `3` an integer, `0.1` a float, `true`, `[1, 2]` a list,
`'1 GiB'` or `1 GiB` a string, `null` nothing. The job is then validated as a whole, so a
wrong field or value is refused as one in the file would be.
"""
import copy
import re

import yaml

from . import JobError, _merge

EXAMPLE = "training.epochs=3"


def apply(raw, assignments, where="job"):
    """(`raw`, a job's plain dict as conf.read_raw gives it, with each `KEY=VALUE` of
    `assignments` set in order: a later one wins; {the field's path as the job's errors
    write it, `groups[0].memory`: the assignment that set it}). Raises JobError naming the
    assignment."""
    out, given = copy.deepcopy(raw), {}
    for text in assignments:
        key, value = parse(text)
        path, created = _set(out, key.split("."), value, text, where)
        given[path] = text
        for section in created:         # a section the file lacks: its errors are this assignment's too
            given.setdefault(section, text)
    return out, given


def parse(text):
    """(key, value) of one `KEY=VALUE`."""
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not key or any(not part for part in key.split(".")):
        raise JobError(f"{text}: a job field set on the command line is KEY=VALUE with a dotted KEY, e.g. {EXAMPLE}")
    try:
        return key, yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobError(f"{text}: the value is not valid YAML ({problem}); quote it") from None


def _set(node, parts, value, text, where):
    """Set `value` at `parts` under `node` (a mapping merged into the mapping there, as a
    section's flags merge: `launcher={idle_timeout: 1m}` keeps the file's other launcher
    fields); (the path as errors write it, the sections it made)."""
    path, created = "", []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = _index(node, part, text, path)
            path += f"[{index}]"
            if last:
                node[index] = _merge(node[index], value) if isinstance(node[index], dict) else value
            else:
                node = node[index]
        elif isinstance(node, dict):
            path += ("." if path else "") + part
            if last:
                node[part] = _merge(node[part], value) if isinstance(node.get(part), dict) else value
            else:
                if node.get(part) is None:
                    node[part] = {}         # a section the job leaves to its defaults
                    created.append(path)
                node = node[part]
        else:
            raise JobError(f"{text}: {where}: {path} is {_kind(node)}, with no field {part!r}")
    return path, created


def _index(items, part, text, name):
    """The index of the list entry `part` names: its position, or the entry whose name it is."""
    if re.fullmatch(r"-?[0-9]+", part):
        i = int(part)
        if not -len(items) <= i < len(items):
            raise JobError(f"{text}: {name} has {len(items)} entries: index {i} is out of range")
        return i % len(items)
    named = [j for j, item in enumerate(items) if isinstance(item, dict) and item.get("name") == part]
    if not named:
        names = [str(item["name"]) for item in items if isinstance(item, dict) and "name" in item]
        raise JobError(f"{text}: {name} has no entry named {part!r}"
                       + (f" (its names: {', '.join(names)})" if names else "; give its index"))
    return named[0]


def _kind(value):
    return "empty" if value is None else f"a {type(value).__name__} ({value!r})"
