"""The data path in real `yarnapp submit`s on the local engine (real containers with
cgroup memory limits, a real MPI world): data larger than memory, foreign Parquet files,
a user's dataset factory."""
import io
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recovery_util import run_to_end
from util import assert_nothing_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
LIMIT_MIB = 1024


def _job(tmp_path, name, data, groups, **training):
    return {"name": name, "max_restarts": 0, "groups": groups,
            "run": {"files": [os.path.join(JOBS, "data_jobs.py")]},
            "training": {"model": "data_jobs:pool_linear", "data": data, "epochs": 1, "log_every": 1, **training},
            "checkpoint": {"uri": str(tmp_path / name / "ckpt"), "every_steps": 100000},
            "tensorboard": {"logdir": str(tmp_path / name / "tb")}}


@pytest.fixture
def bigger_than_memory(tmp_path):
    """Raw 3x64x64 images, 3.2x a container's memory limit: 14 files of 4 MiB row groups.
    The pixels are one random buffer written again and again (quick to write); labels differ."""
    root = tmp_path / "big"
    root.mkdir()
    width = 3 * 64 * 64
    rows = 20000
    px = np.frombuffer(np.random.default_rng(0).bytes(rows * width), np.uint8)
    image = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), rows, [None, pa.py_buffer(px)])
    for f in range(14):
        labels = np.random.default_rng(f).integers(0, 10, rows)
        pq.write_table(pa.table({"image": image, "label": labels}), root / f"part-{f:05d}.parquet",
                       row_group_size=(4 << 20) // width, compression="none")
    size = sum(os.path.getsize(root / f) for f in os.listdir(root))
    assert size >= 3 * LIMIT_MIB * 2 ** 20
    yield str(root), size
    shutil.rmtree(root)                               # 2.3 GB: not left for pytest's retention


def test_a_dataset_three_times_the_container_memory_trains_to_the_end(tmp_path, bigger_than_memory, yarnapp_home):
    uri, size = bigger_than_memory
    groups = [{"name": "big", "instances": 1, "vcores": 1, "memory": f"{LIMIT_MIB} MiB"},
              {"name": "small", "instances": 1, "vcores": 0.5, "memory": f"{LIMIT_MIB} MiB"}]
    job = _job(tmp_path, "big", {"train": uri, "shape": [3, 64, 64]}, groups, batch_size=512, shares="vcores",
               lr=0.01)
    run, st = run_to_end(job, timeout=900)
    assert st["final"]["steps"] == 280000 // 512                       # the whole epoch
    read = 0
    print(f"\ndataset {size / 2 ** 20:.0f} MiB, containers of {LIMIT_MIB} MiB (cgroup v1 limit):")
    for rank, p in sorted(st["progress"].items()):
        print(f"  rank {rank}: peak rss+mapped {p['container_rss_peak_mib']} MiB (memory.stat, sampled every step), "
              f"max_usage {p['memory_peak_mib']} MiB (memory.max_usage_in_bytes: with reclaimable page cache), "
              f"blocks held at most {p['data_blocks_peak_mib']} MiB, read {p['data_read_mb']:.0f} MB")
        assert p["memory_limit_mib"] == LIMIT_MIB
        assert p["container_rss_peak_mib"] < LIMIT_MIB
        read += p["data_read_mb"] * 1e6
    assert st["restarts"] == []                                        # nothing was killed for memory
    amplification = read / size
    print(f"  read amplification {amplification:.2f} (bytes read by both ranks / dataset size)")
    assert 1.0 <= amplification < 1.4
    assert_nothing_left(run.app_id)


def _jpeg(arr):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_plain_pyarrow_jpeg_files_without_metadata_written_partitioned_by_class_train(tmp_path, yarnapp_home):
    """JPEG bytes and an int label, written by plain pyarrow: no yarnapp metadata, mean/std
    computed by rank 0 and cached, augmentation on; the classes are colours, learnt. The
    training set as Spark's partitionBy("class") writes it (class=K/ directories, the column
    left out of the files), the test set one file with the column."""
    rng = np.random.default_rng(5)
    colours = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]])

    def table(n):
        labels = rng.integers(0, 4, n)
        imgs = [np.clip(colours[k] + rng.normal(0, 30, (20, 20, 3)), 0, 255).astype(np.uint8) for k in labels]
        return pa.table({"jpeg": [_jpeg(a) for a in imgs], "class": pa.array(labels, pa.int32())})
    pq.write_to_dataset(table(600), tmp_path / "train", partition_cols=["class"], row_group_size=100)
    assert sorted(os.listdir(tmp_path / "train")) == [f"class={k}" for k in range(4)]
    pq.write_table(table(200), tmp_path / "test.parquet")
    groups = [{"name": "big", "instances": 1, "vcores": 1, "memory": "1 GiB"},
              {"name": "small", "instances": 2, "vcores": 0.5, "memory": "1 GiB"}]
    data = {"train": str(tmp_path / "train"), "test": str(tmp_path / "test.parquet"),
            "columns": {"image": "jpeg", "label": "class"},
            "augment": [{"random_resized_crop": {"size": 16, "scale": [0.5, 1.0]}}, "hflip"],
            "test_transforms": [{"center_crop": {"size": 16}}]}
    job = _job(tmp_path, "jpeg", data, groups, batch_size=30, epochs=3, shares="vcores", lr=0.1)
    run, st = run_to_end(job)
    assert st["final"]["accuracy"] > 0.9, st["final"]
    assert (tmp_path / "train" / "_yarnapp_stats.json").exists()
    assert_nothing_left(run.app_id)


def test_a_users_dataset_factory_trains(tmp_path, yarnapp_home):
    groups = [{"name": "big", "instances": 1, "vcores": 1, "memory": "1 GiB"},
              {"name": "small", "instances": 1, "vcores": 0.5, "memory": "1 GiB"}]
    data = {"dataset": "data_jobs:blobs", "dataset_options": {"n": 600, "classes": 4}}
    job = _job(tmp_path, "factory", data, groups, batch_size=40, epochs=2, shares=[2, 1], lr=0.1)
    run, st = run_to_end(job)
    assert st["final"]["steps"] == 2 * 15 and st["final"]["accuracy"] > 0.9, st["final"]
    assert_nothing_left(run.app_id)


def test_file_uris_and_home_paths_land_where_pyarrow_puts_them(tmp_path, digits, yarnapp_home, monkeypatch, cli):
    """A file:// URI's %-escapes are decoded everywhere, as pyarrow decodes them (the
    checkpoints went to `ck a`, TensorBoard's events to a literal `tb%20a`, and `--resume`
    looked under `ck%20a` and found nothing); `file:/path` (one slash) is that path, not a
    directory `file:` under the submit directory; `~` is the home, not a directory `~`."""
    from recovery_util import digits_job
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(digits, home / "digits")
    job = digits_job(tmp_path, "file:" + digits, "uris", steps=4, every=2, instances=(1, 0))
    job["training"]["data"] = {"train": "~/digits/train", "test": "file:" + digits + "/test"}
    job["checkpoint"]["uri"] = f"file://{tmp_path}/ck%20a"
    job["tensorboard"]["logdir"] = "~/tb"
    run, st = run_to_end(job)
    assert os.listdir(tmp_path / "ck a" / run.app_id), "checkpoints under the decoded path"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(home / "tb" / run.app_id))
    assert not os.path.exists(tmp_path / "~") and not os.path.exists(tmp_path / "file:")
    job["tensorboard"]["logdir"] = f"file://{tmp_path}/tb%20b"
    job["checkpoint"]["resume"] = run.app_id
    job["training"]["max_steps"] = 6
    run2, st2 = run_to_end(job)
    assert st2["final"]["resumed_from"] == 4
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb b" / run2.app_id))
    assert not os.path.exists(tmp_path / "tb%20b")
    # `yarnapp data import` to ~ and to file:/path
    cli("data", "import", "digits", "~/imported", check=0)
    cli("data", "import", "digits", f"file:{tmp_path}/imported2", check=0)
    assert os.path.isdir(home / "imported" / "train") and os.path.isdir(tmp_path / "imported2" / "train")
    for r in (run, run2):
        assert_nothing_left(r.app_id)
