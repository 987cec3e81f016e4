"""Hypergraph-partitioned model parallelism (Eserol 2019): the model as a hypergraph,
its partition, and the communication volume and balance of every way to split it.

The layer chain. A model is traced with torch.fx into a chain of *unit layers*
(nn.Conv2d: one unit per output channel; nn.Linear: one unit per neuron; and a last
pseudo-layer, the loss, of one unit) joined by parameter-free ops. The ops after a
unit layer that act on each channel alone (element-wise activations, pooling) are
*owner-side*: the rank that computes a channel also applies them to it, so what
leaves the rank is the pooled map. Everything from the first op that mixes channels
(a flatten, a reshape) up to the next unit layer is *consumer-side*: every rank that
computes units of the next layer applies it to the assembled input. The model's
input is read by every rank from the data (it is never sent).

The hypergraph H = (V, N):
    vertices   v = (layer l, unit u), weight w(v) = FLOPs of one sample, forward and
               backward: conv  2·Ho·Wo·(Cin/groups)·kh·kw · (3, or 2 for the first layer,
               which needs no dX); linear 2·in_features · (3 or 2); loss 5·classes.
    nets       n(v) = {v} ∪ consumers(v): the units of layer l+1 that read v's
               activation (every unit for a dense conv or a linear layer; the units of
               v's group for a grouped conv); cost c(n) = bytes of v's activation for
               one sample after its owner-side ops (element size × Ho'·Wo').

A partition Π: V → {0..K−1} onto ranks of capacities s_r (relative speed) costs
    forward volume      Σ_n (λ(n) − 1)·c(n)     λ(n) = |{Π(v) : v ∈ n}|, bytes per sample
                        (the producer sends its activation once to each other part);
    backward volume     the same: each consuming part returns its partial gradient
                        ∂L/∂a_v (a sum over its own units) to the producer's part;
    volume per sample   V = 2 Σ_n (λ(n) − 1)·c(n)   (the connectivity − 1 metric, ×2);
    imbalance           max_r W_r / T_r − 1,   W_r = Σ_{Π(v)=r} w(v),  T_r = W·s_r/Σ s.
The partition minimises V subject to W_r ≤ (1 + ε)·T_r, computed by Mt-KaHyPar (a
multilevel hypergraph partitioner, objective km1 = connectivity − 1, individual
maximum block weights). It optimises the *total* load per rank, as the thesis does
for pipelined execution; a layer-synchronous execution waits, layer by layer, for the
rank with the most units of that layer.

Compared with (all on the same hypergraph and volume formula):
    conv-layer split   every conv's channels split in proportion to s_r (contiguous
                       ranges, training.calibrate.proportional_split), every linear
                       layer and the loss on rank 0 (the master), as in
                       training.strategies.conv_mp;
    layer-wise split   contiguous runs of whole layers (a pipeline), one run per rank,
                       the cut points and rank order minimising max_r W_r / T_r (ties:
                       least volume);
    data parallelism   every rank holds all |W| parameter bytes; ring all-reduce sends
                       2(K−1)/K·|W| bytes per rank per step, 2(K−1)·|W| in all, i.e.
                       2(K−1)·|W|/B per sample at a global batch of B rows; the batch is
                       split in proportion to s_r (imbalance from integer rows only).

`partition_report(model, input_shape, capacities, batch)` gives all four as rows (the
planner's entry point); `hypergraph_partition` the partition itself; `layer_chain` the
traced chain that training.strategies.hypergraph executes.
"""
import dataclasses
import itertools
import logging
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from conf.errors import YarnappError

log = logging.getLogger(__name__)

EPSILON = 0.03                 # default allowed imbalance (KaHyPar's customary 3 %)
WEIGHT_SCALE_TOTAL = 10 ** 8   # vertex weights are scaled to integers summing to about this
LOSS_FLOPS_PER_CLASS = 5       # softmax + cross-entropy, forward and backward, per logit
METHODS = ("hypergraph", "conv_split", "pipeline", "data_parallel")


class PartitionError(YarnappError, ValueError):
    """A model or a request the partitioner cannot handle. str() names the op and the fix."""


# ---------------------------------------------------------------------------------------
# The layer chain (torch.fx)
# ---------------------------------------------------------------------------------------

_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.GELU, nn.SiLU, nn.Tanh,
                        nn.Sigmoid, nn.Hardtanh, nn.Softplus, nn.Identity, nn.Dropout)
_POOL_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.LPPool2d)
_RESHAPE_MODULES = (nn.Flatten,)
_ELEMENTWISE_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.leaky_relu, F.elu, F.gelu, F.silu, torch.tanh,
                          torch.sigmoid, F.dropout, F.hardtanh}
_POOL_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
_RESHAPE_FUNCTIONS = {torch.flatten}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh"}
_RESHAPE_METHODS = {"flatten", "view", "reshape"}


@dataclasses.dataclass
class Op:
    """A parameter-free op of the chain: `fn(t)` applies it; `channel_local` says it acts on
    each channel (dim 1) alone, so an owner can apply it to its own channels."""
    name: str
    fn: object
    channel_local: bool
    dropout: bool = False

    def __call__(self, t):
        return self.fn(t)


@dataclasses.dataclass
class UnitLayer:
    """One layer of units: a Conv2d (units = output channels), a Linear (units = neurons) or
    the loss (one unit). Shapes are per sample (no batch dim)."""
    name: str                  # module path in the model ("conv1", "features.3") or "loss"
    kind: str                  # "conv" | "linear" | "loss"
    module: object             # the nn.Conv2d / nn.Linear (None for the loss)
    units: int
    groups: int                # conv groups: unit u reads the inputs of group u // (units/groups)
    flops: float               # per unit, one sample, forward + backward
    pre: list                  # consumer-side Ops applied to the assembled input
    post: list                 # owner-side Ops applied to the own units' output
    in_shape: tuple            # input of the module, after `pre`
    out_shape: tuple           # (units, *S) after `post`: what leaves the owner
    element_bytes: int
    needs_input_grad: bool     # False for the first unit layer (it reads the data)

    @property
    def unit_bytes(self):
        """Bytes of one unit's activation for one sample, as sent: element size × prod(S)."""
        return self.element_bytes * int(np.prod(self.out_shape[1:], dtype=np.int64))


@dataclasses.dataclass
class LayerChain:
    layers: list               # UnitLayer, the loss last
    input_shape: tuple
    parameter_bytes: int       # |W| in bytes (trainable parameters)

    @property
    def offsets(self):
        """First vertex id of every layer: off_l = Σ_{j<l} units_j."""
        return [int(v) for v in np.cumsum([0] + [layer.units for layer in self.layers[:-1]])]

    @property
    def num_vertices(self):
        return sum(layer.units for layer in self.layers)

    def consumers(self, l, u):
        """range of unit indices of layer l+1 that read unit u of layer l."""
        nxt = self.layers[l + 1]
        if nxt.kind == "conv" and nxt.groups > 1 and not nxt.pre and self.layers[l].units == nxt.in_shape[0]:
            per_in, per_out = self.layers[l].units // nxt.groups, nxt.units // nxt.groups
            g = u // per_in
            return range(g * per_out, (g + 1) * per_out)
        return range(nxt.units)

    def dense_boundary(self, l):
        """True when every unit of layer l+1 reads every unit of layer l."""
        nxt = self.layers[l + 1]
        return len(self.consumers(l, 0)) == nxt.units


class _Slot:
    """Stands for the chain's tensor in a bound op's argument template."""


_SLOT = _Slot()


def _bound(node, fn):
    """A one-argument callable applying fx node `node` to a tensor t: the node's args with its
    one input (the chain's predecessor) replaced by t. Only constants are kept, not the
    node, so the callable holds no reference to the traced graph or the model's weights."""
    args = torch.fx.node.map_arg(node.args, lambda n: _SLOT)
    kwargs = dict(torch.fx.node.map_arg(node.kwargs, lambda n: _SLOT))
    method = node.target if node.op == "call_method" else None

    def fill(a, t):
        if a is _SLOT:
            return t
        if isinstance(a, (tuple, list)):
            return type(a)(fill(v, t) for v in a)
        return a

    def call(t):
        a = fill(tuple(args), t)
        kw = {k: fill(v, t) for k, v in kwargs.items()}
        if method is not None:
            return getattr(a[0], method)(*a[1:], **kw)
        return fn(*a, **kw)
    return call


def _classify(node, modules):
    """('unit', module) | ('op', Op); raises PartitionError for anything else."""
    if node.op == "call_module":
        m = modules[node.target]
        if isinstance(m, nn.Conv2d):
            if m.padding_mode != "zeros":
                raise PartitionError(f"{node.target}: padding_mode={m.padding_mode!r} is not supported, "
                                     "only 'zeros'")
            return "unit", m
        if isinstance(m, nn.Linear):
            return "unit", m
        if isinstance(m, _ELEMENTWISE_MODULES):
            return "op", Op(node.target, m, True, dropout=isinstance(m, nn.Dropout) and m.p > 0)
        if isinstance(m, _POOL_MODULES):
            return "op", Op(node.target, m, True)
        if isinstance(m, _RESHAPE_MODULES):
            return "op", Op(node.target, m, False)
        what = type(m).__name__
    elif node.op == "call_function":
        f = node.target
        if f in _ELEMENTWISE_FUNCTIONS or f in _POOL_FUNCTIONS or f in _RESHAPE_FUNCTIONS:
            return "op", Op(node.name, _bound(node, f), f not in _RESHAPE_FUNCTIONS,
                            dropout=f is F.dropout)
        what = getattr(f, "__name__", str(f))
    elif node.op == "call_method":
        if node.target in _ELEMENTWISE_METHODS or node.target in _RESHAPE_METHODS:
            return "op", Op(node.name, _bound(node, None), node.target in _ELEMENTWISE_METHODS)
        what = f"Tensor.{node.target}"
    else:
        what = f"{node.op} {node.target}"
    raise PartitionError(
        f"the hypergraph partitioner cannot place {what} (node {node.name!r}): it handles chains of "
        "Conv2d / Linear layers joined by activations, pooling, dropout and flatten; use the "
        "allreduce or conv_model_parallel strategy for this model")


def layer_chain(model, input_shape, num_classes=None):
    """The model's LayerChain for inputs of `input_shape` (C, H, W): traced by torch.fx,
    shapes from one batch-1 forward on the CPU (torch.fx ShapeProp).

    The graph must be a chain (every node feeds only the next one): residual adds,
    concatenations and shape arithmetic raise PartitionError naming the node.
    """
    from torch.fx.passes.shape_prop import ShapeProp
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as e:  # noqa: BLE001 - tracing errors come in many types
        raise PartitionError(f"torch.fx cannot trace the model ({type(e).__name__}: {e}); the "
                             "hypergraph strategy needs a traceable chain of layers") from None
    modules = dict(gm.named_modules())
    nodes = [n for n in gm.graph.nodes]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise PartitionError(f"the model's forward takes {len(placeholders)} inputs; the hypergraph "
                             "strategy needs exactly one")
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    with torch.no_grad():
        ShapeProp(gm).propagate(torch.zeros((1, *input_shape), dtype=dtype))

    layers, pending = [], []          # pending: ops since the last unit layer
    prev = placeholders[0]
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.all_input_nodes != [prev] or len(prev.users) != 1:
            raise PartitionError(f"the model is not a chain of layers at node {node.name!r} "
                                 f"(inputs {[n.name for n in node.all_input_nodes]}): residual or "
                                 "branching graphs are not supported by the hypergraph strategy")
        kind, what = _classify(node, modules)
        if kind == "op":
            pending.append((what, node))
        else:
            pre = _close_segment(layers, pending)
            in_shape = tuple(node.all_input_nodes[0].meta["tensor_meta"].shape[1:])
            layers.append(_unit_layer(node.target, what, in_shape, tuple(node.meta["tensor_meta"].shape[1:]),
                                      pre, first=not layers,
                                      element_bytes=torch.empty((), dtype=dtype).element_size()))
            pending = []
        prev = node
    if not layers:
        raise PartitionError("the model has no Conv2d or Linear layer to partition")
    out_node = next(n for n in nodes if n.op == "output")
    if out_node.all_input_nodes != [prev]:
        raise PartitionError("the model's output is not the end of its layer chain")
    loss_pre = _close_segment(layers, pending)
    logits = tuple(prev.meta["tensor_meta"].shape[1:])
    classes = num_classes or int(np.prod(logits, dtype=np.int64))
    layers.append(UnitLayer(name="loss", kind="loss", module=None, units=1, groups=1,
                            flops=float(LOSS_FLOPS_PER_CLASS * classes), pre=loss_pre, post=[],
                            in_shape=logits, out_shape=(1,), element_bytes=layers[-1].element_bytes,
                            needs_input_grad=True))
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return LayerChain(layers=layers, input_shape=tuple(input_shape), parameter_bytes=int(pbytes))


def _close_segment(layers, pending):
    """Give the ops after the last unit layer to it: the channel-local prefix becomes its
    owner-side `post` (out_shape updated); the rest is returned (the next layer's `pre`)."""
    if not layers:
        return [op for op, _ in pending]
    last = layers[-1]
    k = 0
    while k < len(pending) and pending[k][0].channel_local:
        k += 1
    last.post = [op for op, _ in pending[:k]]
    if k:
        last.out_shape = tuple(pending[k - 1][1].meta["tensor_meta"].shape[1:])
    return [op for op, _ in pending[k:]]


def _unit_layer(name, m, in_shape, out_shape, pre, first, element_bytes):
    back = 2 if first else 3          # forward, dW (and dX unless it reads the data)
    if isinstance(m, nn.Conv2d):
        ho_wo = int(np.prod(out_shape[1:], dtype=np.int64))
        kh, kw = m.kernel_size
        flops = 2.0 * ho_wo * (m.in_channels // m.groups) * kh * kw * back
        return UnitLayer(name, "conv", m, m.out_channels, m.groups, flops, list(pre), [], tuple(in_shape),
                         tuple(out_shape), element_bytes, not first)
    flops = 2.0 * m.in_features * back
    return UnitLayer(name, "linear", m, m.out_features, 1, flops, list(pre), [], tuple(in_shape),
                     tuple(out_shape), element_bytes, not first)


# ---------------------------------------------------------------------------------------
# The hypergraph and the cost of a partition
# ---------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------
# The partitioner (Mt-KaHyPar)
# ---------------------------------------------------------------------------------------

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
    mtk.set_seed(int(seed))
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


# ---------------------------------------------------------------------------------------
# The splits it is compared with
# ---------------------------------------------------------------------------------------

def conv_split_parts(chain, capacities):
    """Conv-layer model parallelism as a partition: each conv's channels in contiguous ranges
    c_r = proportional_split(C, s) (rank 0 first); every linear unit and the loss on rank 0.
    A conv with fewer channels than ranks stays on rank 0 (as conv_mp leaves it undistributed)."""
    from training.calibrate import proportional_split
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
    from training.strategies.allreduce import split_rows
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


# ---------------------------------------------------------------------------------------
# The two benchmark networks (CIFAR-10 inputs, 3x32x32)
# ---------------------------------------------------------------------------------------

class LeNetCIFAR(nn.Module):
    """LeNet-5 for CIFAR-10 (LeCun et al. 1998, as in the Caffe/PyTorch CIFAR tutorials):
    conv1 5x5 3->6 -> relu -> maxpool 2 -> conv2 5x5 6->16 -> relu -> maxpool 2 -> flatten
    (400) -> fc1 120 -> relu -> fc2 84 -> relu -> fc3 10. 62k parameters."""
    input_shape = (3, 32, 32)

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1, self.relu1, self.pool1 = nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.relu2, self.pool2 = nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1, self.relu3 = nn.Linear(16 * 5 * 5, 120), nn.ReLU()
        self.fc2, self.relu4 = nn.Linear(120, 84), nn.ReLU()
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.relu3(self.fc1(self.flatten(x)))
        return self.fc3(self.relu4(self.fc2(x)))


VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGGCIFAR(nn.Module):
    """VGG-11 (Simonyan & Zisserman 2015, configuration A) for CIFAR-10 without batch norm:
    3x3 convs (padding 1) of widths `cfg`, each followed by ReLU, "M" a 2x2 max pool; after
    the five pools the map is 512x1x1 -> flatten -> fc1 512 -> relu -> fc2 10. 9.5M
    parameters, 0.15 GMAC per image forward. `groups` > 1 makes every conv after the first
    a grouped one (ResNeXt-style cardinality: channel c reads only its group's inputs)."""
    input_shape = (3, 32, 32)

    def __init__(self, num_classes=10, cfg=VGG11, hidden=512, groups=1):
        super().__init__()
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1, groups=1 if c == 3 else groups), nn.ReLU()]
                c = v
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten()
        self.fc1, self.relu, self.fc2 = nn.Linear(c, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(self.flatten(self.features(x)))))


BENCHMARK_NETWORKS = {"lenet": LeNetCIFAR, "vgg11": VGGCIFAR}


__all__ = ["PartitionError", "Op", "UnitLayer", "LayerChain", "Hypergraph", "layer_chain",
           "build_hypergraph", "evaluate", "connectivity", "hypergraph_partition", "max_block_weights",
           "conv_split_parts", "pipeline_parts", "data_parallel_row", "partition_report", "METHODS",
           "EPSILON", "LeNetCIFAR", "VGGCIFAR", "BENCHMARK_NETWORKS"]
