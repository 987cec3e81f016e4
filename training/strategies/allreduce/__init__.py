"""Ring all-reduce data parallelism: the strategy (strategy.py) and its cost model (cost.py).

measure_speed lives in training.strategies.shares and split_rows in training.data.order;
both are importable from here too.
"""
from training.strategies.shares import measure_speed, split_rows

__all__ = ["measure_speed", "split_rows"]
