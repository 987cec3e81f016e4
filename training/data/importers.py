"""Importers: datasets a user has (scikit-learn's digits, a synthetic CIFAR-shaped set,
numpy arrays, a folder of image files) written as Parquet datasets (training.data.writer).

`run_import(kind, uri, options)` is what `yarnapp data import KIND URI` runs. This module
imports only numpy and pyarrow at import time (the CLI imports it); scikit-learn,
Pillow and simplejpeg are imported inside the importers that need them.
"""
import io
import logging
import os
import re
import unicodedata

import numpy as np

from .common import DataError, join, one_line
from .writer import channel_stats, check_absent, check_splits_parent, meta, write_dataset, write_encoded

log = logging.getLogger(__name__)

def _stratified_split(labels, test_fraction, seed):
    """(train_idx, test_idx): `test_fraction` of every class held out, both shuffled."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 20240501


def import_digits(uri, shards=2, overwrite=False):
    """scikit-learn's bundled digits (1797 real 8x8 images, pixels 0..16) at `uri`/train
    and `uri`/test: a fixed stratified split holding out 20% of every class.

    The split is computed here from a fixed seed (not by scikit-learn's splitter), so
    it is the same on every run and every version.
    """
    from sklearn.datasets import load_digits

    train_uri, test_uri = join(uri, "train"), join(uri, "test")
    check_splits_parent(uri, "digits")
    for u in (train_uri, test_uri):
        check_absent(u, overwrite)
    digits = load_digits()
    images = digits.images.astype(np.uint8)[:, None, :, :]          # (1797, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    tr, te = _stratified_split(labels, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    mean, std = channel_stats(images[tr])
    m = meta((1, 8, 8), 10, range(10), mean, std, "sklearn.datasets.load_digits")
    return {"kind": "digits", "datasets": [
        write_dataset(train_uri, images[tr], labels[tr], m, shards, overwrite),
        write_dataset(test_uri, images[te], labels[te], m, shards, overwrite)]}


def _synthetic_cifar_split(patterns, n, rng):
    """n images: class pattern (smooth, per channel) shifted by up to 3 pixels, plus noise."""
    labels = rng.permutation(np.arange(n) % len(patterns)).astype(np.int64)
    images = np.empty((n, 3, 32, 32), np.uint8)
    for i in range(0, n, 2048):
        y = labels[i:i + 2048]
        x = 128.0 + 8.0 * patterns[y] + rng.normal(0.0, 64.0, (len(y), 3, 32, 32))
        x += rng.normal(0.0, 12.0, (len(y), 1, 1, 1))                 # per-image brightness
        shift = rng.integers(-3, 4, (len(y), 2))
        for j in range(len(y)):
            x[j] = np.roll(x[j], tuple(shift[j]), axis=(1, 2))
        images[i:i + 2048] = np.clip(x, 0, 255).astype(np.uint8)
    return images, labels


def import_synthetic_cifar(uri, n_train=10000, n_test=2000, shards=4, seed=0, encoding="raw", quality=90,
                           overwrite=False):
    """A learnable CIFAR-shaped stand-in (3x32x32 uint8, 10 balanced classes) at
    `uri`/train and `uri`/test.

    Each class has a smooth random colour pattern (4x4 per channel, upsampled); an
    image is 128 + 8 * its class pattern, randomly shifted by up to 3 pixels, plus a
    random brightness offset (std 12) and heavy per-pixel noise (std 64). Hard for a
    linear model (a nearest-class-mean classifier gets about 65% with 5000 training
    images), easy for a CNN. Same `seed`, same bytes.

    encoding: "raw" (uint8 pixels), "jpeg" (at `quality`) or "png": the images as files
    (encoded with simplejpeg where installed, else Pillow).
    """
    if encoding not in ("raw", "jpeg", "png"):
        raise DataError(f"synthetic-cifar: encoding {encoding!r}: choose raw, jpeg or png")
    train_uri, test_uri = join(uri, "train"), join(uri, "test")
    check_splits_parent(uri, "synthetic-cifar")
    for u in (train_uri, test_uri):
        check_absent(u, overwrite)
    rng = np.random.default_rng([seed % 2 ** 63, 0])
    coarse = rng.normal(0.0, 1.0, (10, 3, 4, 4))
    patterns = np.kron(coarse, np.ones((1, 1, 8, 8)))
    # smooth the 8x8 blocks a little so the patterns are not pure step functions
    patterns = (patterns + np.roll(patterns, 4, axis=2) + np.roll(patterns, 4, axis=3)) / 3.0
    x_train, y_train = _synthetic_cifar_split(patterns, int(n_train), np.random.default_rng([seed % 2 ** 63, 1]))
    x_test, y_test = _synthetic_cifar_split(patterns, int(n_test), np.random.default_rng([seed % 2 ** 63, 2]))
    mean, std = channel_stats(x_train)
    source = f"synthetic-cifar seed={seed}"
    if encoding == "raw":
        m = meta((3, 32, 32), 10, range(10), mean, std, source)
        return {"kind": "synthetic-cifar", "datasets": [
            write_dataset(train_uri, x_train, y_train, m, shards, overwrite),
            write_dataset(test_uri, x_test, y_test, m, shards, overwrite)]}
    m = meta(None, 10, range(10), None, None, f"{source} {encoding}", encoding="encoded")
    return {"kind": "synthetic-cifar", "datasets": [
        write_encoded(train_uri, encode_images(x_train, encoding, quality), y_train, m, shards, overwrite),
        write_encoded(test_uri, encode_images(x_test, encoding, quality), y_test, m, shards, overwrite)]}


def encode_images(images, encoding="jpeg", quality=90):
    """uint8 images (N, C, H, W) as a list of JPEG or PNG files (bytes)."""
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    from PIL import Image

    out = []
    for img in images:
        hwc = np.ascontiguousarray(img.transpose(1, 2, 0))
        if encoding == "jpeg" and simplejpeg is not None:
            gray = hwc.shape[2] == 1
            out.append(simplejpeg.encode_jpeg(hwc, quality=int(quality), colorspace="GRAY" if gray else "RGB",
                                              colorsubsampling="Gray" if gray else "444"))
            continue
        buf = io.BytesIO()
        im = Image.fromarray(hwc[:, :, 0] if hwc.shape[2] == 1 else hwc)
        im.save(buf, format="JPEG" if encoding == "jpeg" else "PNG",
                **({"quality": int(quality), "subsampling": 0} if encoding == "jpeg" else {}))
        out.append(buf.getvalue())
    return out


def import_arrays(uri, x, y, shards=2, num_classes=None, overwrite=False):
    """A user's arrays as one dataset at `uri`.

    x: uint8 (N, C, H, W), or (N, H, W) for one channel; y: integer labels. The
    number of classes is max(y) + 1 unless given; mean/std are measured on x.
    """
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim == 3:
        x = x[:, None]
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{uri}: labels must be integers, got {y.dtype}")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.integer) or x.size and (x.min() < 0 or x.max() > 255):
            raise DataError(f"{uri}: images must be uint8 pixels (0..255), got {x.dtype}; "
                            f"scale them to uint8 first")
        x = x.astype(np.uint8)
    if x.ndim != 4:
        raise DataError(f"{uri}: images must be (N, C, H, W) or (N, H, W), got shape {x.shape}")
    if x.shape[-1] in (1, 3, 4) and x.shape[1] > 4:     # (N, H, W, C) would train on garbage
        raise DataError(f"{uri}: images of shape {x.shape} look channels-last (N, H, W, C); give them as "
                        f"(N, C, H, W): x.transpose(0, 3, 1, 2)")
    num_classes = int(num_classes) if num_classes is not None else int(y.max()) + 1 if y.size else 0
    if len(x) == 0:
        raise DataError(f"{uri}: no images to write")
    mean, std = channel_stats(x)
    m = meta(x.shape[1:], num_classes, range(num_classes), mean, std, "arrays")
    return {"kind": "arrays", "datasets": [write_dataset(uri, x, y.astype(np.int64), m, shards, overwrite)]}


IMAGE_FOLDER_SEED = 20240501


def import_image_folder(uri, folder, shards=2, overwrite=False, classes=None):
    """The image files under `folder`/<class name>/ (its subfolders too, as torchvision's
    ImageFolder) as one dataset at `uri`, kept as they are (JPEG stays JPEG: no resizing;
    Pillow decodes each once to check it). Class names are the subfolders' in Unicode's
    composed form (NFC).

    Classes are the sorted subfolder names, or `classes` (names in label order, e.g. a
    training set's, for a test folder that lacks some of them: every subfolder must be
    one of them); labels their indices; the names go into the metadata. Rows are written in a fixed shuffled order, so every row group mixes
    the classes (the streaming reader's shuffle permutes row groups, and a rank's share
    of a batch comes from a few of them). Images may differ in size: resize or crop
    them in training.data.augment / test_transforms. Channels: 1 when every image is
    greyscale, else 3 (RGB).
    """
    from PIL import Image, UnidentifiedImageError

    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder; give a folder with one subfolder of images per class")
    check_absent(uri, overwrite)
    extensions = {e.lower() for e in Image.registered_extensions()}
    # class names in Unicode's composed form (NFC): a Mac's folder names are decomposed (NFD),
    # and 'ñandú' of one folder was another class than 'ñandú' of the other, printed alike
    found = {}          # class name -> its folders (two where a name is there in both forms: one class)
    for d in sorted(os.listdir(folder)):
        if os.path.isdir(os.path.join(folder, d)) and not d.startswith("."):
            found.setdefault(unicodedata.normalize("NFC", d), []).append(d)
    if classes is not None:
        classes = [unicodedata.normalize("NFC", c) for c in _to_names(classes)]
        extra = [d for d in found if d not in classes]
        if extra:
            raise DataError(f"{folder}/{found[extra[0]][0]}: a subfolder that is not among the classes given "
                            f"({', '.join(classes)}); add it to them or move it out")
    else:
        classes = sorted(found)
    blobs, labels, grey, skipped = [], [], True, []
    for label, cls in enumerate(classes):
        if cls not in found:
            continue                # a class this folder has no images of (a test set's)
        for path in (p for d in found[cls] for p in _files_under(os.path.join(folder, d))):   # subfolders too
            name = os.path.basename(path)
            if name.startswith(".") or os.path.splitext(name)[1].lower() not in extensions:
                if not name.startswith("."):
                    skipped.append(path)
                continue
            try:
                with open(path, "rb") as f:
                    blob = f.read()
            except OSError as e:        # a broken link, a file this user cannot read
                raise DataError(f"{path}: cannot read it ({e.strerror or one_line(e)}); remove or replace it") from None
            try:
                with Image.open(io.BytesIO(blob)) as im:
                    mode = im.mode
                    im.load()       # decoded whole: verify() passed a JPEG cut inside its scans
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                why = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", one_line(e))    # PIL names its buffer
                raise DataError(f"{path}: not a readable image ({why}); remove or replace it") from None
            grey = grey and mode in ("1", "L", "LA", "I", "I;16", "F")
            blobs.append(blob)
            labels.append(label)
    if not blobs:
        loose = [n for n in os.listdir(folder) if os.path.splitext(n)[1].lower() in extensions]
        raise DataError(f"{folder}: no images in class subfolders" + (
            f"; its {len(loose)} image file(s) ({loose[0]}, ...) lie in it directly: move each into a "
            f"subfolder named for its class, {folder}/<class>/<image files>" if loose else
            f"; expected {folder}/<class>/<image files>"))
    if skipped:     # as torchvision's ImageFolder: only image extensions count, but say so
        log.warning("skipped %d file(s) whose extension is not an image's, e.g. %s", len(skipped), skipped[0])
    empty = [c for label, c in enumerate(classes) if c in found and label not in set(labels)]
    if empty:       # a class the model gets an output for, and never sees
        log.warning("class subfolder(s) without images: %s; their classes are kept (the model gets an output "
                    "for each): remove the subfolder(s) if they are not classes", ", ".join(empty))
    order = np.random.default_rng(IMAGE_FOLDER_SEED).permutation(len(blobs))
    m = meta(None, len(classes), classes, None, None, f"image-folder {folder}", encoding="encoded")
    m["channels"] = 1 if grey else 3
    return {"kind": "image-folder", "datasets": [
        write_encoded(uri, [blobs[i] for i in order], np.asarray(labels)[order], m, shards, overwrite)]}


def _files_under(top):
    """The files under `top`, its subfolders' too (hidden ones left out), in a fixed order."""
    for root, dirs, files in os.walk(top, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            yield os.path.join(root, name)


def _to_int(v):
    return int(v)


def _to_count(v):
    """A whole number >= 1 (rows, shards, classes)."""
    n = int(v)
    if n < 1:
        raise ValueError(v)
    return n


def _to_quality(v):
    """A JPEG quality, 1..100."""
    q = int(v)
    if not 1 <= q <= 100:
        raise ValueError(v)
    return q


def _to_names(v):
    """Class names: a list, or one string of them separated by commas."""
    names = [n.strip() for n in v.split(",")] if isinstance(v, str) else [str(n) for n in v]
    if not names or not all(names) or len(set(names)) != len(names):
        raise ValueError(f"class names {v!r}: give each class once")
    return names


def _to_bool(v):
    if isinstance(v, str):
        if v.lower() in ("1", "true", "yes", "on"):
            return True
        if v.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(v)
    return bool(v)


def _load_npz(path):
    try:
        with np.load(path) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise DataError(f"{path}: no array named {missing[0]!r} (has {', '.join(z.files)}); "
                                f"save it with np.savez(path, x=images, y=labels)")
            return z["x"], z["y"]
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        why = ("not an .npz of plain arrays" if "allow_pickle" in str(e) else one_line(e))   # numpy's: load unsafely
        raise DataError(f"{path}: cannot read the .npz ({why}); save it with "
                        f"np.savez(path, x=images, y=labels)") from None


# kind -> (function, {option: converter}, required options)
_IMPORTS = {
    "digits": (import_digits, {"shards": _to_count, "overwrite": _to_bool}, ()),
    "synthetic-cifar": (import_synthetic_cifar, {"n_train": _to_count, "n_test": _to_count, "shards": _to_count,
                                                 "seed": _to_int, "encoding": str, "quality": _to_quality,
                                                 "overwrite": _to_bool}, ()),
    "arrays": (None, {"path": str, "shards": _to_count, "num_classes": _to_count, "overwrite": _to_bool},
               ("path",)),
    "image-folder": (import_image_folder, {"folder": str, "shards": _to_count, "overwrite": _to_bool,
                                           "classes": _to_names}, ("folder",)),
}
_WANTED = {_to_count: "a whole number of at least 1", _to_quality: "a JPEG quality from 1 to 100",
           _to_int: "a whole number", _to_bool: "true or false",
           _to_names: "class names separated by commas, each once, e.g. bird,cat,dog"}
IMPORT_KINDS = tuple(_IMPORTS)


def run_import(kind, uri, options=None, spell=str):
    """Import a dataset of `kind` to `uri` (what `yarnapp data import KIND URI` runs).

    options (strings are converted, so CLI `key=value` pairs can be passed as they are):
      digits:          shards, overwrite                -> uri/train, uri/test
      synthetic-cifar: n_train, n_test, shards, seed, encoding (raw|jpeg|png), quality,
                       overwrite -> uri/train, uri/test
      arrays:          path (an .npz with x, y), shards, num_classes, overwrite -> uri
      image-folder:    folder, shards, overwrite, classes (names in label order) -> uri
                       (the files as they are)
    spell(option) is how errors name an option (the CLI's: --n-train).
    Returns {"kind": kind, "datasets": [{"uri", "rows", "shards", "encoding", "shape",
    "num_classes", "mean", "std"}, ...]}.
    """
    if kind not in _IMPORTS:
        raise DataError(f"unknown dataset kind {kind!r}; choose one of {', '.join(IMPORT_KINDS)}")
    func, allowed, required = _IMPORTS[kind]
    options = dict(options or {})
    kwargs = {}
    for key, value in options.items():
        if kind == "image-folder" and key in ("size", "mode"):
            raise DataError(f"image-folder: option {spell(key)} is gone: the files are kept as they are; resize "
                            f"or crop them when training (training.data.augment / test_transforms)")
        if key not in allowed:
            raise DataError(f"{kind}: unknown option {spell(key)}; options are "
                            f"{', '.join(sorted(map(spell, allowed)))}")
        try:
            kwargs[key] = allowed[key](value)
        except (TypeError, ValueError):
            raise DataError(f"{kind}: option {spell(key)}={value!r} is not a valid value; give "
                            f"{_WANTED.get(allowed[key], 'another value')}") from None
    for key in required:
        if key not in kwargs:
            raise DataError(f"{kind}: option {key!r} is required")
    if "quality" in kwargs and kwargs.get("encoding") != "jpeg":     # (it wrote raw pixels, the quality unused)
        raise DataError(f"{kind}: option {spell('quality')} is JPEG's; give {spell('encoding')} jpeg with it, or "
                        f"leave it out")
    try:
        if kind == "arrays":
            x, y = _load_npz(kwargs.pop("path"))
            return import_arrays(uri, x, y, **kwargs)
        return func(uri, **kwargs)
    except RuntimeError as e:   # fsspec's (WebHDFS): "Invalid path name ... /user//data" of an unset $USER
        raise DataError(f"{uri}: cannot write there ({one_line(e)}); check the URI") from None
