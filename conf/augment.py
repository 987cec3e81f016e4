"""The augmentation ops a job names (training.data.augment and test_transforms) checked
at submit: each op's options and their ranges, before any rank starts."""
from typing import Annotated, Any, Dict, List, Optional, Union

from pydantic import AfterValidator

# The augmentation ops of training.data.augment / test_transforms and their options
# (training.data.transforms implements them; their option defaults are its keyword
# defaults, documented in docs/data.md). "torchvision.NAME" entries take any options.
AUGMENT_OPS = {
    "resize": {"size"},
    "center_crop": {"size"},
    "random_crop": {"size", "padding", "fill"},
    "random_resized_crop": {"size", "scale", "ratio"},
    "hflip": {"p"},
}
_REQUIRED = {"resize": {"size"}, "center_crop": {"size"}, "random_crop": {"size"}, "random_resized_crop": {"size"}}


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_option(op, key, v):
    """None if option `key` of `op` is valid, else what is wrong."""
    if key == "size":
        ok = (isinstance(v, int) and not isinstance(v, bool) and v > 0) or (
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                         for x in v))
        return None if ok else f"size must be a positive integer or [height, width], got {v!r}"
    if key in ("padding", "fill"):
        top = 255 if key == "fill" else 10 ** 6
        ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= top
        return None if ok else f"{key} must be an integer in [0, {top}], got {v!r}"
    if key == "p":
        return None if _number(v) and 0 <= v <= 1 else f"p must be a probability in [0, 1], got {v!r}"
    if key in ("scale", "ratio"):
        ok = isinstance(v, list) and len(v) == 2 and all(_number(x) and x > 0 for x in v) and v[0] <= v[1] \
            and (key == "ratio" or v[1] <= 1)
        bounds = "0 < a <= b <= 1" if key == "scale" else "0 < a <= b"
        return None if ok else f"{key} must be [a, b] with {bounds}, got {v!r}"
    return f"unknown option {key!r}"


def _augment(entries):
    """Check training.data.augment / test_transforms; returns them as [{op: {options}}]."""
    out = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {entry: {}}
        if not isinstance(entry, dict) or len(entry) != 1:
            raise ValueError(f"[{i}]: expected an op name or {{op: {{options}}}}, such as hflip or "
                             f"{{random_crop: {{size: 32, padding: 4}}}}, got {entry!r}")
        (name, options), = entry.items()
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise ValueError(f"[{i}].{name}: options must be a mapping, got {options!r}")
        if name.startswith("torchvision.") and len(name) > len("torchvision."):
            out.append({name: dict(options)})
            continue
        if name not in AUGMENT_OPS:
            raise ValueError(f"[{i}]: unknown op {name!r}; choose one of {', '.join(AUGMENT_OPS)} "
                             f"or torchvision.NAME")
        for key, v in options.items():
            if key not in AUGMENT_OPS[name]:
                raise ValueError(f"[{i}].{name}: unknown option {key!r}; options are "
                                 f"{', '.join(sorted(AUGMENT_OPS[name]))}")
            wrong = _check_option(name, key, v)
            if wrong:
                raise ValueError(f"[{i}].{name}: {wrong}")
        missing = _REQUIRED.get(name, set()) - set(options)
        if missing:
            raise ValueError(f"[{i}].{name}: {', '.join(sorted(missing))} is required")
        out.append({name: dict(options)})
    return out


Augment = Annotated[List[Union[str, Dict[str, Optional[Dict[str, Any]]]]], AfterValidator(_augment)]
