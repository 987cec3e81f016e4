"""What the client checks before anything starts: the job's datasets are there and
readable, and where it writes (checkpoints, TensorBoard) can be written (a local
directory) or reached (a remote filesystem: whether this user may write there is found
at the first checkpoint).

A job whose data is missing, empty, not Parquet, or lacks its image and label columns
would start its containers only to fail in them. For a job of the built-in runner (the
one that reads `training.data`), the client reads every file's footer first (no rows, but
the label column of a file written without statistics: training.data.checks.check, what
each rank does at start) and refuses such a job in one
line naming the field; where the files give the images' size (raw pixels), it plays the
augmentation and test transforms on one blank image of it, so that sizes which differ
(a crop larger than the test images) are refused too. On YARN, a local path (one on the
nodes' own disks) and a filesystem the client cannot reach (no libhdfs here, a NameNode
or DataNode only the cluster sees) are left to the containers, which report them in one
line too; an unknown scheme is refused on both backends. The same holds for checkpoint.uri and
tensorboard.logdir (`check_outputs`), which a job would otherwise find unwritable only
at its first checkpoint, or at its end.
"""
import collections
import contextlib
import io
import logging
import os
import tempfile
import urllib.parse

from conf import BUILTIN_RUNNER
from conf.schema import BUILTIN_MIN_HW, BUILTIN_MODELS

from .errors import YarnappError

log = logging.getLogger(__name__)

Found = collections.namedtuple("Found", "shape classes rows order")     # check_data's: None where not known here
SLACK = 1.25        # a step's blocks are refused only this far over the rank's data budget, where its
                    # reader warns (a 1024 MiB container ran 1.5x over it, at its memory limit)
ORDER_FRACTION = 0.125  # warn where a rank's epoch orders (Order.plan_bytes) take more of its container


def check_data(job, where=None, on_cluster=False):
    """Raise YarnappError naming `where` and training.data.train/test when a dataset the
    job trains on cannot be opened from here (on_cluster: only a shared filesystem's URI
    that this client reaches is checked), or when its images would come out of the
    augmentation and the test transforms in sizes the model cannot take together.
    Returns a Found (the model's input [C, H, W] and the number of classes, each None where
    not known here; the training set's rows and order) where the data was checked, else None."""
    data = job.training.data if job.training is not None else None
    if data is None or data.dataset or job.run.function != BUILTIN_RUNNER:
        return                  # own code reads what it likes; a user's dataset is theirs to open
    from training import fsutil
    from training.data import DataError
    from training.data.common import Unreachable
    from training.data.checks import check, check_test_classes
    from training.data.formats import Columns
    pre = f"{where}: " if where else ""
    unreachable = set()         # (scheme, host) already found out of reach: not tried again
    shapes = {}                 # split -> [C, H, W] of its raw images (None: encoded, or not checked)
    found = {}                  # split -> what training.data.checks.check found in its footers
    for split in ("train", "test"):
        uri = getattr(data, split)
        if not uri or (on_cluster and fsutil.is_local(uri)):
            continue
        u = urllib.parse.urlparse(uri)
        if (u.scheme, u.netloc) in unreachable:
            continue
        try:
            found[split] = check(uri, Columns.of(data.columns), tuple(data.shape) if data.shape else None,
                                 named=split == "test")
            rows, shapes[split], blocks = found[split].rows, found[split].shape, found[split].blocks
            if split == "test" and "train" in found:
                test, train = found["test"], found["train"]
                check_test_classes(uri, test.classes, test.num_classes, data.train, train.classes,
                                   train.num_classes)
            low = found[split].lowest
            if split == "train" and not found[split].named and low:
                unseen = "class 0 gets an output" if low == 1 else f"classes 0 to {low - 1} get an output each"
                log.warning("training.data.train: its labels start at %d (the footers' statistics): %s and no "
                            "image; labels are class indices from 0 (subtract %d if they count from %d)",
                            low, unseen, low, low)
            classes = found[split].num_classes
            if split == "train" and not found[split].named and classes and classes > max(found[split].rows, 1000):
                # (labels 0, 100000, ... 900000: a classifier of 900001 outputs, killed for memory)
                log.warning("training.data.train: its labels run up to %d (the footers' statistics): the model gets "
                            "%d outputs, more than the %d rows; labels are class indices 0 to K-1: map them to those",
                            classes - 1, classes, found[split].rows)
        except Unreachable as e:
            if not on_cluster or refused_on_loopback(uri):
                raise YarnappError(f"{pre}training.data.{split}: {e}") from None
            unreachable.add((u.scheme, u.netloc))
            log.warning("training.data.%s not checked before submitting: %s (the containers report it if they "
                        "cannot reach it either)", split, e)
        except DataError as e:
            raise YarnappError(f"{pre}training.data.{split}: {e}") from None
        else:
            batch = job.training.batch_size
            if split == "train" and rows < batch:         # not one whole batch: no step (drop_last)
                raise YarnappError(f"{pre}training.batch_size: {batch} is more than the {rows} rows of "
                                   f"training.data.train ({uri}); lower it")
            if split == "train":
                _check_window(job, blocks, pre)
                _warn_big_row_groups(uri, blocks, pre)
                if found[split].one_class_files:
                    _warn_one_class_blocks(job, found[split], pre)
    if data.columns.class_name and "train" in found and not any(f.class_column for f in found.values()):
        # (read_footers drops it where the metadata names the classes: a misspelt name was ignored)
        raise YarnappError(f"{pre}training.data.columns.class_name: no column {data.columns.class_name!r} in "
                           f"training.data.train ({data.train}){' or test' if 'test' in found else ''}, whose "
                           f"metadata names the classes; fix the column's name, or drop the field")
    train, shape = found.get("train"), None
    if not data.transform:      # the user's own transform runs in the containers only
        shape = _check_sizes(data, shapes, pre)
        _check_built(job, shape, pre)
        if shape and data.mean is not None and len(data.mean) != shape[0]:     # (else the ranks said it)
            raise YarnappError(f"{pre}training.data.mean/std: {len(data.mean)} values each, for images of "
                               f"{shape[0]} channel(s) ({data.train}); give one per channel")
    order = None                # the training set's epoch order (Order.fingerprint), as its ranks will record it
    if train:
        from training.data.order import Order
        order = Order([b.rows for b in train.blocks], [b.nbytes for b in train.blocks],
                      (data.shuffle_window or 0) << 20,
                      content=[b.read_bytes for b in train.blocks]).fingerprint(job.training.batch_size)
    return Found(shape, train.num_classes if train else None, train.rows if train else None, order)


def _check_window(job, blocks, pre):
    """Refuse a shuffle window from which one step of a rank reads more bytes of row groups
    than SLACK times what the rank holds data in (training.data.memory, by default a
    quarter of its container): its reader goes over that on every step, with a warning in
    the rank's log, and a step's blocks take more than their bytes while they are read:
    the kernel killed 768 and 896 MiB containers for a step of 377 MiB (a 2 GiB window,
    batch 256, a 381 MiB dataset), and the line said only to raise groups[].memory."""
    from training.data.order import Order, Schedule
    from training.data.source import MEMORY_FRACTION, data_budget
    t, data = job.training, job.training.data
    order = Order([b.rows for b in blocks], [b.nbytes for b in blocks], (data.shuffle_window or 0) << 20)
    for i, group, rows in _rows_per_step(job):
        order_bytes = order.plan_bytes(t.batch_size, rows)
        if order_bytes > (int(group.memory) << 20) * ORDER_FRACTION:
            log.warning("%straining.data.train: its %d rows are many for group %r: each of its ranks keeps the order "
                        "of its rows for %d epochs, about %s beside the data it holds (training.data.memory), of "
                        "its container's %d MiB; raise groups[%d].memory if it is killed for memory", pre, order.n,
                        group.name, Schedule.KEEP, _about(order_bytes), group.memory, i)
        budget = data_budget(data.memory, group.memory)
        need = order.largest_step_bytes(t.batch_size, rows, job.training.seed)
        if need <= budget * SLACK:
            continue
        window = order.window_within(t.batch_size, rows, budget)
        fix = (f"{'lower' if data.shuffle_window else 'set'} training.data.shuffle_window to "
               f"{_size(window)} or less" if window else "write smaller row groups")
        mib = -(-need // 2**20)
        raise_ = (f"training.data.memory to {mib} MiB" if data.memory else
                  f"groups[{i}].memory to {-(-mib // MEMORY_FRACTION):.0f} MiB")
        held = "training.data.memory" if data.memory else f"a quarter of groups[{i}].memory"
        raise YarnappError(f"{pre}training.data.shuffle_window: a step of group {group.name!r} reads {rows} rows of "
                           f"each batch of {t.batch_size} from about {_about(need)} of training.data.train's "
                           f"row groups, more than the {_about(budget)} its ranks hold data in ({held}); "
                           f"{fix}, or raise {raise_}")


def _warn_big_row_groups(uri, blocks, pre):
    """Warn where an epoch reads the training set's row groups more than 1.5 times over: one
    bigger than MAX_BLOCK_BYTES is read in row ranges, each from the row group's start
    (Spark's 128 MiB+ blocks of images: a 295 MiB row group cost 10x its bytes an epoch)."""
    from training.data.formats import MAX_BLOCK_BYTES
    once = sum(b.read_bytes for b in blocks)
    cost = sum(b.read_cost for b in blocks)
    if cost <= 1.5 * once:
        return
    groups = {}
    for b in blocks:
        groups[(b.file, b.row_group)] = groups.get((b.file, b.row_group), 0) + b.read_bytes
    log.warning("%straining.data.train: row groups of up to %s (%s) are read in parts of %s, each from its row "
                "group's start, so an epoch reads about %.1fx the data's %s; write row groups of at most %s "
                "(pyarrow's row_group_size, Spark's parquet.block.size)", pre, _about(max(groups.values())), uri,
                _about(MAX_BLOCK_BYTES), cost / once, _about(once), _about(MAX_BLOCK_BYTES))


def _warn_one_class_blocks(job, found, pre):
    """Warn where the labels or class names come from partitionBy's directories (label=3/,
    class_name=cat/), so every row group holds one class, and a shuffle window holds too few
    row groups for a batch to see most classes (a batch draws its rows from one window)."""
    window = (job.training.data.shuffle_window or 0) << 20
    sizes = [b.nbytes for b in found.blocks]
    k = found.num_classes or 0
    if not window or not sizes or not k:
        return
    per_window = window / (sum(sizes) / len(sizes))
    if per_window >= 2 * k or window >= sum(sizes):
        return
    need = min(sum(sizes), 2 * k * sum(sizes) / len(sizes))
    log.warning("%straining.data.train: its classes come from partitionBy's directories, so each row group holds "
                "one class, and a batch draws from a shuffle window of about %.0f row groups (%s) for %d classes; "
                "raise training.data.shuffle_window to %s or more, write smaller row groups, or write the data "
                "shuffled, without partitionBy", pre, per_window, _size(window), k, f"{-(-int(need) // 2**20)} MiB")


def _about(nbytes):
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 2**20 else f"{max(1, nbytes >> 10)} KiB"


def _rows_per_step(job):
    """(group index, group, the most rows of each global batch one of its ranks reads) for
    each group, by the strategy and training.shares; nothing where the shares are only
    measured at start (speed, with GPU ranks)."""
    from training.data.order import given_weights, split_rows
    t, ranks = job.training, job.ranks()
    B, vcores = t.batch_size, [r["vcores"] for r in ranks]
    if t.strategy.name == "hypergraph":                 # every rank reads the whole batch
        rows = [B] * len(ranks)
    elif t.strategy.name == "conv_model_parallel":      # the master reads it, for everyone
        rows = [B] + [0] * (len(ranks) - 1)
    elif t.shares == "speed":                           # CPU ranks' speeds go about as their vcores
        if any(g.gpus for g in job.groups):
            return []
        rows = split_rows(B, vcores)
    else:
        rows = split_rows(B, given_weights(t.shares, vcores))
    most = {}
    for r, n in zip(ranks, rows):
        most[r["group"]] = max(most.get(r["group"], 0), n)
    return [(i, g, most[g.name]) for i, g in enumerate(job.groups) if most.get(g.name)]


def _check_sizes(data, shapes, pre):
    """The sizes the images come out of training.data.augment and test_transforms, played on
    one blank image of each dataset's size where the files give it (raw pixels): the
    containers refuse sizes that differ (training.data.source), and ops that do not fit."""
    import numpy as np
    from training.data import DataError, transforms
    if any(name.startswith("torchvision.") for field in ("augment", "test_transforms")
           for entry in getattr(data, field) or [] for name in entry):
        return                  # torchvision's ops: left to the containers (their environment's)
    if not any(shapes.values()):
        return                  # no size known here (encoded images): nothing to play
    out = {}
    try:
        ops = {field: transforms.build(getattr(data, field), f"training.data.{field}")[0]
               for field in ("augment", "test_transforms")}
        for split, field in (("train", "augment"), ("train", "test_transforms"), ("test", "test_transforms")):
            if shapes.get(split) is None:
                continue
            c, h, w = shapes[split]
            hwc = transforms.apply(ops[field], np.zeros((1, h, w, c), np.uint8), 0, 0, np.zeros(1, np.int64))
            out[split, field] = [hwc.shape[3], hwc.shape[1], hwc.shape[2]]
    except DataError as e:
        raise YarnappError(f"{pre}{e}") from None
    aug, test = out.get(("train", "augment")), out.get(("train", "test_transforms"))
    if aug and test and aug != test:
        raise YarnappError(f"{pre}training.data.augment: training images come out {aug}, untransformed ones "
                           f"{test} (training.data.test_transforms); make them the same size: the model also "
                           f"sees images through test_transforms (evaluation, the speed probe, "
                           f"Run.model().predict), with or without a test set")
    other = out.get(("test", "test_transforms"))
    if aug and other and aug[0] != other[0]:
        raise YarnappError(f"{pre}training.data.test: its images have {other[0]} channel(s), the training set's "
                           f"{aug[0]}; give a test set of the same kind of images")
    if aug and other and aug != other:
        raise YarnappError(f"{pre}training.data.test: its images come out {other} for the model, the training "
                           f"set's {aug}; give a test set of the same size, or resize it in "
                           f"training.data.test_transforms")
    return aug


def _check_built(job, shape, pre):
    """Build a built-in model for the images' size (`shape`, [C, H, W]) on torch's meta
    device, which allocates and computes nothing, where the job gives it options: an
    option of the wrong type or value is one line here instead of a failure in every
    container."""
    t = job.training
    if shape is None or t.model not in BUILTIN_MODELS:
        return
    least = BUILTIN_MIN_HW.get(t.model, 1)
    if min(shape[1:]) < least:      # (every rank failed on it at setup; found without torch)
        raise YarnappError(f"{pre}training.model: {t.model} takes images of at least {least}x{least}, and "
                           f"training.data.train's come out {shape[1]}x{shape[2]}; make them larger in "
                           f"training.data.augment and test_transforms alike (resize), or give another model")
    if not t.model_options:
        return
    import torch

    from training.models import ModelError, build_model
    try:
        with torch.device("meta"):
            build_model(t.model, shape, 2, t.model_options)     # the classes do not matter here
    except ModelError as e:
        raise YarnappError(f"{pre}training.model_options: {e}") from None


STRUCTURAL = ("conv_model_parallel", "hypergraph")     # strategies that cannot run every model


def check_strategy(job, found, shipment, where=None):
    """Refuse a model the job's strategy cannot run, where the ranks would find it at
    setup or at their first step: conv_model_parallel's layers (a name the model lacks, a
    conv it cannot split, one its forward never calls, none to distribute) and what the
    hypergraph strategy cannot place (anything but a chain of Conv2d / Linear layers:
    BatchNorm, residual adds, concatenations). `found`: check_data's (input shape,
    classes), None where unknown. The model is built here, a factory of the job's own
    imported as the containers import it (yarnapp.shipping.importable): on the meta device
    for conv_model_parallel, for real (it runs one row) for the hypergraph strategy. A
    model that cannot be built here is left to the containers."""
    t = job.training
    _check_factory_call(job, shipment, where)
    if found is None or found[0] is None or t.strategy.name not in STRUCTURAL:
        return
    shape, classes = tuple(found[0]), found[1] or 10
    import torch

    from training.models import build_model
    from training.partition import PartitionError
    from training.strategies.base import StrategyError

    from .shipping import importable
    pre = f"{where}: " if where else ""
    try:        # the caller's torch RNG as it was, and torch.fx's ShapeProp's traceback unprinted
        with importable(shipment), torch.random.fork_rng(devices=[]), contextlib.redirect_stderr(io.StringIO()), \
                torch.device("meta" if t.strategy.name == "conv_model_parallel" else "cpu"):
            model = build_model(t.model, shape, classes, t.model_options)
            if t.strategy.name == "hypergraph":
                from training.partition import layer_chain
                from training.strategies.hypergraph.strategy import check_chain
                check_chain(layer_chain(model, shape, classes))
                return
            from training.strategies.conv_mp.calibrate import conv_shapes
            from training.strategies.conv_mp.strategy import select_layers
            conv_shapes(model, shape, 1, select_layers(model, t.strategy.layers, f"model {t.model!r}", job.world_size))
    except (StrategyError, PartitionError) as e:
        field = "" if str(e).startswith("training.") else "training.strategy: "
        raise YarnappError(f"{pre}{field}{e}") from None
    except Exception as e:  # noqa: BLE001 - what cannot be built or run here: the containers' to report
        log.debug("%s not checked for the %s strategy here: %s", t.model, t.strategy.name, e)


def _check_factory_call(job, shipment, where):
    """Refuse a model factory of the user's (training.model 'package.module:factory') that
    cannot take training.model_options with the input_shape / num_classes it is offered
    (`torch.nn:Linear` with no options: every rank failed on it). Checked against its
    signature, imported as the containers import it, not called; one that does not import
    here is left to the containers (their environment may have what this one lacks)."""
    t = job.training
    if t is None or job.run.function != BUILTIN_RUNNER or ":" not in t.model:
        return
    from training import userfn

    from .shipping import importable
    try:
        with importable(shipment):
            factory = userfn.load(t.model, "training.model")
    except Exception as e:  # noqa: BLE001 - an import of the user's failing here: the containers' to report
        log.debug("%s not imported here: %s", t.model, e)
        return
    try:
        userfn.arguments(factory, t.model_options, "training.model",
                         offered={"input_shape": None, "num_classes": None})
    except userfn.UserCodeError as e:
        raise YarnappError(f"{where}: {e}" if where else str(e)) from None


def _warn_equal_shares(job, pre):
    """Warn where `shares: equal` (the default) splits the batches of groups of unequal
    capacity (vcores, GPUs) for a strategy that splits them by shares: the faster ranks wait
    for the slowest every step."""
    t = job.training
    if t.shares != "equal" or t.strategy.name == "conv_model_parallel" or getattr(t.strategy, "capacities", None):
        return
    kinds = list(dict.fromkeys((g.vcores, g.gpus) for g in job.groups))
    if len(kinds) < 2:
        return
    what = ", ".join(f"{v:g} vcore{'' if v == 1 else 's'}" + (f" + {n} GPU(s)" if n else "") for v, n in kinds)
    same = "share of the model's units" if t.strategy.name == "hypergraph" else "rows of each batch"
    log.warning("%straining.shares: equal (the default) gives every rank the same %s, while the groups have %s: "
                "the faster ranks wait for the slowest every step; set training.shares: vcores (or speed: measured "
                "at start)", pre, same, what)


def _warn_precision_without_gpus(job, pre):
    """Warn where training.precision asks for bf16 or fp16 and no group has a GPU: it applies
    to GPU ranks only (training.precision), so every rank would compute in fp32 unsaid."""
    t = job.training
    if t.precision == "fp32" or any(g.gpus for g in job.groups):
        return
    log.warning("%straining.precision: %s applies to GPU ranks, and no group asks for gpus: every rank computes "
                "in fp32; give a group gpus, or leave precision out", pre, t.precision)


def check_model(job, where=None):
    """Raise YarnappError naming training.model when it is neither a built-in model nor a
    'package.module:factory' (a misspelt name), or training.model_options when a built-in
    model does not take one of them (a misspelt width): the containers would start only to
    fail on it. Imports torch, so only when there are options to check. (Own code, and the
    planner's offline jobs, may name their models as they like.)"""
    t = job.training
    if t is None or job.run.function != BUILTIN_RUNNER:
        return
    pre = f"{where}: " if where else ""
    if t.model not in BUILTIN_MODELS and ":" not in t.model:
        raise YarnappError(f"{pre}training.model: {t.model!r} is neither a built-in model "
                           f"({', '.join(BUILTIN_MODELS)}) nor a 'package.module:factory'")
    _warn_equal_shares(job, pre)
    _warn_precision_without_gpus(job, pre)
    if not t.model_options:
        return
    from training.models import ModelError, check_options
    try:
        check_options(t.model, t.model_options)
    except ModelError as e:
        raise YarnappError(f"{pre}training.model_options: {e}") from None


def refused_on_loopback(uri):
    """Whether an unreachable URI names this machine (127.0.0.1, localhost) and refused the
    connection: no one listens on that port here, where a single-node cluster's containers run
    too (on a cluster of several, a loopback address is each node's own). Else the containers,
    on the cluster's network, may reach what this client cannot."""
    import ipaddress
    import socket

    from training import fsutil
    u = urllib.parse.urlparse(uri)
    host = u.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return False
    try:                # (the error's text is cut short; asked again, directly)
        socket.create_connection((host, u.port or fsutil.NAMENODE_PORTS.get(u.scheme, 8020)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def check_outputs(job, where=None, on_cluster=False):
    """Raise YarnappError naming checkpoint.uri or tensorboard.logdir when the job could not
    write there: a local directory that cannot be created or written (tried with a
    temporary directory, removed at once: nothing is left), or a filesystem the client
    cannot open or reach. On a cluster a local path is the nodes' own, and a filesystem
    this client cannot reach is left to the containers, as for data."""
    outputs = [(f, u) for f, u in (("checkpoint.uri", job.checkpoint.uri), ("tensorboard.logdir",
                                                                          job.tensorboard.logdir)) if u]
    if not outputs:
        return              # nothing to import either (a job's environment may lack pyarrow)
    from training import fsutil
    from training.data import DataError
    from training.data.common import Unreachable, filesystem, info
    pre = f"{where}: " if where else ""
    for field, uri in outputs:
        if on_cluster and fsutil.is_local(uri):
            continue
        try:
            if fsutil.is_local(uri):
                _writable(os.path.abspath(fsutil.local_path(uri)))
            else:
                fs, path = filesystem(uri)
                info(fs, path, uri)
        except Unreachable as e:
            if not on_cluster or refused_on_loopback(uri):
                raise YarnappError(f"{pre}{field}: {e}") from None
            log.warning("%s not checked before submitting: %s (the containers report it if they cannot "
                        "reach it either)", field, e)
        except (DataError, OSError) as e:
            raise YarnappError(f"{pre}{field}: {e}") from None


def _limit(path, name, default):
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def _writable(path):
    """OSError naming `path` when a directory cannot be made there: its nearest existing
    ancestor must be a directory this process can create in (tried, then removed)."""
    probe = path
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OSError(f"{path}: {probe} is not a directory; give a directory you can write to")
    # the parts still to be made: a name the filesystem cannot hold (ENAMETOOLONG in rank 0,
    # after the containers started, and half the directories made)
    name_max, path_max = _limit(probe, "PC_NAME_MAX", 255), _limit(probe, "PC_PATH_MAX", 4096)
    for part in os.path.relpath(path, probe).split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise OSError(f"{path}: the name {part[:20]}... is {len(os.fsencode(part))} bytes, and a file name "
                          f"here may have {name_max}; shorten it")
    if len(os.fsencode(path)) >= path_max:
        raise OSError(f"{path[:40]}...: the path is {len(os.fsencode(path))} bytes, and a path here may have "
                      f"{path_max - 1}; shorten it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".yarnapp-probe-", dir=probe))
    except OSError as e:
        raise OSError(f"{path}: cannot write under {probe} ({e.strerror}); give a directory you can "
                      f"write to") from None
