"""Datasets on disk: importers, the formats the reader accepts, and the errors it gives
(real Parquet files through pyarrow, on the local filesystem: file:// and plain paths)."""
import io
import json
import os
import stat
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training import data
from training.data import DataError, ParquetSource, read_arrays

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    summary = data.import_digits(f"file://{root}/digits", shards=3)
    return root / "digits", summary


def _shards(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".parquet"))


def _one_line_naming(exc_info, *parts):
    """exc_info: pytest.raises' ExceptionInfo, or the DataError itself."""
    assert isinstance(getattr(exc_info, "value", exc_info), DataError), exc_info
    msg = str(getattr(exc_info, "value", exc_info))
    assert "\n" not in msg, msg
    for part in parts:
        assert str(part) in msg, (part, msg)
    return msg


def _jpeg(arr, quality=95):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _png(arr):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- import / read

def test_digits_round_trip_through_parquet(digits_dir):
    from sklearn.datasets import load_digits

    root, summary = digits_dir
    assert [d["rows"] for d in summary["datasets"]] == [1438, 359]
    assert sorted(os.listdir(root)) == ["test", "train"]          # no temporary directories left
    train = ParquetSource(f"file://{root}/train")
    test = ParquetSource(str(root / "test"))                         # plain path works too
    assert train.shape == test.shape == (1, 8, 8) and train.layout.kind == "raw"
    assert train.num_classes == 10 and train.classes == [str(i) for i in range(10)]
    assert len(train) + len(test) == 1797 and len(train.layout.paths) == 3

    # the files hold fixed_size_binary(64) pixels and int64 labels, with the metadata
    for name in _shards(root / "train"):
        schema = pq.read_schema(root / "train" / name)
        assert schema.field("image").type == pa.binary(64)
        assert schema.field("label").type == pa.int64()
        meta = json.loads(schema.metadata[b"yarnapp"])
        assert meta["shape"] == [1, 8, 8] and meta["num_classes"] == 10

    # together the splits are exactly scikit-learn's digits, pixel for pixel
    (xa, ya), (xb, yb) = train.read_arrays(), test.read_arrays()
    d = load_digits()
    ours = np.concatenate([np.concatenate([xa, xb]).reshape(-1, 64), np.concatenate([ya, yb])[:, None]], axis=1)
    ref = np.concatenate([d.images.reshape(-1, 64), d.target[:, None]], axis=1).astype(np.int64)
    assert np.array_equal(ours[np.lexsort(ours.T[::-1])], ref[np.lexsort(ref.T[::-1])])

    # stratified: every class holds out ~20%; normalisation measured on train, shared
    for c in range(10):
        assert abs((yb == c).sum() - 0.2 * (d.target == c).sum()) <= 1
    meta = train.layout.meta
    assert np.allclose(meta["mean"], xa.mean()) and np.allclose(meta["std"], xa.std(), rtol=1e-4)
    assert test.layout.meta["mean"] == meta["mean"]


def test_digits_split_is_fixed_across_runs(digits_dir, tmp_path):
    root, _ = digits_dir
    data.import_digits(str(tmp_path / "again"), shards=2)
    for split in ("train", "test"):
        (xa, ya), (xb, yb) = read_arrays(str(root / split)), read_arrays(str(tmp_path / "again" / split))
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_import_refuses_existing_dataset_and_overwrite_replaces_it(tmp_path):
    uri = str(tmp_path / "syn")
    data.import_synthetic_cifar(uri, n_train=40, n_test=20, shards=2, seed=1)
    with pytest.raises(DataError) as e:
        data.import_synthetic_cifar(uri, n_train=60, n_test=20, shards=2, seed=1)
    _one_line_naming(e, uri, "already exists")
    assert len(ParquetSource(uri + "/train")) == 40
    data.import_synthetic_cifar(uri, n_train=60, n_test=20, shards=3, seed=1, overwrite=True)
    assert len(ParquetSource(uri + "/train")) == 60
    assert len(_shards(tmp_path / "syn" / "train")) == 3
    assert sorted(os.listdir(tmp_path / "syn")) == ["test", "train"]   # old copy and temp dirs gone


def test_overwrite_replaces_a_dataset_and_nothing_else(tmp_path):
    """--overwrite onto a project's directory, onto the images being imported or onto the
    .npz being read: one line, and every file stays."""
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "main.py").write_text("code\n")
    (proj / "README").write_text("r\n")
    x, y = np.zeros((8, 1, 4, 4), np.uint8), np.arange(8) % 2
    with pytest.raises(DataError) as e:
        data.import_arrays(str(proj), x, y, overwrite=True)
    _one_line_naming(e, proj, "not a dataset's Parquet shard", "give another path, or delete it yourself")
    assert sorted(os.listdir(proj)) == ["README", "src"]
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "train" / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError) as e:
        data.run_import("digits", str(tmp_path / "d"), {"overwrite": True})
    _one_line_naming(e, tmp_path / "d" / "train", "'notes.txt'")
    assert sorted(os.listdir(tmp_path / "d")) == ["train"]
    np.savez(tmp_path / "same.npz", x=x, y=y)
    with pytest.raises(DataError) as e:
        data.run_import("arrays", str(tmp_path / "same.npz"), {"path": str(tmp_path / "same.npz"), "overwrite": True})
    _one_line_naming(e, tmp_path / "same.npz", "is a file, not a directory of Parquet shards")
    assert np.load(tmp_path / "same.npz")["x"].shape == (8, 1, 4, 4)
    from PIL import Image
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    Image.new("L", (4, 4)).save(tmp_path / "imgs" / "cat" / "a.png")
    with pytest.raises(DataError) as e:
        data.run_import("image-folder", str(tmp_path / "imgs"), {"folder": str(tmp_path / "imgs"), "overwrite": True})
    _one_line_naming(e, tmp_path / "imgs", "'cat'")
    assert os.listdir(tmp_path / "imgs" / "cat") == ["a.png"]
    # a dataset with Spark's side files is a dataset: replaced
    data.import_arrays(str(tmp_path / "ds"), x, y)
    (tmp_path / "ds" / "_SUCCESS").write_text("")
    data.import_arrays(str(tmp_path / "ds"), x[:4], y[:4], overwrite=True)
    assert len(ParquetSource(str(tmp_path / "ds"))) == 4


def test_failed_write_leaves_nothing_visible(tmp_path):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    uri = str(tmp_path / "blocker" / "ds")
    with pytest.raises(DataError) as e:
        data.import_arrays(uri, np.zeros((4, 1, 2, 2), np.uint8), np.arange(4) % 2)
    _one_line_naming(e, uri)
    assert sorted(os.listdir(tmp_path)) == ["blocker"]


def test_ctrl_c_during_an_import_leaves_no_hidden_copy(tmp_path):
    """Ctrl-C (a real SIGINT) while the second of four shards is being made: the import
    stops with KeyboardInterrupt and neither the dataset nor its hidden staging copy is
    left (before, `.ds.tmp-*` stayed, as large as what had been written)."""
    import signal

    from training.data import writer
    images = np.zeros((8, 1, 2, 2), np.uint8)
    m = writer.meta((1, 2, 2), 2, range(2), None, None, "test")
    meta_bytes = json.dumps(m).encode()

    def table_of(a, b):
        if a:
            signal.raise_signal(signal.SIGINT)
        return writer._raw_table(images[a:b], np.arange(a, b) % 2, meta_bytes)
    with pytest.raises(KeyboardInterrupt):
        writer._write(str(tmp_path / "ds"), 8, 4, False, m, 2, table_of)
    assert os.listdir(tmp_path) == []


def test_synthetic_cifar_is_cifar_shaped_deterministic_and_learnable(tmp_path):
    data.import_synthetic_cifar(str(tmp_path / "a"), n_train=1000, n_test=300, shards=2, seed=7)
    data.import_synthetic_cifar(str(tmp_path / "b"), n_train=1000, n_test=300, shards=2, seed=7)
    train = ParquetSource(str(tmp_path / "a/train"))
    assert train.shape == (3, 32, 32) and train.num_classes == 10 and len(train) == 1000
    x, y = train.read_arrays()
    xt, yt = read_arrays(str(tmp_path / "a/test"))
    assert x.dtype == np.uint8 and np.bincount(y).tolist() == [100] * 10
    xa, ya = read_arrays(str(tmp_path / "b/train"))
    assert np.array_equal(x, xa) and np.array_equal(y, ya)
    # learnable: a nearest-class-mean classifier is far above chance (10%) on held-out data
    x = x.reshape(len(x), -1).astype(np.float32)
    means = np.stack([x[y == c].mean(0) for c in range(10)])
    xt = xt.reshape(len(xt), -1).astype(np.float32)
    pred = ((xt ** 2).sum(1)[:, None] - 2 * xt @ means.T + (means ** 2).sum(1)[None]).argmin(1)
    assert (pred == yt).mean() > 0.3


def test_synthetic_cifar_as_jpeg_files(tmp_path):
    summary = data.run_import("synthetic-cifar", str(tmp_path / "j"), {"n_train": "200", "n_test": "50",
                                                                      "encoding": "jpeg", "quality": "95"})
    assert summary["datasets"][0]["encoding"] == "encoded"
    raw = data.import_synthetic_cifar(str(tmp_path / "r"), n_train=200, n_test=50)
    assert raw["datasets"][0]["encoding"] == "raw"
    table = pq.read_table(tmp_path / "j" / "train")
    assert pa.types.is_binary(table.schema.field("image").type)
    assert all(b[:2] == b"\xff\xd8" for b in table.column("image").to_pylist())        # JPEG files
    src = ParquetSource(str(tmp_path / "j" / "train"))
    assert src.layout.kind == "encoded" and src.shape == (3, 32, 32) and src.num_classes == 10
    xj, yj = src.read_arrays()
    xr, yr = read_arrays(str(tmp_path / "r" / "train"))
    assert np.array_equal(yj, yr)
    assert np.abs(xj.astype(int) - xr).mean() < 12                   # the same images, JPEG-compressed
    with pytest.raises(DataError) as e:
        data.run_import("synthetic-cifar", str(tmp_path / "x"), {"encoding": "webp"})
    _one_line_naming(e, "webp")


def test_run_import_arrays_from_npz(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (30, 2, 3, 4), dtype=np.uint8)
    y = rng.integers(0, 5, 30)
    np.savez(tmp_path / "arrays.npz", x=x, y=y)
    uri = f"file://{tmp_path}/arr"
    summary = data.run_import("arrays", uri, {"path": str(tmp_path / "arrays.npz"), "shards": "3",
                                              "num_classes": 6})
    assert summary["kind"] == "arrays"
    assert summary["datasets"][0]["rows"] == 30 and summary["datasets"][0]["shards"] == 3
    ds = ParquetSource(uri)
    assert ds.shape == (2, 3, 4) and ds.num_classes == 6 and len(ds.layout.paths) == 3
    xs, ys = ds.read_arrays()
    assert np.array_equal(xs, x) and np.array_equal(ys, y)          # order kept for user arrays
    assert np.allclose(ds.layout.meta["mean"], x.mean(axis=(0, 2, 3)), rtol=1e-5)

    np.savez(tmp_path / "nhwc.npz", x=np.zeros((8, 16, 16, 3), np.uint8), y=np.arange(8) % 2)
    with pytest.raises(DataError) as e:         # channels-last: before, 16 "channels" of 16 x 3 pixels
        data.run_import("arrays", f"file://{tmp_path}/nhwc", {"path": str(tmp_path / "nhwc.npz")})
    _one_line_naming(e, "(8, 16, 16, 3) look channels-last", "x.transpose(0, 3, 1, 2)")
    with pytest.raises(DataError) as e:
        data.run_import("arrays", uri, {"path": str(tmp_path / "arrays.npz"), "colour": "red"})
    _one_line_naming(e, "colour")
    with pytest.raises(DataError) as e:
        data.run_import("arrays", uri, {})
    _one_line_naming(e, "path")
    with pytest.raises(DataError) as e:
        data.run_import("mnist", uri, {})
    _one_line_naming(e, "mnist", "digits")
    with pytest.raises(DataError) as e:
        data.run_import("arrays", str(tmp_path / "x"), {"path": str(tmp_path / "missing.npz")})
    _one_line_naming(e, "missing.npz")


def test_run_import_digits_summary(tmp_path):
    summary = data.run_import("digits", str(tmp_path / "d"), {"shards": "1"})
    assert [(d["uri"].rsplit("/", 1)[1], d["rows"], d["shards"]) for d in summary["datasets"]] == \
        [("train", 1438, 1), ("test", 359, 1)]


def test_image_folder_import_keeps_the_files_as_they_are(tmp_path, caplog):
    rng = np.random.default_rng(1)
    files = {}
    for cls in ("dog", "cat"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(3):
            arr = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)          # H=4, W=5, RGB
            blob = _png(arr) if i else _jpeg(arr)
            (tmp_path / "imgs" / cls / f"{i}.{'png' if i else 'jpg'}").write_bytes(blob)
            files[blob] = (cls, arr, bool(i))
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image, skipped")
    (tmp_path / "imgs" / "empty").mkdir()                   # a class with no images: kept, with a word
    summary = data.run_import("image-folder", str(tmp_path / "ds"), {"folder": str(tmp_path / "imgs")})
    assert summary["datasets"][0]["rows"] == 6 and summary["datasets"][0]["encoding"] == "encoded"
    assert f"skipped 1 file(s) whose extension is not an image's, e.g. {tmp_path}/imgs/cat/notes.txt" in caplog.text
    assert "class subfolder(s) without images: empty; their classes are kept" in caplog.text
    table = pq.read_table(tmp_path / "ds")
    assert sorted(table.column("image").to_pylist()) == sorted(files)          # byte for byte
    for blob, label in zip(table.column("image").to_pylist(), table.column("label").to_pylist()):
        assert label == {"cat": 0, "dog": 1}[files[blob][0]]
    src = ParquetSource(str(tmp_path / "ds"))
    assert src.shape == (3, 4, 5) and src.classes == ["cat", "dog", "empty"] and src.num_classes == 3
    x, y = src.read_arrays()
    for img, blob in zip(x, table.column("image").to_pylist()):
        cls, arr, lossless = files[blob]
        if lossless:                                                      # PNG decodes to its pixels
            assert np.array_equal(img, arr.transpose(2, 0, 1))

    # images of another size: a clear error when read, and test_transforms resize them
    from PIL import Image
    Image.fromarray(np.zeros((7, 9, 3), np.uint8)).save(tmp_path / "imgs" / "dog" / "big.png")
    data.import_image_folder(str(tmp_path / "ds2"), str(tmp_path / "imgs"))
    with pytest.raises(DataError) as e:
        read_arrays(str(tmp_path / "ds2"))
    _one_line_naming(e, "different sizes", "resize")
    # ... and where each batch holds images of one size (each rank's rows of one file: a model
    # built for the first image's size trained on others, or failed in torch)
    with pytest.raises(DataError) as e:
        with ParquetSource(str(tmp_path / "ds2")).batches(1, 0, 1, seed=0, epochs=1, drop_last=False,
                                                          train=False) as it:
            for _ in it:
                pass
    _one_line_naming(e, "the dataset's first", "for which the model is built", "resize")
    spec = _spec(test_transforms=[{"resize": {"size": [4, 5]}}])
    x2, _ = read_arrays(str(tmp_path / "ds2"), spec)
    assert x2.shape == (7, 3, 4, 5)

    # a broken image: DataError naming the file, nothing written
    os.remove(tmp_path / "imgs" / "dog" / "big.png")
    (tmp_path / "imgs" / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(DataError) as e:
        data.import_image_folder(str(tmp_path / "ds3"), str(tmp_path / "imgs"))
    _one_line_naming(e, "broken.png")
    assert not (tmp_path / "ds3").exists()
    with pytest.raises(DataError) as e:
        data.run_import("image-folder", str(tmp_path / "ds3"), {"folder": str(tmp_path / "imgs"), "size": "8x8"})
    _one_line_naming(e, "size", "as they are")


def test_image_folder_import_takes_nested_folders_decodes_each_image_and_composes_class_names(tmp_path):
    """From an audit with real folders: images one level down in a class were dropped (and
    the class called empty), a JPEG cut inside its scans passed Pillow's verify() and failed
    in training as "row 1", and a Mac's decomposed folder name was a class of its own."""
    import unicodedata
    from PIL import Image
    rng = np.random.default_rng(2)

    def jpeg(path, size=(64, 64)):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path, quality=90)
    nfc, nfd = unicodedata.normalize("NFC", "ñandú"), unicodedata.normalize("NFD", "ñandú")
    jpeg(tmp_path / "train" / "cat" / "0.jpg")
    jpeg(tmp_path / "train" / "cat" / "2023" / "1.jpg")            # nested, as ImageFolder takes them
    jpeg(tmp_path / "train" / "cat" / "2023" / "deeper" / "2.jpg")
    jpeg(tmp_path / "train" / nfc / "0.jpg")
    summary = data.run_import("image-folder", str(tmp_path / "ds"), {"folder": str(tmp_path / "train")})
    assert summary["datasets"][0]["rows"] == 4
    assert ParquetSource(str(tmp_path / "ds")).classes == ["cat", nfc]
    jpeg(tmp_path / "test" / nfd / "0.jpg")                          # unzipped from a Mac's archive
    data.run_import("image-folder", str(tmp_path / "ds_test"), {"folder": str(tmp_path / "test"),
                                                                 "classes": f"cat,{nfc}"})
    assert ParquetSource(str(tmp_path / "ds_test")).classes == ["cat", nfc]
    jpeg(tmp_path / "test" / nfc / "1.jpg")                          # both forms in one folder: one class
    summary = data.run_import("image-folder", str(tmp_path / "ds_both"), {"folder": str(tmp_path / "test")})
    assert summary["datasets"][0]["rows"] == 2 and ParquetSource(str(tmp_path / "ds_both")).classes == [nfc]
    cut = tmp_path / "train" / "cat" / "2023" / "2.jpg"
    blob = (tmp_path / "train" / "cat" / "2023" / "deeper" / "2.jpg").read_bytes()
    cut.write_bytes(blob[:len(blob) * 8 // 10])                      # verify() passed it
    with pytest.raises(DataError) as e:
        data.import_image_folder(str(tmp_path / "ds2"), str(tmp_path / "train"))
    _one_line_naming(e, f"{cut}: not a readable image", "truncated")
    assert not (tmp_path / "ds2").exists()


def _spec(**data_fields):
    import conf
    job = {"name": "t", "groups": [{"name": "g", "instances": 1, "vcores": 1, "memory": "1 GiB"}],
           "training": {"data": {"train": "unused", **data_fields}}}
    return conf.load_job(job).training.data


# ----------------------------------------------------------------------------- other formats

def test_plain_pyarrow_jpeg_file_without_metadata(tmp_path):
    """JPEG bytes and an int label written by plain pyarrow: classes from the label
    statistics, mean/std computed from the images and cached beside the data."""
    rng = np.random.default_rng(2)
    imgs = [np.clip(rng.normal(100 + 40 * c, 20, (12, 12, 3)), 0, 255).astype(np.uint8)
            for c in (0, 1, 2) for _ in range(10)]
    labels = [c for c in (0, 1, 2) for _ in range(10)]
    table = pa.table({"img": [_jpeg(a) for a in imgs], "target": labels})
    os.makedirs(tmp_path / "ds")
    pq.write_table(table, tmp_path / "ds" / "data.parquet", row_group_size=8)
    spec = _spec(columns={"image": "img", "label": "target"})
    old_umask = os.umask(0o077)                     # a container's: the cache was written 0600 beside shared data
    try:
        src = ParquetSource(str(tmp_path / "ds"), spec)
        src.example(1)
    finally:
        os.umask(old_umask)
    assert src.layout.kind == "encoded" and src.layout.meta == {} and src.num_classes == 3
    assert src.shape == (3, 12, 12) and len(src.layout.blocks) == 4
    x = src.example(30)
    cache = json.loads((tmp_path / "ds" / "_yarnapp_stats.json").read_text())
    assert cache["rows"] == 30                      # the images sampled: all 30 (it said 4096, the sample's cap)
    mode = lambda name: stat.S_IMODE(os.stat(tmp_path / "ds" / name).st_mode)     # noqa: E731
    assert mode("_yarnapp_stats.json") == mode("data.parquet")        # readable as the data is, whatever the umask
    pixels = np.stack(imgs).reshape(-1, 3).astype(np.float64)
    assert np.allclose(cache["mean"], pixels.mean(0), atol=2.0)       # JPEG moves pixels a little
    assert abs(float(x.mean())) < 0.1 and abs(float(x.std()) - 1) < 0.1
    again = ParquetSource(str(tmp_path / "ds"), spec)
    again._resolve_stats()
    assert np.array_equal(again.mean, src.mean)                       # read back from the cache
    # the cache is not a shard, and a changed file invalidates it
    assert _shards(tmp_path / "ds") == ["data.parquet"]

    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "ds"))                                # default column names
    _one_line_naming(e, "data.parquet", "'image'", "training.data.columns.image")


def test_hugging_face_image_struct_with_class_names(tmp_path):
    rng = np.random.default_rng(3)
    arrs = [rng.integers(0, 256, (6, 6, 3), dtype=np.uint8) for _ in range(8)]
    image = pa.array([{"bytes": _png(a), "path": f"img{i}.png"} for i, a in enumerate(arrs)],
                     type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    hf = {"info": {"features": {"image": {"_type": "Image"},
                                "label": {"_type": "ClassLabel", "names": ["ant", "bee", "cow"]}}}}
    table = pa.table({"image": image, "label": pa.array([i % 3 for i in range(8)], pa.int64())})
    table = table.replace_schema_metadata({b"huggingface": json.dumps(hf).encode()})
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    src = ParquetSource(str(tmp_path / "train-00000-of-00001.parquet"))
    assert src.layout.kind == "struct" and src.classes == ["ant", "bee", "cow"] and src.num_classes == 3
    x, y = src.read_arrays()
    assert all(np.array_equal(x[i], arrs[i].transpose(2, 0, 1)) for i in range(8))
    assert y.tolist() == [i % 3 for i in range(8)]
    assert (tmp_path / ".train-00000-of-00001.parquet.yarnapp_stats.json").exists() is False   # no stats asked

    # a struct without bytes (only a path): a clear error when read
    nobytes = pa.array([{"bytes": None, "path": "x.png"}], type=image.type)
    pq.write_table(pa.table({"image": nobytes, "label": pa.array([0], pa.int64())}), tmp_path / "p.parquet")
    with pytest.raises(DataError) as e:
        read_arrays(str(tmp_path / "p.parquet"))
    _one_line_naming(e, "p.parquet", "embed")


def test_class_name_column_and_raw_pixels_with_a_given_shape(tmp_path):
    px = np.arange(5 * 12, dtype=np.uint8).reshape(5, 12)
    table = pa.table({"image": pa.FixedSizeBinaryArray.from_buffers(pa.binary(12), 5, [None, pa.py_buffer(px)]),
                      "label": pa.array([1, 0, 1, 2, 0], pa.int32()),
                      "name": ["b", "a", "b", "c", "a"]})
    pq.write_table(table, tmp_path / "raw.parquet")
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "raw.parquet"))
    _one_line_naming(e, "raw.parquet", "training.data.shape")
    src = ParquetSource(str(tmp_path / "raw.parquet"), _spec(shape=[3, 2, 2], columns={"class_name": "name"}))
    assert src.shape == (3, 2, 2) and src.classes == ["a", "b", "c"]
    x, y = src.read_arrays()
    assert np.array_equal(x.reshape(5, 12), px) and y.tolist() == [1, 0, 1, 2, 0]
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "raw.parquet"), _spec(shape=[3, 2, 3]))
    _one_line_naming(e, "raw.parquet", "fixed_size_binary[18]")


def test_a_class_name_column_is_needed_only_where_no_metadata_names_the_classes(tmp_path):
    """columns.class_name covers the training and the test set; a test set imported by
    yarnapp (its metadata names the classes) has no such column and is read without it.
    Before, it was refused, and the fix the line gave broke the training set."""
    px = np.arange(4 * 12, dtype=np.uint8).reshape(4, 12)
    images = pa.FixedSizeBinaryArray.from_buffers(pa.binary(12), 4, [None, pa.py_buffer(px)])
    meta = {b"yarnapp": json.dumps({"shape": [3, 2, 2], "num_classes": 3, "classes": ["a", "b", "c"]}).encode()}
    table = pa.table({"image": images, "label": pa.array([1, 0, 2, 0], pa.int64())})
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "imported.parquet")
    src = ParquetSource(str(tmp_path / "imported.parquet"), _spec(columns={"class_name": "name"}))
    assert src.classes == ["a", "b", "c"] and src.read_arrays()[1].tolist() == [1, 0, 2, 0]
    assert data.checks.check(str(tmp_path / "imported.parquet"), data.formats.Columns(class_name="name")).rows == 4
    pq.write_table(table, tmp_path / "bare.parquet")                       # no metadata: the column is needed
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "bare.parquet"), _spec(shape=[3, 2, 2], columns={"class_name": "name"}))
    _one_line_naming(e, "bare.parquet", "no class-name column 'name'", "training.data.columns.class_name")


# ----------------------------------------------------------------------------- errors

def test_missing_dataset_and_empty_directory(tmp_path):
    uri = f"file://{tmp_path}/nothing-here"
    with pytest.raises(DataError) as e:
        ParquetSource(uri)
    _one_line_naming(e, uri, "yarnapp data import")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "empty"))
    _one_line_naming(e, str(tmp_path / "empty"), "no .parquet shards")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("uri", ["nosuchscheme://host/data", "hdfs://nonexistent.invalid:8020/data"])
def test_unknown_scheme_or_unreachable_filesystem(uri):
    with pytest.raises(DataError) as e:
        ParquetSource(uri)
    _one_line_naming(e, uri)


def test_truncated_shard_names_the_file(digits_dir, tmp_path):
    src, _ = digits_dir
    shutil.copytree(src / "train", tmp_path / "train")
    victim = tmp_path / "train" / _shards(tmp_path / "train")[1]
    blob = victim.read_bytes()
    victim.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(DataError) as e:
        ParquetSource(f"file://{tmp_path}/train")
    _one_line_naming(e, victim.name, "Parquet")


def test_a_gs_uri_retries_for_seconds_not_minutes():
    """google-cloud-cpp's own retry policy kept an unreachable bucket's submit for over 10
    minutes, deaf to Ctrl-C; an unreachable one now fails in ~2x the limit (24 s measured)."""
    from datetime import timedelta

    from training import fsutil
    for uri, limit in (("gs://bucket/train", fsutil.GCS_RETRY_S), ("gs://bucket/train?retry_limit_seconds=3", 3)):
        fs, path = fsutil.resolve(uri)
        assert path == "bucket/train"
        assert fs.__reduce__()[1][0]["retry_time_limit"] == timedelta(seconds=limit)


def test_corrupt_page_data_names_the_file(digits_dir, tmp_path):
    """A shard whose footer is intact but whose pages are garbage: found when read."""
    src, _ = digits_dir
    shutil.copytree(src / "train", tmp_path / "train")
    victim = tmp_path / "train" / _shards(tmp_path / "train")[0]
    blob = bytearray(victim.read_bytes())
    footer_len = int.from_bytes(blob[-8:-4], "little")
    end = len(blob) - 8 - footer_len
    blob[4:end] = bytes(np.random.default_rng(0).integers(0, 256, end - 4, dtype=np.uint8))
    victim.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        read_arrays(str(tmp_path / "train"))
    _one_line_naming(e, victim.name)
    assert e.value.repeats


def test_an_undecodable_image_is_named_by_its_file_and_its_row_there(tmp_path):
    """Not the dataset's directory and a row counted over every file (the auditor's "row 70"
    was the first row of the eighth file)."""
    rng = np.random.default_rng(5)
    for k in range(3):
        blobs = [_png(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)) for _ in range(4)]
        if k == 2:
            blobs[1] = b"\x89PNG not really"
        _write(str(tmp_path / "ds" / f"part-{k}.parquet"),
               pa.table({"image": pa.array(blobs, pa.binary()), "label": pa.array([0, 1, 0, 1], pa.int64())}))
    with pytest.raises(DataError) as e:
        read_arrays(str(tmp_path / "ds"))
    _one_line_naming(e, f"{tmp_path / 'ds'}/part-2.parquet (row 1): not a decodable image")


def test_a_page_overwritten_inside_is_found_by_its_checksum(digits_dir, tmp_path):
    """Bytes overwritten inside the image column's data page, its header and the footer
    intact: raw pixels parse as any bytes, so before page checksums this trained on garbage."""
    src, _ = digits_dir
    shutil.copytree(src / "train", tmp_path / "train")
    victim = tmp_path / "train" / _shards(tmp_path / "train")[0]
    column = pq.ParquetFile(victim).metadata.row_group(0).column(0)
    assert column.path_in_schema == "image"
    blob = bytearray(victim.read_bytes())
    at = column.data_page_offset + column.total_compressed_size // 2      # inside the page's values
    blob[at:at + 64] = bytes(255 - b for b in blob[at:at + 64])
    victim.write_bytes(bytes(blob))
    assert pq.ParquetFile(victim).read().num_rows > 0              # unverified, it reads as any data
    with pytest.raises(DataError) as e:
        read_arrays(str(tmp_path / "train"))
    _one_line_naming(e, victim.name, "CRC checksum")
    assert e.value.repeats           # in the content: a restart meets it again (launcher.retries)


def _write(path, table):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path)


META = {b"yarnapp": json.dumps({"format": 1, "shape": [1, 2, 2], "num_classes": 3, "classes": ["a", "b", "c"],
                                "mean": [0.0], "std": [1.0]}).encode()}


def _good_table(n=4, labels=None):
    image = pa.array([bytes([i] * 4) for i in range(n)], type=pa.binary(4))
    label = pa.array(labels if labels is not None else [i % 3 for i in range(n)], type=pa.int64())
    return pa.table({"image": image, "label": label}).replace_schema_metadata(META)


@pytest.mark.parametrize("case,table,expect", [
    ("list-image", pa.table({"image": pa.array([[1, 2, 3, 4]], type=pa.list_(pa.uint8())),
                             "label": pa.array([0], pa.int64())}).replace_schema_metadata(META),
     "column 'image'"),
    ("wrong-width", pa.table({"image": pa.array([b"abc"], type=pa.binary(3)),
                              "label": pa.array([0], pa.int64())}).replace_schema_metadata(META),
     "column 'image'"),
    ("no-label", pa.table({"image": pa.array([b"abcd"], type=pa.binary(4))}).replace_schema_metadata(META),
     "'label'"),
    ("float-label", pa.table({"image": pa.array([b"abcd"], type=pa.binary(4)),
                              "label": pa.array([0.5], pa.float64())}).replace_schema_metadata(META),
     "label column 'label' is double, expected integers (class indices 0..K-1); cast them to integers"),
    ("string-label", pa.table({"image": pa.array([b"abcd"], type=pa.binary(4)),
                               "label": pa.array(["cat"], pa.string())}).replace_schema_metadata(META),
     "label column 'label' is string, expected integers (class indices 0..K-1); map each class name to an "
     "index 0..K-1 in an integer column, and name the column of names in training.data.columns.class_name"),
    ("other-dataset", pa.table({"image": pa.array([b"abcd"], type=pa.binary()),
                                "label": pa.array([0], pa.int64())}), "mixes datasets"),
])
def test_wrong_schema_names_file_and_column(tmp_path, case, table, expect):
    _write(str(tmp_path / case / "part-00000.parquet"), _good_table())
    _write(str(tmp_path / case / "part-00001.parquet"), table)
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / case))
    _one_line_naming(e, "part-00001.parquet", expect)


def _partitioned(root, n=30, classes=3, days=("2026-11-01", "2026-11-02")):
    """Spark's partitionBy("day", "label") output: day=D/label=N/part-*.parquet (the label and
    day columns not in the files), with _SUCCESS and .crc side files. Image i holds 12 raw
    pixels of value i; its label i % classes; returns {pixel value: label}."""
    want = {}
    for d, day in enumerate(days):
        for lab in range(classes):
            ids = [i for i in range(n) if i % classes == lab and i % len(days) == d]
            px = np.repeat(np.array(ids, np.uint8), 12)
            table = pa.table({"image": pa.FixedSizeBinaryArray.from_buffers(pa.binary(12), len(ids),
                                                                            [None, pa.py_buffer(px)])})
            leaf = root / f"day={day}" / f"label={lab}"
            _write(str(leaf / "part-00000-5f1c.c000.snappy.parquet"), table)      # the same name in every one
            (leaf / ".part-00000-5f1c.c000.snappy.parquet.crc").write_bytes(b"")
            want.update({i: lab for i in ids})
    (root / "_SUCCESS").write_bytes(b"")
    return want


def test_spark_partitionby_output_reads_its_labels_from_the_directories(tmp_path):
    """Spark's and Hive's partitionBy write label=N/ directories and leave the column out of
    the files: it was refused ("point training.data at one directory"); now every row reads
    with its directory's label, the classes from them, mean/std cached at the dataset's root."""
    want = _partitioned(tmp_path / "ds")
    src = ParquetSource(str(tmp_path / "ds"), _spec(shape=[3, 2, 2]))
    assert src.num_classes == 3 and len(src) == 30 and len(src.layout.paths) == 6
    assert src.layout.partitions == [{"label": k % 3} for k in range(6)]       # day: not read
    assert src.layout.names[0].endswith("ds/day=2026-11-01/label=0/part-00000-5f1c.c000.snappy.parquet")
    x, y = src.read_arrays()
    assert sorted(zip(x[:, 0, 0, 0].tolist(), y.tolist())) == sorted(want.items())
    src._resolve_stats()
    assert os.path.exists(tmp_path / "ds" / "_yarnapp_stats.json") and np.allclose(src.mean, np.mean(list(want)))
    # a label column in the files wins over a directory of that name; class names from a directory too
    _write(str(tmp_path / "own" / "label=7" / "part-0.parquet"), _good_table(labels=[0, 1, 2, 1]))
    assert ParquetSource(str(tmp_path / "own")).read_arrays()[1].tolist() == [0, 1, 2, 1]
    for lab, name in enumerate(["cat", "dog"]):
        _write(str(tmp_path / "named" / f"class_name={name}" / "x.parquet"), pa.table({
            "image": pa.array([bytes([lab] * 4)], pa.binary(4)), "label": pa.array([lab], pa.int64())}))
    named = ParquetSource(str(tmp_path / "named"), _spec(shape=[1, 2, 2], columns={"class_name": "class_name"}))
    assert named.classes == ["cat", "dog"]
    for lab, name in enumerate(["007", "1e3"]):            # names that look like numbers stay as written
        _write(str(tmp_path / "numbers" / f"class_name={name}" / "x.parquet"), pa.table({
            "image": pa.array([bytes([lab] * 4)], pa.binary(4)), "label": pa.array([lab], pa.int64())}))
    numbers = ParquetSource(str(tmp_path / "numbers"), _spec(shape=[1, 2, 2], columns={"class_name": "class_name"}))
    assert numbers.classes == ["007", "1e3"]
    # an empty partition counts no class: the ranks' classes are the client's (it said 2, they built 6)
    _write(str(tmp_path / "own2" / "label=0" / "x.parquet"), _good_table().drop_columns("label").replace_schema_metadata())
    _write(str(tmp_path / "own2" / "label=5" / "x.parquet"), _good_table(n=0).drop_columns("label").replace_schema_metadata())
    from training.data.checks import check
    _write(str(tmp_path / "own2" / "label=cat" / "x.parquet"), _good_table(n=0).drop_columns("label").replace_schema_metadata())
    own2 = (str(tmp_path / "own2"), _spec(shape=[1, 2, 2]))                 # nor does it make labels strings
    assert ParquetSource(*own2).num_classes == 1 == check(own2[0], shape=(1, 2, 2)).num_classes


def test_hive_named_files_and_a_glob_over_one_split_of_a_hub_folder_are_read(tmp_path):
    """A Hive table's files have no extension (000000_0); the Hugging Face hub's data/ folder
    holds train-* beside test-*: read as one dataset it trained on the test rows."""
    _write(str(tmp_path / "hive" / "label=1" / "000000_0"), _good_table(labels=[0, 0, 0, 0]).drop_columns("label"))
    _write(str(tmp_path / "hive" / "label=1" / "000000_0.crc"), _good_table())       # no extension only
    for other in ("LICENSE", "notes/TODO", "label=1/README"):     # not data: not named as Hive names its files
        os.makedirs(os.path.dirname(tmp_path / "hive" / other), exist_ok=True)
        (tmp_path / "hive" / other).write_text("not parquet")
    assert ParquetSource(str(tmp_path / "hive")).read_arrays()[1].tolist() == [1, 1, 1, 1]
    for name in ("part-r-00000", "part-00000-1f2e3d4c-5b6a-c000", "000000_0_copy_1"):   # MapReduce's, Spark's
        _write(str(tmp_path / "named" / name), _good_table(labels=[2, 2, 2, 2]))
    assert ParquetSource(str(tmp_path / "named")).read_arrays()[1].tolist() == [2] * 12
    _write(str(tmp_path / "impala" / "a_data.0.parq"), _good_table(labels=[0, 1, 0, 1]))      # Impala's
    assert len(ParquetSource(str(tmp_path / "impala"))) == 4
    _write(str(tmp_path / "hub" / "data" / "train-00000-of-00002.parquet"), _good_table(labels=[0, 1, 2, 0]))
    _write(str(tmp_path / "hub" / "data" / "train-00001-of-00002.parquet"), _good_table(labels=[1, 1, 1, 1]))
    _write(str(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet"), _good_table(labels=[2, 2, 2, 2]))
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "hub" / "data"))
    _one_line_naming(e, "its files are of 2 splits (test-00000-of-00001.parquet, train-00000-of-00002.parquet)",
                     f"give each split's files with a pattern: {tmp_path / 'hub' / 'data'}/train*.parquet and "
                     f"{tmp_path / 'hub' / 'data'}/test*.parquet")
    train = ParquetSource(f"file://{tmp_path}/hub/data/train-*.parquet")
    assert train.read_arrays()[1].tolist() == [0, 1, 2, 0, 1, 1, 1, 1]
    assert train.layout.names[1] == f"file://{tmp_path}/hub/data/train-00001-of-00002.parquet"
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "hub" / "data" / "valid-*.parquet"))
    _one_line_naming(e, "no file matches 'valid-*.parquet'")
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "hub" / "data" / "*.parquet"))         # a pattern over both splits
    _one_line_naming(e, "its files are of 2 splits")
    one = ParquetSource(str(tmp_path / "hub" / "data" / "train-0000?-of-00002.parquet"))    # a plain path's ?
    assert one.layout.names[0] == str(tmp_path / "hub" / "data" / "train-00000-of-00002.parquet")
    from training.data.formats import _name
    from training.data.listing import _parent
    assert _name("/train-*.parquet", "/train-*.parquet", "/", "/train-0.parquet") == "/train-0.parquet"
    assert _name("file:///t-*?x=1", "/t-*", "/", "/t-0") == "file:///t-0?x=1"
    assert [_parent(p) for p in ([""], ["file:", "", ""], [], ["s3:", "", "b"])] == ["/", "file:///", ".", "s3://b"]


def test_partitioned_output_that_cannot_be_read_is_one_line_naming_the_file(tmp_path, monkeypatch):
    from training.data.checks import check
    from training.data.formats import inspect

    _partitioned(tmp_path / "nulls", classes=2, days=("a",))
    os.rename(tmp_path / "nulls" / "day=a" / "label=1", tmp_path / "nulls" / "day=a" / "label=__HIVE_DEFAULT_PARTITION__")
    for read in (check, inspect):           # the client's check, and a rank's (it raised on a NaN)
        with pytest.raises(DataError) as e:
            read(str(tmp_path / "nulls"), shape=(3, 2, 2))
        _one_line_naming(e, "day=a/label=__HIVE_DEFAULT_PARTITION__/part-00000", "row(s) without a label",
                         "a null in its directory's name, label=__HIVE_DEFAULT_PARTITION__ or label=)")
    image = pa.table({"image": pa.array([b"abcd"], pa.binary(4))})
    for case, values, expect in [
            ("strings", ("cat", "dog"), "label column 'label' (its directories, label=...) is string"),
            ("floats", ("0.0", "1.0"), "label column 'label' (its directories, label=...) is double, expected "
                                       "integers (class indices 0..K-1); cast them to integers"),
            ("digits", ("\u00b2", "1"), "is string"),             # isdigit() says yes; int() says no
            ("negative", ("-1", "0"), "its labels run from -1 to -1 (its directory); labels must be class indices"),
            ("mixed", ("0", "cat"), "label=cat/x.parquet: label column 'label' (its directories, label=...) is string"),
            ("blank", ("", "0"), "label=/x.parquet: 1 row(s) without a label (a null in its directory's name"),
            ("huge", ("99999999999999999999", "0"), "label=99999999999999999999/x.parquet: its directory gives label "
                                                    "99999999999999999999: labels are class indices 0..K-1")]:
        for v in values:
            _write(str(tmp_path / case / f"label={v}" / "x.parquet"), image)
        with pytest.raises(DataError) as e:
            check(str(tmp_path / case), shape=(1, 2, 2))
        _one_line_naming(e, "/x.parquet", expect)
    with pytest.raises(DataError) as e:                   # one partition given: its label is in the name above
        ParquetSource(str(tmp_path / "strings" / "label=cat"), _spec(shape=[1, 2, 2]))
    _one_line_naming(e, "is one partition (label=cat) of partitionBy's output",
                     f"give the directory above it ({tmp_path / 'strings'})")
    monkeypatch.chdir(tmp_path / "strings")               # a relative one: it raised ValueError, a traceback
    with pytest.raises(DataError) as e:
        ParquetSource("label=cat/", _spec(shape=[1, 2, 2]))
    _one_line_naming(e, "label=cat/: is one partition (label=cat)", "give the directory above it (.)")
    # a dataset under a directory that happens to be named label=...: its own directories give the labels
    _write(str(tmp_path / "label=x" / "ds" / "label=4" / "x.parquet"), image)
    assert check(str(tmp_path / "label=x" / "ds"), shape=(1, 2, 2)).num_classes == 5
    _write(str(tmp_path / "beside" / "label=0" / "x.parquet"), _good_table())
    _write(str(tmp_path / "beside" / "y.parquet"), _good_table())
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "beside"))
    _one_line_naming(e, "holds .parquet files (y.parquet) beside column=value directories of them (label=0/x.parquet)")
    _write(str(tmp_path / "backup" / "label=0" / "x.parquet"), _good_table())
    _write(str(tmp_path / "backup" / "old" / "x.parquet"), _good_table())
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "backup"))
    _one_line_naming(e, "backup/old/x.parquet: not under column=value directories", f"move {tmp_path / 'backup' / 'old'} out")
    _write(str(tmp_path / "splits" / "train" / "label=0" / "x.parquet"), _good_table())
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "splits"))
    _one_line_naming(e, "its subdirectories do (train/label=0/x.parquet)")
    _write(str(tmp_path / "mixed" / "label=0" / "x.parquet"), _good_table())
    _write(str(tmp_path / "mixed" / "label=1" / "extra" / "y.parquet"), _good_table())
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "mixed"))
    _one_line_naming(e, "mixed/label=1/extra/y.parquet", "not under column=value directories")
    _write(str(tmp_path / "uneven" / "label=0" / "x.parquet"), _good_table())
    _write(str(tmp_path / "uneven" / "label=1" / "day=a" / "y.parquet"), _good_table())
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "uneven"))
    _one_line_naming(e, "uneven/label=1/day=a/y.parquet", "['day', 'label']", "mixes datasets")
    # subdirectories that are not partitions: two datasets side by side
    _write(str(tmp_path / "two" / "train" / "x.parquet"), _good_table())
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "two"))
    _one_line_naming(e, "holds no .parquet files of its own, but its subdirectories do (train/x.parquet)",
                     "one directory per dataset")
    os.makedirs(tmp_path / "empty" / "sub")
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "empty"))
    _one_line_naming(e, "the directory holds no .parquet shards")


def test_label_outside_the_classes_is_found_when_read(tmp_path):
    _write(str(tmp_path / "ds" / "part-00000.parquet"), _good_table(labels=[0, 1, 2, 7]))
    with pytest.raises(DataError) as e:
        read_arrays(str(tmp_path / "ds"))
    _one_line_naming(e, "label 7", "[0, 3)")


def test_single_file_and_hand_written_dataset_load(tmp_path):
    _write(str(tmp_path / "one.parquet"), _good_table(6))
    ds = ParquetSource(f"file://{tmp_path}/one.parquet")
    assert len(ds) == 6 and ds.shape == (1, 2, 2) and ds.classes == ["a", "b", "c"]
    x, y = ds.read_arrays()
    assert x[5].tolist() == [[[5, 5], [5, 5]]] and y.tolist() == [0, 1, 2, 0, 1, 2]


def test_module_imports_without_torch():
    code = "import sys, training.data; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _test_beside_train(tmp_path, test_shape, test_classes, train_classes=2):
    """(test uri, train uri, the test set opened against the training set: a ParquetSource
    or the DataError raised), arrays of 8 zero images, labels i % classes."""
    train, test = str(tmp_path / "train"), str(tmp_path / "test")
    data.import_arrays(train, np.zeros((8, 1, 4, 4), np.uint8), np.arange(8) % train_classes, overwrite=True)
    data.import_arrays(test, np.zeros((8, *test_shape), np.uint8), np.arange(8) % test_classes, overwrite=True)
    try:
        return test, train, ParquetSource(test, reference=ParquetSource(train))
    except DataError as e:
        return test, train, e


def test_a_test_set_unlike_the_training_set_is_named_with_both(tmp_path):
    """A 3-channel test set beside a 1-channel training set: one line naming both and the
    channels (before, a mean/std message that pointed at training.data.mean)."""
    test, train, e = _test_beside_train(tmp_path, (3, 4, 4), 2)
    _one_line_naming(e, test, "3 channel(s), the training set's", train)
    test, train, e = _test_beside_train(tmp_path, (1, 6, 6), 2)
    _one_line_naming(e, test, "[1, 6, 6]", "[1, 4, 4]")


def test_a_test_set_with_classes_the_training_set_lacks_is_one_line_before_training(tmp_path):
    """Labels 0..6 in the test set, 0..3 in the training set: the model has 4 outputs. Before,
    it trained to the end and failed at evaluation: IndexError: Target 6 is out of bounds."""
    test, train, e = _test_beside_train(tmp_path, (1, 4, 4), 7, train_classes=4)
    _one_line_naming(e, test, "labels go up to 6 (7 classes), the training set's", train)
    _, _, fewer = _test_beside_train(tmp_path, (1, 4, 4), 2, train_classes=4)
    assert fewer.num_classes == 4                                   # fewer classes than training: fine


def test_importing_train_and_test_into_a_dataset_directory_is_refused(tmp_path):
    """digits into data/arr, where an arrays dataset already is: train/ and test/ nested
    inside it, without --overwrite."""
    arr = str(tmp_path / "arr")
    data.import_arrays(arr, np.zeros((8, 1, 4, 4), np.uint8), np.arange(8) % 2)
    for kind in ("digits", "synthetic-cifar"):
        for overwrite in (False, True):
            with pytest.raises(DataError) as e:
                data.run_import(kind, arr, {"overwrite": overwrite})
            _one_line_naming(e, f"{arr} holds a dataset of its own", "give another path")
    assert not {"train", "test"} & set(os.listdir(arr))


# ----------------------------------------------------------------------------- an audit's own data

def _encoded(path, blobs, labels, **columns):
    _write(str(path), pa.table({columns.get("image", "image"): pa.array(blobs, pa.binary()),
                                columns.get("label", "label"): pa.array(labels, pa.int64()),
                                **({columns["class_name"]: columns["names"]} if "class_name" in columns else {})}))


def test_16_bit_greyscale_pngs_keep_their_range():
    """Pillow's convert("L") clips a 16-bit image at 255: values 1000 + 6000 * label all came
    out 255 (white), mean 255 std 1, and training learned nothing. They keep their high byte."""
    from training.data.decode import decode_one
    from PIL import Image
    for label in range(10):
        value = 1000 + 6000 * label
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 4), value, np.uint16)).save(buf, format="PNG")
        assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")       # what a 16-bit PNG opens as
        grey, rgb = decode_one(buf.getvalue(), 1), decode_one(buf.getvalue(), 3)
        assert grey.shape == (4, 4, 1) and rgb.shape == (4, 4, 3) and grey.dtype == rgb.dtype == np.uint8
        assert (grey == value >> 8).all() and (rgb == value >> 8).all()


def test_channels_follow_any_colour_image_the_shape_or_the_training_set(tmp_path, caplog):
    """One greyscale image first made a colour dataset train as greyscale (the first image
    alone decided, and training.data.shape was ignored for encoded images); a greyscale test
    set beside a colour training set was refused. Now any colour image among the first 64
    makes it RGB, the shape's C decides where given, and a test set is decoded to the
    training set's channels."""
    rng = np.random.default_rng(7)
    grey = [_png(rng.integers(0, 256, (6, 6), dtype=np.uint8)) for _ in range(4)]
    colour = [_jpeg(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)) for _ in range(4)]
    _encoded(tmp_path / "mixed" / "a.parquet", grey[:1] + colour + grey[1:], [0, 1, 0, 1, 0, 1, 0, 1])
    _encoded(tmp_path / "grey" / "a.parquet", grey, [0, 1, 0, 1])
    with caplog.at_level("INFO", logger="training.data.source"):
        mixed = ParquetSource(str(tmp_path / "mixed"))
    assert mixed.channels == 3 and mixed.shape == (3, 6, 6)
    assert f"{tmp_path / 'mixed'}: 3 channel(s) (from its first 64 images" in caplog.text
    assert ParquetSource(str(tmp_path / "grey")).channels == 1
    as_rgb = ParquetSource(str(tmp_path / "grey"), _spec(shape=[3, 6, 6]))
    x, _ = as_rgb.read_arrays()
    assert as_rgb.channels == 3 and x.shape == (4, 3, 6, 6) and (x[:, 0] == x[:, 2]).all()
    assert ParquetSource(str(tmp_path / "mixed"), _spec(shape=[1, 6, 6])).channels == 1
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "mixed"), _spec(shape=[4, 6, 6]))
    _one_line_naming(e, "training.data.shape [4, 6, 6]", "give C 1 or 3")
    test = ParquetSource(str(tmp_path / "grey"), reference=mixed)            # was: "1 channel(s), the training set's 3"
    assert test.channels == 3 and test.read_arrays()[0].shape == (4, 3, 6, 6)


def test_a_test_set_needs_no_class_name_column_of_its_own(tmp_path):
    """columns.class_name named the training set's column of names; a plain test set beside
    it (labels only) was refused for lacking it. Its labels mean the training set's classes."""
    rng = np.random.default_rng(8)
    blobs = [_png(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)) for _ in range(4)]
    _encoded(tmp_path / "train" / "a.parquet", blobs, [1, 0, 1, 0], class_name="name", names=["b", "a", "b", "a"])
    _encoded(tmp_path / "test" / "a.parquet", blobs, [0, 1, 0, 1])
    spec = _spec(columns={"class_name": "name"})
    train = ParquetSource(str(tmp_path / "train"), spec)
    test = ParquetSource(str(tmp_path / "test"), spec, reference=train)
    assert train.classes == test.classes == ["a", "b"] and test.read_arrays()[1].tolist() == [0, 1, 0, 1]
    assert data.checks.check(str(tmp_path / "test"), data.formats.Columns(class_name="name"), named=True).rows == 4
    with pytest.raises(DataError) as e:                                        # a training set still needs it
        ParquetSource(str(tmp_path / "test"), spec)
    _one_line_naming(e, "no class-name column 'name'")


def test_cached_mean_and_std_are_measured_again_when_a_file_is_rewritten_at_its_size(tmp_path, caplog):
    """The cache knew files by name and size: raw pixels rewritten inverted (same size,
    uncompressed) were normalised with the old mean. Its modification time counts too; a
    cache used is said in the log."""
    path = tmp_path / "ds" / "part-0.parquet"
    px = np.full((8, 12), 40, np.uint8)

    def write(pixels, mtime):
        _write(str(path), pa.table({"image": pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(12), 8, [None, pa.py_buffer(pixels)]), "label": pa.array([0, 1] * 4, pa.int64())}))
        os.utime(path, (mtime, mtime))
    write(px, 1_700_000_000)
    size = os.path.getsize(path)
    spec = _spec(shape=[3, 2, 2])
    first = ParquetSource(str(path.parent), spec)
    first._resolve_stats()
    assert np.allclose(first.mean, 40)
    with caplog.at_level("INFO", logger="training.data.stats"):
        again = ParquetSource(str(path.parent), spec)
        again._resolve_stats()
    assert np.allclose(again.mean, 40) and f"from {path.parent / '_yarnapp_stats.json'} (delete it" in caplog.text
    write(255 - px, 1_700_000_100)
    assert os.path.getsize(path) == size
    rewritten = ParquetSource(str(path.parent), spec)
    rewritten._resolve_stats()
    assert np.allclose(rewritten.mean, 215)


def test_a_bad_image_met_while_measuring_mean_and_std_is_named_by_its_row_in_the_file(tmp_path):
    """It said "(sample row 23)", the index in the block's sample, for the file's row 123."""
    rng = np.random.default_rng(9)
    blobs = [_png(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)) for _ in range(8)]
    blobs[5] = b"\x89PNG not really"
    _encoded(tmp_path / "ds" / "a.parquet", blobs[:3], [0, 1, 0])
    _encoded(tmp_path / "ds" / "b.parquet", blobs[3:], [0, 1, 0, 1, 0])
    with pytest.raises(DataError) as e:
        ParquetSource(str(tmp_path / "ds"))._resolve_stats()
    _one_line_naming(e, f"{tmp_path / 'ds'}/b.parquet (row 2): not a decodable image")


def test_a_resume_mid_epoch_into_another_order_of_its_rows_is_refused_at_an_epochs_end_taken():
    """The order of an epoch follows training.seed, shuffle_window and the row groups; a
    checkpoint recorded only the batch size and rows, so a resume with a smaller window (as the
    out-of-memory line advises), another seed or the same rows rewritten in other row groups was
    taken, and the rest of its epoch repeated 259-999 rows and skipped as many (an audit)."""
    from training.checkpoint import other_data
    from training.data.order import Order
    rows, nbytes = [1000, 1000, 66], [1 << 20, 1 << 20, 66 << 10]
    same = Order(rows, nbytes, 1 << 20).fingerprint(64)
    assert Order(rows, nbytes, 1 << 20).fingerprint(64) == same
    assert Order(rows, nbytes, 2 << 20).fingerprint(64) != same                 # another window
    assert Order([500, 1500, 66], nbytes, 1 << 20).fingerprint(64) != same       # other row groups
    mine = Order(rows, nbytes, 1 << 20, content=[70_000, 69_000, 4_000]).fingerprint(64)
    assert Order(rows, nbytes, 1 << 20, content=[69_500, 69_500, 4_000]).fingerprint(64) != mine   # rows shuffled
    saved = {"batch_size": 64, "train_rows": 2066, "seed": 5, "order": same}     # 32 steps an epoch
    assert other_data(40, "app_a", saved, dict(saved)) is None
    line = other_data(40, "app_a", saved, dict(saved, seed=6))
    assert line == ("checkpoint.resume: the checkpoint of step 40 (application app_a) is 8 steps into epoch 2 "
                    "(of 32 steps), and this job orders that epoch's rows otherwise (training.seed 6 (it was "
                    "written with 5)): the rest of the epoch would repeat some rows and skip others; resume with "
                    "what it was written with (a checkpoint at an epoch's end takes the change), or start afresh "
                    "(checkpoint.resume: never)"), line
    line = other_data(40, "app_a", saved, dict(saved, order=Order(rows, nbytes, 2 << 20).fingerprint(64)))
    assert ("(training.data.shuffle_window, or the training set's row groups, changed; training.data.memory and "
            "groups[].memory keep the order)") in line, line
    assert other_data(64, "app_a", saved, dict(saved, seed=6, order="x")) is None    # an epoch's end: a new order
    old = {"batch_size": 64, "train_rows": 2066}                                     # recorded before the order
    assert other_data(40, "app_a", old, dict(saved, seed=6)) is None
    assert "other places in the data" in other_data(40, "app_a", saved, dict(saved, batch_size=32))


def test_hdfs_out_of_reach_or_full_is_said_as_hdfs_says_it(monkeypatch):
    """An HDFS audit: a frozen NameNode hung `submit` and `data import` for ever (WebHDFS
    requests had no timeout); safe mode escaped the checkpoint's handling as a RuntimeError
    traceback; a quota exceeded read "403 Client Error: Forbidden", HDFS's reason lost, and
    was retried as a passing cause."""
    import socket
    import time

    import requests

    from launcher.failure import storage_unreachable
    from training import fsutil
    from training.checkpoint import STORAGE_FULL, _attempt
    from training.data.common import Unreachable, info
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(5)                                   # accepts, never answers: a frozen NameNode
    monkeypatch.setattr(fsutil, "WEBHDFS_TIMEOUT", (1.0, 1.0))
    uri = f"webhdfs://127.0.0.1:{silent.getsockname()[1]}/data"
    fs, path = fsutil.resolve(uri)
    started = time.monotonic()
    with pytest.raises(Unreachable, match=rf"^cannot reach {uri}: .*Read timed out"):
        info(fs, path, uri)
    assert time.monotonic() - started < 10
    silent.close()

    def safe_mode():
        raise RuntimeError("Cannot create directory /user/a/ckpt/app_1. Name node is in safe mode.\nMore")
    line = _attempt(safe_mode)
    assert line == "Cannot create directory /user/a/ckpt/app_1. Name node is in safe mode. More"
    assert storage_unreachable(line)

    def quota():
        response = requests.Response()
        response.status_code, response.url = 403, "http://dn:9864/webhdfs/v1/ckpt/rank-00000.pt?op=APPEND"
        response._content = json.dumps({"RemoteException": {
            "exception": "DSQuotaExceededException", "message": "The DiskSpace quota of /ckpt is exceeded: "
            "quota = 1048576 B = 1 MB but diskspace consumed = 402653184 B = 384 MB"}}).encode()
        response.raise_for_status()
    line = _attempt(quota)
    assert line.startswith("DSQuotaExceededException: The DiskSpace quota of /ckpt is exceeded"), line
    assert any(w in line.lower() for w in STORAGE_FULL) and not storage_unreachable(line)


def test_a_checkpoint_saved_or_resumed_with_its_filesystem_out_of_reach_is_every_ranks_one_line(tmp_path):
    """A listing out of reach raised on rank 0 alone (a review: a ConnectionError's traceback,
    the other ranks left in a broadcast), once listdir stopped answering [] for it."""
    import socket
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                                      # nothing listens there
    code = ("import sys\nfrom mpi4py import MPI\nfrom training.checkpoint import Checkpointer, CheckpointError\n"
            f"c = Checkpointer('webhdfs://127.0.0.1:{port}/ckpt', MPI.COMM_SELF, app_id='app_1', name='j',\n"
            "                 data={'batch_size': 8, 'train_rows': 100})\n"
            "for call in (lambda: c.save(10, {'w': 1}), c.latest):\n"
            "    try:\n        call()\n    except CheckpointError as e:\n        print(str(e))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and "Traceback" not in out.stderr, (out.stdout, out.stderr[-2000:])
    assert lines[0].startswith(f"checkpoint.uri webhdfs://127.0.0.1:{port}/ckpt: cannot write the checkpoint of "
                               f"step 10 (rank 0): "), lines
    assert "Connection refused" in lines[0] and lines[0].endswith(
        "check that its filesystem is up (a restart retries it) (the checkpoint before it is intact)"), lines[0]
    assert lines[1].startswith(f"checkpoint.uri webhdfs://127.0.0.1:{port}/ckpt: cannot "), lines[1]


def test_a_file_changed_or_removed_while_the_job_runs_is_one_line_not_retried(digits, tmp_path):
    """A data audit: a training file swapped mid-run for one of other rows (shifted labels) was
    trained on without a word (test accuracy 0.003); one cut shorter said "row group 0 holds
    20 rows, its footer says 36", one removed "corrupt or unreadable Parquet data ([Errno 2]
    ...)", each retried. A file is checked against the plan as the reader opens it:
    DataChanged, whose words say why it is not retried (launcher.retries)."""
    from training.data.common import DataChanged
    from training.data.formats import inspect
    from training.data.reader import _Files, read_block
    train = tmp_path / "train"
    shutil.copytree(f"{digits}/train", train)
    layout = inspect(str(train))
    first = next(b for b in layout.blocks if b.file == 0)
    second = next(b for b in layout.blocks if b.file == 1)
    files = _Files(layout)
    assert read_block(layout, files, first)[0] is not None          # as planned: read
    files.close()
    table = pq.read_table(layout.paths[0])
    pq.write_table(table.slice(0, 20), layout.paths[0])            # rewritten with fewer rows
    with pytest.raises(DataChanged, match=r"^\S+part-\S+: changed while the job ran \(\d+ rows in 1 row groups when "
                                          r"it started, 20 in 1 now, or rewritten in place\); a dataset must not "
                                          r"change under a running job: put it back"):
        read_block(layout, _Files(layout), first)
    os.remove(layout.paths[1])
    with pytest.raises(DataChanged, match=r"^\S+: removed while the job ran; a dataset must not change"):
        read_block(layout, _Files(layout), second)
    assert DataChanged.certain.startswith("the dataset changed under the job")
