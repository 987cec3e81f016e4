"""Central and sharded parameter servers: the strategies (strategy.py) and their cost models (cost.py)."""
