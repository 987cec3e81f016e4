"""The training loss of the built-in runner (`training.loss`, `training.loss_options`).

    cross_entropy                    torch.nn.CrossEntropyLoss(**options), the default
                                     (e.g. {label_smoothing: 0.1})
    package.module:Class             a loss class (an nn.Module such as torch.nn:NLLLoss),
                                     built with **options
    package.module:function          a loss function, called as f(output, target, **options)

Every strategy uses `Loss`: `mean(out, y)` is what it backpropagates (the mean over the
rows it is given), `sum(out, y)` what evaluation adds up, `correct(out, y)` the rows
whose arg-max is the label (0 where that means nothing: not a class index target).
The update stays exactly the single-process one on the global batch as long as the loss
is a mean over rows, which a per-row loss with reduction "mean" is.
"""
import torch

from . import userfn


class Loss:
    def __init__(self, fn, name):
        self.fn = fn
        self.name = name

    def mean(self, out, y):
        return self.fn(out, y)

    def sum(self, out, y):
        return self.fn(out, y) * len(y)

    @staticmethod
    def correct(out, y):
        if out.dim() != 2 or y.dim() != 1 or y.dtype not in (torch.int64, torch.int32):
            return 0
        return int((out.detach().argmax(1) == y).sum())


def build_loss(name="cross_entropy", options=None):
    """The Loss `name` with `options` (one-line UserCodeError naming training.loss)."""
    options = dict(options or {})
    if name == "cross_entropy":
        obj = torch.nn.CrossEntropyLoss
    else:
        obj = userfn.load(name, "training.loss")
    if isinstance(obj, type):
        fn = userfn.call(obj, options, "training.loss")
    elif callable(obj):
        def fn(out, y, _f=obj):
            return _f(out, y, **options)
    else:
        raise userfn.UserCodeError(f"training.loss: {name} is neither a loss class nor a function")
    return Loss(fn, name)
