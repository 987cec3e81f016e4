"""Models by name: `build_model(name, input_shape, num_classes, options)`.

Built in: digits_cnn, seed_cnn, resnet, mlp; any other name of the form
`package.module:factory` is a user's model factory or nn.Module class (see
build_model).

Contract with the model-parallel strategy: every convolution is a plain
`torch.nn.Conv2d` held as an attribute (reachable through `named_modules()`, e.g.
"conv2" or "stage1.0.conv1"), and whatever follows it (ReLU, pooling, batch norm) is
a separate module. The forward pass calls each attribute by name, so a strategy can
replace a conv with ``setattr(parent, name, distributed_conv)`` and the network
uses the replacement. `conv_layers(model)` lists them in order.

Initialisation uses PyTorch's default initialisers only, so a model built after
``torch.manual_seed(s)`` is identical on every rank and every run.
"""
import inspect
import logging

from torch import nn

from conf.errors import YarnappError
from conf.schema import BUILTIN_MIN_HW

log = logging.getLogger(__name__)


class ModelError(YarnappError, ValueError):
    """A model that cannot be built. str() is one line naming the model and the fix. Not
    retried (launcher.retries)."""
    certain = True


def _positive_int(model, key, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{model}: option {key} must be a positive integer, got {value!r}")
    return value


def _shape(model, input_shape):
    min_hw = BUILTIN_MIN_HW.get(model, 1)
    try:
        c, h, w = (int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ModelError(f"{model}: input_shape must be (C, H, W), got {input_shape!r}") from None
    if c < 1 or h < min_hw or w < min_hw:
        raise ModelError(f"{model}: input_shape {tuple(input_shape)} is too small "
                         f"(needs C >= 1 and H, W >= {min_hw})")
    return c, h, w


def conv_layers(model):
    """[(name, module)] of every nn.Conv2d in `model`, in registration order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digits (any C x H x W with H, W >= 2 works):

    conv1 3x3 (pad 1) -> relu1 -> conv2 3x3 (pad 1) -> relu2 -> pool2 (max 2x2)
    -> flatten -> fc1 (hidden) -> relu3 -> fc2 (classes).
    About 140k parameters at the defaults; reaches ~98% on the digits test split in
    a few epochs.
    """

    def __init__(self, input_shape, num_classes, conv1=32, conv2=64, hidden=128):
        super().__init__()
        c, h, w = _shape("digits_cnn", input_shape)
        conv1 = _positive_int("digits_cnn", "conv1", conv1)
        conv2 = _positive_int("digits_cnn", "conv2", conv2)
        hidden = _positive_int("digits_cnn", "hidden", hidden)
        self.conv1 = nn.Conv2d(c, conv1, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(conv1, conv2, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(conv2 * (h // 2) * (w // 2), hidden)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = self.relu1(self.conv1(x))
        x = self.pool2(self.relu2(self.conv2(x)))
        return self.fc2(self.relu3(self.fc1(self.flatten(x))))


class SeedCNN(nn.Module):
    """The CIFAR-10 network of the seed paper (Marques, Falcao & Alexandre, "Distributed
    learning of CNNs on heterogeneous CPU/GPU architectures", Applied Artificial
    Intelligence 2018): two convolutional layers of 500 and 1500 kernels, pooling, and
    a classifier. The paper's body is not available to us; the abstract gives only the
    two widths, so these choices are ours:

    - 5x5 kernels, stride 1, zero padding 2 ("same" size), with bias: the classic
      LeNet / Caffe CIFAR-10 example layout that networks of that time used.
    - ReLU after each convolution, then 2x2 max pooling with stride 2:
      3x32x32 -> conv1 -> 500x32x32 -> pool1 -> 500x16x16
              -> conv2 -> 1500x16x16 -> pool2 -> 1500x8x8.
    - Classifier: one fully connected layer, 1500*8*8 = 96000 -> classes (no hidden
      layer, no dropout, no normalisation: the convolutions should dominate the work,
      which is what conv-layer model parallelism distributes).

    Cost at the defaults on 3x32x32: ~19.5M parameters (conv2: 18.75M), ~5.0 GMAC per
    image forward (conv2: 4.8 GMAC). Options conv1, conv2 (widths) and kernel (odd
    size) shrink it for tests.
    """

    def __init__(self, input_shape, num_classes, conv1=500, conv2=1500, kernel=5):
        super().__init__()
        c, h, w = _shape("seed_cnn", input_shape)
        conv1 = _positive_int("seed_cnn", "conv1", conv1)
        conv2 = _positive_int("seed_cnn", "conv2", conv2)
        kernel = _positive_int("seed_cnn", "kernel", kernel)
        if kernel % 2 == 0:
            raise ModelError(f"seed_cnn: option kernel must be odd (padding keeps the size), got {kernel}")
        self.conv1 = nn.Conv2d(c, conv1, kernel, padding=kernel // 2)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(conv1, conv2, kernel, padding=kernel // 2)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(conv2 * (h // 4) * (w // 4), num_classes)

    def forward(self, x):
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        return self.fc(self.flatten(x))


class BasicBlock(nn.Module):
    """conv1 3x3 (stride s) -> bn1 -> relu1 -> conv2 3x3 -> bn2, plus the shortcut
    (identity, or downsample 1x1 conv -> downsample_bn when the shape changes), -> relu2."""

    def __init__(self, cin, cout, stride, norm):
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=bias)
        self.bn1 = _norm(norm, cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=bias)
        self.bn2 = _norm(norm, cout)
        if stride != 1 or cin != cout:
            self.downsample = nn.Conv2d(cin, cout, 1, stride=stride, bias=bias)
            self.downsample_bn = _norm(norm, cout)
        else:
            self.downsample = None
            self.downsample_bn = None
        self.relu2 = nn.ReLU()

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        short = x if self.downsample is None else self.downsample_bn(self.downsample(x))
        return self.relu2(out + short)


def _norm(norm, channels):
    return nn.BatchNorm2d(channels) if norm == "batch" else nn.Identity()


class ResNet(nn.Module):
    """A small CIFAR-style ResNet (He et al. 2016, section 4.2): a 3x3 stem conv of
    `width` channels, then `stages` stages of `blocks` BasicBlocks whose widths double
    (and resolution halves) from one stage to the next, global average pooling, and
    one fully connected layer. width=16, blocks=3, stages=3 is ResNet-20.

    norm: "batch" (BatchNorm2d after every conv; running statistics are per rank
    under data parallelism) or "none" (convs get biases instead).
    """

    def __init__(self, input_shape, num_classes, width=16, blocks=3, stages=3, norm="batch"):
        super().__init__()
        c, h, w = _shape("resnet", input_shape)
        width = _positive_int("resnet", "width", width)
        blocks = _positive_int("resnet", "blocks", blocks)
        stages = _positive_int("resnet", "stages", stages)
        if norm not in ("batch", "none"):
            raise ModelError(f"resnet: option norm must be 'batch' or 'none', got {norm!r}")
        self.conv1 = nn.Conv2d(c, width, 3, padding=1, bias=norm == "none")
        self.bn1 = _norm(norm, width)
        self.relu1 = nn.ReLU()
        cin = width
        for s in range(stages):
            cout = width * 2 ** s
            stage = nn.Sequential(*[BasicBlock(cin if b == 0 else cout, cout, 2 if (s > 0 and b == 0) else 1, norm)
                                    for b in range(blocks)])
            self.add_module(f"stage{s + 1}", stage)
            cin = cout
        self.stages = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(x)))
        for s in range(self.stages):
            x = getattr(self, f"stage{s + 1}")(x)
        return self.fc(self.flatten(self.pool(x)))


class MLP(nn.Module):
    """Communication-heavy baseline: flatten -> `layers` x (fc -> relu) of `hidden`
    units -> out. At the defaults on 3x32x32 it has ~29M parameters (116 MB of
    gradients per step) for very little compute per sample."""

    def __init__(self, input_shape, num_classes, hidden=4096, layers=2):
        super().__init__()
        c, h, w = _shape("mlp", input_shape)
        hidden = _positive_int("mlp", "hidden", hidden)
        layers = _positive_int("mlp", "layers", layers)
        self.flatten = nn.Flatten()
        width = c * h * w
        self._names = []
        for i in range(layers):
            self.add_module(f"fc{i + 1}", nn.Linear(width, hidden))
            self.add_module(f"relu{i + 1}", nn.ReLU())
            self._names += [f"fc{i + 1}", f"relu{i + 1}"]
            width = hidden
        self.out = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.flatten(x)
        for name in self._names:
            x = getattr(self, name)(x)
        return self.out(x)


MODELS = {      # conf.schema.BUILTIN_MODELS names them for the job check (a test holds the two together)
    "digits_cnn": DigitsCNN,
    "seed_cnn": SeedCNN,
    "resnet": ResNet,
    "mlp": MLP,
}


def check_options(name, options):
    """ModelError naming the first option a built-in model `name` does not take (a user's
    factory is called as it is: its own errors say)."""
    if name in MODELS:
        _check_options(name, MODELS[name], options)


def _check_options(name, cls, options):
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    allowed = [p for p in list(params)[3:]
               if params[p].kind in (params[p].POSITIONAL_OR_KEYWORD, params[p].KEYWORD_ONLY)]
    for key in options:
        if key not in allowed:
            raise ModelError(f"model {name!r}: unknown option {key!r}; options are "
                             f"{', '.join(allowed) or '(none)'}")


def build_model(name, input_shape, num_classes, options=None):
    """The model `name` for inputs of `input_shape` (C, H, W) and `num_classes` outputs.

    A built-in name is constructed as ``Class(input_shape, num_classes, **options)``
    (unknown options are refused). Any other name is a user's ``package.module:factory``
    (a function or an nn.Module class, e.g. ``torchvision.models:resnet18``), called
    with the keyword `options` (training.model_options, nested values allowed) plus
    `input_shape` / `num_classes` where it asks for them by name (a factory taking
    **kwargs gets num_classes): training.userfn.call. Raises ModelError (one line).
    """
    from . import userfn
    options = dict(options or {})
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"model {name!r}: num_classes must be a positive integer, got {num_classes!r}")
    if name in MODELS:
        cls = MODELS[name]
        _check_options(name, cls, options)
        try:
            model = cls(tuple(input_shape), num_classes, **options)
        except ModelError:
            raise
        except TypeError as e:
            raise ModelError(f"model {name!r}: cannot construct it with options {options}: {e}") from None
    elif ":" not in name:
        raise ModelError(f"training.model: {name!r} is neither a built-in model ({', '.join(MODELS)}) "
                         f"nor a 'package.module:factory'")
    else:
        try:
            factory = userfn.load(name, "training.model")
            model = userfn.call(factory, options, "training.model",
                                offered={"input_shape": tuple(input_shape), "num_classes": num_classes})
        except userfn.UserCodeError as e:
            raise ModelError(str(e)) from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {name!r}: constructing it gave a {type(model).__name__}, not an nn.Module")
    log.debug("built %s for %s -> %d classes: %d parameters, convs %s", name, tuple(input_shape),
              num_classes, sum(p.numel() for p in model.parameters()), [n for n, _ in conv_layers(model)])
    return model


def check_output(model, name, example, num_classes):
    """Raise ModelError (one line) unless `model` maps a batch like `example` (B x C x H x W,
    the training data's first rows) to logits of shape (B, num_classes), as the built-in
    runner's loss needs (num_classes None: one tensor, of any width). Before this, a user's
    model with 13 outputs for 10 classes trained and reported success, and one with 7 failed
    in cross_entropy with a torch traceback after a restart. The pass runs in eval mode
    without gradients on a fork of the RNG, so nothing it touches (batch-norm statistics,
    the random stream) differs afterwards."""
    import torch
    x = example[:2]
    modes = [(m, m.training) for m in model.modules()]
    try:
        param = next(model.parameters(), None)
        if param is not None:
            x = x.to(param.device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            try:
                out = model(x)
            except Exception as e:  # noqa: BLE001 - the user's model: its error as one line, traceback in the log
                log.error("model %r: forward pass on a batch of shape %s", name, tuple(x.shape), exc_info=True)
                raise ModelError(f"model {name!r}: a batch of the training data, shape {tuple(x.shape)}, "
                                 f"does not go through it: {type(e).__name__}: {e}".splitlines()[0]) from None
    finally:
        for m, training in modes:
            m.training = training
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"model {name!r}: its forward returns a {type(out).__name__}; the built-in runner "
                         f"needs one tensor of logits, shape (batch, {num_classes})")
    if num_classes is not None and tuple(out.shape) != (x.shape[0], num_classes):
        raise ModelError(f"model {name!r}: a batch of {x.shape[0]} images {'x'.join(map(str, x.shape[1:]))} "
                         f"gives outputs of shape {tuple(out.shape)}, but the data has {num_classes} classes: "
                         f"the model must give ({x.shape[0]}, {num_classes}); build its last layer with the "
                         f"num_classes it is given")


def parameter_count(model):
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["ModelError", "build_model", "check_output", "conv_layers", "parameter_count", "MODELS",
           "DigitsCNN", "SeedCNN", "ResNet", "MLP", "BasicBlock"]
