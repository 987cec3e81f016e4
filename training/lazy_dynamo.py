"""torch's optimizers without importing torch._dynamo, until something compiles.

torch 2.13's optimizers import torch._dynamo the first time one is built
(`Optimizer.add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` are
wrapped in `torch._disable_dynamo`, which imports it on its first call) and again on the
first step (`_use_grad` calls `torch._dynamo.graph_break()`). The import costs about 1.4
CPU-seconds, 2.8 s of a 0.5-vcore rank's start, at every start and restart. Outside
torch.compile both wrappers do nothing: `disable` only matters while dynamo traces or
compiles frames, and `graph_break` only while it traces.

`defer()` makes those wrappers call straight through for as long as nothing else has
imported torch._dynamo. Once something has (torch.compile imports it before it traces a
frame), every call takes torch's own path again. Where torch's wrappers are not the ones
described here (another torch version), it changes nothing.
"""
import functools
import sys

_DISABLED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _loaded():
    return "torch._dynamo" in sys.modules


def defer():
    """Defer torch._dynamo's import by torch.optim's Optimizer, SGD and Adam (the optimizers
    the built-in runner builds). Call it before building an optimizer."""
    if _loaded():
        return
    import torch.optim
    for name in _DISABLED:
        _defer_disable(getattr(torch.optim.Optimizer, name))
    for cls in (torch.optim.SGD, torch.optim.Adam):
        _defer_graph_breaks(cls)


def _defer_disable(inner):
    """`inner`, torch._disable_dynamo's wrapper of fn, looks up fn.__dynamo_disable (made on
    its first call by importing torch._dynamo): set it to a call through that makes the
    real one once torch._dynamo is loaded."""
    code = getattr(inner, "__code__", None)
    if code is None or code.co_qualname != "_disable_dynamo.<locals>.inner" or inner.__closure__ is None:
        return
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in inner.__closure__)))
    fn, recursive = cells.get("fn"), cells.get("recursive", True)
    if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
        return

    def through(*args, **kwargs):
        if not _loaded():
            return fn(*args, **kwargs)
        import torch._dynamo
        real = torch._dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = real
        return real(*args, **kwargs)

    fn.__dynamo_disable = through


def _defer_graph_breaks(cls):
    """cls.step as torch's `_use_grad` runs it (grad mode set to the optimizer's
    `differentiable`, restored after), without its two graph breaks while dynamo is not
    loaded; torch's own step once it is."""
    step = cls.__dict__.get("step")
    code = getattr(step, "__code__", None)
    if code is None or code.co_qualname != "_use_grad_for_differentiable.<locals>._use_grad":
        return                  # another torch, or already hooked by an optimizer built before
    import torch
    func = step.__wrapped__

    @functools.wraps(func)
    def _use_grad(self, *args, **kwargs):
        if _loaded():
            return step(self, *args, **kwargs)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return func(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    cls.step = _use_grad
