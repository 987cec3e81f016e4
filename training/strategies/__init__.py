"""Training strategies by name. Each module registers one Strategy subclass.

Imports are lazy so that a job only loads the strategy it uses.
"""
import importlib

_REGISTRY = {
    "allreduce": "training.strategies.allreduce:AllReduceStrategy",
    "conv_model_parallel": "training.strategies.conv_mp:ConvModelParallelStrategy",
    "ps_central": "training.strategies.ps:CentralPSStrategy",
    "ps_sharded": "training.strategies.ps:ShardedPSStrategy",
    "hypergraph": "training.strategies.hypergraph:HypergraphStrategy",
}


def get(name):
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(_REGISTRY)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
