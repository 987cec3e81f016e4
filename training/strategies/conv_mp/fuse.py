"""Channel-wise layers run inside the shards: what follows a distributed conv and acts
on each channel alone (an activation, pooling) is applied by every rank to its own
channels before the gather, instead of by the master to the whole feature map after it.

Why: those layers are the master's serial part of the step (every other rank waits
while the master runs them), and pooling shrinks what is gathered and scattered. The
values are the same: a channel-wise op on a block of channels computes exactly what it
computes on those channels of the full map.

Found with torch.fx, tracing the root's forward (and nn.Sequential's; every other module,
a Conv2d subclass or a user's block, is one call): after each distributed conv called
there, the longest chain of nodes where every node is the only user of the one before,
and each is a channel-wise module (ReLU, MaxPool2d, Identity, ...), function (F.relu,
F.max_pool2d, ...) or tensor method (.relu()) whose other arguments are constants. A
module called in more than one place (one ReLU reused after several layers) joins no
chain: the master still needs it elsewhere. Dropout is not channel-wise in this sense
(each rank would draw other random numbers), nor is BatchNorm in training (its
statistics are per channel, but it holds parameters and buffers the master owns).
A distributed conv whose output (after its chain) goes to the next distributed conv
alone is linked to it (`links`): its output is all-gathered on every rank, not
gathered at the master and broadcast again. One whose output is flattened into an
nn.Linear alone (`heads`: the classifier after the last conv) runs that Linear
row-parallel: each rank multiplies its own channels by their columns of the weight and
the master sums the partial outputs, so the feature map never goes to the master at all.

The master then runs the trace, so nothing is fused where the trace would not do what
the forward does: a model fx cannot trace, a forward that differs between train and
eval, changes the grad mode, assigns to the module, takes a second required argument
or reads a distributed conv's parameters (the reason is logged once).
"""
import copy
import inspect
import logging

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

MODULES = (nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh,
           nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
           nn.AdaptiveMaxPool2d)
FUNCTIONS = {F.relu, F.relu6, F.leaky_relu, F.elu, F.gelu, F.silu, F.hardswish, F.hardsigmoid, F.mish,
             torch.relu, torch.sigmoid, torch.tanh, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d,
             F.adaptive_max_pool2d}
METHODS = {"relu", "sigmoid", "tanh"}


class Call(nn.Module):
    """fn(x, *args, **kwargs): a channel-wise function with its constant arguments."""

    def __init__(self, fn, args=(), kwargs=None):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs or {})

    def forward(self, x):
        if isinstance(self.fn, str):
            return getattr(x, self.fn)(*self.args, **self.kwargs)
        return self.fn(x, *self.args, **self.kwargs)

    def extra_repr(self):
        return getattr(self.fn, "__name__", str(self.fn))


def _constant(value):
    if isinstance(value, (tuple, list)):
        return all(_constant(v) for v in value)
    return not isinstance(value, torch.fx.Node)


def _returns_indices(module_or_kwargs):
    """A pooling that also returns indices (a tuple, not a map). For functions, fx traces
    F.max_pool2d(..., return_indices=True) to max_pool2d_with_indices, which is not in
    FUNCTIONS; the keyword is checked as well."""
    if isinstance(module_or_kwargs, nn.Module):
        return bool(getattr(module_or_kwargs, "return_indices", False))
    return bool(module_or_kwargs.get("return_indices", False))


def _follower(node, modules, calls):
    """A Call or the module for a channel-wise node, else None."""
    rest_args = node.args[1:]
    if not _constant(rest_args) or not _constant(tuple(node.kwargs.values())):
        return None
    if node.op == "call_module":
        module = modules.get(node.target)
        if isinstance(module, MODULES) and calls[node.target] == 1 and not _returns_indices(module):
            return node.target
        return None
    if node.op == "call_function" and node.target in FUNCTIONS and not _returns_indices(node.kwargs):
        kwargs = dict(node.kwargs)
        if "inplace" in kwargs:     # out of place inside a shard, as _out_of_place does for modules
            kwargs["inplace"] = False
        return Call(node.target, rest_args, kwargs)
    if node.op == "call_method" and node.target in METHODS:
        return Call(node.target, rest_args, node.kwargs)
    return None


class Fusion:
    """The chains found in one model: `chains` {conv: [follower module name or Call]}
    (in model order), the traced graph with those chains removed, `links` {conv: next
    conv}: a distributed conv whose output (after its chain) goes to the next distributed
    conv alone (DistributedConv2d.link_to), and `heads` {conv: nn.Linear's name}: a
    distributed conv whose output (after its chain) is flattened into that Linear alone
    (DistributedConv2d.attach_head; the graph then has neither the flatten nor the Linear)."""

    def __init__(self, chains, graph, links=None, heads=None):
        self.chains, self.graph, self.links = chains, graph, dict(links or {})
        self.heads = dict(heads or {})

    def followers(self, model):
        """{conv: [nn.Module, ...]}: each chain's followers, resolved in `model`; an
        in-place one (ReLU(inplace=True)) as an out-of-place copy: inside a shard the
        chain runs on a tensor autograd must keep for the conv's backward."""
        modules = dict(model.named_modules())
        return {conv: [_out_of_place(modules[f]) if isinstance(f, str) else f for f in chain]
                for conv, chain in self.chains.items()}

    def graph_module(self, model):
        """A GraphModule that runs `model` without the chains (they run inside the
        distributed convs). Build it once the convs are replaced: it holds the
        modules `model` has now, and shares them (same objects, same parameters)."""
        return torch.fx.GraphModule(model, self.graph)

    def describe(self):
        """'conv1 + ReLU + MaxPool2d; conv2 + relu; conv1 -> conv2' for a log line."""
        return "; ".join([f"{conv} + " + " + ".join(f if isinstance(f, str) else f.extra_repr() for f in chain)
                          for conv, chain in self.chains.items()] +
                         [f"{a} -> {b}" for a, b in self.links.items()] +
                         [f"{a} -> {b} row-parallel" for a, b in self.heads.items()])


def _out_of_place(module):
    if getattr(module, "inplace", False):
        module = copy.copy(module)   # no parameters: a shallow copy is a separate layer
        module.inplace = False
    return module


class _Tracer(torch.fx.Tracer):
    """Traces the root's forward and nn.Sequential ones only: every other module (a
    Conv2d subclass, a user's block) is one call_module node, run as it is."""

    def is_leaf_module(self, m, qualname):
        return not isinstance(m, nn.Sequential)


GRAD_MODE = ("no_grad", "enable_grad", "inference_mode", "set_grad_enabled")


def _why_not(model):
    """Why the root's forward cannot be replaced by a trace of it, or None.

    fx records tensor operations only: a grad-mode context in forward would be dropped,
    arguments besides the input would become inputs the strategy never passes, and a
    state change (self.x = ...) would not be replayed."""
    if any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in _other_arguments(model)):
        return "its forward takes more than one required argument"
    if set(GRAD_MODE) & _names(getattr(type(model).forward, "__code__", None)):
        return "its forward changes the grad mode, which a trace would drop"
    return None


def _names(code):
    """Every global and attribute name a function's code (and the code nested in it) uses."""
    if code is None:
        return set()
    out = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            out |= _names(const)
    return out


def _other_arguments(model):
    """The parameters of model.forward after the input."""
    return list(inspect.signature(model.forward).parameters.values())[1:]


def _traces(model):
    """The graphs of one copy of `model` in train and in eval mode, and whether tracing
    changed the copy's state (a forward that assigns to self). Optional arguments take
    their defaults."""
    probe = copy.deepcopy(model)
    concrete = {p.name: p.default for p in _other_arguments(probe) if p.default is not inspect.Parameter.empty}
    graphs, changed = [], False
    for mode in (True, False):
        probe.train(mode)
        before = _state(probe)
        graphs.append(_Tracer().trace(probe, concrete_args=concrete or None))
        changed = changed or _state(probe) != before
    return graphs, changed


def _state(module):
    """What a forward that assigns to self would change: every public attribute of every
    module (by identity), every parameter and buffer (by identity and version: an
    in-place update)."""
    return [(name, key, id(value)) for name, m in module.named_modules()
            for key, value in sorted(vars(m).items()) if not key.startswith("_")] + \
           [(name, id(t), t._version) for name, t in module.state_dict(keep_vars=True).items()]


def plan(model, names):
    """The Fusion for the distributed convs `names` (module docstring), or None where
    no chain follows them or the model cannot be fused (the reason is logged)."""
    why = _why_not(model)
    if why is None:
        try:
            (graph, eval_graph), changed = _traces(model)
        except Exception as e:  # noqa: BLE001 - any tracing failure means "do not fuse"
            first = (str(e).splitlines() or [""])[0][:200]
            why = f"torch.fx cannot trace the model ({type(e).__name__}: {first})"
        else:
            if changed:
                why = "its forward assigns to the module, which a trace would not replay"
            elif str(graph) != str(eval_graph):
                why = "the model's forward differs between training and evaluation"
            elif any(n.op == "get_attr" and any(str(n.target).startswith(x + ".") for x in names)
                     for n in graph.nodes):
                why = "its forward reads a distributed conv's parameters directly"
    if why is not None:
        log.info("conv_model_parallel: channel-wise layers stay on the master: %s", why)
        return None
    modules = dict(model.named_modules())
    calls = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    found = {}
    for node in list(graph.nodes):
        if node.op != "call_module" or node.target not in names or calls[node.target] != 1:
            continue
        chain, cur = [], node
        while len(cur.users) == 1:
            nxt = next(iter(cur.users))
            if not nxt.args or nxt.args[0] is not cur or any(a is cur for a in nxt.args[1:]):
                break
            follower = _follower(nxt, modules, calls)
            if follower is None:
                break
            chain.append(follower)
            cur = nxt
        if chain:
            cur.replace_all_uses_with(node)
            while cur is not node:
                prev = cur.args[0]
                graph.erase_node(cur)
                cur = prev
            found[node.target] = chain
    links = _links(graph, names, calls)
    heads = _heads(graph, names, calls, modules, list(model.named_modules(remove_duplicate=False)))
    if not found and not links and not heads:
        return None
    graph.lint()
    return Fusion({n: found[n] for n in names if n in found}, graph, links, heads)


def _links(graph, names, calls):
    """{a: b} for distributed convs a, b each called once, where b's only argument is a's
    output (after a's chain) and nothing else uses it."""
    links = {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in names or calls[node.target] != 1:
            continue
        if len(node.users) != 1:
            continue
        user = next(iter(node.users))
        if (user.op == "call_module" and user.target in names and user.target != node.target
                and calls[user.target] == 1 and user.args == (node,) and not user.kwargs):
            links[node.target] = user.target
    return links


def _flattened(node):
    """The nodes that flatten `node`'s output to (N, -1) and are its only users, the last
    one first: torch.flatten(x, 1), x.flatten(1), nn.Flatten() (checked by the caller),
    x.view(x.size(0), -1) or x.reshape(x.size(0), -1); else None."""
    users = list(node.users)
    if len(users) == 1:
        f = users[0]
        start = f.args[1] if len(f.args) > 1 else f.kwargs.get("start_dim", 0)
        end = f.args[2] if len(f.args) > 2 else f.kwargs.get("end_dim", -1)
        if ((f.op == "call_function" and f.target is torch.flatten) or
                (f.op == "call_method" and f.target == "flatten")) and f.args[0] is node \
                and start == 1 and end == -1:
            return [f]
        if f.op == "call_module":
            return [f]      # an nn.Flatten: _heads checks the module
        return None
    if len(users) == 2:
        size = next((u for u in users if u.op == "call_method" and u.target == "size"), None)
        view = next((u for u in users if u is not size), None)
        if size is not None and size.args == (node, 0) and not size.kwargs and len(size.users) == 1 \
                and view.op == "call_method" and view.target in ("view", "reshape") \
                and view.args == (node, size, -1) and not view.kwargs:
            return [view, size]
    return None


def _shared(module, name, graph, every):
    """Whether `module` (the Linear `name`) cannot move into the shards: the forward reads
    its parameters directly, another module holds it or one of its parameters (tied
    weights, or a block fx does not trace into calling it too), or it is more than a plain
    weight and bias (hooks, as the old weight_norm and spectral_norm add: its `weight`
    is then computed, not a parameter)."""
    if any(n.op == "get_attr" and str(n.target).startswith(name + ".") for n in graph.nodes):
        return True
    if set(dict(module.named_parameters())) - {"weight", "bias"} or list(module.buffers()) \
            or not isinstance(module.weight, nn.Parameter) \
            or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks \
            or getattr(module, "_backward_pre_hooks", None):
        return True
    mine = {id(p) for p in module.parameters()}
    for other, m in every:
        if other == name:
            continue
        if m is module or any(id(p) in mine for p in m.parameters(recurse=False)):
            return True
    return False


def _heads(graph, names, calls, modules, every):
    """{conv: linear}: distributed convs each called once whose output (after the chain)
    is flattened to (N, -1) into an nn.Linear called once, which nothing else uses, with
    a whole number of input features per output channel. The flatten and the Linear are
    taken out of `graph`: the conv's node stands for the Linear's output."""
    heads = {}
    for node in list(graph.nodes):
        if node.op != "call_module" or node.target not in names or calls[node.target] != 1:
            continue
        flat = _flattened(node)
        if flat is None or len(flat[0].users) != 1:
            continue
        if flat[0].op == "call_module":
            module = modules.get(flat[0].target)
            if type(module) is not nn.Flatten or (module.start_dim, module.end_dim) != (1, -1) \
                    or calls[flat[0].target] != 1 or flat[0].args != (node,):
                continue
        linear = next(iter(flat[0].users))
        module = modules.get(linear.target) if linear.op == "call_module" else None
        if type(module) is not nn.Linear or calls[linear.target] != 1 or linear.args != (flat[0],) \
                or linear.kwargs or module.in_features % modules[node.target].out_channels \
                or _shared(module, linear.target, graph, every):
            continue
        linear.replace_all_uses_with(node)
        graph.erase_node(linear)
        for f in flat:
            graph.erase_node(f)
        heads[node.target] = linear.target
    return heads
