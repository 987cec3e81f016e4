"""Conv-layer model parallelism with ranks on the GPU against the CPU-only reference
(tests/test_conv_mp.py, where CUDA is available): 2 ranks."""
import copy

import torch
import torch.nn.functional as F

import conf
from launcher.world import join_local
from training.context import RunContext
from training.models import build_model
from training.probes import finish, report
from training.strategies.conv_mp.strategy import ConvModelParallelStrategy

torch.backends.cudnn.allow_tf32 = False          # compare fp32 with fp32
comm, rank, _ = join_local()


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


out = {}
for gpus in ([0, 1], [1, 0], [1, 1]):           # worker, master, both on the GPU
    job = conf.offline_job([1.0, 1.0], gpus=gpus, strategy={"name": "conv_model_parallel", "split": [3.0, 1.0]},
                           model="seed_cnn", batch_size=8)
    spec = job.training
    ctx = RunContext.offline(comm, job)
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
report(rank, out)
finish(comm)
