"""Backends by name, imported lazily (skein only when YARN is used)."""
import importlib

from ..errors import YarnappError

_REGISTRY = {
    "local": "yarnapp.backends.local.engine:LocalBackend",
    "yarn": "yarnapp.backends.yarn:YarnBackend",
}


def get(name, **kwargs):
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise YarnappError(f"unknown backend {name!r}; choose one of {', '.join(sorted(_REGISTRY))}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
