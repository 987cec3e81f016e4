"""submit's keyword overrides (`submit(job, training={"lr": 0.1})`): numpy's scalars made
Python's, an error about a field they set said as given, and kept as the command line's
KEY=VALUE fields (conf.overrides), which resubmit the same job."""
import json
import re

import yaml


def said_as_given(line, overrides):
    """A job's error line about a field the caller's overrides set, saying so: "job.yaml:
    training.lr: Input should be a valid number (got 'fast')" named the file, whose lr was
    0.05 (an API audit), for submit(..., training={'lr': 'fast'})."""
    m = re.match(r"(.*?): ((\w+)(?:\.\w+)*): (.*)$", line)
    if not m or m.group(3) not in overrides:
        return line
    value, path = overrides, m.group(2).split(".")
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return line
        value = value[key]
    given = repr(value)
    for key in reversed(path[1:]):
        given = f"{{{key!r}: {given}}}"
    return f"{m.group(2)} (given as {path[0]}={given}, not in {m.group(1)}): {m.group(4)}"


def as_setting(overrides, prefix=""):
    """submit's keyword overrides as the command line's KEY=VALUE fields, kept with the
    application: `yarnapp kill`'s resume hint for a sweep's job left them out (its batch size,
    its learning rate), and the command it gave resumed another job, or was refused."""
    out = []
    for key, value in overrides.items():
        if isinstance(value, dict) and value:       # (a section merges, as KEY=VALUE's fields do)
            out += as_setting(value, f"{prefix}{key}.")
            continue
        plain = isinstance(value, str) and value.strip() == value and yaml.safe_load(value) == value
        out.append(f"{prefix}{key}={value if plain else json.dumps(value)}")
    return out


def plain(value):
    """`value` with numpy's scalars as Python's (a sweep's np.int64(16) from ParameterGrid was
    refused: "training.batch_size: Input should be a valid integer"), in dicts and lists."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)      # (a namedtuple: a plain tuple, as YAML gives)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)) and \
            getattr(value, "shape", None) == ():
        if getattr(value, "dtype", None) is not None and value.dtype.kind == "f" and value.dtype.itemsize < 8:
            return float(str(value))     # np.float32(0.1) is 0.1, as written (not 0.10000000149011612)
        return value.item()
    return value
