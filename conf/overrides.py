"""Job fields set on the command line: `yarnapp submit job.yaml training.epochs=3
groups.big.instances=2` (as Hydra and torchrun users set a config's fields, and TonY's
`--conf key=value`).

A KEY is a dotted path into the job: a section's field (`training.lr`), a list's entry by
index or, for groups, by name (`groups.0.vcores` or `groups[0].vcores`, `groups.big.memory`).
A VALUE is read as a job file's YAML is: `3` an integer, `0.1` or `1e-3` a float, `true`,
`[1, 2]` a list, `'1 GiB'` or `1 GiB` a string, `null` nothing; a mapping merges into the
one there (see _merged). The job is then validated as a whole, so a wrong field or value
is refused as one in the file would be.
"""
import copy
import re

import yaml

from . import JobError, _merge, load_yaml

EXAMPLE = "training.epochs=3"


def apply(raw, assignments, where="job"):
    """(`raw`, a job's plain dict as conf.read_raw gives it, with each `KEY=VALUE` of
    `assignments` set in order: a later one wins; {the field's path as the job's errors
    write it, `groups[0].memory`: the assignment that set it}). Raises JobError naming the
    assignment."""
    out, given = copy.deepcopy(raw), {}
    for text in assignments:
        key, value = parse(text)
        parts = _parts(key)
        path, created = _set(out, parts, value, text, where)
        if not (_in_env(parts) and len(parts) == 4):     # (an env variable: `spark` and `spark.conf` are two)
            _check_kept(path, value, given, text)
        given[path] = text
        for section in created:         # a section the file lacks: its errors are this assignment's too
            given.setdefault(section, text)
    return out, given


def parse(text):
    """(key, value) of one `KEY=VALUE`."""
    key, eq, value = text.partition("=")
    key = re.sub(r"\[(-?[0-9]+)\]", r".\1", key.strip())      # groups[0].vcores, as errors write it
    if not eq or not key or any(not part for part in key.split(".")):
        raise JobError(f"{text}: a job field set on the command line is KEY=VALUE with a dotted KEY, e.g. {EXAMPLE}")
    parts = _parts(key)
    text_numbers = _in_env(parts) or parts[:2] == ["run", "args"]
    try:
        return key, load_yaml(value, numbers_text=text_numbers) if value.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobError(f"{text}: the value is not valid YAML ({problem}); quote it") from None


def _parts(key):
    """A dotted key's parts; a group's env variable is the whole rest, dots and all
    (`groups.a.env.spark.conf=1` sets `spark.conf`)."""
    parts = key.split(".")
    if _in_env(parts) and len(parts) > 4:
        parts[3:] = [".".join(parts[3:])]
    return parts


def _in_env(parts):
    """Whether a key's parts name a group's env, or a variable of it (`groups.big.env.X`)."""
    return parts[0] == "groups" and parts[2:3] == ["env"]


def _check_kept(path, value, given, text):
    """A mapping or a name set where an earlier assignment set fields of it replaces them:
    refused, not silently dropped (`training.strategy.bucket_mb=8 training.strategy=allreduce`
    lost bucket_mb)."""
    lost = [g for p, g in given.items() if p.startswith(path + ".") or p.startswith(path + "[")]
    if lost and not isinstance(value, dict):
        raise JobError(f"{text}: replaces what {', '.join(lost)} set before it; give {text} first, then those")


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
                node[index] = _merged(node[index], value)
            else:
                node = node[index]
        elif isinstance(node, dict):
            path += ("." if path else "") + part
            if last:
                node[part] = _merged(node.get(part), value)
            else:
                if node.get(part) is None:
                    if re.fullmatch(r"-?[0-9]+", parts[i + 1]):     # a list the job leaves to its defaults
                        raise JobError(f"{text}: {where} sets no {path} to index; give the whole list: "
                                       f"{path}=[...]")
                    node[part] = {}         # a section the job leaves to its defaults
                    created.append(path)
                elif isinstance(node[part], str) and path == "training.strategy":
                    node[part] = {"name": node[part]}       # a strategy named alone: its fields' block
                node = node[part]
        else:
            raise JobError(f"{text}: {where}: {path} is {_kind(node)}, with no field {part!r}")
    return path, created


def _merged(old, value):
    """What a field holding `old` holds once set to `value`: a mapping merges into the
    mapping there, unless it is empty (`env={}`: cleared) or names another entry or
    strategy (`{name: ps_central}`: the old one's fields do not apply)."""
    if not (isinstance(old, dict) and isinstance(value, dict)) or not value or \
            value.get("name", old.get("name")) != old.get("name"):
        return value
    return _merge(old, value)


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
