"""Ring all-reduce data parallelism: the strategy (strategy.py) and its cost model (cost.py).

split_rows and measure_speed live in training.strategies.shares; they are also
importable from here, where training.dist found them before.
"""
from training.strategies.shares import measure_speed, split_rows

__all__ = ["measure_speed", "split_rows"]
