"""The model a built-in training run ends with, for use after it: built, loaded, and fed
images as training fed its test set.

The runner writes beside the final weights (training.checkpoint's `final/model.pt`) a card,
`final/model.json`: what built the model (training.model and its options, the input shape,
the classes) and what its inputs went through (the test transforms, the mean and std), so
that nobody has to find the normalisation in a dataset's side files:

    run = yarnapp.Run(app_id)               # or the handle submit returned
    trained = run.model()                   # a TrainedModel
    labels = trained.predict(images)        # uint8 N x C x H x W, as ParquetSource.read_arrays gives
    names = [trained.classes[i] for i in labels]
    trained.module                          # the nn.Module itself (eval mode, on the CPU)
"""
import json

import numpy as np
import pyarrow as pa

from . import fsutil
from .checkpoint import FINAL_CARD as CARD
from .checkpoint import CheckpointError


def card(spec, train):
    """The card of a run of training spec `spec` on the training set `train` (a
    ParquetSource or MapSource): plain JSON."""
    pixels = hasattr(train, "layout")           # a Parquet dataset's images; a user's dataset gives tensors
    data = spec.data.model_dump(mode="json")
    return {"model": spec.model, "model_options": spec.model_options or {},
            "input_shape": [int(d) for d in train.shape], "num_classes": int(train.num_classes),
            "classes": [str(c) for c in train.classes],
            "inputs": "pixels" if pixels else "tensors",
            "test_transforms": (data.get("test_transforms") or []) if pixels else [],
            "transform": data.get("transform"),
            "mean": [float(v) for v in train.mean] if pixels else None,
            "std": [float(v) for v in train.std] if pixels else None}


class TrainedModel:
    """`module` (an nn.Module in eval mode, on the CPU), `classes` (names by label), `card`
    (what built it and what its inputs went through)."""

    def __init__(self, module, card, where):
        self.module, self.card, self.where = module, card, where
        self.classes = card["classes"]

    def __repr__(self):
        return (f"TrainedModel({self.card['model']!r}, input_shape={self.card['input_shape']}, "
                f"{len(self.classes)} classes, from {self.where})")

    def inputs(self, images):
        """The model's input for `images` as training's test set had it: uint8 pixels
        (N x C x H x W, or N x H x W for one channel) through the test transforms and the
        normalisation; a user's dataset's tensors (training.data.dataset) as they are."""
        import torch
        if self.card["inputs"] == "tensors":
            return torch.as_tensor(images, dtype=torch.float32)
        if self.card.get("transform"):
            raise CheckpointError(f"{self.where}: the run passed its images through its own "
                                  f"training.data.transform ({self.card['transform']}); give the module its inputs "
                                  f"yourself: TrainedModel.module")
        from .data import transforms
        images = self._pixels(images)
        hwc = images[..., None] if images.ndim == 3 else images.transpose(0, 2, 3, 1)
        ops, hooks = transforms.build(self.card["test_transforms"], "training.data.test_transforms")
        if hooks:
            raise CheckpointError(f"{self.where}: the run's test_transforms use torchvision; apply them, then give "
                                  f"the module its inputs yourself: TrainedModel.module")
        hwc = transforms.apply(ops, np.ascontiguousarray(hwc), 0, 0, np.arange(len(hwc), dtype=np.int64))
        c, h, w = self.card["input_shape"]
        if tuple(hwc.shape[1:3]) != (h, w):
            after = f" after the run's test_transforms {self.card['test_transforms']}" \
                if self.card["test_transforms"] else ""
            raise ValueError(f"predict: images of {images.shape[-2]} x {images.shape[-1]} pixels come out "
                             f"{hwc.shape[1]} x {hwc.shape[2]}{after}; the model takes {h} x {w} "
                             f"(input_shape {self.card['input_shape']}): resize them to {h} x {w} first")
        return transforms.normalise(hwc, self.card["mean"], self.card["std"])

    def _pixels(self, images):
        """`images` as a uint8 N x C x H x W (or N x H x W, one channel) array with the
        model's channels; anything else is one ValueError saying what to give."""
        c = self.card["input_shape"][0]
        want = f"uint8 N x {c} x H x W" + (" (or N x H x W)" if c == 1 else "")
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"predict: images must be {want}, got {images.dtype} of shape {images.shape}")
        if images.ndim == 3 and c > 1:
            one = ("; one image? give a batch of one: images[None]" if images.shape[0] == c else
                   "; one channels-last image (H x W x C, as PIL gives)? give images.transpose(2, 0, 1)[None]"
                   if images.shape[2] == c else "")
            raise ValueError(f"predict: images must be {want}: the model takes {c} channels, got shape "
                             f"{images.shape}{one}")
        if images.ndim == 4 and images.shape[1] != c:
            hint = ("; they look channels-last (N x H x W x C, as PIL and numpy give): "
                    "images.transpose(0, 3, 1, 2)" if images.shape[3] == c else "")
            raise ValueError(f"predict: images must be {want}: the model takes {c} channel(s), got shape "
                             f"{images.shape}{hint}")
        return images

    def logits(self, images):
        """The model's outputs (a float tensor, N x classes) for `images` (see inputs)."""
        import torch
        with torch.no_grad():
            return self.module(self.inputs(images))

    def predict(self, images):
        """The label the model gives each of `images` (see inputs): an int64 array of class
        indices (`classes` names them)."""
        return self.logits(images).argmax(1).numpy()


def load(root):
    """The TrainedModel an application saved in its checkpoint directory `root` (a URI or
    path: training.checkpoint's <uri>/<app id>). Raises CheckpointError (one line) where
    there is none, or no card (an application of an earlier yarnapp)."""
    import torch

    from .models import build_model
    fs, path = fsutil.resolve(root)         # YarnappError (one line) for a URI it cannot open
    try:
        info = json.loads(fsutil.read_bytes(fs, f"{path}/final/{CARD}"))
    except (OSError, ValueError, pa.ArrowException):
        why = (f"no {CARD} beside model.pt (an earlier yarnapp's run): load its weights with "
               f"training.checkpoint.load_final" if fsutil.exists(fs, f"{path}/final/model.pt") else
               "no final model (the run did not end its training: its checkpoints are step-* beside)")
        raise CheckpointError(f"{root}/final: {why}") from None
    module = build_model(info["model"], tuple(info["input_shape"]), info["num_classes"], info["model_options"])
    try:
        weights = fsutil.torch_load_file(fs, f"{path}/final/model.pt")
    except fsutil.ChecksumError as e:
        raise CheckpointError(f"{root}/final/model.pt: {e}; train it again, or resume from its last checkpoint") \
            from None
    module.load_state_dict(weights)
    module.eval()
    return TrainedModel(module.to(torch.device("cpu")), info, root)
