"""A data-parallel strategy on 3 ranks, each on the device its `gpus` gives it (a GPU rank
where CUDA is available), against one process on the whole global batch: the largest
difference of parameters after 3 SGD steps, and each rank's device. Args JSON:
{"strategy": "allreduce" | "ps_central" | "ps_sharded", "gpus": [g0, g1, g2],
 "precision": "fp32" | "bf16" | "fp16", "shares": [w0, w1, w2]}."""
import copy
import json
import sys

import torch
import torch.nn.functional as F

import conf
from launcher.world import join_local
from training import strategies
from training.context import RunContext
from training.models import build_model
from training.probes import finish, report

torch.backends.cudnn.allow_tf32 = False          # compare fp32 with fp32
torch.backends.cuda.matmul.allow_tf32 = False
args = json.loads(sys.argv[1])
comm, rank, size = join_local()
job = conf.offline_job([1.0] * size, gpus=args["gpus"], strategy=args["strategy"], model="seed_cnn",
                       batch_size=12, shares=args.get("shares", "equal"), precision=args.get("precision", "fp32"))
spec = job.training
ctx = RunContext.offline(comm, job)


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


torch.manual_seed(0)
model = build_model("seed_cnn", (3, 16, 16), 10, {"conv1": 8, "conv2": 16, "kernel": 3})
ref = copy.deepcopy(model)
ref_opt = sgd(ref.parameters())
s = strategies.get(spec.strategy.name)(ctx, spec)
s.setup(model, sgd)
losses = []
for step in range(3):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(12, 3, 16, 16, generator=g), torch.randint(0, 10, (12,), generator=g)
    lo, hi = s.batch_slice(12)
    st = s.train_step(x[lo:hi], y[lo:hi])
    losses.append(st.loss)
    ref_opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
mine = {n: p.detach().cpu() for n, p in s.model.named_parameters()}
worst = max(float((mine[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
out = comm.gather({"device": s.device.type, "worst": worst, "losses": losses}, root=0)
s.close()
report(rank, out)
finish(comm)
