"""Hypergraph-partitioned model parallelism (Eserol 2019): the strategy (strategy.py) and
the partitioned execution (execution.py); the partitioner is training.partition. No cost
model: the planner reports its communication volume (training.partition) instead."""
