"""The data layer with real Parquet files on the local filesystem (file:// and plain paths)."""
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training import data
from training.data import DataError, Loader, ParquetDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    summary = data.import_digits(f"file://{root}/digits", shards=3)
    return root / "digits", summary


@pytest.fixture(scope="module")
def digits(digits_dir):
    return ParquetDataset(str(digits_dir[0] / "train"))


def _shards(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".parquet"))


def _one_line_naming(exc_info, *parts):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert str(part) in msg, (part, msg)
    return msg


def _collect(loader):
    return [(e, s, x.clone(), y.clone()) for e, s, x, y in loader]


# ----------------------------------------------------------------------------- import / read

def test_digits_round_trip_through_parquet(digits_dir):
    from sklearn.datasets import load_digits

    root, summary = digits_dir
    assert [d["rows"] for d in summary["datasets"]] == [1438, 359]
    assert sorted(os.listdir(root)) == ["test", "train"]          # no temporary directories left
    train = ParquetDataset(f"file://{root}/train")
    test = ParquetDataset(str(root / "test"))                        # plain path works too
    assert train.shape == test.shape == (1, 8, 8)
    assert train.num_classes == 10 and train.classes == [str(i) for i in range(10)]
    assert len(train) + len(test) == 1797 and len(train.files) == 3

    # the files hold fixed_size_binary(64) pixels and int64 labels, with the metadata
    for name in _shards(root / "train"):
        schema = pq.read_schema(root / "train" / name)
        assert schema.field("image").type == pa.binary(64)
        assert pa.types.is_fixed_size_binary(schema.field("image").type)
        assert schema.field("label").type == pa.int64()
        meta = json.loads(schema.metadata[b"yarnapp"])
        assert meta["shape"] == [1, 8, 8] and meta["num_classes"] == 10

    # together the splits are exactly scikit-learn's digits, pixel for pixel
    d = load_digits()
    ours = np.concatenate([np.concatenate([train.images, test.images]).reshape(-1, 64),
                           np.concatenate([train.labels, test.labels])[:, None]], axis=1)
    ref = np.concatenate([d.images.reshape(-1, 64), d.target[:, None]], axis=1).astype(np.int64)
    assert np.array_equal(ours[np.lexsort(ours.T[::-1])], ref[np.lexsort(ref.T[::-1])])

    # stratified: every class holds out ~20%; normalisation measured on train, shared
    for c in range(10):
        n_test, n_all = (test.labels == c).sum(), (d.target == c).sum()
        assert abs(n_test - 0.2 * n_all) <= 1
    assert np.allclose(train.mean, train.images.mean()) and np.allclose(train.std, train.images.std(), rtol=1e-4)
    assert np.array_equal(train.mean, test.mean) and np.array_equal(train.std, test.std)


def test_digits_split_is_fixed_across_runs(digits_dir, tmp_path):
    root, _ = digits_dir
    data.import_digits(str(tmp_path / "again"), shards=2)
    for split in ("train", "test"):
        a, b = ParquetDataset(str(root / split)), ParquetDataset(str(tmp_path / "again" / split))
        assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)


def test_import_refuses_existing_dataset_and_overwrite_replaces_it(tmp_path):
    uri = str(tmp_path / "syn")
    data.import_synthetic_cifar(uri, n_train=40, n_test=20, shards=2, seed=1)
    with pytest.raises(DataError) as e:
        data.import_synthetic_cifar(uri, n_train=60, n_test=20, shards=2, seed=1)
    _one_line_naming(e, uri, "already exists")
    assert len(ParquetDataset(uri + "/train")) == 40
    data.import_synthetic_cifar(uri, n_train=60, n_test=20, shards=3, seed=1, overwrite=True)
    assert len(ParquetDataset(uri + "/train")) == 60
    assert len(_shards(tmp_path / "syn" / "train")) == 3
    assert sorted(os.listdir(tmp_path / "syn")) == ["test", "train"]   # old copy and temp dirs gone


def test_failed_write_leaves_nothing_visible(tmp_path):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    uri = str(tmp_path / "blocker" / "ds")
    with pytest.raises(DataError) as e:
        data.import_arrays(uri, np.zeros((4, 1, 2, 2), np.uint8), np.arange(4) % 2)
    _one_line_naming(e, uri)
    assert sorted(os.listdir(tmp_path)) == ["blocker"]


def test_synthetic_cifar_is_cifar_shaped_deterministic_and_learnable(tmp_path):
    data.import_synthetic_cifar(str(tmp_path / "a"), n_train=1000, n_test=300, shards=2, seed=7)
    data.import_synthetic_cifar(str(tmp_path / "b"), n_train=1000, n_test=300, shards=2, seed=7)
    train, test = ParquetDataset(str(tmp_path / "a/train")), ParquetDataset(str(tmp_path / "a/test"))
    assert train.shape == (3, 32, 32) and train.num_classes == 10 and len(train) == 1000
    assert train.images.dtype == np.uint8 and np.bincount(train.labels).tolist() == [100] * 10
    again = ParquetDataset(str(tmp_path / "b/train"))
    assert np.array_equal(train.images, again.images) and np.array_equal(train.labels, again.labels)
    # learnable: a nearest-class-mean classifier is far above chance (10%) on held-out data
    x = train.images.reshape(len(train), -1).astype(np.float32)
    means = np.stack([x[train.labels == c].mean(0) for c in range(10)])
    xt = test.images.reshape(len(test), -1).astype(np.float32)
    pred = ((xt ** 2).sum(1)[:, None] - 2 * xt @ means.T + (means ** 2).sum(1)[None]).argmin(1)
    assert (pred == test.labels).mean() > 0.3


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
    ds = ParquetDataset(uri)
    assert ds.shape == (2, 3, 4) and ds.num_classes == 6 and len(ds.files) == 3
    assert np.array_equal(ds.images, x) and np.array_equal(ds.labels, y)   # order kept for user arrays
    assert np.allclose(ds.mean, x.mean(axis=(0, 2, 3)), rtol=1e-5)

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


def test_image_folder_import(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    pixels = {}
    for cls in ("dog", "cat"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(3):
            arr = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)          # H=4, W=5, RGB
            Image.fromarray(arr).save(tmp_path / "imgs" / cls / f"{i}.png")
            pixels[(cls, i)] = arr
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image, skipped")
    summary = data.run_import("image-folder", str(tmp_path / "ds"), {"folder": str(tmp_path / "imgs")})
    assert summary["datasets"][0]["rows"] == 6
    ds = ParquetDataset(str(tmp_path / "ds"))
    assert ds.shape == (3, 4, 5) and ds.classes == ["cat", "dog"] and ds.num_classes == 2
    got = sorted((int(lab), img.tobytes()) for img, lab in zip(ds.images, ds.labels))
    want = sorted(({"cat": 0, "dog": 1}[c], a.transpose(2, 0, 1).tobytes()) for (c, _), a in pixels.items())
    assert got == want

    # greyscale and resizing
    data.import_image_folder(str(tmp_path / "small"), str(tmp_path / "imgs"), size=(2, 3), mode="L")
    assert ParquetDataset(str(tmp_path / "small")).shape == (1, 2, 3)

    # a different size without `size`, and a broken image: DataError naming the file
    Image.fromarray(np.zeros((7, 7, 3), np.uint8)).save(tmp_path / "imgs" / "dog" / "big.png")
    with pytest.raises(DataError) as e:
        data.import_image_folder(str(tmp_path / "ds2"), str(tmp_path / "imgs"))
    _one_line_naming(e, "big.png", "size")
    os.remove(tmp_path / "imgs" / "dog" / "big.png")
    (tmp_path / "imgs" / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(DataError) as e:
        data.import_image_folder(str(tmp_path / "ds2"), str(tmp_path / "imgs"))
    _one_line_naming(e, "broken.png")
    assert not (tmp_path / "ds2").exists()


# ----------------------------------------------------------------------------- errors

def test_missing_dataset_and_empty_directory(tmp_path):
    uri = f"file://{tmp_path}/nothing-here"
    with pytest.raises(DataError) as e:
        ParquetDataset(uri)
    _one_line_naming(e, uri, "yarnapp data import")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    with pytest.raises(DataError) as e:
        ParquetDataset(str(tmp_path / "empty"))
    _one_line_naming(e, str(tmp_path / "empty"), "no .parquet shards")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("uri", ["nosuchscheme://host/data", "hdfs://nonexistent.invalid:8020/data"])
def test_unknown_scheme_or_unreachable_filesystem(uri):
    with pytest.raises(DataError) as e:
        ParquetDataset(uri)
    _one_line_naming(e, uri)


def test_truncated_shard_names_the_file(digits_dir, tmp_path):
    src, _ = digits_dir
    shutil.copytree(src / "train", tmp_path / "train")
    victim = tmp_path / "train" / _shards(tmp_path / "train")[1]
    blob = victim.read_bytes()
    victim.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(DataError) as e:
        ParquetDataset(f"file://{tmp_path}/train")
    _one_line_naming(e, victim.name, "Parquet")


def test_corrupt_page_data_names_the_file(digits_dir, tmp_path):
    """A shard whose footer is intact but whose pages are garbage."""
    src, _ = digits_dir
    shutil.copytree(src / "train", tmp_path / "train")
    victim = tmp_path / "train" / _shards(tmp_path / "train")[0]
    blob = bytearray(victim.read_bytes())
    footer_len = int.from_bytes(blob[-8:-4], "little")
    end = len(blob) - 8 - footer_len
    blob[4:end] = bytes(np.random.default_rng(0).integers(0, 256, end - 4, dtype=np.uint8))
    victim.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        ParquetDataset(str(tmp_path / "train"))
    _one_line_naming(e, victim.name)


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
     "column 'label'"),
    ("no-metadata", _good_table().replace_schema_metadata(None), "metadata"),
    ("label-range", _good_table(labels=[0, 1, 2, 7]), "label 7"),
])
def test_wrong_schema_names_file_and_column(tmp_path, case, table, expect):
    _write(str(tmp_path / case / "part-00000.parquet"), _good_table())
    _write(str(tmp_path / case / "part-00001.parquet"), table)
    with pytest.raises(DataError) as e:
        ParquetDataset(str(tmp_path / case))
    _one_line_naming(e, "part-00001.parquet", expect)


def test_single_file_and_hand_written_dataset_load(tmp_path):
    _write(str(tmp_path / "one.parquet"), _good_table(6))
    ds = ParquetDataset(f"file://{tmp_path}/one.parquet")
    assert len(ds) == 6 and ds.shape == (1, 2, 2) and ds.classes == ["a", "b", "c"]
    assert ds.images[5].tolist() == [[[5, 5], [5, 5]]] and ds.labels.tolist() == [0, 1, 2, 0, 1, 2]


def test_module_imports_without_torch():
    code = "import sys, training.data; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ----------------------------------------------------------------------------- loader

def test_loader_is_deterministic_per_seed_and_epoch(digits):
    a = _collect(Loader(digits, 64, 0, 64, seed=3, epochs=2))
    b = _collect(Loader(digits, 64, 0, 64, seed=3, epochs=2, prefetch=0))
    assert len(a) == 2 * (len(digits) // 64)
    for (ea, sa, xa, ya), (eb, sb, xb, yb) in zip(a, b):
        assert (ea, sa) == (eb, sb) and np.array_equal(xa.numpy(), xb.numpy()) and np.array_equal(ya, yb)
    loader = Loader(digits, 64, 0, 64, seed=3)
    assert np.array_equal(loader.permutation(0), Loader(digits, 64, 0, 64, seed=3).permutation(0))
    assert not np.array_equal(loader.permutation(0), loader.permutation(1))
    assert not np.array_equal(loader.permutation(0), Loader(digits, 64, 0, 64, seed=4).permutation(0))
    assert sorted(loader.permutation(1)) == list(range(len(digits)))


def test_loader_normalises_with_metadata(digits):
    loader = Loader(digits, 32, 0, 32, seed=0)
    epoch, step, x, y = next(iter(loader))
    loader.close()
    rows = loader.rows(0, 0)
    assert (epoch, step) == (0, 0)
    assert x.dtype.is_floating_point and str(x.dtype) == "torch.float32" and str(y.dtype) == "torch.int64"
    assert tuple(x.shape) == (32, 1, 8, 8)
    expect = (digits.images[rows].astype(np.float32) - digits.mean[0]) / digits.std[0]
    assert np.allclose(x.numpy(), expect, atol=1e-6) and np.array_equal(y.numpy(), digits.labels[rows])
    assert abs(float(x.mean())) < 0.5


@pytest.mark.parametrize("drop_last", [True, False])
def test_slices_of_unequal_shares_tile_the_global_batch(digits, drop_last):
    B, cuts = 50, [0, 7, 30, 50]                        # three ranks with shares 7, 23, 20
    full = _collect(Loader(digits, B, 0, B, seed=5, epochs=2, drop_last=drop_last))
    parts = [_collect(Loader(digits, B, lo, hi, seed=5, epochs=2, drop_last=drop_last))
             for lo, hi in zip(cuts, cuts[1:])]
    assert all(len(p) == len(full) for p in parts)
    for i, (e, s, x, y) in enumerate(full):
        assert [(p[i][0], p[i][1]) for p in parts] == [(e, s)] * 3
        assert np.array_equal(np.concatenate([p[i][2].numpy() for p in parts]), x.numpy())
        assert np.array_equal(np.concatenate([p[i][3].numpy() for p in parts]), y.numpy())
        n = len(y)                                        # a last partial batch is split pro rata
        bounds = [c * n // B for c in cuts]
        assert [len(p[i][3]) for p in parts] == [b - a for a, b in zip(bounds, bounds[1:])]
    epoch0 = np.concatenate([y.numpy() for e, s, x, y in full if e == 0])
    if drop_last:
        assert len(epoch0) == (len(digits) // B) * B
    else:                                                 # every row exactly once per epoch
        assert len(epoch0) == len(digits) and full[len(full) // 2 - 1][3].shape[0] == len(digits) % B
        assert np.array_equal(np.sort(epoch0), np.sort(digits.labels))


def test_resume_at_epoch_and_step_matches_uninterrupted_run(digits):
    full = _collect(Loader(digits, 40, 10, 30, seed=11, epochs=3))
    spe = len(digits) // 40
    for start_epoch, start_step in [(1, 5), (0, spe - 1), (2, 0), (1, spe)]:   # (1, spe) == (2, 0)
        resumed = _collect(Loader(digits, 40, 10, 30, seed=11, start_epoch=start_epoch,
                                  start_step=start_step, epochs=3))
        tail = full[start_epoch * spe + start_step:]
        assert len(resumed) == len(tail) > 0
        for (e1, s1, x1, y1), (e2, s2, x2, y2) in zip(resumed, tail):
            assert (e1, s1) == (e2, s2)
            assert np.array_equal(x1.numpy(), x2.numpy()) and np.array_equal(y1.numpy(), y2.numpy())


def test_prefetch_statistics_and_clean_shutdown(digits):
    loader = Loader(digits, 64, 0, 32, seed=0, prefetch=2)
    assert loader.steps_per_epoch == len(digits) // 64
    seen = 0
    for epoch, step, x, y in loader:            # an endless loader (epochs=None): the consumer stops it
        seen += 1
        if seen == 30:
            assert any(t.name == "yarnapp-loader" for t in threading.enumerate())
            break
    loader.close()
    assert not any(t.name == "yarnapp-loader" and t.is_alive() for t in threading.enumerate())
    assert (epoch, step) == divmod(29, loader.steps_per_epoch)
    stats = loader.stats
    assert stats.batches == 30 and stats.samples == 30 * 32
    assert 30 * 32 <= stats.read_samples <= (30 + 2 + 1) * 32        # read ahead by at most prefetch+1
    assert stats.wait_s >= 0 and stats.read_s > 0 and stats.samples_per_s > 0
    assert set(stats.as_dict()) >= {"wait_s", "samples_per_s", "batches", "samples"}
    # iterating again starts over at (start_epoch, start_step)
    with Loader(digits, 64, 0, 32, seed=0, epochs=1) as again:
        firsts = [(e, s) for e, s, _, _ in again]
    assert firsts[0] == (0, 0) and len(firsts) == loader.steps_per_epoch


def test_loader_rejects_bad_batches(digits):
    with pytest.raises(DataError) as e:
        Loader(digits, len(digits) + 1, 0, 1, seed=0)
    _one_line_naming(e, digits.uri, "batch")
    with pytest.raises(ValueError):
        Loader(digits, 32, 10, 40, seed=0)
    # a batch larger than the dataset is fine when the last partial batch is kept
    assert Loader(digits, len(digits) + 1, 0, 1, seed=0, drop_last=False).steps_per_epoch == 1
