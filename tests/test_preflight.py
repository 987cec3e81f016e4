"""The client's data and output checks before submitting (yarnapp.preflight), at its boundary: which
URIs it refuses, which it leaves to the containers, and which jobs it does not check."""
import logging
import os
import socket

import pytest

import conf
from yarnapp import advice, preflight
from yarnapp.errors import YarnappError

pytestmark = pytest.mark.unit


def _job(train, test=None, run=None):
    data = {"train": train, **({"test": test} if test else {})}
    return conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                          **({"run": run} if run else {}), "training": {"data": data}})


def _closed_port():
    with socket.socket() as s:          # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unknown_scheme_is_refused_on_both_backends():
    for on_cluster in (False, True):
        with pytest.raises(YarnappError, match=r"^job.yaml: training.data.train: cannot open hdsf://nn/x: "
                                               r"Unrecognized filesystem type"):
            preflight.check_data(_job("hdsf://nn/x"), "job.yaml", on_cluster=on_cluster)


def test_a_filesystem_out_of_reach_is_left_to_the_cluster_once_and_refused_locally(caplog):
    """Out of this client's reach, a cluster's containers may still reach it: left to them,
    with a warning. A port refused on this machine's own address is refused on a cluster too
    (it started three containers, which failed 33 s later): a single-node cluster's
    containers run here, and on a cluster of several a loopback address is each node's own."""
    train, test = "webhdfs://namenode.invalid:9870/d/train", "webhdfs://namenode.invalid:9870/d/test"
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(_job(train, test), "job.yaml", on_cluster=True)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith("training.data.train not checked before submitting: "
                                                     f"cannot reach {train}"), warned    # test: same host, not retried
    with pytest.raises(YarnappError, match=rf"^job.yaml: training.data.train: cannot reach {train}"):
        preflight.check_data(_job(train, test), "job.yaml")
    here = f"webhdfs://127.0.0.1:{_closed_port()}/d/train"
    for on_cluster in (False, True):
        with pytest.raises(YarnappError, match=rf"^job.yaml: training.data.train: cannot reach {here}"):
            preflight.check_data(_job(here), "job.yaml", on_cluster=on_cluster)


def test_local_paths_are_the_nodes_own_on_a_cluster(tmp_path):
    preflight.check_data(_job(str(tmp_path / "nope")), "job.yaml", on_cluster=True)
    with pytest.raises(YarnappError, match="no dataset at"):
        preflight.check_data(_job(str(tmp_path / "nope")), "job.yaml")


def test_own_code_with_a_training_section_is_not_checked(tmp_path):
    """Only the built-in runner reads training.data; a function or script reads what it likes."""
    missing = str(tmp_path / "nope")
    for run in ({"function": "training.hello:main"}, {"script": str(tmp_path / "train.py")}):
        preflight.check_data(_job(missing, run=run), "job.yaml")


def test_an_empty_dataset_and_no_where(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"image": pa.array([], pa.binary()), "label": pa.array([], pa.int64())}),
                   tmp_path / "empty" / "part-0.parquet")
    with pytest.raises(YarnappError) as e:
        preflight.check_data(_job(str(tmp_path / "empty")))
    assert str(e.value) == f"training.data.train: {tmp_path / 'empty'}: the dataset has no rows; " \
                           f"import one with `yarnapp data import KIND URI`"


def _outputs(ckpt=None, logdir=None):
    return conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                          "run": {"function": "training.hello:main"},
                          "checkpoint": {"uri": ckpt}, "tensorboard": {"logdir": logdir}})


def test_outputs_that_cannot_be_written_are_refused_before_anything_starts(tmp_path, caplog):
    """checkpoint.uri and tensorboard.logdir: before, an unwritable checkpoint.uri crashed the
    checkpoint code in the containers (a TypeError), and an unreachable logdir failed the
    job at its end, after the whole training."""
    (tmp_path / "a-file").write_text("x")
    preflight.check_outputs(_outputs(str(tmp_path / "new" / "ckpt"), f"file://{tmp_path}/tb"), "job.yaml")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]               # tried, and nothing left
    with pytest.raises(YarnappError, match=rf"^job.yaml: checkpoint.uri: {tmp_path}/a-file/c: {tmp_path}/a-file "
                                           r"is not a directory; give a directory you can write to$"):
        preflight.check_outputs(_outputs(str(tmp_path / "a-file" / "c")), "job.yaml")
    with pytest.raises(YarnappError, match=r"^job.yaml: tensorboard.logdir: /proc/nope/tb: cannot write under /proc"):
        preflight.check_outputs(_outputs(logdir="/proc/nope/tb"), "job.yaml")
    # names the filesystem cannot hold: rank 0 failed on them (ENAMETOOLONG), half made, and restarted
    with pytest.raises(YarnappError, match=r"^job.yaml: tensorboard.logdir: .*: the name y{20}\.\.\. is 300 bytes, "
                                           r"and a file name here may have 255; shorten it$"):
        preflight.check_outputs(_outputs(logdir=str(tmp_path / "new" / ("y" * 300))), "job.yaml")
    with pytest.raises(YarnappError, match=r"^job.yaml: checkpoint.uri: .*: the path is 50\d\d bytes, and a path here "
                                           r"may have 4095; shorten it$"):
        preflight.check_outputs(_outputs(str(tmp_path / "/".join(["z" * 200] * 25))), "job.yaml")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
    port = _closed_port()
    far = f"webhdfs://127.0.0.1:{port}/ckpt"
    with pytest.raises(YarnappError) as refused:        # (urllib3's cause was cut at 200 characters, mid-phrase)
        preflight.check_outputs(_outputs(far), "job.yaml")
    assert str(refused.value) == (f"job.yaml: checkpoint.uri: cannot reach {far}: HTTPConnectionPool(host='127.0.0.1', "
                                  f"port={port}): Connection refused; check the URI and that its filesystem is up")
    with pytest.raises(YarnappError, match=rf"^job.yaml: checkpoint.uri: cannot reach {far}"):
        preflight.check_outputs(_outputs(far), "job.yaml", on_cluster=True)       # refused on this machine
    far = "webhdfs://namenode.invalid:9870/ckpt"
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):      # the nodes' paths; their reach
        preflight.check_outputs(_outputs(far, "/proc/nope/tb"), "job.yaml", on_cluster=True)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["checkpoint.uri not checked before submitting"]


def test_a_batch_larger_than_the_training_set_is_refused_before_anything_starts(digits):
    """It started the containers, whose loader then found no whole batch in 1438 rows."""
    job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                         "training": {"batch_size": 1439, "data": {"train": f"{digits}/train"}}})
    with pytest.raises(YarnappError, match=rf"^job.yaml: training.batch_size: 1439 is more than the 1438 rows of "
                                           rf"training.data.train \({digits}/train\); lower it$"):
        preflight.check_data(job, "job.yaml")
    preflight.check_data(job.model_copy(update={"training": job.training.model_copy(update={"batch_size": 1438})}),
                         "job.yaml")


def test_an_option_a_built_in_model_does_not_take_is_refused_before_anything_starts():
    job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                         "training": {"model": "digits_cnn", "model_options": {"widht": 32}, "data": {"train": "/x"}}})
    with pytest.raises(YarnappError, match=r"^job.yaml: training.model_options: model 'digits_cnn': unknown option "
                                           r"'widht'; options are conv1, conv2, hidden$"):
        preflight.check_model(job, "job.yaml")
    preflight.check_model(conf.load_job({**job.model_dump(mode="json"), "training": {
        **job.training.model_dump(mode="json"), "model_options": {"conv1": 8}}}), "job.yaml")


def test_equal_shares_over_groups_of_unequal_vcores_are_warned_of(caplog):
    """An auditor left `shares` out on 1 + 0.5 vcore groups and got shares [1.0, 1.0] with no
    word: the 1-vcore rank waits for the other every step."""
    def job(shares=None, strategy="allreduce", big=1.0):
        groups = [{"name": "big", "instances": 1, "vcores": big}, {"name": "small", "instances": 2, "vcores": 0.5}]
        return conf.load_job({"name": "t", "groups": groups, "training": {
            "data": {"train": "/x"}, "strategy": strategy, **({"shares": shares} if shares else {})}})
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_model(job(), "job.yaml")
    assert caplog.messages == ["job.yaml: training.shares: equal (the default) gives every rank the same rows of each "
                               "batch, while the groups have 1 vcore, 0.5 vcores: the faster ranks wait for the "
                               "slowest every step; set training.shares: vcores (or speed: measured at start)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        for quiet in (job("vcores"), job(big=0.5), job(strategy="conv_model_parallel"),
                      job(strategy={"name": "hypergraph", "capacities": [2, 1, 1]})):
            preflight.check_model(quiet, "job.yaml")
    assert caplog.messages == []


def test_half_precision_where_no_group_has_a_gpu_is_warned_of(caplog):
    """bf16 on CPU-only groups was accepted without a word; the ranks said at info level,
    in their logs, that they computed in fp32."""
    def job(precision, gpus=0):
        return conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 2, "vcores": 1, "gpus": gpus}],
                              "training": {"data": {"train": "/x"}, "precision": precision}})
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_model(job("bf16"), "job.yaml")
    assert caplog.messages == ["job.yaml: training.precision: bf16 applies to GPU ranks, and no group asks for gpus: "
                               "every rank computes in fp32; give a group gpus, or leave precision out"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        for quiet in (job("fp32"), job("bf16", gpus=1), job("fp16", gpus=1)):
            preflight.check_model(quiet, "job.yaml")
    assert caplog.messages == []


def _write(path, images, labels, statistics=True):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.mkdir()
    pq.write_table(pa.table({"image": images, "label": pa.array(labels, pa.int64())}), path / "part-0.parquet",
                   write_statistics=statistics)
    return str(path)


def test_raw_pixels_in_a_plain_binary_column_and_negative_labels_are_refused_before_anything_starts(tmp_path):
    """Raw pixels written as pa.binary() were found in the ranks at their first step, as
    "not a decodable image (cannot identify image file <_io.BytesIO object at 0x...>)",
    with training.data.shape silently unused; labels of -1 were found in the ranks too."""
    import io

    import numpy as np
    import pyarrow as pa
    from PIL import Image
    pixels, labels = [bytes(range(64)), bytes(64)] * 32, [0, 1] * 32      # a whole batch of the default 64
    raw = _write(tmp_path / "raw", pa.array(pixels, pa.binary()), labels)
    with pytest.raises(YarnappError) as e:
        preflight.check_data(_job(raw), "job.yaml")
    assert str(e.value) == (f"job.yaml: training.data.train: {raw}/part-0.parquet (row 0): column 'image' holds 64 "
                            f"bytes that are not an image (cannot identify image file); write encoded images (PNG, "
                            f"JPEG), or raw uint8 pixels as a fixed-size binary column (pa.binary(64)) with "
                            f"training.data.shape")
    shaped = conf.load_job({**_job(raw).model_dump(mode="json"), "training": {"data": {"train": raw,
                                                                                       "shape": [1, 8, 8]}}})
    with pytest.raises(YarnappError, match=r"its 64 bytes are C\*H\*W of training.data.shape \[1, 8, 8\]: write "
                                           r"raw pixels as a fixed-size binary column \(pa.binary\(64\)\)$"):
        preflight.check_data(shaped, "job.yaml")
    preflight.check_data(conf.load_job({**shaped.model_dump(mode="json"), "training": {"data": {
        "train": _write(tmp_path / "fixed", pa.array(pixels, pa.binary(64)), labels), "shape": [1, 8, 8]}}}))
    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(png, format="PNG")
    preflight.check_data(_job(_write(tmp_path / "png", pa.array([png.getvalue()] * 64, pa.binary()), labels)))
    negative = _write(tmp_path / "negative", pa.array([png.getvalue()] * 64, pa.binary()), [-1] + labels[1:])
    with pytest.raises(YarnappError, match=r"^job.yaml: training.data.train: .*/negative/part-0.parquet: its labels "
                                           r"run from -1 to 1 \(its footer's statistics\); labels must be class "
                                           r"indices >= 0$"):
        preflight.check_data(_job(negative), "job.yaml")


def test_a_test_folder_imported_without_a_class_of_the_training_folder_is_refused_before_anything_starts(tmp_path):
    """A test folder that lacks one of the training folder's classes (no bird/), imported as
    data.md says: its labels were cat=0, dog=1 against the training set's bird=0, cat=1, dog=2,
    and the job SUCCEEDED with accuracy 0.0 and no word. Refused at submit now, naming the
    import that fixes it; imported with --classes, it trains (labels as the training set's)."""
    import numpy as np
    from PIL import Image

    from training.data import run_import
    from training.data.source import ParquetSource
    for split, names in (("train", ("bird", "cat", "dog")), ("test", ("cat", "dog"))):
        for cls in names:
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(22):
                Image.fromarray(np.full((4, 4), 40 * names.index(cls) + i, np.uint8)).save(
                    tmp_path / split / cls / f"{i}.png")
    train, test = str(tmp_path / "ds-train"), str(tmp_path / "ds-test")
    run_import("image-folder", train, {"folder": str(tmp_path / "train")})
    run_import("image-folder", test, {"folder": str(tmp_path / "test")})
    with pytest.raises(YarnappError) as e:
        preflight.check_data(_job(train, test), "job.yaml")
    assert str(e.value) == (f"job.yaml: training.data.test: {test}: its label 0 is class 'cat', in the training set "
                            f"({train}) 'bird'; import it with the training set's classes in their order (yarnapp "
                            f"data import image-folder ... --classes bird,cat,dog)")
    with pytest.raises(Exception, match=r"its label 0 is class 'cat'"):   # the ranks' own check, as the containers run it
        ParquetSource(test, reference=ParquetSource(train))
    run_import("image-folder", test, {"folder": str(tmp_path / "test"), "classes": "bird,cat,dog", "overwrite": True})
    preflight.check_data(_job(train, test), "job.yaml")
    source = ParquetSource(test, reference=ParquetSource(train))
    _, labels = source.read_arrays()
    assert sorted(set(labels.tolist())) == [1, 2] and source.classes == ["bird", "cat", "dog"]
    with pytest.raises(Exception, match=r"test/dog: a subfolder that is not among the classes given \(bird, cat\)"):
        run_import("image-folder", str(tmp_path / "other"), {"folder": str(tmp_path / "test"), "classes": "bird,cat"})
    with pytest.raises(Exception, match=r"option classes='cat,cat' is not a valid value; give class names separated "
                                        r"by commas, each once"):
        run_import("image-folder", str(tmp_path / "other"), {"folder": str(tmp_path / "test"), "classes": "cat,cat"})


def test_null_labels_and_test_labels_past_the_training_classes_are_refused_before_anything_starts(tmp_path, caplog):
    """Both were found only in the ranks, after the containers started: a null label as
    "1 null labels in column 'label'", a test set labelled 1..4 against a training set of 4
    classes (0..3) as "its labels go up to 4". The footers' statistics tell both."""
    import io

    import numpy as np
    import pyarrow as pa
    from PIL import Image

    from training.data import DataError
    from training.data.formats import inspect
    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(png, format="PNG")
    images = pa.array([png.getvalue()] * 64, pa.binary())
    train = _write(tmp_path / "train", images, [i % 4 for i in range(64)])
    nulls = _write(tmp_path / "nulls", images, [None] + [i % 4 for i in range(1, 64)])
    with pytest.raises(YarnappError) as e:
        preflight.check_data(_job(nulls), "job.yaml")
    assert str(e.value) == (f"job.yaml: training.data.train: {nulls}/part-0.parquet: 1 row(s) without a label (null "
                            f"in column 'label', its footer's statistics); drop those rows, or give each a label")
    # written without statistics: its label column is read (a null label was a bare "cannot
    # convert float NaN to integer" in every rank; -1 named only the directory)
    for labels, says in (([None] + [i % 4 for i in range(1, 64)], "1 row(s) without a label (null in column "
                          "'label'); drop those rows, or give each a label"),
                         ([-1] + [i % 4 for i in range(1, 64)], "its labels run from -1 to 3 (its label column); "
                          "labels must be class indices >= 0")):
        bare = _write(tmp_path / f"bare{len(says)}", images, labels, statistics=False)
        for check in (lambda: preflight.check_data(_job(bare), "job.yaml"), lambda: inspect(bare)):
            with pytest.raises((YarnappError, DataError)) as e:       # at submit, and in the ranks
                check()
            assert f"{bare}/part-0.parquet: " in str(e.value) and \
                (says in str(e.value) or "labels must be class indices >= 0, found -1" in str(e.value)), e.value
    one_based = _write(tmp_path / "one-based", images, [1 + i % 4 for i in range(64)])
    with pytest.raises(YarnappError) as e:
        preflight.check_data(_job(train, one_based), "job.yaml")
    assert str(e.value) == (f"job.yaml: training.data.test: {one_based}: its labels go up to 4 (5 classes), the "
                            f"training set's ({train}) to 3: the model has 4 outputs; give a test set of the "
                            f"training set's classes")
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(_job(one_based, train), "job.yaml")    # the test set's classes are among them: fine
    assert [r.getMessage() for r in caplog.records] == [
        "training.data.train: its labels start at 1 (the footers' statistics): class 0 gets an output and no "
        "image; labels are class indices from 0 (subtract 1 if they count from 1)"]
    # labels 0, 100000, ... (ids, not indices): a classifier of 300001 outputs, killed for memory in the ranks
    sparse = _write(tmp_path / "sparse", images, [100000 * (i % 4) for i in range(64)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(_job(sparse), "job.yaml")
    assert [r.getMessage() for r in caplog.records] == [
        "training.data.train: its labels run up to 300000 (the footers' statistics): the model gets 300001 outputs, "
        "more than the 64 rows; labels are class indices 0 to K-1: map them to those"]


def test_row_groups_read_in_parts_many_times_over_are_warned_of(tmp_path, caplog, monkeypatch):
    """A row group bigger than a block (formats.MAX_BLOCK_BYTES, 32 MiB; 1 MiB here) is read
    in row ranges, each from the row group's start: an audit's 295 MiB row groups (Spark's
    block size) read 10x the data an epoch, with nothing said but `status --json`'s counters."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from training.data import formats
    monkeypatch.setattr(formats, "MAX_BLOCK_BYTES", 1 << 20)
    n, width = 5600, 3 * 16 * 16                        # 4.1 MiB of raw pixels
    px = np.random.default_rng(0).integers(0, 256, (n, width), dtype=np.uint8)
    table = pa.table({"image": pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(px)]),
                      "label": pa.array(np.arange(n) % 4, pa.int64())})
    (tmp_path / "one").mkdir()
    pq.write_table(table, tmp_path / "one" / "part-0.parquet", row_group_size=n, compression="none")
    job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                         "training": {"data": {"train": str(tmp_path / "one"), "shape": [3, 16, 16]}}})
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(job, "job.yaml")
    assert caplog.messages == [
        f"job.yaml: training.data.train: row groups of up to 4 MiB ({tmp_path / 'one'}) are read in parts of 1 MiB, "
        f"each from its row group's start, so an epoch reads about 3.0x the data's 4 MiB; write row groups of at "
        f"most 1 MiB (pyarrow's row_group_size, Spark's parquet.block.size)"], caplog.messages
    pq.write_table(table, tmp_path / "one" / "part-0.parquet", row_group_size=n // 8, compression="none")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(job, "job.yaml")                   # row groups of 0.5 MiB: read once
    assert caplog.messages == []


def test_labels_from_partition_directories_with_a_small_shuffle_window_are_warned_of(tmp_path, caplog):
    """Spark's partitionBy("label") puts one class in every row group, and a batch draws from
    one shuffle window: a window of 2 row groups would train on batches of 1-2 of 4 classes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, width = 2 * 670, 3 * 16 * 16             # 2 row groups of 0.49 MiB a class
    for label in range(4):
        px = np.random.default_rng(label).integers(0, 256, (n, width), dtype=np.uint8)
        (tmp_path / "ds" / f"label={label}").mkdir(parents=True)
        pq.write_table(pa.table({"image": pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n,
                                                                               [None, pa.py_buffer(px)])}),
                       tmp_path / "ds" / f"label={label}" / "part-0.parquet", row_group_size=n // 2,
                       compression="none")

    def warned(window):
        job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                             "training": {"data": {"train": str(tmp_path / "ds"), "shape": [3, 16, 16],
                                                   "shuffle_window": window}}})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
            preflight.check_data(job, "job.yaml")
        return caplog.messages
    assert warned("1 MiB") == [
        "job.yaml: training.data.train: its classes come from partitionBy's directories, so each row group holds "
        "one class, and a batch draws from a shuffle window of about 2 row groups (1 MiB) for 4 classes; raise "
        "training.data.shuffle_window to 4 MiB or more, write smaller row groups, or write the data shuffled, "
        "without partitionBy"]
    assert warned("4 MiB") == []               # the whole dataset: one window


def test_a_test_set_whose_class_directories_mean_other_labels_is_refused_before_anything_starts(tmp_path):
    """partitionBy("cname") with the label in the files: the client knew no class names
    (footers only), so a test set with two names swapped started every container to fail."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(split, names):
        for label, name in enumerate(names):
            (tmp_path / split / f"cname={name}").mkdir(parents=True)
            pq.write_table(pa.table({"image": pa.array([bytes([label] * 4)] * 3, pa.binary(4)),
                                     "label": pa.array([label] * 3, pa.int64())}),
                           tmp_path / split / f"cname={name}" / "part-0.parquet")
    write("train", ["zero", "one", "two"])
    write("test", ["zero", "two", "one"])

    def job(test):
        return conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                              "training": {"batch_size": 3, "data": {
                                  "train": str(tmp_path / "train"), "test": str(tmp_path / test),
                                  "shape": [1, 2, 2], "columns": {"class_name": "cname"}}}})
    with pytest.raises(YarnappError, match=r"^job.yaml: training.data.test: .*test: its label 1 is class 'two', in "
                                           r"the training set \(.*train\) 'one'"):
        preflight.check_data(job("test"), "job.yaml")
    write("test2", ["zero", "one"])                 # fewer classes, the same names: fine
    preflight.check_data(job("test2"), "job.yaml")


def test_a_dataset_of_very_many_rows_is_warned_of_for_its_epoch_orders(tmp_path, caplog, monkeypatch):
    """A rank keeps the order of its rows for two epochs (training.data.order, 4 bytes a
    row), outside training.data.memory: where that passes an eighth of its container,
    submit says so (a fraction lowered here, for a dataset of 64 rows)."""
    import io

    import numpy as np
    import pyarrow as pa
    from PIL import Image

    from training.data.order import Order
    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(png, format="PNG")
    train = _write(tmp_path / "train", pa.array([png.getvalue()] * 64, pa.binary()), [i % 4 for i in range(64)])
    assert Order([160_000_000], window_bytes=64 << 20).plan_bytes(512, 256) > 1024 << 20 >> 3    # 160M rows: warned
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(_job(train), "job.yaml")
    assert not caplog.records
    monkeypatch.setattr(preflight, "ORDER_FRACTION", 1e-5)
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        preflight.check_data(_job(train), "job.yaml")
    assert [r.getMessage() for r in caplog.records] == [
        "job.yaml: training.data.train: its 64 rows are many for group 'w': each of its ranks keeps the order of "
        "its rows for 2 epochs, about 12 MiB beside the data it holds (training.data.memory), of its "
        "container's 1024 MiB; raise groups[0].memory if it is killed for memory"]


def test_images_too_small_for_a_built_in_model_are_refused_before_anything_starts(tmp_path):
    """1x1 images for digits_cnn (it pools twice) started the containers, and every rank
    failed at setup: the least size is known without torch (conf.schema.BUILTIN_MIN_HW)."""
    import pyarrow as pa
    tiny = _write(tmp_path / "tiny", pa.array([bytes([i]) for i in range(64)], pa.binary(1)), [i % 2 for i in range(64)])
    job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                         "training": {"model": "digits_cnn", "data": {"train": tiny, "shape": [1, 1, 1]}}})
    with pytest.raises(YarnappError) as e:
        preflight.check_data(job, "job.yaml")
    assert str(e.value) == ("job.yaml: training.model: digits_cnn takes images of at least 2x2, and "
                            "training.data.train's come out 1x1; make them larger in training.data.augment and "
                            "test_transforms alike (resize), or give another model")
    preflight.check_data(job.model_copy(update={"training": job.training.model_copy(update={"model": "mlp"})}),
                         "job.yaml")                                        # the MLP takes them


def test_a_class_name_column_no_split_has_is_refused_where_the_metadata_names_the_classes(digits):
    """digits' metadata names its classes, so read_footers drops a class-name column the
    files lack (a training set with it, beside a test set imported by yarnapp): a misspelt
    name was ignored without a word, and the run SUCCEEDED with the metadata's names."""
    def job(column):
        return conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1}],
                              "training": {"data": {"train": f"{digits}/train", "test": f"{digits}/test",
                                                    "columns": {"class_name": column}}}})
    with pytest.raises(YarnappError, match=r"^job.yaml: training.data.columns.class_name: no column 'nosuch' in "
                                           r"training.data.train \(.*\) or test, whose metadata names the classes"):
        preflight.check_data(job("nosuch"), "job.yaml")
    preflight.check_data(job(None), "job.yaml")


def test_a_container_leaving_its_rank_little_beside_its_data_memory_is_warned_of(digits, caplog):
    """The kernel killed 448-640 MiB containers of the built-in runner at the default data
    memory (a quarter of the container), nothing said before: a data-at-scale audit."""
    def job(memory, held=None):
        return conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1, "memory": memory}],
                              "training": {"data": {"train": f"{digits}/train",
                                                    **({"memory": held} if held else {})}}})
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        advice.warn_little_beside_data(job("512 MiB"), "job.yaml")
    assert ("job.yaml: groups[0].memory: 512 MiB leaves 384 MiB beside the 128 MiB of data its ranks hold "
            "(training.data.memory: a quarter of it)") in caplog.text, caplog.text
    from training.data.source import MEMORY_FRACTION
    assert advice.DATA_FRACTION == MEMORY_FRACTION          # (the client's copy, without pyarrow)
    for fits in (job("1 GiB"), job("512 MiB", "32 MiB")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
            advice.warn_little_beside_data(fits, "job.yaml")
        assert "beside the" not in caplog.text, caplog.text


def test_gpus_a_built_in_runners_container_holds_and_leaves_idle_are_warned_of(caplog):
    """`gpus: 2` in one container dry-ran on both backends without a word, and its rank
    computed on cuda:0 alone (a migration audit: TonY users ask for a node's GPUs at once)."""
    def job(gpus, **run):
        return conf.load_job({"name": "t", "groups": [{"name": "g", "instances": 1, "gpus": gpus}],
                              **({"run": run} if run else {"training": {"data": {"train": "/d/train"}}})})
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        advice.warn_idle_gpus(job(2), "job.yaml")
    assert ("job.yaml: groups[0].gpus: 2: the built-in runner's rank computes on one GPU of its container, and the "
            "other 1 stay idle; give the group 2 times the instances with gpus: 1 each") in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yarnapp.preflight"):
        advice.warn_idle_gpus(job(1), "job.yaml")
        advice.warn_idle_gpus(job(4, script=__file__), "job.yaml")     # own code may use them all
    assert caplog.text == ""
