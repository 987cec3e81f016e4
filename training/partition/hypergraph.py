"""The hypergraph of a layer chain, and the communication volume and balance of a
partition of it (training.partition gives the formulas)."""
import dataclasses

import numpy as np

from .chain import LayerChain, PartitionError


@dataclasses.dataclass
class Hypergraph:
    """Vertices (units, weighted by FLOPs) and nets (one per unit except the loss: the unit
    and its consumers, weighted by the bytes of its activation), as in the module doc."""
    chain: LayerChain
    weights: np.ndarray        # float64 FLOPs per vertex (one sample, forward + backward)
    nets: list                 # np.int64 arrays of pins, the producer first
    net_bytes: np.ndarray      # float64 bytes per sample of each net's activation
    net_layer: np.ndarray      # the producer's layer of each net

    def __post_init__(self):
        self.pins = np.concatenate(self.nets) if self.nets else np.zeros(0, dtype=np.int64)
        self.pin_net = np.repeat(np.arange(len(self.nets)), [len(p) for p in self.nets])
        self.source = np.asarray([p[0] for p in self.nets], dtype=np.int64)

    @property
    def num_vertices(self):
        return len(self.weights)

    @property
    def total_weight(self):
        return float(self.weights.sum())


def build_hypergraph(chain):
    """H = (V, N) of a LayerChain (see the module docstring)."""
    off = chain.offsets
    weights = np.concatenate([np.full(layer.units, layer.flops) for layer in chain.layers])
    nets, nbytes, nlayer = [], [], []
    for l, layer in enumerate(chain.layers[:-1]):
        dense = chain.dense_boundary(l)
        if dense:
            consumers = np.arange(off[l + 1], off[l + 1] + chain.layers[l + 1].units, dtype=np.int64)
        for u in range(layer.units):
            if not dense:
                r = chain.consumers(l, u)
                consumers = np.arange(off[l + 1] + r.start, off[l + 1] + r.stop, dtype=np.int64)
            nets.append(np.concatenate([[off[l] + u], consumers]).astype(np.int64))
            nbytes.append(layer.unit_bytes)
            nlayer.append(l)
    return Hypergraph(chain, weights, nets, np.asarray(nbytes, dtype=np.float64), np.asarray(nlayer))


def _check_capacities(capacities):
    caps = np.asarray([float(c) for c in capacities], dtype=np.float64)
    if caps.ndim != 1 or len(caps) < 1 or not np.all(np.isfinite(caps)) or not np.all(caps > 0):
        raise PartitionError(f"capacities must be one positive number per rank, got {list(capacities)}")
    return caps


def _net_parts(hg, parts, k):
    """The distinct (net, part) pairs of a partition: every part each net touches."""
    pairs = np.unique(hg.pin_net * k + np.asarray(parts, dtype=np.int64)[hg.pins])
    return pairs // k, pairs % k


def connectivity(hg, parts, k):
    """λ(n) for every net: the number of distinct parts among its pins."""
    nets, _ = _net_parts(hg, parts, k)
    return np.bincount(nets, minlength=len(hg.nets))


def evaluate(hg, parts, capacities):
    """Volume and balance of a partition `parts` (one part per vertex) onto ranks of
    `capacities`, per sample:

        forward_bytes      Σ_n (λ(n) − 1)·c(n)
        volume_bytes       2 × forward_bytes (the gradients go back the same way)
        rank_send_bytes    [r] bytes rank r sends, forward and backward: for each net whose
                           producer it owns, (λ − 1)·c forward; for each net it consumes but
                           does not produce, c backward
        loads              W_r / W;  imbalance = max_r W_r / T_r − 1, T_r = W·s_r/Σ s
    """
    caps = _check_capacities(capacities)
    k = len(caps)
    parts = np.asarray(parts, dtype=np.int64)
    if parts.shape != (hg.num_vertices,) or parts.min() < 0 or parts.max() >= k:
        raise PartitionError(f"a partition needs one part in [0, {k}) per vertex")
    nets, touched = _net_parts(hg, parts, k)
    lam = np.bincount(nets, minlength=len(hg.nets))
    forward = float(((lam - 1) * hg.net_bytes).sum())
    src = parts[hg.source]
    send = np.bincount(src, weights=(lam - 1) * hg.net_bytes, minlength=k)
    back = touched != src[nets]
    send += np.bincount(touched[back], weights=hg.net_bytes[nets[back]], minlength=k)
    loads = np.bincount(parts, weights=hg.weights, minlength=k) / hg.total_weight
    target = caps / caps.sum()
    return {"forward_bytes_per_sample": forward, "volume_bytes_per_sample": 2 * forward,
            "max_rank_bytes_per_sample": float(send.max()), "rank_bytes_per_sample": send.tolist(),
            "loads": loads.tolist(), "imbalance": float((loads / target).max() - 1)}
