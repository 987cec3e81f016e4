"""The seeds' formulas (pure): seed 4's step times of synchronous training, seed 1's bound.

c is the communication of one |W| transfer, g the gradient compute of a step, n the
ranks (workers). The strategies' cost models (training.strategies.*.cost) build on them.
"""
import math


def ring_allreduce_s(n, c, g):
    """Ring all-reduce step: g + 2(n−1)/n · c."""
    return g + 2 * (n - 1) / n * c


def central_ps_s(n, c, g):
    """Seed 4's central parameter server with n workers: (best, worst) = ((n+1)c + g, 2nc + g)."""
    return (n + 1) * c + g, 2 * n * c + g


def sharded_ps_s(n, c, g):
    """Seed 4's sharded ("distributed") server, a shard on every worker: 2c(n−1)/n + g."""
    return 2 * c * (n - 1) / n + g


def amdahl_bound(f, k):
    """Seed 1's bound on the speedup of distributing a share f of the work over k devices:
    S ≤ 1 / ((1 − f) + f / k)."""
    return 1.0 / ((1.0 - f) + f / k)


def proportional_s(seconds):
    """Time of work split in proportion to speed over devices that take `seconds` each for
    all of it: 1 / Σ_r (1 / t_r)  (every device then finishes at the same time)."""
    return 1.0 / sum(1.0 / t for t in seconds)


def log2(n):
    """⌈log2 n⌉ (0 for one rank): the rounds of a tree collective."""
    return math.ceil(math.log2(n)) if n > 1 else 0

