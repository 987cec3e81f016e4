"""The partition itself: Mt-KaHyPar (objective km1, individual maximum block weights)."""
import math
import time

import numpy as np

from .chain import PartitionError
from .hypergraph import _check_capacities, connectivity

EPSILON = 0.03                 # default allowed imbalance (KaHyPar's customary 3 %)
WEIGHT_SCALE_TOTAL = 10 ** 8   # vertex weights are scaled to integers summing to about this


_MTK = {}


def _mtkahypar():
    """The Mt-KaHyPar module and its initializer (one per process, one thread)."""
    if "init" not in _MTK:
        try:
            import mtkahypar
        except ImportError:
            raise PartitionError("the hypergraph partitioner needs Mt-KaHyPar: pip install mtkahypar") from None
        _MTK["mod"], _MTK["init"] = mtkahypar, mtkahypar.initialize(1, False)
    return _MTK["mod"], _MTK["init"]


def _int_weights(hg):
    """Vertex weights as integers for the partitioner: max(1, round(w / scale)), scale chosen
    so that they sum to about WEIGHT_SCALE_TOTAL (Mt-KaHyPar's weights are 32-bit)."""
    scale = max(1.0, hg.total_weight / WEIGHT_SCALE_TOTAL)
    return np.maximum(1, np.rint(hg.weights / scale)).astype(np.int64)


def max_block_weights(total, capacities, epsilon):
    """L_r = ⌈(1 + ε)·total·s_r/Σ s⌉: the heaviest part r may be (integer weights)."""
    caps = _check_capacities(capacities)
    return [int(math.ceil((1 + epsilon) * total * c / caps.sum())) for c in caps]


def integer_imbalance(hg, parts, capacities):
    """max_r W_r/T_r − 1 on the partitioner's integer weights (what its ε constrains)."""
    caps = _check_capacities(capacities)
    w = _int_weights(hg)
    loads = np.bincount(np.asarray(parts, dtype=np.int64), weights=w, minlength=len(caps))
    return float((loads / (w.sum() * caps / caps.sum())).max() - 1)


def hypergraph_partition(hg, capacities, epsilon=EPSILON, seed=0, starts=(), preset="default",
                         vcycles=2):
    """The partition Π of `hg` onto len(capacities) ranks minimising Σ_n (λ(n) − 1)·c(n)
    subject to W_r ≤ (1 + ε)·W·s_r/Σ s, by Mt-KaHyPar (objective km1).

    starts: further initial partitions (e.g. the conv and layer-wise splits) that
    Mt-KaHyPar improves by `vcycles` V-cycles (its iterated multilevel refinement); the
    best feasible result over the fresh partition and the improved starts is returned,
    so the result is never worse than a feasible start. Returns (parts, info) with info
    {"start": "fresh" | index of the winning start, "km1": forward bytes per sample,
    "fresh_km1": the fresh partition's, "seconds": ...} (net weights are c(n), whole bytes,
    so km1 is the forward volume). With K = 1 every vertex is on rank 0.
    """
    caps = _check_capacities(capacities)
    k = len(caps)
    if k == 1:
        return np.zeros(hg.num_vertices, dtype=np.int64), {"start": "trivial", "km1": 0.0, "fresh_km1": 0.0,
                                                           "seconds": 0.0}
    if epsilon < 0:
        raise PartitionError(f"epsilon must be >= 0, got {epsilon}")
    mtk, init = _mtkahypar()
    t0 = time.perf_counter()
    presets = {"default": mtk.PresetType.DEFAULT, "quality": mtk.PresetType.QUALITY,
               "deterministic": mtk.PresetType.DETERMINISTIC}
    ctx = init.context_from_preset(presets[preset])
    ctx.set_partitioning_parameters(k, float(epsilon), mtk.Objective.KM1)
    ctx.logging = False
    w = _int_weights(hg)
    limits = max_block_weights(int(w.sum()), caps, epsilon)
    ctx.set_individual_target_block_weights(limits)
    mtk.set_seed(int(seed) % 2 ** 31)      # (its seed is a C int; the job's may be any 64-bit one)
    net_w = np.maximum(1, np.rint(hg.net_bytes)).astype(np.int64)
    graph = init.create_hypergraph(ctx, hg.num_vertices, len(hg.nets), [p.tolist() for p in hg.nets],
                                   w.tolist(), net_w.tolist())
    candidates = [("fresh", np.asarray(graph.partition(ctx).get_partition(), dtype=np.int64))]
    for i, start in enumerate(starts):
        start = np.asarray(start, dtype=np.int64)
        ph = graph.create_partitioned_hypergraph(ctx, k, start.tolist())
        ph.improve_partition(ctx, int(vcycles))
        candidates.append((i, np.asarray(ph.get_partition(), dtype=np.int64)))

    def score(parts):
        loads = np.bincount(parts, weights=w, minlength=k)
        feasible = bool(np.all(loads <= np.asarray(limits)))
        lam = connectivity(hg, parts, k)
        return (not feasible, float(((lam - 1) * net_w).sum()))
    best_name, best = min(candidates, key=lambda c: score(c[1]))
    km1 = score(best)[1]
    return best, {"start": best_name, "km1": km1, "seconds": time.perf_counter() - t0,
                  "fresh_km1": score(candidates[0][1])[1]}
