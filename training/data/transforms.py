"""Augmentation and normalisation of a batch of decoded images, deterministic per
(seed, epoch, row): a resumed run sees the very same pixels.

The ops of `training.data.augment` (training set) and `training.data.test_transforms`
(test set and the speed probe) run in order on uint8 images, height x width x
channels; conf.schema has already checked their names and options:

    resize              {size: S | [H, W]}       shorter side to S (aspect kept), or exactly H x W
    center_crop         {size: S | [H, W]}       the middle H x W (zero-padded where smaller)
    random_crop         {size: S | [H, W], padding: 0, fill: 0}   pad every side, then a random H x W
    random_resized_crop {size: S | [H, W], scale: [0.08, 1.0], ratio: [0.75, 1.333]}
                        a random area and aspect ratio (torchvision's algorithm), resized to H x W
    hflip               {p: 0.5}                 mirror left-right with probability p
    torchvision.NAME    {...}                    torchvision.transforms.NAME(**options), when installed

Randomness comes from a counter-based hash of (seed, epoch, row, op), not from a
generator's state, so any row of any epoch can be produced alone, in any order, by any
number of threads. Resizing uses Pillow (bilinear); everything else is numpy on whole
batches where the images share a size. torchvision's ops and the user's hook
(`training.data.transform`) run per image in the training thread (see Hooks), since
torchvision draws from torch's global generator.

Normalisation, last: (pixel - mean[c]) / std[c] as float32, channels first.
"""
import math

import numpy as np

from .common import DataError

_G = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def _mix(z):
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seed, epoch, rows, k, stream=0):
    """(len(rows), k) floats in [0, 1): a pure function of (seed, epoch, row, stream, j)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([int(seed) & _MASK], np.uint64) ^ _mix(
            np.array([(int(epoch) * 1_000_003 + int(stream)) & _MASK], np.uint64) * _G))
        z = _mix(np.asarray(rows, dtype=np.int64).astype(np.uint64) * _G + key)
        cols = (np.arange(1, k + 1, dtype=np.uint64) * _G)[None, :]
        out = _mix(z[:, None] ^ cols)
    return (out >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _hw(size):
    return (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))


def _pil():
    from PIL import Image
    return Image


def _resize(img, h, w, box=None):
    Image = _pil()
    im = Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img)
    out = np.asarray(im.resize((w, h), Image.BILINEAR, box=box))
    return out[:, :, None] if out.ndim == 2 else out


class Resize:
    k = 0

    def __init__(self, size):
        self.size = size

    def out_hw(self, h, w):
        if isinstance(self.size, (list, tuple)):
            return _hw(self.size)
        s = int(self.size)
        return (s, max(1, round(w * s / h))) if h <= w else (max(1, round(h * s / w)), s)

    def __call__(self, imgs, u):
        out = []
        for img in imgs:
            h, w = self.out_hw(*img.shape[:2])
            out.append(img if (h, w) == img.shape[:2] else _resize(img, h, w))
        return out


def _crop_or_pad(img, top, left, h, w, fill=0):
    """img[top:top+h, left:left+w], zero (fill) where the window leaves the image."""
    H, W = img.shape[:2]
    if top >= 0 and left >= 0 and top + h <= H and left + w <= W:
        return img[top:top + h, left:left + w]
    out = np.full((h, w, img.shape[2]), fill, np.uint8)
    t0, l0 = max(top, 0), max(left, 0)
    t1, l1 = min(top + h, H), min(left + w, W)
    if t1 > t0 and l1 > l0:
        out[t0 - top:t1 - top, l0 - left:l1 - left] = img[t0:t1, l0:l1]
    return out


class CenterCrop:
    k = 0

    def __init__(self, size):
        self.h, self.w = _hw(size)

    def __call__(self, imgs, u):
        if isinstance(imgs, np.ndarray):
            H, W = imgs.shape[1:3]
            if H >= self.h and W >= self.w:
                t, l = (H - self.h) // 2, (W - self.w) // 2
                return imgs[:, t:t + self.h, l:l + self.w]
        return [_crop_or_pad(img, (img.shape[0] - self.h) // 2, (img.shape[1] - self.w) // 2, self.h, self.w)
                for img in imgs]


class RandomCrop:
    k = 2

    def __init__(self, size, padding=0, fill=0):
        self.h, self.w = _hw(size)
        self.padding, self.fill = int(padding), int(fill)

    def __call__(self, imgs, u):
        p = self.padding
        if isinstance(imgs, np.ndarray):                       # one size: the whole batch at once
            n, H, W, C = imgs.shape
            H2, W2 = H + 2 * p, W + 2 * p
            if H2 >= self.h and W2 >= self.w:
                padded = imgs if not p else np.pad(imgs, ((0, 0), (p, p), (p, p), (0, 0)),
                                                   constant_values=self.fill)
                top = (u[:, 0] * (H2 - self.h + 1)).astype(np.int64)
                left = (u[:, 1] * (W2 - self.w + 1)).astype(np.int64)
                rows = top[:, None] + np.arange(self.h)[None, :]
                cols = left[:, None] + np.arange(self.w)[None, :]
                return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
        out = []
        for img, (a, b) in zip(imgs, u):
            H2, W2 = img.shape[0] + 2 * p, img.shape[1] + 2 * p
            top = int(a * max(H2 - self.h + 1, 1)) - p
            left = int(b * max(W2 - self.w + 1, 1)) - p
            out.append(_crop_or_pad(img, top, left, self.h, self.w, self.fill))
        return out


class RandomResizedCrop:
    ATTEMPTS = 10
    k = 4 * ATTEMPTS

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.h, self.w = _hw(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def box(self, H, W, u):
        """(top, left, h, w) of the crop: torchvision's RandomResizedCrop.get_params."""
        area = H * W
        for i in range(self.ATTEMPTS):
            a, r, t, l = u[4 * i:4 * i + 4]
            target = area * (self.scale[0] + a * (self.scale[1] - self.scale[0]))
            aspect = math.exp(self.log_ratio[0] + r * (self.log_ratio[1] - self.log_ratio[0]))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= W and 0 < h <= H:
                return int(t * (H - h + 1)), int(l * (W - w + 1)), h, w
        in_ratio = W / H
        if in_ratio < self.ratio[0]:
            w, h = W, int(round(W / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = H, int(round(H * self.ratio[1]))
        else:
            w, h = W, H
        return (H - h) // 2, (W - w) // 2, h, w

    def __call__(self, imgs, u):
        out = []
        for img, uu in zip(imgs, u):
            top, left, h, w = self.box(img.shape[0], img.shape[1], uu)
            out.append(_resize(img, self.h, self.w, box=(left, top, left + w, top + h)))
        return out


class HFlip:
    k = 1

    def __init__(self, p=0.5):
        self.p = float(p)

    def __call__(self, imgs, u):
        flip = u[:, 0] < self.p
        if isinstance(imgs, np.ndarray):
            if flip.any():
                imgs = imgs.copy()
                imgs[flip] = imgs[flip][:, :, ::-1]
            return imgs
        return [img[:, ::-1] if f else img for img, f in zip(imgs, flip)]


OPS = {"resize": Resize, "center_crop": CenterCrop, "random_crop": RandomCrop,
       "random_resized_crop": RandomResizedCrop, "hflip": HFlip}


class TorchvisionOp:
    """torchvision.transforms.NAME(**options) on one PIL image (in the training thread)."""

    def __init__(self, name, options, field):
        try:
            import torchvision.transforms as T
        except Exception as e:  # noqa: BLE001 - ImportError, or torchvision's own failure to load
            raise DataError(f"{field}: torchvision is not usable here ({str(e).splitlines()[0] if str(e) else e}); "
                            f"install it, or use the built-in ops") from None
        cls = getattr(T, name, None)
        if cls is None:
            raise DataError(f"{field}: torchvision.transforms has no {name!r}")
        try:
            self.fn = cls(**options)
        except (TypeError, ValueError) as e:
            raise DataError(f"{field}: torchvision.transforms.{name}({options}): {e}") from None

    def __call__(self, image, rng=None):
        return self.fn(image)


def build(entries, field):
    """(batch ops, per-image hooks) from canonical entries [{name: {options}}, ...]: the
    built-in ops up to the first torchvision one run in the workers; that one and every
    op after it run per image in the training thread (order is kept)."""
    ops, hooks = [], []
    for i, entry in enumerate(entries or []):
        (name, options), = entry.items()
        options = dict(options or {})
        where = f"{field}[{i}].{name}"
        if name.startswith("torchvision."):
            hooks.append(TorchvisionOp(name.split(".", 1)[1], options, where))
        elif hooks:
            hooks.append(_PerImage(OPS[name](**options)))
        else:
            try:
                ops.append(OPS[name](**options))
            except (KeyError, TypeError, ValueError) as e:
                raise DataError(f"{where}: {e}") from None
    return ops, hooks


class _PerImage:
    """A built-in op applied to one PIL image (after a torchvision op)."""
    def __init__(self, op):
        self.op = op

    def __call__(self, image, rng=None):
        arr = np.asarray(image)
        arr = arr[:, :, None] if arr.ndim == 2 else arr
        u = rng.random((1, self.op.k)) if rng is not None else np.zeros((1, self.op.k))
        return self.op([arr], u)[0]


def apply(ops, imgs, seed, epoch, rows):
    """Run the batch ops on imgs (a list of HWC uint8 arrays, or one (n, H, W, C) array);
    returns one (n, H, W, C) uint8 array, or raises DataError if sizes still differ.
    Images of one size are stacked first, so the ops that can work on whole batches do."""
    for i, op in enumerate(ops):
        if isinstance(imgs, list) and imgs and len({img.shape for img in imgs}) == 1:
            imgs = np.stack(imgs)
        u = uniforms(seed, epoch, rows, op.k, stream=i) if op.k else None
        imgs = op(imgs, u)
    return stack(imgs)


def stack(imgs):
    if isinstance(imgs, np.ndarray):
        return imgs
    sizes = {img.shape for img in imgs}
    if len(sizes) > 1:
        a, b = sorted(sizes)[:2]
        raise DataError(f"images of different sizes ({a[0]}x{a[1]} and {b[0]}x{b[1]}) in one batch; bring them "
                        f"to one size in training.data.augment and training.data.test_transforms alike, e.g. "
                        f"{{resize: {{size: [{a[0]}, {a[1]}]}}}} (a single size S keeps the aspect ratio: the "
                        f"shorter side becomes S), or a resize then a center_crop")
    return np.stack(imgs) if imgs else np.zeros((0, 1, 1, 1), np.uint8)


def normalise(hwc, mean, std):
    """float32 (n, C, H, W) tensor of (pixel - mean[c]) / std[c] from uint8 (n, H, W, C).

    Through a table of the 256 values per channel, computed in float32 as torch computes
    (x - mean) / std: the same bits, at the cost of one lookup per pixel."""
    import torch

    n, h, w, c = hwc.shape
    lut = (np.arange(256, dtype=np.float32)[None, :] - np.asarray(mean, np.float32).reshape(c, 1)) \
        / np.asarray(std, np.float32).reshape(c, 1)
    out = np.empty((n, c, h, w), np.float32)
    for k in range(c):
        np.take(lut[k], hwc[:, :, :, k], out=out[:, k])
    return torch.from_numpy(out)


def pil_of(img):
    """A PIL image of one HWC uint8 array (what hooks receive)."""
    Image = _pil()
    return Image.fromarray(np.ascontiguousarray(img[:, :, 0] if img.shape[2] == 1 else img))


def array_of(image, field):
    """A hook's result (PIL image, HWC array or CHW tensor of uint8) as an HWC uint8 array."""
    if hasattr(image, "mode") and hasattr(image, "size"):          # PIL
        arr = np.asarray(image)
    else:
        arr = np.asarray(image.numpy() if hasattr(image, "numpy") else image)
        if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[2] not in (1, 3):
            arr = arr.transpose(1, 2, 0)
    if arr.dtype != np.uint8:
        raise DataError(f"{field}: returned {arr.dtype} pixels; return a PIL image or uint8 pixels "
                        f"(normalisation comes after)")
    return arr[:, :, None] if arr.ndim == 2 else arr

