"""Training strategies by name: the one registry, each strategy listed once.

A strategy is one package, training/strategies/<package>/:
    strategy.py   its Strategy subclass (the runner drives it through training.strategies.base)
    cost.py       its cost model: predict(case, config) -> the planner's prediction of its
                  step (training.perf.model.Case), or None where it cannot run; absent
                  where the strategy has none (the planner then says so)
and its typed configuration, `name` plus its own fields, is a model in conf.schema
(STRATEGY_CONFIGS; conf imports nothing of training), with its defaults under
`strategies:` in conf/defaults.yaml. tests/test_strategy_names.py fails when a name is
in one of these places and not in the others (and in docs/job-reference.md, README.md
and the planner's table). Imports are lazy: a job loads only the strategy it runs.
"""
import dataclasses
import importlib
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str              # training.strategy's name (conf.schema)
    title: str             # the method, as users read it
    strategy: str          # "module:Class" of its Strategy
    cost: Optional[str]    # "module:function" of its cost model; None: not modelled
    data_parallel: bool    # every rank holds the whole model and reads its training.shares of the batch


_ENTRIES = (
    Entry("allreduce", "ring all-reduce",
          "training.strategies.allreduce.strategy:AllReduceStrategy",
          "training.strategies.allreduce.cost:predict", data_parallel=True),
    Entry("ps_central", "central parameter server",
          "training.strategies.ps.strategy:CentralPSStrategy",
          "training.strategies.ps.cost:predict_central", data_parallel=True),
    Entry("ps_sharded", "sharded parameter server",
          "training.strategies.ps.strategy:ShardedPSStrategy",
          "training.strategies.ps.cost:predict_sharded", data_parallel=True),
    Entry("conv_model_parallel", "conv-layer model parallelism",
          "training.strategies.conv_mp.strategy:ConvModelParallelStrategy",
          "training.strategies.conv_mp.cost:predict", data_parallel=False),
    Entry("hypergraph", "hypergraph-partitioned model parallelism",
          "training.strategies.hypergraph.strategy:HypergraphStrategy",
          None, data_parallel=False),
)
REGISTRY = {e.name: e for e in _ENTRIES}


def names():
    """Every strategy's name, in registry order."""
    return list(REGISTRY)


def entry(name):
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {names()}") from None


def _load(target):
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def get(name):
    """The Strategy class of strategy `name`."""
    return _load(entry(name).strategy)


def cost_model(name):
    """predict(case, config) of strategy `name`, or None where it has no cost model."""
    target = entry(name).cost
    return _load(target) if target else None
