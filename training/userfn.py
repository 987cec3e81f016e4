"""The user's own pieces named in a job.yaml as `package.module:name` (a model factory,
a loss, a dataset factory, a transform): found, checked and called in one way.

    obj = load("mypkg.models:make_net", "training.model")
    net = call(obj, options, "training.model", offered={"num_classes": 10, "input_shape": (3, 32, 32)})

`call` passes the keyword `options` from the job, plus each `offered` value the callable
asks for by name and the job does not set. A callable taking **kwargs is offered
`num_classes` only (the convention of torchvision's and timm's model factories).
Errors are one line naming the field (a YarnappError).
"""
import importlib
import inspect

from conf.errors import YarnappError


class UserCodeError(YarnappError, ValueError):
    """A `package.module:name` of the job that cannot be found or called. (Not `certain`,
    launcher.retries: an import that fails on one node alone may be that node's; where every
    rank fails alike before training, it is not retried.)"""


def load(ref, field):
    """The object `ref` ('package.module:name') names; raises UserCodeError naming `field`."""
    module_name, _, attr = str(ref).partition(":")
    if not module_name or not attr or ":" in attr:
        raise UserCodeError(f"{field}: expected 'package.module:name', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserCodeError(f"{field}: cannot import {module_name} ({e}); install it, or ship it with the "
                            f"job (run.files)") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserCodeError(f"{field}: module {module_name} has no {attr!r}")
    return obj


def accepts(fn, name):
    """Whether `fn` takes a keyword argument `name` (named, not through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def takes_kwargs(fn):
    try:
        return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def arguments(fn, options, field, offered=None):
    """The keyword arguments `call` passes `fn`: the job's `options`, and each `offered`
    value `fn` asks for by name; a one-line UserCodeError where `fn` cannot take them
    (checked against its signature, not called: submit asks this of a factory before any
    container starts)."""
    kwargs = dict(options or {})
    for name, value in (offered or {}).items():
        if name not in kwargs and (accepts(fn, name) or (name == "num_classes" and takes_kwargs(fn))):
            kwargs[name] = value
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise UserCodeError(f"{field}: cannot call {getattr(fn, '__qualname__', fn)} with {sorted(kwargs)}: "
                            f"{e}; fix {field}_options") from None
    except ValueError:
        pass                      # no signature (a builtin): let the call itself decide
    return kwargs


def call(fn, options, field, offered=None):
    """fn(**options, **the offered values it asks for); one-line UserCodeError on a bad call."""
    return fn(**arguments(fn, options, field, offered))
