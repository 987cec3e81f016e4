"""Conv-layer model parallelism against single-process training (tests/test_conv_mp.py):
the distributed layers, the strategy's steps, evaluation, checkpoints, resharding and
the calibrated split, on 2 or 3 ranks; rank 0 reports the largest differences."""
import copy
import io

import torch
import torch.nn as nn
import torch.nn.functional as F

import conf
from launcher.world import join_local
from training.context import RunContext
from training.probes import finish, report
from training.strategies.conv_mp.fuse import Call
from training.strategies.conv_mp.layers import DistributedConv2d
from training.strategies.conv_mp.protocol import ShardProtocol
from training.strategies.conv_mp.strategy import ConvModelParallelStrategy

comm, rank, n = join_local()
torch.set_num_threads(1)
WEIGHTS = {2: [3.0, 1.0], 3: [5.0, 2.0, 1.0]}[n]     # uneven: conv1 (8) -> [6,2] / [5,2,1]


class SmallCNN(nn.Module):
    input_shape = (3, 12, 12)

    def __init__(self, c1=8, c2=16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc = nn.Linear(c2 * 3 * 3, 10)

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


JOB = conf.offline_job([1.0] * n, strategy="conv_model_parallel", model="small", batch_size=6)


def make_ctx():
    return RunContext.offline(comm, JOB)


def spec(split=WEIGHTS, recalibrate_every=0, layers=None, fuse=True):
    """The training section with this conv-MP block; set after validation: a split of
    another length is refused by the schema, and the strategy must refuse it too."""
    block = JOB.training.strategy.model_copy(update={"split": split, "recalibrate_every": recalibrate_every,
                                                     "layers": layers, "fuse": fuse})
    return JOB.training.model_copy(update={"strategy": block})


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


def against_one_process(ref, c1, c2, step):
    """fc(c2(c1(x))) with distributed c1, c2 against `ref` on step's batch: forward and fc
    gradient differences (at the master), and each conv's largest gradient difference."""
    fc = copy.deepcopy(ref.fc)
    protocol = ShardProtocol([c1, c2], comm)
    x, y = data(step)
    diffs = {}
    if rank == 0:
        logits = fc(c2(c1(x)).flatten(1))
        F.cross_entropy(logits, y).backward()
        protocol.finish()
        ref_logits = ref(x)
        F.cross_entropy(ref_logits, y).backward()
        diffs["forward"] = maxdiff(logits, ref_logits)
        diffs["fc_grad"] = maxdiff(fc.weight.grad, ref.fc.weight.grad)
    else:
        protocol.serve()
    grads = {}
    for name, layer in (("conv1", c1), ("conv2", c2)):
        gw, gb = layer.gather_full((layer.weight.grad, layer.bias.grad))
        if rank == 0:
            r = getattr(ref, name)
            grads[name] = max(maxdiff(gw, r.weight.grad), maxdiff(gb, r.bias.grad))
    return diffs, grads


# 1b. The same with ReLU and pooling inside the shards (each rank on its own channels,
# training.strategies.conv_mp.fuse), rank 0 of 3 again owning no kernel of conv2.
ref = fresh()
chain = [nn.ReLU(), Call(F.max_pool2d, (2,))]
c1 = DistributedConv2d(ref.conv1, comm, splits["conv1"], followers=chain)
c2 = DistributedConv2d(ref.conv2, comm, splits["conv2"], followers=chain)
diffs, out["fused_conv_grads"] = against_one_process(ref, c1, c2, step=1)
if rank == 0:
    out["fused_forward"], out["fused_fc_grad"] = diffs["forward"], diffs["fc_grad"]

# 1c. conv1 linked to conv2 (DistributedConv2d.link_to): conv1's pooled map all-gathered
# on every rank, dX summed rank by rank, with no master in between; a rank owning none of
# conv1's kernels, and rank 0 of 3 none of conv2's.
ref = fresh()
link_splits = {"conv1": {2: [8, 0], 3: [0, 5, 3]}[n], "conv2": splits["conv2"]}
c1 = DistributedConv2d(ref.conv1, comm, link_splits["conv1"], followers=chain)
c2 = DistributedConv2d(ref.conv2, comm, link_splits["conv2"], followers=chain)
c1.link_to(c2)
diffs, out["linked_conv_grads"] = against_one_process(ref, c1, c2, step=2)
if rank == 0:
    out["linked_forward"] = diffs["forward"]


# 2. The strategy: a few SGD steps (momentum, weight decay) equal the single-process run.
def make(strategy_spec, seed=0, build=None):
    s = ConvModelParallelStrategy(make_ctx(), strategy_spec)
    s.setup((build or fresh)(seed), sgd)
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
out["strategy_fused"] = comm.gather(s.fusion.describe() if s.fusion else None, root=0)
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

def against_reference(strategy, steps=2, before_step=lambda step: None, build=fresh):
    """`steps` SGD steps of `strategy` and of a single-process reference from the same
    init on the same data: (the strategy's exported model, the reference) at the master."""
    ref = build()
    ref_opt = sgd(ref.parameters())
    for step in range(steps):
        before_step(step)
        x, y = data(step)
        strategy.train_step(x if rank == 0 else None, y if rank == 0 else None)
        if rank == 0:
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
    return strategy.model_for_export(), ref


# 2b. With `fuse: false` the chain stays on the master: the same steps, as exact.
s_nf = make(spec(fuse=False))
export_nf, ref_nf = against_reference(s_nf)
out["unfused"] = comm.gather([s_nf.fusion is None, [len(layer.followers) for layer in s_nf.layers.values()]], root=0)
if rank == 0:
    out["unfused_weights"] = params_diff(export_nf, ref_nf)

# 2c. Module followers, an in-place ReLU among them, inside nn.Sequential: fused through
# the master's trace, and as exact.
class ModuleCNN(nn.Module):
    input_shape = (3, 12, 12)

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.AvgPool2d(2))
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def fresh_modules(seed=0):
    torch.manual_seed(seed)
    return ModuleCNN()


s_mod = make(spec(layers=["features.0", "features.3"]), build=fresh_modules)
export_mod, ref_mod = against_reference(s_mod, steps=3, build=fresh_modules)
out["modules_fused"] = comm.gather(s_mod.fusion.describe() if s_mod.fusion else None, root=0)
if rank == 0:
    out["modules_weights"] = params_diff(export_mod, ref_mod)

# 2d. In-place ReLUs on what a distributed layer hands the master: after the gathered conv
# outputs (`fuse: false`), and after the classifier's first Linear, run in the shards. They
# were refused: "Output 0 of _AnnounceBackward is a view and is being modified inplace".
class InplaceCNN(ModuleCNN):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(16 * 3 * 3, 32), nn.ReLU(inplace=True), nn.Linear(32, 10))

    def forward(self, x):
        return self.fc(self.features(x))


def fresh_inplace(seed=0):
    torch.manual_seed(seed)
    return InplaceCNN()


out["inplace_weights"] = []
for fuse in (True, False):
    s_ip = make(spec(layers=["features.0", "features.3"], fuse=fuse), build=fresh_inplace)
    export_ip, ref_ip = against_reference(s_ip, steps=3, build=fresh_inplace)
    if rank == 0:
        out["inplace_weights"].append(params_diff(export_ip, ref_ip))

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

# 4b. A checkpoint that keeps the classifier whole on the master (`fuse: false`) does not
# load into a strategy that runs it in the shards: refused on every rank, naming the setting.
buf_nf = io.BytesIO()
torch.save(s_nf.state_dict(), buf_nf)
buf_nf.seek(0)
t_nf = make(spec(), seed=1)
out["kept_classifier"] = comm.gather(refused(lambda: t_nf.load_state_dict(torch.load(buf_nf, weights_only=True))),
                                     root=0)

# 5. Resharding mid-run (what recalibration does) keeps the run exact, momentum included.
s2 = make(spec())
new_split = {"conv1": [1] * (n - 1) + [8 - (n - 1)], "conv2": [16 - (n - 1)] + [1] * (n - 1)}


def reshard_at_step_1(step):
    if step == 1:
        s2._reshard(new_split)


export, ref = against_reference(s2, steps=3, before_step=reshard_at_step_1)
if rank == 0:
    out["reshard"] = params_diff(export, ref)
out["reshard_split"] = comm.gather(s2.layer_split, root=0)

# 6. Calibrated split (no manual split): measured speeds, split agreed by every rank, exact.
s3 = make(spec(split=None, recalibrate_every=2))
export, ref = against_reference(s3)
out["calibrated_split"] = comm.gather(s3.layer_split, root=0)
out["calibrated_speeds"] = comm.gather(s3.speeds, root=0)
out["block"] = comm.gather(s3.block, root=0)
if rank == 0:
    out["calibrated"] = params_diff(export, ref)

# 6b. A run resuming that checkpoint takes its split and speeds at setup: not calibrated again.
import training.strategies.conv_mp.strategy as conv_mp_strategy     # noqa: E402
calibrations, measure_speeds = [], conv_mp_strategy.measure_speeds
conv_mp_strategy.measure_speeds = lambda *a, **k: calibrations.append(1) or measure_speeds(*a, **k)
buf3 = io.BytesIO()
torch.save(s3.state_dict(), buf3)
buf3.seek(0)
state = torch.load(buf3, weights_only=True)
s6 = ConvModelParallelStrategy(make_ctx(), spec(split=None, recalibrate_every=2))
s6.setup(fresh(1), sgd, resumed=state)
s6.load_state_dict(state)
conv_mp_strategy.measure_speeds = measure_speeds
out["resumed_calibration"] = comm.gather([len(calibrations), s6.layer_split == s3.layer_split,
                                          s6.speeds == s3.speeds], root=0)

# 7. Layers with a vector block of kernels per rank (calibrate.kernel_block) split in whole
# blocks where that makes the slowest rank faster: here a manual 1.3 : 1 [: 1] split.
def wide(seed=0):
    torch.manual_seed(seed)
    return SmallCNN(48, 64)


s7 = make(spec(split=[1.3] + [1.0] * (n - 1)), build=wide)
export, ref = against_reference(s7, build=wide)
out["wide_split"] = comm.gather(s7.layer_split, root=0)
if rank == 0:
    out["wide"] = params_diff(export, ref)

report(rank, out)
finish(comm)
