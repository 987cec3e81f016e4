"""Bad job.yaml files: one clear line naming the file and field, non-zero exit, nothing started."""
import json
import os
import re
import shutil

import numpy as np
import psutil
import pytest
import yaml

import conf
from util import app_id_from, apps

pytestmark = pytest.mark.e2e

GOOD = {"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1, "memory": "256 MiB"}],
        "run": {"function": "training.hello:main"}}


def _with(path, value):
    """GOOD with the dotted `path` set to value (None deletes it)."""
    job = yaml.safe_load(yaml.safe_dump(GOOD))
    node, parts = job, path.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else node[p]
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return job


_DELETE = object()

# (case id, job dict or raw text, field path expected in the message, words expected)
CASES = [
    ("unknown-top-key", _with("nmae", "x"), "nmae", "unknown field; did you mean 'name'?"),
    ("unknown-group-key", _with("groups.0.vcorez", 2), "groups[0].vcorez", "unknown field; did you mean 'vcores'?"),
    ("unknown-far-key", _with("zzz", 2), "zzz", "unknown field; remove it or check its spelling"),
    # from a DDP user's pass: GiB meant, read as MiB, died in 2 s; a YAML number among the script's arguments
    ("memory-bare-small", _with("groups.0.memory", 2), "groups[0].memory",
     "2 is read as 2 MiB (a bare number is MiB, as on YARN), too little for a container; write 2 GiB"),
    ("no-run-no-training", {k: v for k, v in GOOD.items() if k != "run"}, "training",
     "give a training: section, or run.script or run.function for your own code"),
    # a section's field one level too high: named where it goes (was "remove it or check its spelling")
    ("section-field-at-top", _with("epochs", 3), "epochs", "unknown field here; it is training.epochs"),
    ("data-field-in-training", {**GOOD, "training": {"data": {"train": "x"}, "shuffle_window": 64}},
     "training.shuffle_window",
     "unknown field here; it is training.data.shuffle_window"),
    ("no-groups", _with("groups", []), "groups", "at least one"),
    ("zero-instances", _with("groups.0.instances", 0), "groups[0].instances", "greater than or equal to 1"),
    ("string-instances", _with("groups.0.instances", "3"), "groups[0].instances", "integer"),
    ("memory-gigs", _with("groups.0.memory", "4 gigs"), "groups[0].memory", "cannot parse"),
    ("memory-zero", _with("groups.0.memory", 0), "groups[0].memory", "more than 0"),
    ("memory-negative", _with("groups.0.memory", "-1 GiB"), "groups[0].memory", "cannot parse"),
    ("vcores-zero", _with("groups.0.vcores", 0), "groups[0].vcores", "greater than or equal to 0.01 (got 0)"),
    ("negative-gpus", _with("groups.0.gpus", -1), "groups[0].gpus", "greater than or equal to 0"),
    ("duplicate-groups", _with("groups", [GOOD["groups"][0], GOOD["groups"][0]]), "groups", "duplicate"),
    ("bad-group-name", _with("groups.0.name", "Worker Group"), "groups[0].name", "lower-case"),
    ("env-boolean", _with("groups.0.env", {"A": True}), "groups[0].env", "A: a boolean"),       # a number is its text
    ("env-not-text", _with("groups.0.env", {"A": [1]}), "groups[0].env.A", "string"),
    ("bad-function", _with("run.function", "no_colon"), "run.function", "module:function"),
    ("function-in-a-file", _with("run.function", "mytrain.py:main"), "run.function",     # passed, failed in the ranks
     "names a file; name its module as Python imports it: mytrain:main"),
    ("function-and-script", _with("run.script", "x.py"), "run", "not function and script"),
    ("negative-restarts", _with("max_restarts", -1), "max_restarts", "greater than or equal to 0"),
    ("bad-backend", _with("backend", "k8s"), "backend", "local"),
    ("bad-duration", _with("launcher", {"heartbeat_timeout": "soon"}), "launcher.heartbeat_timeout", "duration"),
    ("training-missing", _with("run.function", "training.runner:main"), "training", "required"),
    ("bad-strategy", dict(_with("run.function", "training.runner:main"),
                          training={"strategy": "magic", "data": {"train": "/x"}}), "training.strategy", "allreduce"),
    ("strategy-field-of-another", dict(_with("run.function", "training.runner:main"),
                                       training={"strategy": {"name": "allreduce", "split": [1]},
                                                 "data": {"train": "/x"}}),
     "training.strategy.split", "not a field of strategy allreduce"),
    ("strategy-without-name", dict(_with("run.function", "training.runner:main"),
                                   training={"strategy": {"split": [1]}, "data": {"train": "/x"}}),
     "training.strategy", "give a strategy name"),
    ("split-count", dict(_with("run.function", "training.runner:main"),
                         training={"strategy": {"name": "conv_model_parallel", "split": [2, 1]},
                                   "data": {"train": "/x"}}), "training.strategy.split", "2 weights given for 1"),
    ("model-typo", dict(_with("run.function", "training.runner:main"),      # before: failed in the containers
                        training={"model": "digits_cnnn", "data": {"train": "/x"}}), "training.model",
     "'digits_cnnn' is neither a built-in model (digits_cnn, seed_cnn, resnet, mlp) nor a 'package.module:factory'"),
    ("zero-batch", dict(_with("run.function", "training.runner:main"),
                        training={"batch_size": 0, "data": {"train": "/x"}}), "training.batch_size", "1"),
    ("shares-count", dict(_with("run.function", "training.runner:main"),
                          training={"shares": [1, 2], "data": {"train": "/x"}}), "training.shares", "2 shares"),
    ("data-neither", dict(_with("run.function", "training.runner:main"), training={"data": {}}),
     "training.data", "give train"),
    ("data-bad-op", dict(_with("run.function", "training.runner:main"),
                         training={"data": {"train": "/x", "augment": ["hflip", {"crop": {"size": 3}}]}}),
     "training.data.augment[1]", "unknown op 'crop'"),
    ("data-bad-option", dict(_with("run.function", "training.runner:main"),
                             training={"data": {"train": "/x", "augment": [{"random_crop": {"size": 32, "pad": 4}}]}}),
     "training.data.augment[0].random_crop", "unknown option 'pad'"),
    ("data-bad-scale", dict(_with("run.function", "training.runner:main"),
                            training={"data": {"train": "/x", "test_transforms": [
                                {"random_resized_crop": {"size": 8, "scale": [0.5, 2]}}]}}),
     "training.data.test_transforms[0].random_resized_crop", "scale"),
    ("data-mean-alone", dict(_with("run.function", "training.runner:main"),
                             training={"data": {"train": "/x", "mean": [1, 2, 3]}}), "training.data", "mean and std"),
    ("data-window", dict(_with("run.function", "training.runner:main"),
                         training={"data": {"train": "/x", "shuffle_window": "lots"}}),
     "training.data.shuffle_window", "cannot parse"),
    ("data-factory", dict(_with("run.function", "training.runner:main"),
                          training={"data": {"dataset": "nocolon"}}), "training.data.dataset", "module:function"),
    ("data-missing", dict(_with("run.function", "training.runner:main"),
                          training={"data": {"train": "/nonexistent-yarnapp-data/train"}}),
     "training.data.train", "no dataset at /nonexistent-yarnapp-data/train"),
    ("data-bad-scheme", dict(_with("run.function", "training.runner:main"),
                             training={"data": {"train": "nosuch://host/train"}}), "training.data.train",
     "cannot open nosuch://host/train"),
    # a module neither installed nor shipped (before: the containers started, and failed importing it)
    ("function-module-missing", _with("run.function", "no_module_of_yarnapp_tests:main"), "run.function",
     "no_module_of_yarnapp_tests:main: no module named 'no_module_of_yarnapp_tests' in this environment or in "
     "what the job ships; install it, or ship it with the job (run.files"),
    ("function-of-main", _with("run.function", "__main__:train"), "run.function",     # a notebook's function
     "a function of a notebook or of the running script is shipped by value: yarnapp.submit(job, function=train)"),
    ("model-module-missing", dict(_with("run.function", "training.runner:main"),
                                  training={"model": "no_nets_of_yarnapp_tests:build",
                                            "data": {"dataset": "training.hello:main"}}), "training.model",
     "no module named 'no_nets_of_yarnapp_tests'"),
    # a factory the options cannot call (before: every rank failed on it)
    ("model-factory-options", dict(_with("run.function", "training.runner:main"),
                                   training={"model": "torch.nn:Linear", "model_options": {"in_features": 64},
                                             "data": {"dataset": "training.hello:main"}}), "training.model",
     "cannot call Linear with ['in_features']: missing a required argument: 'out_features'; fix "
     "training.model_options"),
    ("dataset-module-missing", dict(_with("run.function", "training.runner:main"),
                                    training={"data": {"dataset": "no_sets_of_yarnapp_tests.sub:make"}}),
     "training.data.dataset", "no module named 'no_sets_of_yarnapp_tests'"),
    ("script-missing", {**GOOD, "run": {"script": "/nonexistent-yarnapp/train.py"}}, "run.script",
     "/nonexistent-yarnapp/train.py does not exist"),
    ("script-a-directory", {**GOOD, "run": {"script": "/tmp"}}, "run.script", "/tmp is a directory"),
    ("key-twice", "name: t\ngroups: [{name: w, instances: 1}]\nrun: {function: a:b}\nrun: {function: c:d}\n",
     ":4:1", "the key 'run' is given twice"),
    ("not-utf8", "name: caf\xe9\n".encode("latin-1"), "", "not UTF-8 text (byte 0xe9 at offset 9)"),
    ("tensorboard-group", dict(_with("groups.0.name", "tensorboard"), tensorboard={"service": True}),
     "groups[0].name", "names the TensorBoard service"),
    ("not-a-mapping", "- just\n- a list\n", "", "mapping"),
    ("yaml-syntax", "name: t\ngroups: [\n", ":", "not valid YAML"),
    ("gpus-unavailable", _with("groups.0.gpus", 64), "groups[0].gpus", "this machine has"),
    ("vcores-too-many", _with("groups.0.vcores", 4096), "groups[0].vcores", "this machine has"),
    ("shares-weight", dict(_with("run.function", "training.runner:main"),
                           training={"shares": [1, 0], "data": {"train": "/nonexistent-yarnapp-data/train"}}),
     "training.shares", "weight [1] must be a finite number > 0, got 0"),
    # non-finite numbers (before: .inf passed, job.json wrote it as null, and the master died)
    ("lr-inf", dict(_with("run.function", "training.runner:main"),
                    training={"lr": float("inf"), "data": {"train": "/x"}}), "training.lr",
     "must be a finite number (got inf)"),
    ("shares-inf", dict(_with("run.function", "training.runner:main"),
                        training={"shares": [float("inf")], "data": {"train": "/x"}}), "training.shares",
     "weight [0] must be a finite number > 0, got inf"),
    ("memory-inf", _with("groups.0.memory", float("inf")), "groups[0].memory", "must be a finite size"),
    # a training section beside the user's own function (it asked for training.data)
    ("training-beside-own-code", dict(GOOD, training={"epochs": 2}), "training",
     "only the built-in runner (run.function: training.runner:main) reads this section, and your own code runs"),
    # under CFS's least quota (before: the kernel refused it, and both limits were dropped)
    ("vcores-too-few", _with("groups.0.vcores", 0.005), "groups[0].vcores", "greater than or equal to 0.01"),
    # own code resumes from its own snapshots: before, --resume latest was accepted and did nothing
    ("resume-own-code", dict(GOOD, checkpoint={"resume": "latest"}), "checkpoint.resume",
     "'latest' is for the built-in runner, which writes the checkpoints it resumes from"),
    # each container fits, all of them do not (before: 200 x 1 vcore started ~400 processes)
    ("vcores-in-all", _with("groups.0.instances", max(os.cpu_count() or 1, 8) + 1), "groups",
     f"containers ask for {max(os.cpu_count() or 1, 8) + 1} vcores in all"),
    # from a bad-input audit: each started the application, which failed (a traceback, "FAILED: unknown")
    ("seed-too-big", _with("run.function", "training.runner:main") | {"training": {"data": {"train": "x"},
                                                                                  "seed": 10 ** 23}},
     "training.seed", "out of torch's range for a seed, -2**63 to 2**64-1"),
    ("env-name-with-equals", _with("groups.0.env", {"A=B": "x"}), "groups[0].env",
     "'A=B' is not an environment variable's name"),
    ("env-value-nul", _with("groups.0.env", {"A": "x\0y"}), "groups[0].env", "A: its value holds a NUL byte"),
    # a limit no longer than a look can never be kept; a look an hour apart never ended the job
    ("heartbeat-1ms", _with("launcher", {"heartbeat_timeout": "1ms"}), "launcher",
     "heartbeat_timeout: 0.001s is not longer than poll_interval (0.2s)"),
    ("poll-an-hour", _with("launcher", {"poll_interval": "1h"}), "launcher", "give at most 10s"),
    # '' was the submit directory: checkpoints written there, the whole directory shipped
    ("checkpoint-uri-empty", _with("checkpoint", {"uri": ""}), "checkpoint.uri", "empty: give a path or URI"),
    ("files-empty", _with("run.files", [""]), "run.files[0]", "empty: give a path or URI"),
    # a URI was joined to the submit directory ("/tmp/x/hdfs:/user/a/v.txt does not exist")
    ("files-uri", _with("run.files", ["hdfs:///user/a/vocab.txt"]), "run.files[0]",
     "hdfs:///user/a/vocab.txt is a URI; run.files ships files and directories of this machine only"),
    # from a job-reference audit: each was accepted and ignored, or read as 256 TiB, without a word
    ("args-of-a-function", _with("run.args", ["--x"]), "run.args", "only run.script reads them"),
    ("data-memory-in-bytes", {**GOOD, "run": {"function": "training.runner:main"},
                              "training": {"data": {"train": "x", "memory": 268435456}}}, "training.data.memory",
     "268435456 MiB, not less than the 256 MiB of group 'w''s containers"),
    ("train-empty", {**GOOD, "run": {"function": "training.runner:main"}, "training": {"data": {"train": ""}}},
     "training.data.train", "empty: give a path or URI"),
    ("test-empty", {**GOOD, "run": {"function": "training.runner:main"},
                    "training": {"data": {"train": "x", "test": ""}}}, "training.data.test",
     "empty: give a path or URI"),
    ("memory-in-all", {**GOOD, "groups": [{"name": "w", "instances": 2, "vcores": 0.5,
                                           "memory": f"{psutil.virtual_memory().total * 6 // 10 // 2**20} MiB"}]},
     "groups", "of memory in all"),
]


@pytest.mark.parametrize("case,job,field,words", CASES, ids=[c[0] for c in CASES])
def test_bad_job_is_one_clear_line_and_starts_nothing(case, job, field, words, tmp_path, cli, yarnapp_home):
    path = tmp_path / f"{case}.yaml"
    if isinstance(job, bytes):
        path.write_bytes(job)
    else:
        path.write_text(job if isinstance(job, str) else yaml.safe_dump(job))
    proc = cli("submit", path, "--wait", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith(f"Error: {path}"), line
    assert field in line and words in line, line
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert apps(yarnapp_home) == [], "an application was created for a bad job"


def test_a_corrupt_or_wrong_dataset_is_refused_before_anything_starts(tmp_path, cli, yarnapp_home, digits):
    """The client reads every file's footer before starting containers: a file that is not
    Parquet, a dataset without the job's image column, or labels outside the classes (the
    footer's statistics; before, a rank found them mid-epoch and every restart was spent
    on them) is one line naming the field and the file, and no application."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    bad = tmp_path / "bad"
    shutil.copytree(os.path.join(digits, "train"), bad)
    (bad / "part-zz.parquet").write_bytes(b"not parquet at all")
    shifted = tmp_path / "shifted"
    shutil.copytree(os.path.join(digits, "train"), shifted)
    victim = sorted(shifted.iterdir())[0]
    table = pq.read_table(victim)
    table = table.set_column(table.schema.get_field_index("label"), "label", pc.add(table["label"], 100))
    pq.write_table(table, victim)
    cases = [({"train": os.path.join(digits, "train"), "test": str(bad)}, "training.data.test",
              f"{bad / 'part-zz.parquet'}: not a readable Parquet file"),
             ({"train": os.path.join(digits, "train"), "columns": {"image": "pixels"}}, "training.data.train",
              "no image column 'pixels'"),
             # a shape other than its metadata's: the pixels were read in that geometry, and trained on
             ({"train": os.path.join(digits, "train"), "shape": [1, 4, 16]}, "training.data.train",
              "training.data.shape [1, 4, 16] is not the shape its metadata gives, [1, 8, 8]; leave "
              "training.data.shape out"),
             ({"train": str(shifted)}, "training.data.train",
              f"{victim}: its labels run from 100 to 109 (its footer's statistics), outside the 10 classes the "
              f"dataset's metadata gives (0 to 9)")]
    for data, field, words in cases:
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"), training={"data": data})))
        proc = cli("submit", job, "--wait", timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"Error: {job}: {field}: ") and words in proc.stderr, proc.stderr
        assert apps(yarnapp_home) == [], "an application was created for a dataset that cannot be read"


def test_a_model_option_of_the_wrong_kind_or_an_unknown_layer_is_refused_before_anything_starts(
        tmp_path, cli, yarnapp_home, digits):
    """The client checked the options' names only, and conv-MP's layers not at all: the
    containers started and every rank failed on them. The model is built on torch's meta
    device for the images' size, which allocates nothing."""
    train = os.path.join(digits, "train")
    cases = [({"model": "mlp", "model_options": {"hidden": "big"}}, "training.model_options: mlp: option hidden "
              "must be a positive integer, got 'big'"),
             ({"strategy": {"name": "conv_model_parallel", "layers": ["conv9"]}}, "training.strategy.layers: "
              "['conv9'] are not Conv2d layers of model 'digits_cnn'; its Conv2d layers are ['conv1', 'conv2']")]
    job = tmp_path / "job.yaml"
    for training, words in cases:
        job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"),
                                           training={"data": {"train": train}, **training})))
        proc = cli("submit", job, "--wait", timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr == f"Error: {job}: {words}\n", proc.stderr
        assert apps(yarnapp_home) == []
    job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"), training={
        "data": {"train": train}, "model_options": {"hidden": 32},
        "strategy": {"name": "conv_model_parallel", "layers": ["conv2"]}})))
    assert cli("submit", job, "--dry-run", timeout=60).returncode == 0


def test_a_model_of_the_users_own_that_its_strategy_cannot_run_is_refused_before_anything_starts(
        tmp_path, cli, yarnapp_home, digits):
    """A model factory shipped with run.files, built at submit as the containers import it:
    BatchNorm under the hypergraph strategy (before, it failed in the containers at the
    first step and was tried max_restarts + 1 times), a grouped conv named in conv-MP's
    layers (a ValueError with its traceback in every container)."""
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "user_model.py")
    base = dict(_with("run.function", "training.runner:main"))
    base["run"]["files"] = [model]
    cases = [("hypergraph", "training.strategy: the hypergraph partitioner cannot place BatchNorm2d (layer '1'): "
              "it handles chains of Conv2d / Linear layers"),
             ({"name": "conv_model_parallel", "layers": ["3"]}, "training.strategy.layers: 3: grouped convolutions "
              "(groups=4) cannot be split by output channel; leave it out (the layers that can be split: ['0'])")]
    job = tmp_path / "job.yaml"
    for strategy, words in cases:
        job.write_text(yaml.safe_dump(dict(base, training={"data": {"train": os.path.join(digits, "train")},
                                                           "model": "user_model:make_bn_net", "strategy": strategy})))
        proc = cli("submit", job, "--wait", timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr.startswith(f"Error: {job}: {words}") and proc.stderr.count("\n") == 1, proc.stderr
        assert apps(yarnapp_home) == []


def test_a_conv_with_fewer_kernels_than_ranks_stays_whole_or_is_refused_by_its_field(tmp_path, cli, yarnapp_home,
                                                                                     digits):
    """conv1 of 2 kernels on 3 ranks: conv-MP's layers (every one that can be split) took it,
    and every rank failed at the first step with proportional_split's ValueError and its
    traceback, max_restarts + 1 times. It stays whole on the master now; named in `layers`,
    it is refused at submit."""
    from training.models import build_model
    from training.strategies.conv_mp.strategy import select_layers
    assert select_layers(build_model("digits_cnn", (1, 8, 8), 10, {"conv1": 2}), None, ranks=3) == ["conv2"]
    raw = {"name": "few", "groups": [{"name": "w", "instances": 3, "vcores": 0.5, "memory": "512 MiB"}],
           "training": {"data": {"train": os.path.join(digits, "train")}, "model": "digits_cnn",
                        "model_options": {"conv1": 2}, "strategy": {"name": "conv_model_parallel", "layers": ["conv1"]}}}
    job = tmp_path / "few.yaml"
    job.write_text(yaml.safe_dump(raw))
    proc = cli("submit", job, "--dry-run", timeout=60)
    assert proc.returncode == 1 and proc.stderr == (
        f"Error: {job}: training.strategy.layers: conv1: its 2 kernel(s) cannot give each of 3 ranks one; leave it "
        f"out (the layers that can be split: ['conv2'])\n"), proc.stderr
    assert apps(yarnapp_home) == []


def test_images_that_would_come_out_in_other_sizes_are_refused_before_anything_starts(tmp_path, cli, yarnapp_home,
                                                                                         digits):
    """A crop larger than digits' 8x8 images in training.data.augment alone, and a test set of
    6x6 images: before, the application started and its ranks failed on it."""
    from training.data import import_arrays
    small = str(tmp_path / "small")
    import_arrays(small, np.zeros((8, 1, 6, 6), np.uint8), np.arange(8) % 10)
    train = os.path.join(digits, "train")
    cases = [({"train": train, "augment": [{"random_crop": {"size": 12}}]}, "training.data.augment: training "
              "images come out [1, 12, 12], untransformed ones [1, 8, 8] (training.data.test_transforms); make them "
              "the same size: the model also sees images through test_transforms (evaluation, the speed probe, "
              "Run.model().predict), with or without a test set"),
             ({"train": train, "test": small}, "training.data.test: its images come out [1, 6, 6] for the model, "
              "the training set's [1, 8, 8]; give a test set of the same size, or resize it in "
              "training.data.test_transforms"),
             # three channels' mean/std for one-channel images (the ranks said it, once started)
             ({"train": train, "mean": [0.5, 0.5, 0.5], "std": [1, 1, 1]}, f"training.data.mean/std: 3 values each, "
              f"for images of 1 channel(s) ({train}); give one per channel")]
    for data, words in cases:
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"), training={"data": data})))
        proc = cli("submit", job, "--wait", timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr == f"Error: {job}: {words}\n", proc.stderr
        assert apps(yarnapp_home) == []
    data = {"train": train, "test": small, "test_transforms": [{"resize": {"size": 8}}]}   # the fix it names
    job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"), training={"data": data})))
    assert cli("submit", job, "--dry-run", timeout=60).returncode == 0
    # torchvision's ops are the containers' (their environment may have torchvision where the
    # client has none): not built here, and the sizes not checked
    data = {"train": train, "augment": [{"random_crop": {"size": 12}}, {"torchvision.NoSuchOp": {}}]}
    job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"), training={"data": data})))
    assert cli("submit", job, "--dry-run", timeout=60).returncode == 0


def test_a_shuffle_window_a_step_of_which_overflows_a_ranks_data_memory_is_refused(tmp_path, cli, yarnapp_home):
    """Before, such a rank went over its data budget on every step: with a 2 GiB window, batch
    256 and 768 MiB containers (a 382 MiB dataset) the kernel killed it, and the line said
    only to raise groups[].memory. The window it names fits."""
    from training.data import import_arrays
    train = str(tmp_path / "train")
    import_arrays(train, np.zeros((3000, 3, 32, 32), np.uint8), np.arange(3000) % 10)   # 9 MB, 2 MiB row groups
    job = tmp_path / "job.yaml"

    def submit(**data):
        job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"), training={
            "batch_size": 64, "data": {"train": train, "memory": "6 MiB", **data}})))
        return cli("submit", job, "--dry-run", timeout=60)
    proc = submit()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == (f"Error: {job}: training.data.shuffle_window: a step of group 'w' reads 64 rows of each "
                           f"batch of 64 from about 9 MiB of training.data.train's row groups, more than the 6 MiB "
                           f"its ranks hold data in (training.data.memory); lower training.data.shuffle_window to "
                           f"2 MiB or less, or raise training.data.memory to 9 MiB\n"), proc.stderr
    assert apps(yarnapp_home) == []
    assert submit(shuffle_window="2 MiB").returncode == 0
    assert submit(memory="9 MiB").returncode == 0


def test_a_dry_run_checks_the_data_as_submit_does(tmp_path, cli, yarnapp_home, digits):
    job = tmp_path / "job.yaml"
    # relative to where submit runs (the cli fixture's: the project), shown as submit resolves it
    rel = os.path.relpath(os.path.join(digits, "train"), os.path.dirname(os.path.dirname(conf.__file__)))
    for train, rc in (("/nonexistent-yarnapp-data/train", 1), (rel, 0)):
        job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"),
                                           training={"data": {"train": train}})))
        proc = cli("submit", job, "--dry-run", timeout=60)
        assert proc.returncode == rc, proc.stdout + proc.stderr
        if rc:
            assert proc.stderr.strip() == (f"Error: {job}: training.data.train: no dataset at {train}: it does "
                                           f"not exist; import one with `yarnapp data import KIND URI`")
    assert proc.stdout.startswith(f"# {job}: the resolved job") and f"train: {digits}/train" in proc.stdout
    assert apps(yarnapp_home) == []


def test_missing_job_file(cli, yarnapp_home, tmp_path):
    proc = cli("submit", tmp_path / "nope.yaml")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"Error: {tmp_path / 'nope.yaml'}: no such file"


def test_a_wrong_cli_argument_is_one_line_naming_the_command(cli):
    """argparse printed its usage lines before the error; now one line, exit status 2."""
    for argv, line in [(["submit"], "Error: yarnapp submit: the following arguments are required: job "
                                    "(see `yarnapp submit --help`)"),
                       (["submitt", "job.yaml"], "Error: yarnapp: argument COMMAND: invalid choice: 'submitt' "
                                                 "(choose from 'submit', "),
                       (["data", "import", "digitz", "/tmp/x"], "did you mean 'digits'? "
                                                                "(see `yarnapp data import --help`)"),
                       (["plan", "job.yaml", "--classes", "ten"], "Error: yarnapp plan: argument --classes: "
                                                                  "invalid int value: 'ten'"),
                       (["submit", "job.yaml", "--bogus"], "Error: yarnapp submit: unrecognized arguments: --bogus "
                                                           "(see `yarnapp submit --help`)")]:
        proc = cli(*argv)
        assert proc.returncode == 2 and proc.stdout == "", (argv, proc.stdout + proc.stderr)
        assert proc.stderr.count("\n") == 1 and line in proc.stderr, (argv, proc.stderr)
    assert "did you mean 'submit'?" in cli("submitt", "job.yaml").stderr
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("yarnapp 0."), version.stdout + version.stderr
    proc = cli("status", "app_that_does_not_exist")
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("Error: no application 'app_that_does_not_exist'")
    # a value argparse took for an option ("expected one argument") reaches the option's own check
    proc = cli("clean", "--older-than", "-1d")
    assert proc.returncode == 2 and proc.stderr == "Error: --older-than '-1d': expected a duration such as 12h or " \
                                                   "7d (0: every finished application)\n", proc.stderr


def test_ctrl_c_while_the_command_imports_says_interrupted_without_a_traceback(tmp_path):
    """Ctrl-C in the command's first half second (its imports, before cli.main) printed
    Python's KeyboardInterrupt traceback; later it says "interrupted" and ends 130. Here
    the console script's name runs its first import, and the signal comes after it."""
    import signal
    import subprocess
    import sys
    script = tmp_path / "yarnapp"
    script.write_text("import os, signal, sys, time\nimport yarnapp.cli\n"
                      "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (130, "interrupted\n"), proc.stderr
    later = tmp_path / "later.py"           # another program importing yarnapp keeps Python's own Ctrl-C
    later.write_text(script.read_text())
    proc = subprocess.run([sys.executable, str(later)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGINT and proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr


def test_defaults_resolve_in_one_place():
    job = conf.load_job(GOOD)
    d = conf.defaults()
    assert job.max_restarts == d["max_restarts"] and job.queue == d["queue"]
    assert job.groups[0].gpus == d["group"]["gpus"] and job.groups[0].memory == 256
    assert conf.load_job(GOOD, {"max_restarts": 7}).max_restarts == 7   # flag > job.yaml > defaults


@pytest.mark.parametrize("text,mib", [("512 MiB", 512), ("2 GiB", 2048), ("4 GB", 3815), (1024, 1024),
                                      ("1.5GiB", 1536), ("100000 KiB", 98)])
def test_memory_units(text, mib):
    assert conf.parse_memory_mib(text) == mib


def test_every_example_validates():
    names = [n for n in os.listdir(conf.EXAMPLES_DIR) if n.endswith(".yaml")]
    assert "hello.yaml" in names
    for n in names:
        conf.load_job(os.path.join(conf.EXAMPLES_DIR, n))


def test_an_applications_stored_job_is_read_back_without_checks_added_since():
    """The checks a submit makes since this version (launcher limits, env names, seed range)
    stopped the logs, status, clean and restarts of an application submitted before it,
    whose job.json the engine reads back (a review found `yarnapp logs` failing on one)."""
    raw = dict(GOOD, launcher={"poll_interval": "30s"}, groups=[dict(GOOD["groups"][0], env={"A=B": "x"})],
               network={"subnet": "127.0.0.0/24"})
    with pytest.raises(conf.JobError, match=r"is not an environment variable.s name .* \(and 2 more\)"):
        conf.load_job(raw)
    job = conf.load_job(raw, stored=True)
    assert job.launcher.poll_interval == 30 and job.groups[0].env == {"A=B": "x"}
    assert job.network.subnet == "127.0.0.0/24"


def test_every_example_is_a_valid_job():
    examples = sorted(f for f in os.listdir(conf.EXAMPLES_DIR) if f.endswith(".yaml"))
    assert "cifar_jpeg.yaml" in examples
    for name in examples:
        conf.load_job(os.path.join(conf.EXAMPLES_DIR, name))


@pytest.mark.parametrize("args,words", [
    (["synthetic-cifar", "--n-train", "-5"], "option --n-train=-5 is not a valid value; give a whole number of at least 1"),
    (["synthetic-cifar", "--n-test", "0"], "option --n-test=0 is not a valid value"),       # 0 was the default's
    (["synthetic-cifar", "--shards", "0"], "option --shards=0 is not a valid value"),
    (["digits", "--n-train", "5"], "digits: unknown option --n-train; options are --overwrite, --shards"),
    (["synthetic-cifar", "--encoding", "jpeg", "--quality", "500"], "give a JPEG quality from 1 to 100"),
    (["synthetic-cifar", "--quality", "50"], "option --quality is JPEG's; give --encoding jpeg with it"),
    (["image-folder"], "data import image-folder: give --path"),
    (["arrays"], "data import arrays: give --path"),
])
def test_bad_data_import_arguments_are_one_line_and_write_nothing(args, words, tmp_path, cli):
    proc = cli("data", "import", args[0], tmp_path / "ds", *args[1:], timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_dataset_path_under_a_file_says_so(tmp_path, cli):
    """It said to check that the directory is writable."""
    (tmp_path / "afile").write_text("x")
    proc = cli("data", "import", "digits", tmp_path / "afile" / "ds", timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"Error: cannot write {tmp_path}/afile/ds/train: ") and proc.stderr.endswith(
        "; a part of its path is a file, not a directory: give another path\n"), proc.stderr
    assert os.listdir(tmp_path) == ["afile"]


def test_flags_merge_into_their_section_and_a_bad_value_names_the_file(tmp_path, cli, yarnapp_home):
    """--resume and --nodes set one field of their section (the rest stays the file's);
    a bad value is one line naming the job's file, the field and the flag that gave it
    (an auditor took "job.yaml: checkpoint.resume" for a mistake in the file)."""
    from yarnapp import api
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "run": {"function": "training.runner:main"},
                                    "training": {"data": {"train": "/x"}}, "checkpoint": {"every_steps": 7}}))
    spec = api.load(str(path), checkpoint={"resume": "latest"})
    assert spec.checkpoint.resume == "latest" and spec.checkpoint.every_steps == 7
    for flag, value, field in (("--resume", "bogus", "checkpoint.resume"), ("--nodes", "-1", "network.nodes"),
                               ("--nodes", "99", "network.nodes"),      # found as the nodes are made
                               ("--max-restarts", "-1", "max_restarts")):
        proc = cli("submit", path, flag, value, timeout=60)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"Error: {path}: {field} (given as {flag} {value}): "), proc.stderr
    assert apps(yarnapp_home) == []


def test_job_fields_set_as_key_value_on_the_command_line_reach_the_run_or_name_what_gave_them(
        tmp_path, cli, yarnapp_home):
    """`yarnapp submit job.yaml KEY=VALUE ...` (Hydra's and TonY's `--conf` way; before, only a
    few flags could change a job without editing its file): each sets one field, a group by
    name or index, values read as YAML; a bad one is one line naming what gave it, with
    nothing started. A real run shows the fields reached the containers."""
    hello = os.path.join(conf.EXAMPLES_DIR, "hello.yaml")
    dry = cli("submit", hello, "groups.small.instances=1", "--dry-run", "groups.0={memory: 768 MiB}",
              "max_restarts=2", "launcher={heartbeat_timeout: 30s}", "launcher.idle_timeout=1m", "network.nodes=0",
              check=0)
    job = yaml.safe_load(dry.stdout)        # a mapping merges into the entry or section there
    assert [(g["name"], g["instances"], g["memory"]) for g in job["groups"]] == [("big", 1, 768), ("small", 1, 512)]
    assert job["max_restarts"] == 2 and job["launcher"]["heartbeat_timeout"] == 30, job
    assert job["launcher"]["idle_timeout"] == 60, job
    bad = _with("launcher", {"poll_interval": "5s", "heartbeat_timeout": "2s"})
    (tmp_path / "poll.yaml").write_text(yaml.safe_dump(bad))
    for args, line in (
            (["groups.tiny.vcores=1"], "groups.tiny.vcores=1: groups has no entry named 'tiny' (its names: big, "
                                       "small)"),
            (["groups.2.vcores=1"], "groups.2.vcores=1: groups has 2 entries: index 2 is out of range"),
            (["groups.--1.vcores=1"], "groups.--1.vcores=1: groups has no entry named '--1' (its names: big, small)"),
            (["max_restarts"], "max_restarts: a job field set on the command line is KEY=VALUE with a dotted KEY, "
                               "e.g. training.epochs=3"),
            (["run.args=[a"], "run.args=[a: the value is not valid YAML (expected ',' or ']', but got '<stream "
                              "end>'); quote it"),
            (["name.first=x"], f"name.first=x: {hello}: name is a str ('hello'), with no field 'first'"),
            (["groups.small.vcores=many"], f"{hello}: groups[1].vcores (given as groups.small.vcores=many): "),
            (["groups.0.memory=2"], f"{hello}: groups[0].memory (given as groups.0.memory=2): 2 is read as 2 MiB"),
            (["max_restartz=1"], f"{hello}: max_restartz (given as max_restartz=1): unknown field; did you mean "
                                 f"'max_restarts'?")):
        proc = cli("submit", hello, *args, "--wait", timeout=60)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"Error: {line}"), proc.stderr
    # the file's own mistake is the file's, not a field set beside it in its section
    proc = cli("submit", tmp_path / "poll.yaml", "launcher.idle_timeout=1m", timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith(
        f"Error: {tmp_path / 'poll.yaml'}: launcher: heartbeat_timeout"), proc.stderr
    proc = cli("submit", "training.epochs=3", hello, "--max-restarts", "0", timeout=60)     # fields before the file
    assert proc.stderr == (f"Error: training.epochs=3: not a job file; give the job's file first, then its fields: "
                           f"yarnapp submit {hello} training.epochs=3 --max-restarts 0\n"), proc.stderr
    assert apps(yarnapp_home) == []
    run = cli("submit", hello, "groups.small.instances=1", "--wait", "groups.big.vcores=0.5", timeout=240, check=0)
    assert re.search(r"^final: .*world_size=2", run.stdout, re.M), run.stdout
    st = json.loads(cli("status", apps(yarnapp_home)[0], "--json", check=0).stdout)
    ran = json.load(open(os.path.join(st["app_dir"], "job.json")))       # the job the engine ran
    assert [(g["name"], g["instances"], g["vcores"]) for g in ran["groups"]] == [("big", 1, 0.5), ("small", 1, 0.5)]


def test_key_value_fields_read_as_users_write_them(tmp_path):
    """A CLI audit: `training.lr=1e-3` was refused (YAML 1.1 reads 1e-3 as a string; `lr: 1e-3`
    in a file too), a strategy named alone had no fields to set, a strategy's block given
    anew kept the old one's fields, `groups[0].vcores` (as errors write it) was no key, and
    `env={}` could not clear a mapping."""
    from conf import overrides
    job = {**GOOD, "training": {"data": {"train": "/x"}, "strategy": "allreduce", "model_options": {"hidden": 32}},
           "run": {"function": "training.runner:main"}}
    raw, _ = overrides.apply(job, ["training.lr=1e-3", "training.weight_decay=5E-4", "training.strategy.bucket_mb=8",
                                   "groups[0].vcores=2", "training.model_options={}"])
    spec = conf.load_job(raw)
    assert (spec.training.lr, spec.training.weight_decay, spec.groups[0].vcores) == (1e-3, 5e-4, 2)
    assert spec.training.strategy.name == "allreduce" and spec.training.strategy.bucket_mb == 8
    assert raw["training"]["model_options"] == {}
    raw, _ = overrides.apply(raw, ["training.strategy={name: ps_central}"])     # another strategy: its own fields
    assert conf.load_job(raw).training.strategy.name == "ps_central"
    path = tmp_path / "lr.yaml"
    path.write_text("name: t\ngroups: [{name: w, instances: 1, vcores: 1}]\nrun: {function: training.runner:main}\n"
                    "training: {lr: 1e-3, data: {train: /x}}\n")
    assert conf.load_job(str(path)).training.lr == 1e-3


def test_numbers_read_as_yaml_1_2_and_env_and_args_kept_as_written(tmp_path):
    """A power user's audit: `epochs: 010` was octal 8 (YAML 1.1), env `PYVER: 3.10` reached
    the program as "3.1" and `UMASK: 0022` as "18", and an env that could not run (a 200 KB
    value: "FAILED: unknown"; CUDA_VISIBLE_DEVICES, silently replaced) was taken; a list as a
    key was a bare TypeError."""
    from conf import overrides
    path = tmp_path / "n.yaml"
    path.write_text("name: t\ngroups: [{name: w, instances: 1, vcores: 1, env: {PYVER: 3.10, UMASK: 0022, "
                    "N: 1_000, BIG: 1e3, OMP_NUM_THREADS: 2}}]\nrun: {script: t.py, args: [--lr, 0.10, 010]}\n"
                    "max_restarts: 010\nlauncher: {heartbeat_timeout: 0o100}\n")
    job = conf.load_job(str(path))
    assert dict(job.groups[0].env) == {"PYVER": "3.10", "UMASK": "0022", "N": "1_000", "BIG": "1e3",
                                       "OMP_NUM_THREADS": "2"}
    assert job.run.args == ["--lr", "0.10", "010"] and job.max_restarts == 10
    assert job.launcher.heartbeat_timeout == 64 and job.ranks()[0]["omp_threads"] == 2
    raw, _ = overrides.apply(conf.read_raw(str(path))[1], ["groups.w.env.V=3.10", "groups.0.env.spark.conf.x=08",
                                                           "run.args=[--epochs, 010]", "max_restarts=007"])
    job = conf.load_job(raw)
    assert (job.groups[0].env["V"], job.groups[0].env["spark.conf.x"]) == ("3.10", "08")
    assert job.run.args == ["--epochs", "010"] and job.max_restarts == 7
    for env, error in (({"K": "x" * 200_000}, r"K: its value is 200,000 bytes; Linux takes at most 128 KiB a "
                                                r"variable: ship it as a file \(run.files\)"),
                       ({"CUDA_VISIBLE_DEVICES": "0"}, r"CUDA_VISIBLE_DEVICES: yarnapp sets it: each container sees "
                                                       r"exactly its own GPUs \(groups\[\]\.gpus\); remove it"),
                       ({"E": None}, r"E: no value; give '' \(quoted\) for an empty one"),
                       ({"OMP_NUM_THREADS": "4,2"}, r"OMP_NUM_THREADS: '4,2'; give a number of threads")):
        with pytest.raises(conf.JobError, match=r"groups\[0\]\.env: " + error):
            conf.load_job({**GOOD, "groups": [dict(GOOD["groups"][0], env=env)]})
    # only a group's env and run.args: a model's own `args` keep their numbers; an anchor's
    # other uses too (a review: `vcores: &v 2` reused in env made vcores the text '2')
    path.write_text("name: t\ngroups: [{name: w, instances: 1, vcores: &v 2, env: {T: *v, N: 1_000}}]\n"
                    "run: {function: training.runner:main}\ntraining: {data: {train: /x}, epochs: 1_000, "
                    "model_options: {args: [3, *v], env: {a: 1.5}}}\n")
    job = conf.load_job(str(path))
    assert (job.groups[0].vcores, dict(job.groups[0].env), job.training.epochs) == (2, {"T": "2", "N": "1_000"}, 1000)
    assert job.training.model_options == {"args": [3, 2], "env": {"a": 1.5}}
    raw, _ = overrides.apply(conf.read_raw(str(path))[1], ["groups.w.env.spark.conf=2", "groups.w.env.spark=1"])
    assert conf.load_job(raw).groups[0].env["spark"] == "1"
    stored = conf.load_job(str(path)).model_dump(mode="json")       # a stored job from before the check
    stored["groups"][0]["env"]["OMP_NUM_THREADS"] = "4,2"
    assert conf.load_job(stored, stored=True).ranks()[0]["omp_threads"] is None
    path.write_text("name: t\ngroups: [{name: w, instances: 1, vcores: 1, env: {D: 2024-01-01}}]\n")
    with pytest.raises(conf.JobError, match=r"D: read as a date \(2024-01-01\); quote it to give it as text"):
        conf.load_job(str(path))
    path.write_text("name: t\ngroups: [{name: w, instances: 1, vcores: 1, env: {[1, 2]: x}}]\n")
    with pytest.raises(conf.JobError, match=r"n.yaml:2:\d+: not valid YAML: a key must be a name, not a list$"):
        conf.load_job(str(path))


def test_key_value_fields_never_drop_what_an_earlier_one_set(tmp_path, cli, yarnapp_home):
    """`training.strategy.bucket_mb=8 training.strategy=allreduce` silently lost bucket_mb; an
    index into a list the file leaves to its defaults made a mapping of it ("Input should be a
    valid list"); a check of a whole section (a duplicate group name) did not say which
    KEY=VALUE made it fail."""
    hello = os.path.join(conf.EXAMPLES_DIR, "hello.yaml")
    from conf import overrides
    job = {**GOOD, "training": {"data": {"train": "/x"}, "strategy": "allreduce"},
           "run": {"function": "training.runner:main"}}
    with pytest.raises(conf.JobError, match=re.escape(
            "training.strategy=allreduce: replaces what training.strategy.bucket_mb=8 set before it; give "
            "training.strategy=allreduce first, then those")):
        overrides.apply(job, ["training.strategy.bucket_mb=8", "training.strategy=allreduce"])
    raw, _ = overrides.apply(job, ["training.strategy=allreduce", "training.strategy.bucket_mb=8"])
    assert conf.load_job(raw).training.strategy.bucket_mb == 8
    for args, line in (
            (["yarn.acls.view_users.0=bob"], f"yarn.acls.view_users.0=bob: {hello} sets no yarn.acls.view_users to "
                                             f"index; give the whole list: yarn.acls.view_users=[...]"),
            (["groups.1.name=big"], f"{hello}: groups (with groups.1.name=big on the command line): duplicate group "
                                    f"name 'big'")):
        proc = cli("submit", hello, *args, "--dry-run", timeout=60)
        assert proc.returncode == 1 and proc.stderr == f"Error: {line}\n", proc.stderr
    dry = cli("submit", hello, "yarn.acls.view_users=[bob]", "--dry-run", check=0)
    assert yaml.safe_load(dry.stdout)["yarn"]["acls"]["view_users"] == ["bob"]


def test_what_a_new_user_got_wrong_is_one_line_that_says_what_to_do(tmp_path, cli, yarnapp_home):
    """From a new user's pass: each case below gave a misleading line (numpy's 'load it
    unsafely', PIL's buffer address, 'import with overwrite', 'remove' /etc/passwd), a
    TensorBoard launched only to fail on the port, or a silently ignored --wait."""
    (tmp_path / "g.npz").write_text("garbage\n")
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "a.jpg").write_text("not an image\n")
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "train.py").write_text("import torch\nprint('training')\n")     # given where the job file goes
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "0.png").write_bytes(b"")           # images with no class subfolder (said "no images found")
    job = tmp_path / "passwd.yaml"
    job.write_text(yaml.safe_dump(dict(_with("run.function", "training.runner:main"),
                                       training={"data": {"train": "/etc/passwd"}})))
    cases = [(["data", "import", "arrays", tmp_path / "ds", "--path", tmp_path / "g.npz"],
              "cannot read the .npz (not an .npz of plain arrays); save it with np.savez(path, x=images, y=labels)"),
             (["data", "import", "image-folder", tmp_path / "ds", "--path", tmp_path / "imgs"],
              "a.jpg: not a readable image (cannot identify image file); remove or replace it"),
             (["data", "import", "image-folder", tmp_path / "ds", "--path", tmp_path / "flat"],
              "no images in class subfolders; its 1 image file(s) (0.png, ...) lie in it directly: move each into "
              "a subfolder named for its class"),
             (["submit", tmp_path / "train.py"], "train.py: a Python script, not a job file; name it in a job.yaml "
                                                   "as run.script: train.py"),
             (["data", "import", "digits", tmp_path / "dd"],
              f"{tmp_path / 'dd' / 'train'} already exists; delete it, or import again with --overwrite"),
             (["submit", job], "/etc/passwd: not a readable Parquet file (Parquet magic bytes not found in footer. "
                               "Either the file is corrupted or this is not a parquet file.); give a dataset's "
                               "directory or Parquet file (import one with `yarnapp data import KIND URI`)"),
             (["submit", job, "--dry-run", "--wait"], "--wait: a --dry-run starts nothing to wait for"),
             (["tensorboard", "app_x", "--port", "99999"], "--port 99999: give a port from 1 to 65535")]
    for args, words in cases:
        proc = cli(*args, timeout=120)
        usage = args[-1] in ("--wait", "99999")       # a flag's value: 2, as argparse's own refusals
        assert proc.returncode == 1 + usage and proc.stderr.count("\n") == 1 and words in proc.stderr, \
            (args, proc.stderr)
    assert sorted(os.listdir(tmp_path)) == ["dd", "flat", "g.npz", "imgs", "passwd.yaml", "train.py"]  # not even a home
    assert apps(yarnapp_home) == []
    assert os.listdir(tmp_path / "dd") == ["train"]


def test_a_scripts_arguments_written_as_yaml_numbers_are_its_command_line_strings():
    """`args: [--epochs, 1]` was refused: "run.args[1]: Input should be a valid string"."""
    import conf
    job = conf.load_job({**GOOD, "run": {"script": "train.py", "args": ["--epochs", 1, "--lr", 0.05, "--fast"]}})
    assert job.run.args == ["--epochs", "1", "--lr", "0.05", "--fast"]


def test_a_groups_env_written_as_yaml_numbers_is_text_and_a_boolean_is_named():
    """`env: {OMP_NUM_THREADS: 1}` was refused ("Input should be a valid string", naming one
    key and "and 1 more"); a boolean has no one text, so each is named."""
    import conf
    group = dict(GOOD["groups"][0], env={"OMP_NUM_THREADS": 1, "LR": 0.5, "NAME": "x"})
    job = conf.load_job({**GOOD, "groups": [group]})
    assert dict(job.groups[0].env) == {"OMP_NUM_THREADS": "1", "LR": "0.5", "NAME": "x"}
    with pytest.raises(conf.JobError, match=r'groups\[0\]\.env: FLAG, DEBUG: a boolean; give the text the program '
                                            r'reads, quoted \("1", "true"\)'):
        conf.load_job({**GOOD, "groups": [dict(group, env={"FLAG": True, "N": 1, "DEBUG": False})]})


def test_the_python_api_names_what_it_was_given(tmp_path, yarnapp_home):
    """submit(42) said "expected a mapping of job fields"; with function=, a job file's
    mistake was said of "job", not of the file."""
    import yarnapp
    with pytest.raises(yarnapp.YarnappError, match=r"^job: expected a job.yaml path, a dict of job fields or a "
                                                   r"conf.JobSpec, got int$"):
        yarnapp.submit(42)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    with pytest.raises(yarnapp.YarnappError, match=r"^Run\(None\): give an application id"):   # (a bare TypeError)
        yarnapp.Run(None).status()
    with pytest.raises(yarnapp.YarnappError, match=r"^wait\(timeout='5'\): give seconds"):
        yarnapp.Run("app_20260101_000000_abcdef").wait(timeout="5")
    with pytest.raises(yarnapp.YarnappError, match=rf"^groupz \(given as groupz=\[\], not in {path}\): unknown field"):
        yarnapp.submit(str(path), function=lambda ctx: None, groupz=[])
    with pytest.raises(yarnapp.YarnappError, match=r"^submit: wiat=: neither an argument of submit nor a field of "
                                                   r"the job; did you mean wait=\?$"):     # was "job: wiat: unknown field"
        yarnapp.submit(str(path), wiat=True)
    assert not os.path.isdir(os.path.join(yarnapp_home, "apps")) or os.listdir(os.path.join(yarnapp_home, "apps")) == []


def test_a_function_submitted_over_a_job_file_with_a_scripts_args_drops_them_with_a_word(tmp_path, yarnapp_home,
                                                                                         caplog):
    """run.args beside a function is refused in a job.yaml; yarnapp.submit(job, function=f)
    over a job file made for a script kept its args and was refused for them."""
    import logging
    import yarnapp
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "run": {"script": "train.py", "args": ["--epochs", "2"]}}))
    with caplog.at_level(logging.WARNING, logger="yarnapp.api"):
        st = yarnapp.submit(str(path), function=lambda ctx: None, wait=True, progress=False).status()
    assert st["state"] == "SUCCEEDED", st
    assert f"{path}: run.args: not used: the function given takes no command line" in caplog.text


def test_resuming_an_application_without_checkpoints_is_one_line(digits, tmp_path, cli, yarnapp_home):
    job = {"name": "t", "groups": [{"name": "w", "instances": 1, "vcores": 1, "memory": "1 GiB"}],
           "training": {"data": {"train": f"{digits}/train"}, "model": "digits_cnn"},
           "checkpoint": {"resume": "app_20200101_000000_abcdef"}}
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = cli("submit", path, "--wait", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"Error: {path}: checkpoint.resume: no checkpoints of application "
                                  f"app_20200101_000000_abcdef under"), proc.stderr
    apps = os.path.join(yarnapp_home, "apps")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (os.path.isdir(apps) and os.listdir(apps))
    # an application of this home that wrote its checkpoints elsewhere (its checkpoint.uri): where
    # (the line said "give an application id `yarnapp list` shows", and list showed it: an audit)
    ckpt = tmp_path / "ckpt"
    wrote = dict(job, training=dict(job["training"], max_steps=2), checkpoint={"uri": str(ckpt), "every_steps": 2})
    path.write_text(yaml.safe_dump(wrote))
    done = cli("submit", path, "--wait", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    app = app_id_from(done.stdout)
    path.write_text(yaml.safe_dump(dict(job, checkpoint={"resume": app})))
    proc = cli("submit", path, "--wait", timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().endswith(
        f"no checkpoints of application {app} under {apps}; it wrote them under {ckpt}, its checkpoint.uri: set "
        f"checkpoint.uri to it (checkpoint.uri={ckpt})"), proc.stderr


def test_a_groups_override_gets_the_group_defaults_as_the_jobs_own_groups_do():
    """submit(job, groups=[{"name": "big"}]) was "groups[0].instances: required field is
    missing (and 5 more)": overrides were merged after the defaults."""
    import yarnapp
    job = yarnapp.load(os.path.join(conf.EXAMPLES_DIR, "digits.yaml"), groups=[{"name": "big"}])
    assert [(g.name, g.instances, g.vcores, g.memory) for g in job.groups] == [("big", 1, 1.0, 1024)]
    job = yarnapp.load(os.path.join(conf.EXAMPLES_DIR, "digits.yaml"), checkpoint={"resume": "latest"})
    assert job.checkpoint.resume == "latest" and job.checkpoint.every_steps == 50     # a section still merges
    # a wrong value given as an override is said as given, not as the file's (an API audit:
    # "digits.yaml: training.lr: Input should be a valid number", whose lr was 0.05)
    with pytest.raises(yarnapp.YarnappError) as e:
        yarnapp.load(os.path.join(conf.EXAMPLES_DIR, "digits.yaml"), training={"lr": "fast"})
    assert str(e.value) == (f"training.lr (given as training={{'lr': 'fast'}}, not in {conf.EXAMPLES_DIR}/digits.yaml)"
                            f": Input should be a valid number (got 'fast')"), str(e.value)
