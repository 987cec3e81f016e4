"""The cost models of the parameter servers (seed 4: Šlampa 2017), on the data-parallel
step of training.strategies.allreduce.cost (the same notation; c = α + |W|/β).

    central server   seed 4: (m+1)c + g ≤ T ≤ 2mc + g for m workers talking to the server;
                     rank 0 is server and worker, so m = n−1; our server receives the m
                     gradients one after another and then sends m copies of W, with no
                     overlap, so T = g + 2(n−1)c + o_0 (the worst case; "bounds" holds
                     both cases)                                        (+ 2⌈log2 n⌉α)
    sharded server   T = g + 2(n−1)/n·|W|/β + 2α + max_r o_r / n        (+ 2⌈log2 n⌉α)

Not modelled: a server's own CPU growing with its workers (it is measured with one).
"""
from training.perf.formulas import central_ps_s, sharded_ps_s
from training.strategies.allreduce.cost import Exchange, data_parallel


def predict_central(case, config):
    """Central server on rank 0 with m = n−1 remote workers: g + 2mc + o_0."""
    n, w, link = len(case.devices), case.devices[0].profile.param_bytes, case.link
    exchange = Exchange(seconds=central_ps_s(n - 1, link.seconds(w), 0.0)[1], optimizer=[1.0] + [0.0] * (n - 1),
                        waits=2, received=[(n - 1) * w] + [w] * (n - 1))
    return data_parallel("ps_central", case, exchange, bounds=lambda g: central_ps_s(n - 1, link.seconds(w), g))


def predict_sharded(case, config):
    """Sharded server: g + 2(n−1)/n·|W|/β + 2α + max_r o_r / n."""
    n, w, link = len(case.devices), case.devices[0].profile.param_bytes, case.link
    exchange = Exchange(seconds=sharded_ps_s(n, w / link.bandwidth_Bps, 0.0) + 2 * link.latency_s,
                        optimizer=[1.0 / n] * n, waits=2, received=[2 * (n - 1) / n * w] * n)
    return data_parallel("ps_sharded", case, exchange)
