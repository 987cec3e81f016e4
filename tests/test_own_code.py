"""Users' own code, as users bring it: an unmodified torchrun-style DDP script, a loop on
the public API (training.dist), a Horovod script, a notebook function, the user's own model;
what fails or hangs: test_own_code_failures. Real `yarnapp submit`s on the local engine:
real containers, cgroups, MPI world, gloo."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import yarnapp
from own_code_util import GROUPS, JOBS, script_job
from recovery_util import rank_pid
from util import app_id_from, apps, assert_nothing_left, tb_scalars, write_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _ranks(out, n=3):
    return ([torch.load(out / f"rank{r}.pt") for r in range(n)],
            [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)])


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_unmodified_ddp_script_gets_torchruns_environment_survives_a_sigkill_and_its_snapshot_resumes(
        tmp_path, yarnapp_home):
    """A torchrun script, unmodified: the environment torchrun gives it, a rank SIGKILLed after
    its first snapshot, the world restarted and the script resuming from its own snapshot, the
    replicas equal at the end."""
    out = tmp_path / "out"
    out.mkdir()
    groups = [GROUPS[0], {**GROUPS[1], "env": {"MALLOC_TRIM_THRESHOLD_": "1073741824"}}]
    job = {"name": "ddp-kill", "groups": groups, "max_restarts": 2,
           "run": {"script": os.path.join(JOBS, "ddp_train.py"),
                   "args": ["--out", str(out), "--epochs", "6", "--pause", "0.05"]}}
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=1)
    deadline = time.monotonic() + 240
    snapshot = os.path.join(run.status()["app_dir"], "checkpoints", "snapshot.pt")   # $YARNAPP_CHECKPOINT_URI's
    while not os.path.exists(snapshot):                 # at least one epoch is in the snapshot
        assert run.state == "RUNNING" and time.monotonic() < deadline, run.logs()
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    st = run.wait(timeout=400)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert [r["generation"] for r in st["restarts"]] == [1], st["restarts"]
    assert "rank 1 (small_0) killed by signal 9" in st["restarts"][0]["reason"]
    weights, info = _ranks(out)
    assert _equal(weights[0], weights[1]) and _equal(weights[0], weights[2])
    envs = [i["env"] for i in info]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]            # all on this one host
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"} and {e["GROUP_RANK"] for e in envs} == {"0"}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"1"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"1"}
    # launcher.malloc's settings, unless the group sets its own (then none of ours)
    assert [(e["MALLOC_MMAP_THRESHOLD_"], e["MALLOC_TRIM_THRESHOLD_"]) for e in envs] == \
        [(str(32 << 20), str(256 << 20))] + [(None, "1073741824")] * 2
    # the script was shipped: every container ran its own copy, not the repository's
    for c in ("big_0", "small_0", "small_1"):
        assert os.path.isfile(os.path.join(st["app_dir"], "containers", c, "work", "jobs", "ddp_train.py"))
    started = {i["started_at_epoch"] for i in info}
    assert len(started) == 1 and started.pop() >= 1, info          # resumed from its snapshot
    assert "resuming from the snapshot" in run.logs("small_0")["small_0"]
    assert_nothing_left(run.app_id)


def test_a_loop_on_the_public_api_with_vcores_shares_equals_one_process(tmp_path, yarnapp_home):
    """...with its gradient clipped between backward and step, as DDP's and Horovod's users
    do: the sum over the world is complete when backward returns (before, p.grad was the
    bucket being reduced, the clip raced the all-reduce, and the replicas diverged); and
    fine-tuned, a conv frozen when the optimizer was wrapped and unfrozen at step 5, another
    frozen at step 12 (before, the first's gradients were never summed, and the replicas
    diverged; momentum moved the second on zeros)."""
    sys.path.insert(0, JOBS)
    try:
        import user_loop
        expected = user_loop.reference(steps=20, batch=48, clip=0.05, tune=True)
        unclipped = user_loop.reference(steps=20, batch=48, tune=True)
        untuned = user_loop.reference(steps=20, batch=48, clip=0.05)
    finally:
        sys.path.remove(JOBS)
    assert max(float((expected[k] - unclipped[k]).abs().max()) for k in expected) > 1e-3     # the clip bites
    assert float((expected["0.weight"] - untuned["0.weight"]).abs().max()) > 1e-3          # and the schedule
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "SHARES": "vcores", "STEPS": "20", "BATCH": "48", "CLIP": "0.05", "FINETUNE": "1"}
    job = {"name": "user-loop", "groups": [dict(g, env=env) for g in GROUPS], "max_restarts": 0,
           "run": {"function": "user_loop:main", "files": [os.path.join(JOBS, "user_loop.py")]}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    rows = {r: p["rows"] for r, p in st["progress"].items()}
    assert rows == {0: 24, 1: 12, 2: 12}                  # 1 : 0.5 : 0.5 of each 48-row batch
    weights = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    assert _equal(weights[0], weights[1]) and _equal(weights[0], weights[2])      # the replicas, bit for bit
    for r in range(3):
        worst = max(float((weights[r][k] - expected[k]).abs().max()) for k in expected)
        assert worst < 1e-5, (r, worst)
    assert_nothing_left(run.app_id)


def test_a_horovod_script_ported_by_its_import_line_trains_as_one_process(tmp_path, yarnapp_home):
    """A Horovod user changed `import horovod.torch as hvd` to `import training.dist as hvd`
    and met AttributeErrors one submit at a time (hvd.Average, hvd.Compression, then, after
    the whole training, hvd.allgather) and TypeErrors (op=, compression=). Horovod's names
    are there now, and those not offered say in one line what to do instead. Gradients
    flow back through allgather, allreduce and broadcast as through Horovod's (a loss over
    every rank's outputs trains as one process does; they were refused, then detached)."""
    sys.path.insert(0, JOBS)
    try:
        import horovod_port
        expected = horovod_port.reference(3)
    finally:
        sys.path.remove(JOBS)
    out = tmp_path / "out"
    out.mkdir()
    job = {"name": "hvd-port", "groups": [dict(g, env={"OUT": str(out)}) for g in GROUPS], "max_restarts": 0,
           "run": {"script": os.path.join(JOBS, "horovod_port.py")}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    weights, said = _ranks(out)
    assert _equal(weights[0], weights[1]) and _equal(weights[0], weights[2])      # the replicas, bit for bit
    assert max(float((weights[0][k] - expected[k]).abs().max()) for k in expected) < 1e-5
    assert {(s["initialized"], s["cross_rank"], s["cross_size"], s["nccl"]) for s in said} == {(True, 0, 1, False)}
    assert {(tuple(s["sum"]), tuple(s["average"]), tuple(s["scaled"])) for s in said} == {((3.0,), (1.0,), (3.0,))}
    assert all(s["gathered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
               and s["broadcast"] == [1.0] and s["bf16"] == [2.0] for s in said), said[0]
    # backward through allgather: its gradients summed over the world (1 + 2 + 3), this rank's rows;
    # through broadcast: the sum for the root (rank 1), nothing for the others
    assert [s["gather_grad"] for s in said] == [[[6.0, 6.0]] * (r + 1) for r in range(3)], said
    assert [s["broadcast_grad"] for s in said] == [[0.0], [6.0], [0.0]], said
    # through allreduce: the gradients reduced as the tensor was (Sum x 2 x 0.25; Average)
    assert [s["allreduce_grads"] for s in said] == [[3.0, 2.0]] * 3, said
    assert said[0]["join"] == ("AttributeError: training.dist has no join (Horovod's): every rank must run the same "
                               "steps; ShareSampler gives each rank the same number of batches (docs/own-code.md)")
    assert said[0]["adasum"].startswith("ValueError: allreduce: op='Adasum' is not offered"), said[0]
    assert said[0]["fp16"].startswith("ValueError: DistributedOptimizer: compression='fp16' is not offered"), said[0]
    assert_nothing_left(run.app_id)


def test_a_horovod_name_not_offered_is_said_at_submit_naming_its_line(cli, tmp_path, yarnapp_home):
    """`hvd.join()` after the training failed the rank there, the training lost: the client
    reads the script (and a run.function's module) before anything starts and warns (not
    refuses: a use may be guarded, `if hasattr(hvd, "join")`)."""
    src = ("import torch\nimport training.dist as hvd\n\nhvd.init()\nfor step in range(3):\n"
           "    hvd.allreduce(torch.ones(1))\nhvd.join()\n")
    job = script_job(tmp_path, "port", src)
    proc = cli("submit", job, "--dry-run")
    assert proc.returncode == 0 and proc.stderr == (
        f"WARNING yarnapp.codecheck: run.script: {tmp_path / 'code' / 'port.py'}:7: hvd.join: training.dist has no "
        "join (Horovod's): every rank must run the same steps; ShareSampler gives each rank the same number of "
        "batches (docs/own-code.md); the rank fails there if it runs it\n"), proc.stderr
    (tmp_path / "code" / "mod.py").write_text("from training.dist import SyncBatchNorm\nfrom .training import dist\n"
                                              "\n\ndef main(ctx):\n    dist.join()\n")
    job = write_job(tmp_path / "fn.yaml", {"name": "fn", "groups": GROUPS,
                                           "run": {"function": "mod:main", "files": [str(tmp_path / "code" / "mod.py")]}})
    proc = cli("submit", job, "--dry-run")
    assert proc.returncode == 0 and proc.stderr.count("WARNING") == 1 and "run.function: " in proc.stderr \
        and "mod.py:1: SyncBatchNorm: training.dist has no SyncBatchNorm (Horovod's)" in proc.stderr, proc.stderr
    # values it has but refuses where passed, and a keyword at its default only: each use
    # (only the first name was said; these, not at all)
    src = ("import torch\nimport training.dist as hvd\n\nopt = hvd.DistributedOptimizer(torch.optim.SGD([], lr=1),\n"
           "    backward_passes_per_step=2, op=hvd.Adasum, compression=hvd.Compression.fp16)\n"
           "hvd.DistributedOptimizer(torch.optim.SGD([], lr=1), backward_passes_per_step=1)\nhvd.join()\nhvd.join()\n")
    proc = cli("submit", script_job(tmp_path, "port", src), "--dry-run")
    said = [line.split(": ", 3)[2:] for line in proc.stderr.splitlines()]
    assert proc.returncode == 0 and [s[0] for s in said] == [
        f"{tmp_path / 'code' / 'port.py'}:{n}" for n in (7, 8, 5, 5, 5)], proc.stderr
    assert [s[1].split(":")[0] for s in said[2:]] == [
        "hvd.Adasum", "hvd.Compression.fp16", "hvd.DistributedOptimizer(backward_passes_per_step=...)"], proc.stderr
    assert apps(yarnapp_home) == []
    # Horovod itself, unported: its init() here makes each rank a world of one (a migration audit:
    # it passed --dry-run, then the ranks failed on ModuleNotFoundError, no word of the port)
    proc = cli("submit", script_job(tmp_path, "unported", "import os\nimport horovod.torch as hvd\nhvd.init()\n"),
               "--dry-run")
    assert proc.returncode == 0 and proc.stderr == (
        f"WARNING yarnapp.codecheck: run.script: {tmp_path / 'code' / 'unported.py'}:2: imports Horovod, whose init() "
        "here (no horovodrun) makes each rank a world of one; yarnapp's Horovod-style API takes the same calls: "
        "`import training.dist as hvd` (docs/own-code.md)\n"), proc.stderr


def test_a_snapshot_saved_and_loaded_by_a_relative_path_is_warned_of_at_submit(cli, tmp_path, yarnapp_home):
    """The PyTorch fault-tolerance tutorial's snapshot.pt, relative: each container's own work
    directory holds it, so after a restart rank 0 resumed at epoch 2 and rank 1 at 0, and the
    failure named a rank that "had ended" (an audit's). A path under a directory is not said."""
    src = ("import os, torch\n\n\ndef main(snapshot_path='snapshot.pt'):\n    if os.path.exists(snapshot_path):\n"
           "        torch.load(snapshot_path)\n    torch.save({}, snapshot_path)\n\n\nmain()\n")
    proc = cli("submit", script_job(tmp_path, "tutorial", src), "--dry-run")
    assert proc.returncode == 0 and proc.stderr == (
        f"WARNING yarnapp.codecheck: run.script: {tmp_path / 'code' / 'tutorial.py'}:4: 'snapshot.pt' is a relative "
        "path: each container runs in its own work directory, so a restarted rank would not find another rank's "
        "snapshot there; keep it under $YARNAPP_CHECKPOINT_URI, e.g. os.path.join(os.environ[\"YARNAPP_CHECKPOINT_URI"
        "\"], 'snapshot.pt') (docs/own-code.md)\n"), proc.stderr
    src = src.replace("snapshot_path='snapshot.pt'", "snapshot_path=os.path.join(os.environ['YARNAPP_CHECKPOINT_URI'], "
                                                     "'snapshot.pt')")
    proc = cli("submit", script_job(tmp_path, "tutorial", src), "--dry-run")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert apps(yarnapp_home) == []


def test_outside_a_container_training_dist_is_a_world_of_one():
    """`python train.py`, a Horovod user's smoke test (Horovod runs as size 1 without
    horovodrun), failed with NoContext: outside a container the world is the process alone."""
    code = ("import torch\nimport training.dist as hvd\nhvd.init()\nnet = torch.nn.Linear(4, 2)\n"
            "hvd.broadcast_parameters(net.state_dict(), root_rank=0)\n"
            "opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net)\n"
            "net(torch.ones(3, 4)).sum().backward()\nopt.step()\n"
            "print(hvd.rank(), hvd.size(), float(hvd.allreduce(torch.tensor([2.0]))[0]), hvd.allgather_object(5))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YARNAPP_RANK", "YARNAPP_APP_ID", "SKEIN_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout) == (0, "0 1 2.0 [5]\n"), out.stderr
    assert out.stderr == "training.dist: not in a yarnapp container: a world of this process alone (`yarnapp " \
                         "submit` runs it on the job's containers)\n", out.stderr


def test_distributed_optimizer_mistakes_are_one_line_each():
    """Horovod users' slips, in a world of one: a generator for the optimizer, wrapping the
    same optimizer or model twice (before, one silently trained worse, the other failed
    naming GradientReducer.begin()), a second backward before step (its gradient would be
    this rank's alone), and a root rank the world does not have (MPI's error stack)."""
    code = (
        "import torch\nfrom mpi4py import MPI\nimport training.dist as yd\n"
        "from training.context import RankInfo, RunContext\n"
        "me = RankInfo(rank=0, group='w', instance=0, container='w_0', vcores=1.0, memory_mib=512, gpus=0)\n"
        "ctx = RunContext(comm=MPI.COMM_SELF, rank=0, world_size=1, ranks=[me], job=None, app_id='a', "
        "generation=0, workdir='.', checkpoint_uri='', logdir='')\n"
        "def said(f):\n    try:\n        f()\n    except Exception as e:\n        print(type(e).__name__, e)\n"
        "said(yd.barrier)\n"                 # in a rank process (YARNAPP_RANK) before its context: none to init from
        "from training.context import _set_current\n_set_current(ctx)\n"
        "yd.barrier()\nprint('without init(), in a rank:', yd.rank(), yd.size())\n"     # init()s itself
        "yd.init(ctx)\nprint(\"Horovod's name=:\", float(yd.allreduce(torch.tensor([2.0]), name='loss')[0]), "
        "yd.broadcast_object(3, name='x'), yd.allgather_object(4, name='y'))\n"
        "net = torch.nn.Linear(4, 2)\n"
        "said(lambda: yd.DistributedOptimizer(net.parameters(), model=net))\n"
        "said(lambda: yd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), backward_passes_per_step=2))\n"
        "opt = yd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net)\n"
        "said(lambda: yd.DistributedOptimizer(opt, model=net))\n"
        "said(lambda: yd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net))\n"
        "x = torch.randn(3, 4)\nnet(x).sum().backward()\n"
        "said(lambda: net(x).sum().backward())\n"
        "opt.zero_grad()\nnet(x).sum().backward()\n"          # GradScaler skipped the step: zero_grad goes on
        "print('after a step not taken, zero_grad() starts the next:', net.weight.grad is not None)\n"
        "opt.step()\nopt.zero_grad()\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "net2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "opt2 = yd.DistributedOptimizer(torch.optim.SGD(net2.parameters(), lr=0.1), model=net2)\n"
        "checkpoint(net2[1], net2[0](x), use_reentrant=True).sum().backward()\n"    # a nested backward inside
        "print('reentrant checkpointing:', all(p.grad is not None for p in net2.parameters()))\nopt2.step()\n"
        "said(lambda: yd.broadcast_parameters(net.state_dict(), root_rank=3))\n"
        "said(lambda: yd.broadcast_parameters(net.state_dict(), root_rank='0'))\n"
        "ctx.ranks = [me, RankInfo(1, 'w', 1, 'w_1', 0.5, 512, 0), RankInfo(2, 'w', 2, 'w_2', 0.5, 512, 0)]\n"
        "ctx.world_size = 3\n"
        "said(lambda: yd.ShareSampler(100, batch_size=2, shares='vcores', ctx=ctx))\n"
        "for r in range(3):\n"
        "    ctx.rank = r\n"
        "    kept, dropped = (yd.ShareSampler(n, 8, shares='vcores', ctx=ctx, drop_last=False) for n in (19, 17))\n"
        "    print('rank', r, [len(b) for b in kept], [len(b) for b in dropped], len(kept), len(dropped))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, YARNAPP_RANK="0"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "NoContext no yarnapp RunContext: this code must run inside a yarnapp container (yarnapp submit)",
        "without init(), in a rank: 0 1",
        "Horovod's name=: 2.0 3 [4]",
        "TypeError DistributedOptimizer: expected a torch.optim.Optimizer, got generator; wrap the optimizer: "
        "DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=...), model=model)",
        "TypeError DistributedOptimizer(backward_passes_per_step=2): Horovod's accumulation over backward passes is "
        "not offered; add up the micro-batches' losses and call backward() once per step (docs/own-code.md)",
        "RuntimeError DistributedOptimizer: this optimizer is distributed already (DistributedOptimizer was called "
        "on it before); call it once per optimizer",
        "RuntimeError DistributedOptimizer: 2 of these parameters are reduced by another DistributedOptimizer "
        "already (each would sum their gradients); wrap one optimizer per model, or leave out model= so that "
        "each wraps its own optimizer's parameters",
        "RuntimeError a second backward before optimizer.step() or zero_grad(): its gradients would be this "
        "rank's alone; call backward once per step (to accumulate gradients, accumulate the loss and call "
        "backward once)",
        "after a step not taken, zero_grad() starts the next: True",
        "reentrant checkpointing: True",
        "ValueError root_rank 3: the world's ranks are 0 to 0",
        "TypeError root_rank: expected a rank (an int), got str '0'",
        "ValueError batch_size 2 leaves rank(s) 2 without rows of a batch (shares [1.0, 0.5, 0.5]); give a "
        "batch_size of 4 or more",
        # a last partial batch of 3 rows gives each rank one; of 1 row it would leave two with none: dropped
        "rank 0 [4, 4, 1] [4, 4] 3 2", "rank 1 [2, 2, 1] [2, 2] 3 2", "rank 2 [2, 2, 1] [2, 2] 3 2"], out.stdout


def test_a_users_model_factory_with_nested_options_trains_in_the_built_in_runner(digits, tmp_path, yarnapp_home,
                                                                                 monkeypatch):
    """...and the notebook that submitted it uses the trained model: Run.model() builds it
    with the user's factory and options, and predicts as the run's evaluation did (before,
    only a state_dict, with the normalisation to be found in the dataset's side files). Its
    BatchNorm too: each rank scored its test rows with its own statistics, so the final
    figures were not the saved model's (rank 0's)."""
    job = {"name": "user-model", "max_restarts": 0,
           "groups": [{"name": "big", "instances": 1, "vcores": 1, "memory": "2 GiB"},
                      {"name": "small", "instances": 1, "vcores": 0.5, "memory": "2 GiB"}],
           "run": {"files": [os.path.join(JOBS, "user_model.py")]},
           "training": {"model": "user_model:make_net",
                        "model_options": {"hidden": 16, "block": {"kind": "tanh", "dropout": 0.1}, "norm": True},
                        "data": {"train": f"{digits}/train", "test": f"{digits}/test"},
                        "batch_size": 64, "epochs": 4, "shares": "vcores"},
           "checkpoint": {"uri": str(tmp_path / "ckpt")}}
    run = yarnapp.submit(job)
    with pytest.raises(yarnapp.YarnappError, match=rf"^{run.app_id} is still (ACCEPTED|RUNNING): its final model is "
                                                   rf"written as its training ends; wait\(\) for it first$") as e:
        run.model()                 # (an API audit: "no final model ... its checkpoints are step-* beside")
    assert e.value.app_id == run.app_id
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert st["final"]["accuracy"] > 0.9, st["final"]
    from training.checkpoint import load_final
    weights = load_final(str(tmp_path / "ckpt"))
    assert weights["0.weight"].shape == (16, 1, 3, 3)          # hidden=16 reached the factory
    monkeypatch.syspath_prepend(JOBS)                           # the user's package, as in their notebook
    trained = yarnapp.Run(run.app_id).model()                   # a handle from the id alone
    assert trained.classes == [str(i) for i in range(10)] and trained.module[0].weight.shape == (16, 1, 3, 3)
    from training.data.source import ParquetSource
    images, labels = ParquetSource(f"{digits}/test").read_arrays()      # uint8 N x C x H x W
    accuracy = float((trained.predict(images) == labels).mean())
    assert abs(accuracy - st["final"]["accuracy"]) <= 1 / len(labels), (accuracy, st["final"])
    loss = float(torch.nn.functional.cross_entropy(trained.logits(images), torch.as_tensor(labels).long()))
    assert loss == pytest.approx(st["final"]["loss"], rel=1e-5), (loss, st["final"])
    with pytest.raises(ValueError, match=r"images must be uint8 N x 1 x H x W \(or N x H x W\), got float32"):
        trained.predict(images.astype(np.float32))
    assert_nothing_left(run.app_id)


def test_ctx_init_process_group_joins_the_gloo_group_the_launcher_prepared(yarnapp_home):
    job = {"name": "pg", "groups": GROUPS, "max_restarts": 0,
           "run": {"function": "user_model:process_group", "files": [os.path.join(JOBS, "user_model.py")]}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert st["final"] == {"sum": 6.0, "backend": "gloo", "world": 3}
    with pytest.raises(yarnapp.YarnappError, match=r"ran its own code \(user_model:process_group\), which saves its "
                                                   r"models itself; Run.model\(\) is the built-in runner's$"):
        run.model()
    assert_nothing_left(run.app_id)


def test_a_groups_env_reaches_its_ranks_as_written_and_its_thread_counts_are_kept(cli, tmp_path, monkeypatch):
    """A power user's audit: `OMP_NUM_THREADS: 2` in a group's env was replaced by the
    vcores' 1 (torch's threads too), and `PYVER: 3.10` arrived as "3.1". The submitting
    shell's own OMP_NUM_THREADS is not a container's."""
    out = tmp_path / "out"
    out.mkdir()
    src = ("import json, os, torch\nfrom training.context import current\n"
           f"json.dump([os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'PYVER')] + "
           f"[torch.get_num_threads()], open('{out}/rank%d' % current().rank, 'w'))\n")
    (tmp_path / "env.py").write_text(src)
    path = tmp_path / "env.yaml"        # (as a user writes it: YAML's numbers)
    path.write_text(f"name: env\nmax_restarts: 0\nrun: {{script: {tmp_path / 'env.py'}}}\ngroups:\n"
                    "- {name: big, instances: 1, vcores: 0.5, memory: 1 GiB, env: {OMP_NUM_THREADS: 2, PYVER: 3.10}}\n"
                    "- {name: small, instances: 1, vcores: 0.5, memory: 1 GiB, env: {MKL_NUM_THREADS: 3}}\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    cli("submit", path, "--wait", check=0)
    big, small = (json.loads((out / f"rank{r}").read_text()) for r in range(2))
    assert big == ["2", "2", "3.10", 2] and small[:3] == ["1", "3", None], (big, small)


def test_files_a_script_writes_have_the_submitters_umask(cli, tmp_path):
    """A script's torch.save() outside the application wrote -rw------- (the local engine
    keeps its own files under umask 077, and the code inherited it), where `python train.py`
    or a YARN container writes -rw-r--r--: a shared output directory could not read it."""
    out = tmp_path / "out"
    out.mkdir()
    job = script_job(tmp_path, "writes", f"from training.context import current\n"
                                          f"open('{out}/rank%d' % current().rank, 'w').close()\n",
                      groups=[GROUPS[0]])
    umask = os.umask(0o022)         # the submitter's (the yarnapp it starts inherits it)
    try:
        cli("submit", job, "--wait", check=0)
    finally:
        os.umask(umask)
    assert oct(stat.S_IMODE(os.stat(out / "rank0").st_mode)) == oct(0o644)


def test_a_script_shipped_with_its_directory_runs_in_it_and_opens_files_beside_it(yarnapp_home, tmp_path):
    """`python train.py` in its directory opens data.txt beside it; so does the script as
    shipped by default (its directory, run.files unset) and submitted from there. Before, it
    ran in the container's working directory, one level up: FileNotFoundError: 'data.txt'."""
    job = script_job(tmp_path, "train", "import os\nfrom training import context\n"
                                         "with open('data.txt') as f:\n    n = int(f.read())\n"
                                         "import numpy, torch\n"      # numbers a loop has at hand (they crashed it)
                                         "context.current().final(n=numpy.int64(n + 1), beside=os.path.isfile('train.py'),"
                                         " loss=torch.tensor(0.5), acc=numpy.float32(0.75))\n",
                      groups=GROUPS[:1], files={"data.txt": "41\n"})
    proc = subprocess.run([sys.executable, "-m", "yarnapp.cli", "submit", str(job), "--wait"], cwd=tmp_path / "code",
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))   # from its directory
    assert proc.returncode == 0, proc.stdout + proc.stderr
    app = app_id_from(proc.stdout)
    assert yarnapp.status(app)["final"] == {"n": 42, "beside": True, "loss": 0.5, "acc": 0.75}
    assert_nothing_left(app)


def test_a_function_whose_module_calls_init_at_its_top_as_under_horovod_runs(cli, tmp_path):
    """`import training.dist as yd; yd.init()` at a run.function module's top: the module
    was imported before the world formed, and every rank failed "no yarnapp RunContext:
    this code must run inside a yarnapp container" (inside one), with no reason in the
    failure line; os.environ["LOCAL_RANK"] there raised KeyError. It is imported again
    once the context and the environment are set; a module whose top level raises for its
    own reasons fails before the world forms, with its line, once."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "modinit.py").write_text(
        "import os\nimport torch\nimport training.dist as yd\nLOCAL = int(os.environ['LOCAL_RANK'])\n"
        "ctx0 = yd.init()\nRANK = yd.rank()\n\n"
        "def main(ctx):\n    s = yd.allreduce(torch.tensor([float(RANK)]), average=False)\n"
        "    ctx.final(sum=float(s[0]), same=ctx is ctx0)\n")
    (code / "broken.py").write_text("raise ValueError('a setting this module needs is missing')\n\n"
                                    "def main(ctx):\n    pass\n")
    for name in ("modinit", "broken"):
        write_job(tmp_path / f"{name}.yaml", {"name": name, "groups": GROUPS[:1] + [dict(GROUPS[1], instances=1)],
                                              "max_restarts": 2, "run": {"function": f"{name}:main",
                                                                         "files": [str(code / f"{name}.py")]}})
    proc = cli("submit", tmp_path / "modinit.yaml", "--wait", check=0)
    assert "final: " in proc.stdout and "sum=1" in proc.stdout and "same=True" in proc.stdout, proc.stdout
    proc = cli("submit", tmp_path / "broken.yaml", "--wait", check=1)
    err = proc.stderr.strip().splitlines()[-1]
    assert "ValueError: a setting this module needs is missing" in err and "after 1 attempt(s)" in err, err
    for app in (app_id_from(proc.stdout + proc.stderr),):
        assert_nothing_left(app)


def test_a_notebook_function_using_a_local_module_takes_it_along(tmp_path, yarnapp_home):
    """cloudpickle sends a __main__ function by value but what it uses from other modules
    by name, and the containers lack a module beside the notebook. Before, every rank
    failed: "No module named 'mylocal'", and the user had to add run.files. Now what the
    function uses from such modules (a module, a function, a class) travels by value; a
    job that ships the module in run.files still imports it by name there."""
    (tmp_path / "mylocal.py").write_text("class Scale:\n    k = 3\n\ndef value():\n    return 7\n")
    (tmp_path / "nb.py").write_text(
        "import yarnapp\nimport mylocal\nfrom mylocal import Scale\n\n"
        "def f(ctx):\n    import sys\n"
        "    ctx.final(value=mylocal.value() * Scale.k, imported='mylocal' in sys.modules)\n\n"
        "job = {'name': 'nb', 'groups': [{'name': 'w', 'instances': 1, 'vcores': 0.5}], 'max_restarts': 0}\n"
        "run = yarnapp.submit(job, function=f, wait=True, progress=False)\n"
        "print('BY VALUE:', run.final)\n"
        "run = yarnapp.submit(job, function=f, wait=True, progress=False, run={'files': ['mylocal.py']})\n"
        "print('SHIPPED:', run.final)\n"
        "import types, sys\n"     # a cell's module of a notebook tool: exec'd, with no file to import
        "cell = sys.modules['nbcell'] = types.ModuleType('nbcell')\n"
        "exec(compile('import mylocal\\ndef g(ctx):\\n    return {\"v\": mylocal.value() * 2}\\n', '<ipython-input-1>',\n"
        "             'exec'), cell.__dict__)\n"
        "run = yarnapp.submit(job, function=cell.g, wait=True, progress=False)\n"
        "print('IN MEMORY:', run.final)\n")
    proc = subprocess.run([sys.executable, "nb.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BY VALUE: {'value': 21, 'imported': False}" in proc.stdout, proc.stdout
    assert "SHIPPED: {'value': 21, 'imported': True}" in proc.stdout, proc.stdout
    assert "IN MEMORY: {'v': 14}" in proc.stdout, proc.stdout     # (failed: No module named 'nbcell')
    for app in apps(yarnapp_home):
        assert_nothing_left(app)


def test_reports_with_or_without_a_step_show_in_submit_wait(cli, tmp_path):
    """report(epoch=..., loss=...) without step= showed nothing while `submit --wait` waited;
    with step=, a metric of the user's own (lr) was left out. And what rank 0's code prints
    shows as it comes, as under torchrun (it was in the containers' logs only), yarnapp's
    own lines and the other ranks' output left out."""
    job = script_job(tmp_path, "epochs", "import time\nfrom training import context\nctx = context.current()\n"
                                          "for epoch in range(2):\n    ctx.report(epoch=epoch, loss=1.5 - epoch)\n"
                                          "    print(f'epoch {epoch} on rank {ctx.rank}', flush=True)\n"
                                          "    time.sleep(1.5)\n"
                                          "ctx.report(step=3, total_steps=3, lr=0.01)\ntime.sleep(1.5)\n",
                      groups=GROUPS[:2])
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0: epoch=1 loss=0.5 restarts=0" in proc.stderr, proc.stderr
    assert "step 3/3 lr=0.01 restarts=0" in proc.stderr, proc.stderr
    shown = [line for line in proc.stderr.splitlines() if line.startswith("big_0| ")]
    assert shown == ["big_0| epoch 0 on rank 0", "big_0| epoch 1 on rank 0"], proc.stderr
    assert "on rank 1" not in proc.stderr, proc.stderr


def test_a_functions_reports_are_tensorboard_scalars_and_its_return_value_its_result(tmp_path, yarnapp_home):
    """Own code had no TensorBoard at all (only the built-in runner wrote events, while
    `Run.tensorboard()` served an empty folder), and a notebook function's return value was
    dropped. Rank 0's reported numbers (numpy's too) are now report/<name> at their step, and
    its return value, with no ctx.final, is the run's final."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def train(ctx):
        import numpy as np

        import training.dist as yd
        yd.init()
        for step in range(1, 6):
            yd.report(step=step, loss=np.float32(1.0 / step), note="not a number", rank_seen=ctx.rank)
        if ctx.rank == 0:                           # a writer of one's own, in the application's run
            from torch.utils.tensorboard import SummaryWriter
            with SummaryWriter(ctx.run_logdir) as w:
                w.add_scalar("mine/value", 7.0, 1)
        import torch           # what a loop reduces besides gradients (they raised TypeError, AttributeError)
        count = yd.allreduce(torch.tensor([ctx.rank + 1]))               # an int's average: float64
        total = yd.allreduce_(torch.tensor([ctx.rank + 1]), average=False)   # an int's sum, in place
        model = torch.nn.Linear(2, 1)
        yd.broadcast_parameters(model)                                   # a model, not its state_dict
        mine = model.weight.detach().numpy().tobytes()
        same = all(theirs == mine for theirs in yd.allgather_object(mine))        # bit for bit on every rank
        return {"acc": 0.75, "steps": np.int64(5), "weights": np.zeros(10_000),     # an array is left out,
                "model": model,             # and a model (was kept as its text: "Linear(in_features=2, ...)")
                "mean_rank": float(count), "sum_rank": int(total), "n": float(yd.allreduce(1.0, average=False)),
                "same": float(same)}
    logdir = tmp_path / "tb"
    # what was left out is said where a notebook looks: a warning of wait() (was: rank 0's log only)
    with pytest.warns(RuntimeWarning, match=r"app_\w+: warning \(rank 0\): the function's return value: weights "
                                            r"\(ndarray of shape \(10000,\)\), model \(Linear\) not kept \(only numbers"):
        run = yarnapp.submit({"name": "fn-tb", "groups": GROUPS[:2], "max_restarts": 0,
                              "tensorboard": {"logdir": str(logdir)}}, function=train, wait=True, progress=False)
    assert run.final == {"acc": 0.75, "steps": 5, "mean_rank": 2.0, "sum_rank": 6, "n": 3.0, "same": 1.0}, run.final
    tb = EventAccumulator(str(logdir / run.app_id), size_guidance={"scalars": 0})
    tb.Reload()
    assert tb_scalars(logdir / run.app_id, "report/loss")[0] == (1, 1.0)       # as TensorBoard's server reads it
    assert sorted(tb.Tags()["scalars"]) == ["final/acc", "final/mean_rank", "final/n", "final/same", "final/steps",
                                            "final/sum_rank", "mine/value", "report/loss", "report/rank_seen"]
    assert os.listdir(logdir) == [run.app_id]           # nothing in the experiment's own directory
    assert [(e.step, round(e.value, 4)) for e in tb.Scalars("report/loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333),
                                                                                (4, 0.25), (5, 0.2)]
    assert {e.value for e in tb.Scalars("report/rank_seen")} == {0.0}          # rank 0's
    assert [e.step for e in tb.Scalars("final/acc")] == [5]
    assert_nothing_left(run.app_id)


