"""Conv-layer model parallelism: exact equivalence with the single-process model.

Each MPI world (2 and 3 ranks) is started once (module fixtures) and runs every check
of the distributed layers and of the strategy; rank 0 also trains the single-process
reference from the same initial weights on the same data and reports the largest
differences, which the tests below assert. proportional_split is tested in-process.
"""
import json

import pytest
import torch

from mpi_util import mpi_result, run_mpi
from training.calibrate import corrected_speeds, proportional_split

TOL = 1e-5

WORLD = r'''
import copy, io, json
import numpy as np
import torch, torch.nn as nn, torch.nn.functional as F
from mpi4py import MPI
import conf
from mpi_util import make_ctx
from training.model_parallel import DistributedConv2d, ShardProtocol
from training.strategies.conv_mp import ConvModelParallelStrategy

comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
WEIGHTS = {2: [3.0, 1.0], 3: [5.0, 2.0, 1.0]}[n]     # uneven: conv1 (8) -> [6,2] / [5,2,1]


class SmallCNN(nn.Module):
    input_shape = (3, 12, 12)

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def fresh(seed=0):
    torch.manual_seed(seed)
    return SmallCNN()


def data(step, batch=6):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 3, 12, 12, generator=g), torch.randint(0, 10, (batch,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def spec(split=WEIGHTS, recalibrate_every=0, layers=None):
    mp = {"name": "conv_model_parallel", "recalibrate_every": recalibrate_every, "layers": layers}
    job = conf.load_job({"name": "t", "groups": [{"name": "g", "instances": n}],
                         "training": {"strategy": mp, "model": "small",
                                      "data": {"train": "file:///unused"}, "batch_size": 6}})
    # set after validation: a split of another length is refused by the schema, and the
    # strategy must refuse it too when given one
    return job.training.model_copy(update={"strategy": job.training.strategy.model_copy(update={"split": split})})


def maxdiff(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


def params_diff(model, ref):
    """Largest difference over every parameter of two full models (master only)."""
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    return max(maxdiff(got[k], want[k]) for k in want)


out = {}

# 0. Misconfigurations are refused with a message that names the fix, on every rank.
def refused(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None

conv = nn.Conv2d(3, 8, 3)
errors = [refused(lambda: DistributedConv2d(conv, comm, [8] + [0] * n)),
          refused(lambda: DistributedConv2d(conv, comm, [7] + [0] * (n - 1))),
          refused(lambda: DistributedConv2d(nn.Conv2d(4, 8, 3, groups=2), comm, [4] + [4 // (n - 1)] * (n - 1))),
          refused(lambda: ConvModelParallelStrategy(make_ctx(), spec(split=[1.0] * (n + 1))).setup(fresh(), sgd)),
          refused(lambda: ConvModelParallelStrategy(make_ctx(), spec(layers=["conv1", "fc"])).setup(fresh(), sgd))]
out["errors"] = comm.gather(errors, root=0)

# 1. The layers alone: forward output, loss and every gradient against one process.
ref = fresh()
model = copy.deepcopy(ref)
splits = {"conv1": {2: [6, 2], 3: [5, 2, 1]}[n], "conv2": {2: [9, 7], 3: [0, 10, 6]}[n]}  # rank 0 may own 0
for name in ("conv1", "conv2"):
    setattr(model, name, DistributedConv2d(getattr(ref, name), comm, splits[name]))
layers = [model.conv1, model.conv2]
protocol = ShardProtocol(layers, comm)
x, y = data(0)
if rank == 0:
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    protocol.finish([loss.item()])
    ref_logits = ref(x)
    ref_loss = F.cross_entropy(ref_logits, y)
    ref_loss.backward()
    out["layers_forward"] = maxdiff(logits, ref_logits)
    out["layers_loss"] = abs(loss.item() - ref_loss.item())
    out["layers_fc_grad"] = max(maxdiff(model.fc.weight.grad, ref.fc.weight.grad),
                                maxdiff(model.fc.bias.grad, ref.fc.bias.grad))
    out["layers_shapes"] = [list(model.conv1.weight.shape), list(model.conv2.weight.shape)]
    payload = [loss.item()]
else:
    payload = protocol.serve()
out["layers_payload"] = comm.gather(float(payload[0]), root=0)
grads = {}
for name, layer in (("conv1", model.conv1), ("conv2", model.conv2)):
    gw, gb = layer.gather_full((layer.weight.grad, layer.bias.grad))
    w, b = layer.gather_full()
    if rank == 0:
        r = getattr(ref, name)
        grads[name] = max(maxdiff(gw, r.weight.grad), maxdiff(gb, r.bias.grad))
        out[f"layers_{name}_init"] = max(maxdiff(w, r.weight), maxdiff(b, r.bias))
        out[f"layers_{name}_gw_norm"] = float(r.weight.grad.norm())
out["layers_conv_grads"] = grads
out["rank_shards"] = comm.gather([model.conv1.count, model.conv2.count], root=0)

# 2. The strategy: a few SGD steps (momentum, weight decay) equal the single-process run.
def make(strategy_spec, seed=0):
    s = ConvModelParallelStrategy(make_ctx(), strategy_spec)
    s.setup(fresh(seed), sgd)
    return s

s = make(spec())
ref = fresh()
ref_opt = sgd(ref.parameters())
losses, ref_losses = [], []
for step in range(3):
    x, y = data(step)
    lo, hi = s.batch_slice(6)
    stats = s.train_step(x[lo:hi] if rank == 0 else None, y[lo:hi] if rank == 0 else None)
    losses.append([stats.loss, stats.correct, stats.samples, stats.compute_s, stats.comm_s])
    if rank == 0:
        ref_opt.zero_grad()
        logits = ref(x)
        l = F.cross_entropy(logits, y)
        l.backward()
        ref_opt.step()
        ref_losses.append([l.item(), int((logits.argmax(1) == y).sum())])
all_losses = comm.gather(losses, root=0)
out["strategy_split"] = comm.gather([s.layer_split, s.split], root=0)
out["strategy_slices"] = comm.gather(list(s.batch_slice(6)), root=0)
buf = io.BytesIO()
torch.save(s.state_dict(), buf)             # a checkpoint: serialised, as the runner writes it
export = s.model_for_export()
if rank == 0:
    out["strategy_losses"] = all_losses
    out["ref_losses"] = ref_losses
    out["strategy_weights"] = params_diff(export, ref)
    out["export_types"] = [type(export.conv1).__name__, type(export.conv2).__name__]
    out["last_conv_s"] = s.last_conv_s                  # every rank's, gathered at the master
out["conv_s"] = comm.gather(s.conv_s, root=0)

# 3. eval_step agrees with the reference's summed loss and correct count.
x, y = data(10)
ev = s.eval_step(x if rank == 0 else None, y if rank == 0 else None)
if rank == 0:
    with torch.no_grad():
        logits = ref(x)
        out["eval"] = [ev[0], F.cross_entropy(logits, y, reduction="sum").item(),
                       ev[1], int((logits.argmax(1) == y).sum()), ev[2]]
evs = comm.gather(list(ev), root=0)
if rank == 0:
    out["eval_workers"] = evs[1:]

# 4. Checkpoint: a fresh strategy loading the state continues exactly like the original.
x, y = data(3)
s.train_step(x if rank == 0 else None, y if rank == 0 else None)
continued = s.model_for_export()
t = make(spec(), seed=1)                     # different init: everything must come from the state
buf.seek(0)
t.load_state_dict(torch.load(buf, weights_only=True))
t.train_step(x if rank == 0 else None, y if rank == 0 else None)
resumed = t.model_for_export()
if rank == 0:
    out["resume"] = params_diff(resumed, continued)
out["resume_split"] = t.layer_split == s.layer_split

# 5. Resharding mid-run (what recalibration does) keeps the run exact, momentum included.
s2 = make(spec())
ref = fresh()
ref_opt = sgd(ref.parameters())
new_split = {"conv1": [1] * (n - 1) + [8 - (n - 1)], "conv2": [16 - (n - 1)] + [1] * (n - 1)}
for step in range(3):
    if step == 1:
        s2._reshard(new_split)
    x, y = data(step)
    s2.train_step(x if rank == 0 else None, y if rank == 0 else None)
    if rank == 0:
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
export = s2.model_for_export()
if rank == 0:
    out["reshard"] = params_diff(export, ref)
out["reshard_split"] = comm.gather(s2.layer_split, root=0)

# 6. Calibrated split (no manual split): measured speeds, split agreed by every rank, exact.
s3 = make(spec(split=None, recalibrate_every=2))
ref = fresh()
ref_opt = sgd(ref.parameters())
for step in range(2):
    x, y = data(step)
    s3.train_step(x if rank == 0 else None, y if rank == 0 else None)
    if rank == 0:
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
export = s3.model_for_export()
out["calibrated_split"] = comm.gather(s3.layer_split, root=0)
out["calibrated_speeds"] = comm.gather(s3.speeds, root=0)
if rank == 0:
    out["calibrated"] = params_diff(export, ref)

if rank == 0:
    print("RESULT " + json.dumps(out))
'''


def _world(n):
    return mpi_result(n, WORLD, timeout=180)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    return request.param, _world(request.param)


def test_layers_forward_backward_equal_single_process(world):
    n, r = world
    assert r["layers_forward"] < TOL
    assert r["layers_loss"] < TOL
    assert len(set(r["layers_payload"])) == 1           # END carried the master's loss to all
    assert r["layers_fc_grad"] < TOL
    for name in ("conv1", "conv2"):
        assert r[f"layers_{name}_init"] == 0.0          # shards are slices of the same init
        assert r[f"layers_{name}_gw_norm"] > 1e-3        # the gradients compared are not trivially 0
        assert r["layers_conv_grads"][name] < TOL
    # uneven splits, including a rank that owns no kernel of conv2
    expected = {2: [[6, 9], [2, 7]], 3: [[5, 0], [2, 10], [1, 6]]}[n]
    assert r["rank_shards"] == expected
    assert r["layers_shapes"] == [[expected[0][0], 3, 3, 3], [expected[0][1], 8, 3, 3]]


def test_misconfigurations_are_refused(world):
    n, r = world
    for errors in r["errors"]:                               # every rank refuses, none hangs
        assert f"split has {n + 1} entries for {n} ranks" in errors[0]
        assert "must be non-negative and sum to the layer's 8 kernels" in errors[1]
        assert "grouped convolutions" in errors[2]
        assert f"{n + 1} weights for {n} ranks" in errors[3]
        assert "['fc'] are not Conv2d layers" in errors[4] and "['conv1', 'conv2']" in errors[4]


def test_sgd_steps_equal_single_process(world):
    n, r = world
    split = {2: {"conv1": [6, 2], "conv2": [12, 4]},
             3: {"conv1": [5, 2, 1], "conv2": [10, 4, 2]}}[n]
    totals = [split["conv1"][i] + split["conv2"][i] for i in range(n)]
    assert r["strategy_split"] == [[split, totals]] * n     # manual split, the same on every rank
    assert r["strategy_slices"] == [[0, 6]] + [[0, 0]] * (n - 1)
    ref = r["ref_losses"]
    for rank_losses in r["strategy_losses"]:                # every rank knows loss and correct
        for (loss, correct, samples, compute_s, comm_s), (ref_loss, ref_correct) in zip(rank_losses, ref):
            assert abs(loss - ref_loss) < TOL
            assert correct == ref_correct and samples == 6
            assert compute_s >= 0 and comm_s > 0
    assert r["strategy_weights"] < TOL
    assert r["export_types"] == ["Conv2d", "Conv2d"]
    assert len(r["last_conv_s"]) == n and all(t > 0 for t in r["last_conv_s"])
    assert all(t > 0 for t in r["conv_s"])


def test_eval_step(world):
    n, r = world
    loss_sum, ref_sum, correct, ref_correct, samples = r["eval"]
    assert abs(loss_sum - ref_sum) < TOL * 6
    assert correct == ref_correct and samples == 6
    assert r["eval_workers"] == [[0.0, 0, 0]] * (n - 1)     # the others were given no rows


def test_checkpoint_resume_is_exact(world):
    n, r = world
    assert r["resume"] < TOL
    assert r["resume_split"] is True


def test_reshard_keeps_training_exact(world):
    n, r = world
    assert r["reshard"] < TOL
    assert r["reshard_split"] == [{"conv1": [1] * (n - 1) + [8 - (n - 1)],
                                   "conv2": [16 - (n - 1)] + [1] * (n - 1)}] * n


def test_calibrated_split(world):
    n, r = world
    splits = r["calibrated_split"]
    assert all(s == splits[0] for s in splits)              # every rank agrees
    assert sum(splits[0]["conv1"]) == 8 and sum(splits[0]["conv2"]) == 16
    assert all(c >= 1 for s in splits[0].values() for c in s)
    speeds = r["calibrated_speeds"][0]
    assert all(len(v) == n and all(x > 0 for x in v) for v in speeds.values())
    assert r["calibrated"] < TOL


GPU_WORLD = r'''
import copy, dataclasses, json
import torch, torch.nn.functional as F
from mpi4py import MPI
import conf
from mpi_util import make_ctx
from training.models import build_model
from training.strategies.conv_mp import ConvModelParallelStrategy

torch.backends.cudnn.allow_tf32 = False          # compare fp32 with fp32
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
spec = conf.load_job({"name": "t", "groups": [{"name": "g", "instances": 2}],
                      "training": {"strategy": {"name": "conv_model_parallel", "split": [3.0, 1.0]},
                                   "model": "seed_cnn", "data": {"train": "file:///unused"},
                                   "batch_size": 8}}).training
sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
out = {}
for gpus in ([0, 1], [1, 0], [1, 1]):           # worker, master, both on the GPU
    ctx = make_ctx()
    ctx.ranks = [dataclasses.replace(info, gpus=g) for info, g in zip(ctx.ranks, gpus)]
    torch.manual_seed(0)
    model = build_model("seed_cnn", (3, 16, 16), 10, {"conv1": 8, "conv2": 16, "kernel": 3})
    ref = copy.deepcopy(model)
    ref_opt = sgd(ref.parameters())
    s = ConvModelParallelStrategy(ctx, spec)
    s.setup(model, sgd)
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        st = s.train_step(x if rank == 0 else None, y if rank == 0 else None)
        if rank == 0:
            ref_opt.zero_grad()
            loss = F.cross_entropy(ref(x), y)
            loss.backward()
            ref_opt.step()
            worst = max(worst, abs(st.loss - loss.item()))
    export = s.model_for_export()
    devices = comm.gather(s.device.type, root=0)
    if rank == 0:
        weights = max(float((p - q).abs().max()) for p, q in zip(export.parameters(), ref.parameters()))
        out[str(gpus)] = {"devices": devices, "loss": worst, "weights": weights}
if rank == 0:
    print("RESULT " + json.dumps(out))
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ranks_equal_single_process():
    """Ranks on the GPU stage through host memory; the run stays equal to the CPU one."""
    proc = run_mpi(2, GPU_WORLD, timeout=180)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT "):])
    expected = {"[0, 1]": ["cpu", "cuda"], "[1, 0]": ["cuda", "cpu"], "[1, 1]": ["cuda", "cuda"]}
    assert {k: v["devices"] for k, v in results.items()} == expected
    for r in results.values():
        assert r["loss"] < TOL and r["weights"] < TOL


# -- proportional_split ----------------------------------------------------------------------

def test_proportional_split_exact_quotas():
    assert proportional_split(1500, [2, 1]) == [1000, 500]
    assert proportional_split(500, [1, 1, 1, 1]) == [125] * 4
    assert proportional_split(8, [5, 2, 1]) == [5, 2, 1]


def test_proportional_split_sums_and_largest_remainder():
    # quotas 3.33.., 3.33.., 3.33..: one leftover kernel, ties go to the lower rank
    assert proportional_split(10, [1, 1, 1]) == [4, 3, 3]
    # quotas 6.6, 3.3 (+0.1): floors 6, 3 leave one kernel for the largest remainder (0.6)
    assert proportional_split(10, [2, 1]) == [7, 3]
    # quotas 1.75, 5.25: floors 1, 5; leftover to the larger remainder .75
    assert proportional_split(7, [1, 3]) == [2, 5]
    for kernels in (3, 7, 16, 500, 1501):
        for speeds in ([1.0, 0.5], [3.0, 2.0, 1.0], [0.9, 1.1, 1.0, 0.3]):
            if kernels < len(speeds):
                continue
            split = proportional_split(kernels, speeds)
            assert sum(split) == kernels and all(c >= 1 for c in split)
            quota = [kernels * s / sum(speeds) for s in speeds]
            assert all(abs(c - q) < 1 for c, q in zip(split, quota))


def test_proportional_split_gives_every_rank_one_kernel():
    assert proportional_split(10, [1, 1, 100]) == [1, 1, 8]
    assert proportional_split(3, [1000, 1, 1]) == [1, 1, 1]


def test_proportional_split_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        proportional_split(2, [1, 1, 1])
    with pytest.raises(ValueError, match="positive"):
        proportional_split(8, [1, 0])
    with pytest.raises(ValueError, match="no ranks"):
        proportional_split(8, [])


# -- corrected_speeds (recalibration from measured training times) ---------------------------

def test_corrected_speeds_moves_work_off_the_slower_rank():
    # calibration said equal; training measured rank 1 twice as slow on the same share
    speeds = corrected_speeds({"conv": [10.0, 10.0]}, {"conv": [5, 5]}, {"conv": [0.5, 1.0]})
    assert speeds["conv"][0] == 10.0 and abs(speeds["conv"][1] - 10.0 / 2 ** 0.5) < 1e-12  # damped: sqrt
    assert proportional_split(10, speeds["conv"]) == [6, 4]


def test_corrected_speeds_keeps_per_layer_ratios():
    speeds = {"a": [10.0, 20.0], "b": [30.0, 15.0]}
    split = {"a": [4, 8], "b": [20, 10]}
    new = corrected_speeds(speeds, split, {"a": [0.4, 0.2], "b": [0.5, 1.0]})
    for r in range(2):
        assert abs(new["a"][r] / new["b"][r] - speeds["a"][r] / speeds["b"][r]) < 1e-12


def test_recalibration_converges_to_the_true_speed_ratio():
    true = [2.0, 1.0]                        # rank 1 really runs at half speed
    speeds = {"conv": [1.0, 1.0]}            # but calibration measured them equal
    split = {"conv": proportional_split(300, speeds["conv"])}
    for _ in range(12):
        seconds = {"conv": [c / t for c, t in zip(split["conv"], true)]}
        speeds = corrected_speeds(speeds, split, seconds)
        split = {"conv": proportional_split(300, speeds["conv"])}
    assert split["conv"] == [200, 100]
