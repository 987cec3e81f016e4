"""The layer chain: a model traced (torch.fx) into unit layers joined by parameter-free
ops (see training.partition for what a unit, an owner-side and a consumer-side op are)."""
import collections
import dataclasses
import operator
import re

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from conf.errors import YarnappError

LOSS_FLOPS_PER_CLASS = 5       # softmax + cross-entropy, forward and backward, per logit


class PartitionError(YarnappError, ValueError):
    """A model or a request the partitioner cannot handle. str() names the op and the fix.
    Not retried (launcher.retries)."""
    certain = True


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


@dataclasses.dataclass(frozen=True)
class _Size:
    """Stands for t.size(dim) of the chain's tensor: `x.view(x.size(0), -1)` (the batch's
    size differs by rank and step, so it is read from t, never traced as a constant)."""
    dim: int


def _size_part(node, prev):
    """Whether fx node `node` computes a size of `prev` (x.size(d), x.size(), x.shape, or an
    item of those)."""
    if node.op == "call_method" and node.target == "size":
        return node.args[0] is prev
    if node.op == "call_function" and node.target is getattr:
        return node.args[0] is prev and node.args[1:] == ("shape",)
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return _size_part(node.args[0], prev)
    return False


def _size_dim(node, prev):
    """dim, where fx node `node` is the size of one dimension of `prev` — x.size(d),
    x.size()[d], x.shape[d] — else None."""
    if not _size_part(node, prev) or len(node.args) != 2 or not isinstance(node.args[1], int):
        return None
    return node.args[1]         # x.size(d)'s d, or the item of x.size() / x.shape


def _sizes(node, prev):
    """{argument node: dim} of the sizes of `prev` that `node` (a reshape of prev) takes as
    arguments, or None where one is not a size of one dimension."""
    out = {}
    for a in node.all_input_nodes:
        if a is not prev and _size_part(a, prev):
            d = _size_dim(a, prev)
            if d is None:
                return None
            out[a] = d
    return out


def _bound(node, fn, sizes=None):
    """A one-argument callable applying fx node `node` to a tensor t: the node's args with its
    one input (the chain's predecessor) replaced by t, and its sizes of it (`sizes`, from
    _sizes) read from t. Only constants are kept, not the node, so the callable holds no
    reference to the traced graph or the model's weights."""
    sizes = sizes or {}
    args = torch.fx.node.map_arg(node.args, lambda n: _Size(sizes[n]) if n in sizes else _SLOT)
    kwargs = dict(torch.fx.node.map_arg(node.kwargs, lambda n: _Size(sizes[n]) if n in sizes else _SLOT))
    method = node.target if node.op == "call_method" else None

    def fill(a, t):
        if a is _SLOT:
            return t
        if isinstance(a, _Size):
            return t.size(a.dim)
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


def _classify(node, modules, sizes=None):
    """('unit', module) | ('op', Op); raises PartitionError for anything else. sizes: a
    reshape's size arguments (_sizes)."""
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
            return "op", Op(node.name, _bound(node, f, sizes), f not in _RESHAPE_FUNCTIONS,
                            dropout=f is F.dropout)
        what = getattr(f, "__name__", str(f))
    elif node.op == "call_method":
        if node.target in _ELEMENTWISE_METHODS or node.target in _RESHAPE_METHODS:
            return "op", Op(node.name, _bound(node, None, sizes), node.target in _ELEMENTWISE_METHODS)
        what = f"Tensor.{node.target}"
    else:
        what = f"{node.op} {node.target}"
    raise PartitionError(
        f"the hypergraph partitioner cannot place {what} "
        f"({f'layer {node.target!r}' if node.op == 'call_module' else f'node {node.name!r}'}): it handles chains of "
        "Conv2d / Linear layers joined by activations, pooling, dropout (p=0) and flatten; use the "
        "allreduce or conv_model_parallel strategy for this model")


def _defaults(model):
    """forward's arguments after the first that have defaults: {name: default}."""
    import inspect
    try:
        params = list(inspect.signature(model.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_each_layer_once(model):
    """PartitionError where two layers share a parameter (weight tying): each is placed apart.
    One module under two names (`self.head = self.fc`) is one layer."""
    owner = {}          # id(parameter) -> (its module, the module's name)
    for layer, m in model.named_modules():          # (each module once, under its first name)
        for name, p in m.named_parameters(recurse=False):
            first = owner.setdefault(id(p), (m, layer))
            if first[0] is not m:
                raise PartitionError(f"layers {first[1]!r} and {layer!r} share a parameter ({layer}.{name}); the "
                                     f"hypergraph strategy places each layer apart: untie them, or train with "
                                     f"allreduce or conv_model_parallel")


def layer_chain(model, input_shape, num_classes=None):
    """The model's LayerChain for inputs of `input_shape` (C, H, W): traced by torch.fx,
    shapes from one batch-1 forward on the CPU (torch.fx ShapeProp).

    The graph must be a chain (every node feeds only the next one): residual adds,
    concatenations and shape arithmetic raise PartitionError naming the node.
    """
    from torch.fx.passes.shape_prop import ShapeProp
    _check_each_layer_once(model)
    defaults = _defaults(model)
    try:        # the runner passes the images alone: forward's other arguments keep their defaults
        gm = torch.fx.symbolic_trace(model, concrete_args=defaults or None)
    except Exception as e:  # noqa: BLE001 - tracing errors come in many types
        raise PartitionError(f"torch.fx cannot trace the model ({type(e).__name__}: {e}); the "
                             "hypergraph strategy needs a traceable chain of layers") from None
    if defaults:        # fx keeps each as a placeholder whose value it asserts: no input of the chain
        checks = (torch._assert, operator.eq, getattr(torch.fx._symbolic_trace, "_assert_is_none", None))
        for n in reversed(list(gm.graph.nodes)):
            named = n.op == "placeholder" and re.sub(r"_\d+$", "", n.target) in defaults
            if not n.users and (named or n.op == "call_function" and n.target in checks):
                gm.graph.erase_node(n)
    modules = dict(gm.named_modules())
    nodes = [n for n in gm.graph.nodes]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise PartitionError(f"the model's forward takes {len(placeholders)} inputs without a default; the "
                             "hypergraph strategy (and the built-in runner) gives it one, the images")
    calls = collections.Counter(n.target for n in nodes if n.op == "call_module"
                                and next(modules[n.target].parameters(), None) is not None)
    twice = next((name for name, k in calls.items() if k > 1), None)
    if twice:       # (placed once under its name, each use partitioned apart: wrong gradients, no word)
        raise PartitionError(f"layer {twice!r} is called {calls[twice]} times in the model's forward; the hypergraph "
                             f"strategy places each layer once: give each use its own module, or train with "
                             f"allreduce or conv_model_parallel")
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    with torch.no_grad():
        ShapeProp(gm).propagate(torch.zeros((1, *input_shape), dtype=dtype))

    layers, pending = [], []          # pending: ops since the last unit layer
    prev = placeholders[0]
    for node in nodes:
        if node.op in ("placeholder", "output") or _size_part(node, prev):
            continue                    # a size of the chain's tensor: read by the reshape that takes it
        sizes = _sizes(node, prev) if node.op == "call_method" and node.target in _RESHAPE_METHODS else {}
        users = [u for u in prev.users if not _size_part(u, prev)]
        if sizes is None or prev not in node.all_input_nodes or users != [node] or \
                any(a is not prev and a not in sizes for a in node.all_input_nodes):
            raise PartitionError(f"the model is not a chain of layers at node {node.name!r} "
                                 f"(inputs {[n.name for n in node.all_input_nodes]}): residual or "
                                 "branching graphs are not supported by the hypergraph strategy")
        kind, what = _classify(node, modules, sizes)
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
