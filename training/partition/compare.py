"""The other ways to split a model (conv-layer split, pipeline, data parallelism) on the
same hypergraph, and the report comparing them with the partition."""
import itertools
import math

import numpy as np

from .chain import PartitionError, layer_chain
from .hypergraph import _check_capacities, build_hypergraph, evaluate
from .kahypar import EPSILON, hypergraph_partition, integer_imbalance

METHODS = ("hypergraph", "conv_split", "pipeline", "data_parallel")


def conv_split_parts(chain, capacities):
    """Conv-layer model parallelism as a partition: each conv's channels in contiguous ranges
    c_r = proportional_split(C, s) (rank 0 first); every linear unit and the loss on rank 0.
    A conv with fewer channels than ranks stays on rank 0 (as conv_mp leaves it undistributed)."""
    from training.strategies.conv_mp.calibrate import proportional_split
    caps = _check_capacities(capacities)
    parts = []
    for layer in chain.layers:
        if layer.kind == "conv" and layer.units >= len(caps):
            split = proportional_split(layer.units, caps.tolist())
            parts.append(np.repeat(np.arange(len(caps)), split))
        else:
            parts.append(np.zeros(layer.units, dtype=np.int64))
    return np.concatenate(parts).astype(np.int64)


def pipeline_parts(chain, capacities, hg=None):
    """Layer-wise (pipeline) split: contiguous runs of whole layers (the loss with the last),
    stage j on rank order[j]; over every choice of K−1 cut points and rank order, the one
    with the least max_r W_r/T_r, ties broken by the least volume (`hg` given) or the
    earliest cuts. Fewer layers than ranks leaves the extra ranks empty."""
    caps = _check_capacities(capacities)
    k = len(caps)
    w = np.asarray([layer.units * layer.flops for layer in chain.layers])
    w[-2] += w[-1]                                   # the loss goes with the last layer
    w = w[:-1]
    m = len(w)
    target = caps / caps.sum() * w.sum()
    best, ties = None, []
    stages = min(k, m)
    for cuts in itertools.combinations(range(1, m), stages - 1):
        bounds = (0, *cuts, m)
        loads = [w[a:b].sum() for a, b in zip(bounds, bounds[1:])]
        for order in itertools.permutations(range(k), stages):
            ratio = max(loads[j] / target[order[j]] for j in range(stages))
            key = round(ratio, 12)
            if best is None or key < best:
                best, ties = key, [(bounds, order)]
            elif key == best:
                ties.append((bounds, order))

    def parts_of(choice):
        bounds, order = choice
        layer_part = np.empty(m + 1, dtype=np.int64)
        for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
            layer_part[a:b] = order[j]
        layer_part[m] = layer_part[m - 1]
        return np.concatenate([np.full(layer.units, layer_part[l]) for l, layer in enumerate(chain.layers)])
    # the volume depends on the cut points only (a cut costs the same whichever ranks it joins)
    first = {}
    for bounds, order in ties:
        first.setdefault(bounds, (bounds, order))
    ties = list(first.values())
    if hg is None or len(ties) == 1:
        return parts_of(ties[0])
    return min((parts_of(t) for t in ties), key=lambda p: evaluate(hg, p, caps)["forward_bytes_per_sample"])


def data_parallel_row(chain, capacities, batch):
    """Ring all-reduce data parallelism: 2(K−1)/K·|W| bytes per rank per step, 2(K−1)·|W| in all;
    per sample: /B. Rows split in proportion to capacity (largest remainder)."""
    from training.strategies.shares import split_rows
    caps = _check_capacities(capacities)
    k = len(caps)
    per_rank_step = 2 * (k - 1) / k * chain.parameter_bytes
    rows = np.asarray(split_rows(int(batch), caps.tolist()), dtype=np.float64)
    loads = rows / rows.sum()
    return {"method": "data_parallel", "forward_bytes_per_sample": 0.0,
            "volume_bytes_per_sample": k * per_rank_step / batch,
            "max_rank_bytes_per_sample": per_rank_step / batch,
            "rank_bytes_per_sample": [per_rank_step / batch] * k,
            "bytes_per_rank_per_step": per_rank_step, "bytes_per_step": k * per_rank_step,
            "loads": loads.tolist(), "imbalance": float((loads / (caps / caps.sum())).max() - 1)}


# ---------------------------------------------------------------------------------------
# The report (`yarnapp plan`)
# ---------------------------------------------------------------------------------------

def partition_report(model, input_shape, capacities, batch, epsilon=EPSILON, seed=0, chain=None):
    """Communication volume and balance of the four ways to spread `model` over ranks of
    relative speeds `capacities` at a global batch of `batch` rows, one dict per method
    (METHODS order). Every row has:

        method                      "hypergraph" | "conv_split" | "pipeline" | "data_parallel"
        volume_bytes_per_sample     bytes moved in all, forward + backward, per sample
                                    (model parallel: 2 Σ_n (λ−1)·c(n); data parallel:
                                    2(K−1)·|W| / B)
        forward_bytes_per_sample    the forward half (0 for data parallelism)
        max_rank_bytes_per_sample   the most one rank sends (data parallel: 2(K−1)/K·|W|/B)
        loads, imbalance            W_r/W per rank and max_r W_r/T_r − 1
        reduction_vs_data_parallel  1 − volume / data parallelism's volume (per sample)
        break_even_batch            (model-parallel rows) B* = 2(K−1)·|W| / volume: data
                                    parallelism moves less per sample at batches above B*

    The model-parallel baselines also carry `hypergraph_at_same_balance`: the hypergraph
    partition constrained to that baseline's own imbalance (ε = its imbalance on the
    partitioner's integer weights, at least 1e-3), with the baseline given to Mt-KaHyPar
    as a start to improve, so the two can be compared at equal or better balance
    (`fresh_volume_bytes_per_sample`: what the partitioner found without the start). The hypergraph row has
    `partitioner` (which start won, seconds) and `epsilon`. Raises PartitionError for a
    model that is not a chain of Conv2d/Linear layers.
    """
    caps = _check_capacities(capacities)
    if int(batch) < 1:
        raise PartitionError(f"batch must be a positive integer, got {batch}")
    chain = chain or layer_chain(model, input_shape)
    hg = build_hypergraph(chain)
    conv = conv_split_parts(chain, caps)
    pipe = pipeline_parts(chain, caps, hg)
    dp = data_parallel_row(chain, caps, batch)
    rows = {}
    hp_parts, info = hypergraph_partition(hg, caps, epsilon, seed, starts=())
    rows["hypergraph"] = {"method": "hypergraph", **evaluate(hg, hp_parts, caps), "epsilon": epsilon,
                          "partitioner": {"name": "mtkahypar", **info}}
    for name, parts in (("conv_split", conv), ("pipeline", pipe)):
        row = {"method": name, **evaluate(hg, parts, caps)}
        eps = max(integer_imbalance(hg, parts, caps), 1e-3)
        matched, minfo = hypergraph_partition(hg, caps, eps, seed, starts=(parts,))
        m = evaluate(hg, matched, caps)
        row["hypergraph_at_same_balance"] = {
            "epsilon": eps, "volume_bytes_per_sample": m["volume_bytes_per_sample"],
            "imbalance": m["imbalance"], "max_rank_bytes_per_sample": m["max_rank_bytes_per_sample"],
            "start": "fresh" if minfo["start"] == "fresh" else name,
            "fresh_volume_bytes_per_sample": 2 * minfo["fresh_km1"]}
        rows[name] = row
    rows["data_parallel"] = dp
    for row in rows.values():
        row["reduction_vs_data_parallel"] = 1 - row["volume_bytes_per_sample"] / dp["volume_bytes_per_sample"]
        if row is not dp:
            # data parallelism moves 2(K−1)|W|/B per sample: less than this split above B*
            v = row["volume_bytes_per_sample"]
            row["break_even_batch"] = dp["bytes_per_step"] / v if v > 0 else math.inf
        row.update(k=len(caps), capacities=caps.tolist(), batch=int(batch))
    return [rows[m] for m in METHODS]
