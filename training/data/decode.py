"""From the columns of a block to uint8 pixels: a block's images as numpy views of its
Arrow buffers, the rows of a batch copied out of them, and their decoding.

Encoded images are decoded by simplejpeg (libjpeg-turbo; JPEG only) where it is
installed, else by Pillow, which reads every other format (PNG, WebP, BMP, ...) too.
Colour: `channels` 3 gives RGB (greyscale and palette images are converted), 1 gives
greyscale. 16-bit greyscale images keep their high byte (their range, scaled to 8 bits).
"""
import dataclasses
import io
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .common import BadData, one_line
from .formats import RAW, STRUCT

try:
    import simplejpeg
except ImportError:          # optional: Pillow decodes JPEG too, more slowly
    simplejpeg = None

JPEG_MAGIC = b"\xff\xd8"


@dataclasses.dataclass
class BlockData:
    """The columns of one block, in memory: labels, and the images as numpy views of the
    Arrow buffers (raw: (rows, C*H*W); encoded: value offsets and data)."""
    labels: np.ndarray
    pixels: np.ndarray = None          # raw
    offsets: np.ndarray = None         # encoded: row i is data[offsets[i]:offsets[i + 1]]
    data: np.ndarray = None
    nbytes: int = 0
    keep: object = None                # the Arrow arrays the views point into


def block_data(table, layout, name):
    """BlockData of a table read from a block; DataError naming the file for nulls."""
    cols = layout.columns
    image = table.column(cols.image).combine_chunks()
    label = table.column(cols.label).combine_chunks()
    if layout.kind == STRUCT:
        if image.null_count:
            raise BadData(f"{name}: {image.null_count} null images in column {cols.image!r}")
        image = pc.struct_field(image, "bytes")
    if image.null_count:
        what = "images without bytes (only a path: embed the images in the file)" if layout.kind == STRUCT \
            else "null images"
        raise BadData(f"{name}: {image.null_count} {what} in column {cols.image!r}; drop those rows, or give "
                      f"each an image")
    if label.null_count:
        raise BadData(f"{name}: {label.null_count} row(s) without a label (null in column {cols.label!r}); drop "
                      f"those rows, or give each a label")
    labels = label.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    n = len(image)
    out = BlockData(labels=labels, keep=(image, label))
    if layout.kind == RAW:
        width = image.type.byte_width
        out.pixels = np.frombuffer(image.buffers()[1], np.uint8, count=n * width,
                                   offset=image.offset * width).reshape(n, width)
    else:
        if pa.types.is_binary_view(image.type) or pa.types.is_binary(image.type):
            image = image.cast(pa.large_binary()) if pa.types.is_binary_view(image.type) else image
        off_type = np.int64 if pa.types.is_large_binary(image.type) else np.int32
        offsets = np.frombuffer(image.buffers()[1], off_type, count=n + 1, offset=image.offset * off_type().itemsize)
        out.offsets = offsets.astype(np.int64)
        data = image.buffers()[2]
        out.data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        out.keep = (image, label)
    out.nbytes = sum(b.size for arr in (image, label) for b in arr.buffers() if b is not None)
    return out


def gather(block, offsets):
    """(images, labels) of rows `offsets` of a block, copied out of it: raw pixels as an
    (n, C*H*W) array, encoded images as a list of bytes."""
    labels = block.labels[offsets]
    if block.pixels is not None:
        return block.pixels[offsets], labels
    starts, ends = block.offsets[offsets], block.offsets[offsets + 1]
    data = block.data
    return [data[a:b].tobytes() for a, b in zip(starts.tolist(), ends.tolist())], labels


WIDE = ("I;16", "I;16B", "I;16L", "I;16N", "I")   # 16-bit greyscale (a PNG's, opened as I;16 or I)


def _pil_decode(blob, channels):
    from PIL import Image
    with Image.open(io.BytesIO(blob)) as im:
        if im.mode in WIDE:     # convert("L") clips at 255: a 16-bit image came out white
            grey = (np.clip(np.asarray(im), 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
            return np.repeat(grey[:, :, None], channels, axis=2)
        if channels == 1:
            im = im.convert("L")
        elif im.mode != "RGB":
            im = im.convert("RGBA").convert("RGB") if "transparency" in im.info or im.mode in ("P", "LA") \
                else im.convert("RGB")
        arr = np.asarray(im)
    return arr[:, :, None] if arr.ndim == 2 else arr


def decode_one(blob, channels):
    """HWC uint8 pixels of one encoded image (raises on undecodable bytes)."""
    if simplejpeg is not None and blob[:2] == JPEG_MAGIC:
        try:
            arr = simplejpeg.decode_jpeg(blob, colorspace="GRAY" if channels == 1 else "RGB")
            return arr if arr.ndim == 3 else arr[:, :, None]
        except ValueError:
            pass                       # CMYK, 12-bit... : let Pillow try
    return _pil_decode(blob, channels)


def decode(images, shape, channels, where):
    """uint8 images of a batch: raw rows (n, C*H*W) -> (n, H, W, C); encoded -> a list of
    HWC arrays. `where(i)` names row i in errors."""
    if isinstance(images, np.ndarray):
        c, h, w = shape
        return images.reshape(len(images), c, h, w).transpose(0, 2, 3, 1)
    out = []
    for i, blob in enumerate(images):
        try:
            out.append(decode_one(blob, channels))
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for bad bytes
            raise BadData(f"{where(i)}: not a decodable image ({why_not_image(e)}); re-encode or remove it") \
                from None
    return out


def why_not_image(exc):
    """Pillow's reason, without the address of its BytesIO ("cannot identify image file
    <_io.BytesIO object at 0x7f...>")."""
    return re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", one_line(exc)).strip() or type(exc).__name__


def channels_of(blobs):
    """1 where every one of the images is greyscale, else 3 (one colour image among them
    makes the dataset colour: greyscale ones are converted)."""
    from PIL import Image
    for blob in blobs:
        try:
            with Image.open(io.BytesIO(blob)) as im:
                if im.mode not in ("1", "L", "LA", "F", *WIDE):
                    return 3
        except Exception:  # noqa: BLE001 - not an image: its row is named where it is decoded
            continue
    return 1
