"""Users' own code, as users bring it: an unmodified torchrun-style DDP script, a loop on
the public API (training.dist), a deterministic startup error. Real `yarnapp submit`s on
the local engine: real containers, cgroups, MPI world, gloo."""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml

import yarnapp
from recovery_util import rank_pid
from util import app_id_from, apps, assert_nothing_left, tb_scalars, until, write_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
GROUPS = [{"name": "big", "instances": 1, "vcores": 1, "memory": "2 GiB"},
          {"name": "small", "instances": 2, "vcores": 0.5, "memory": "2 GiB"}]


def _script_job(tmp_path, name, source, groups=GROUPS, max_restarts=0, files=None, **extra):
    """job.yaml of `run.script: code/<name>.py` holding `source` ({name: text} of other files beside it)."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    for fname, text in (files or {}).items():
        (code / fname).write_text(text)
    (code / f"{name}.py").write_text(source)
    return write_job(tmp_path / f"{name}.yaml", {"name": name, "groups": groups, "max_restarts": max_restarts,
                                                 "run": {"script": str(code / f"{name}.py")}, **extra})


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
    job = _script_job(tmp_path, "port", src)
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
    proc = cli("submit", _script_job(tmp_path, "port", src), "--dry-run")
    said = [line.split(": ", 3)[2:] for line in proc.stderr.splitlines()]
    assert proc.returncode == 0 and [s[0] for s in said] == [
        f"{tmp_path / 'code' / 'port.py'}:{n}" for n in (7, 8, 5, 5, 5)], proc.stderr
    assert [s[1].split(":")[0] for s in said[2:]] == [
        "hvd.Adasum", "hvd.Compression.fp16", "hvd.DistributedOptimizer(backward_passes_per_step=...)"], proc.stderr
    assert apps(yarnapp_home) == []
    # Horovod itself, unported: its init() here makes each rank a world of one (a migration audit:
    # it passed --dry-run, then the ranks failed on ModuleNotFoundError, no word of the port)
    proc = cli("submit", _script_job(tmp_path, "unported", "import os\nimport horovod.torch as hvd\nhvd.init()\n"),
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
    proc = cli("submit", _script_job(tmp_path, "tutorial", src), "--dry-run")
    assert proc.returncode == 0 and proc.stderr == (
        f"WARNING yarnapp.codecheck: run.script: {tmp_path / 'code' / 'tutorial.py'}:4: 'snapshot.pt' is a relative "
        "path: each container runs in its own work directory, so a restarted rank would not find another rank's "
        "snapshot there; keep it under $YARNAPP_CHECKPOINT_URI, e.g. os.path.join(os.environ[\"YARNAPP_CHECKPOINT_URI"
        "\"], 'snapshot.pt') (docs/own-code.md)\n"), proc.stderr
    src = src.replace("snapshot_path='snapshot.pt'", "snapshot_path=os.path.join(os.environ['YARNAPP_CHECKPOINT_URI'], "
                                                     "'snapshot.pt')")
    proc = cli("submit", _script_job(tmp_path, "tutorial", src), "--dry-run")
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


def test_ranks_that_freeze_apart_fail_in_one_line_instead_of_summing_other_tensors(tmp_path, yarnapp_home):
    """Rank 1 alone freezes a layer (its own validation loss said so): its sums would have
    lined up against other tensors of its peers, or waited for sums they never start."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "SHARES": "vcores", "STEPS": "6", "BATCH": "48", "FINETUNE": "apart"}
    job = {"name": "apart", "groups": [dict(g, env=env) for g in GROUPS], "max_restarts": 0,
           "run": {"function": "user_loop:main", "files": [os.path.join(JOBS, "user_loop.py")]}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=300)
    assert st["state"] == "FAILED", run.logs()
    assert "the ranks disagree on which parameters are trainable this step" in run.failure_message(), \
        run.failure_message()
    assert_nothing_left(run.app_id)


@pytest.mark.parametrize("broadcast,says", [
    ("rank0", ["the ranks' first collectives of training.dist differ (rank(s) 0 in broadcast_parameters("
               "root_rank=0); rank(s) 1, 2 in DistributedOptimizer): every rank calls them"]),
    ("rank0_late", ["the ranks wait in different collectives of training.dist, which never meet: rank 0 (big_0) in "
                    "broadcast_parameters(root_rank=0) (call 2 of training.dist, at user_loop.py:",
                    "ranks 1 (small_0), 2 (small_1) in optimizer #1's sum of gradients (backward, or step()) (call 2 of "
                    "training.dist, "
                    "at user_loop.py:", "every attempt would make the same calls, so it was not retried"]),
    ("none", ["at the first step the ranks' parameters differ"]),
    # (stale values taken, and SUCCEEDED: the root of a small broadcast does not wait)
    ("rank0_object", ["'s call 7 of training.dist, broadcast_object(root_rank=0), received rank 0's call 5, "
                      "broadcast_object(root_rank=0) at user_loop.py:", "the ranks made different collectives of "
                      "training.dist", "every attempt would make the same calls, so it was not retried"])])
def test_replicas_left_apart_by_a_broadcast_on_rank_0_alone_or_none_fail_once(tmp_path, yarnapp_home, broadcast, says):
    """Horovod slips: `if rank == 0: broadcast_parameters(...)` before the optimizer is
    wrapped (its broadcasts met the others' next collectives: the application hung), or
    after it (Horovod's order: rank 0 stays in its broadcast, the others in their first
    step's sum, before any progress report: it hung for good), and no broadcast of weights
    each rank drew itself (trained apart without a word). Each now fails in one line,
    once. (With 2 ranks and a small model the late broadcast's root returns at once, and
    the replicas' check at the first step finds it.)"""
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "SHARES": "vcores", "STEPS": "6", "BATCH": "48", "BROADCAST": broadcast}
    job = {"name": "apart-weights", "groups": [dict(g, env=env) for g in GROUPS], "max_restarts": 2,
           "run": {"function": "user_loop:main", "files": [os.path.join(JOBS, "user_loop.py")]}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=120)
    assert st["state"] == "FAILED", run.logs()
    line = run.failure_message()
    assert all(part in line for part in says) and "after 1 attempt(s)" in line, line
    assert_nothing_left(run.app_id)


def test_a_model_its_strategy_cannot_run_found_in_the_ranks_is_not_retried(cli, tmp_path):
    """A dataset of the user's own: the client cannot build the model for its images, so the
    hypergraph strategy met the BatchNorm at its first step, and every attempt did again."""
    job = write_job(tmp_path / "hg.yaml", {
        "name": "hg", "groups": [{"name": "w", "instances": 2, "vcores": 0.5, "memory": "1 GiB"}], "max_restarts": 2,
        "run": {"files": [os.path.join(JOBS, "user_model.py")]},
        "training": {"strategy": "hypergraph", "model": "user_model:make_bn_net", "batch_size": 16, "epochs": 1,
                     "data": {"dataset": "user_model:TinySet"}}})
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "FAILED after 1 attempt(s)" in err and "cannot place BatchNorm2d (layer '1')" in err, err
    assert "a mistake in the job's model or strategy settings, which every attempt meets, so it was not retried" \
        in err, err


@pytest.mark.parametrize("kind", ["script", "function", "async"])
def test_a_deterministic_startup_error_uses_one_attempt_and_prints_its_line(kind, cli, tmp_path):
    """... and a wrapped async def (the source does not tell submit): it "succeeded" at once on
    every rank, a coroutine never awaited."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "broken.py").write_text(
        "import functools\n\ndef wrap(f):\n    @functools.wraps(f)\n    def w(ctx):\n        return f(ctx)\n"
        "    return w\n\n@wrap\nasync def main(ctx):\n    pass\n" if kind == "async" else
        "import not_a_module_of_anyone\n\ndef main(ctx):\n    pass\n")
    run = ({"script": str(code / "broken.py")} if kind == "script"
           else {"function": "broken:main", "files": [str(code / "broken.py")]})
    job = write_job(tmp_path / "broken.yaml", {"name": "broken", "groups": GROUPS, "max_restarts": 3, "run": run})
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("Error: app_") and "FAILED after 1 attempt(s)" in err, err
    if kind == "async":
        assert "async def main: every rank calls main(ctx), which only makes a coroutine nobody runs" in err, err
    else:
        assert "ModuleNotFoundError: No module named 'not_a_module_of_anyone'" in err, err
    if kind == "function":
        assert "install it, or ship it with the job (run.files)" in err, err
    assert "every rank failed the same way before training started, so it was not retried" in err, err
    app = app_id_from(err)
    st = yarnapp.status(app)
    assert st["state"] == "FAILED" and st["restarts"] == [] and st["failure"]["attempts"] == 1
    assert_nothing_left(app)


def test_a_crash_during_training_is_still_retried(tmp_path, yarnapp_home):
    """Every rank failing the same way counts as deterministic only before training
    starts: here rank 1 fails once its training has begun, and the job is retried."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "flaky.py").write_text(
        "from training.context import current\n"
        "ctx = current()\n"
        "ctx.report(step=1)\n"
        "ctx.report(step=2, loss=1.0 + ctx.restart_count)\n"
        "ctx.comm.Barrier()\n"
        "if ctx.rank == 1 and ctx.restart_count == 0:\n"
        "    raise RuntimeError('transient failure')\n"
        "ctx.comm.Barrier()\n")
    job = {"name": "flaky", "groups": GROUPS, "max_restarts": 1, "run": {"script": str(code / "flaky.py")},
           "tensorboard": {"logdir": str(tmp_path / "tb")}}
    run = yarnapp.submit(job)
    st = run.wait(timeout=300)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert [r["generation"] for r in st["restarts"]] == [1]
    assert "RuntimeError: transient failure" in st["restarts"][0]["reason"]
    # the code started again from step 1: the first generation's points are gone from the curve (were repeated)
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    written = [(e.step, v.simple_value) for f in sorted((tmp_path / "tb" / run.app_id).iterdir())
               for e in LegacyEventFileLoader(str(f)).Load() for v in e.summary.value if v.tag == "report/loss"]
    assert written == [(2, 1.0), (2, 2.0)], written         # both generations wrote theirs
    assert tb_scalars(tmp_path / "tb" / run.app_id, "report/loss") == [(2, 2.0)]
    assert_nothing_left(run.app_id)


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


def test_a_script_exiting_non_zero_silently_is_described_by_its_status_not_our_log(cli, tmp_path):
    """Every rank of a script that prints to stdout only and exits with status 3: the
    reason is "exited with status 3", the same on every rank, so it is not retried (before,
    it was the launcher's own last log line, which differs per rank: a restart was spent)."""
    job = _script_job(tmp_path, "quits", "import sys\nprint('nothing to do')\nsys.exit(3)\n", max_restarts=3)
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "FAILED after 1 attempt(s)" in err and "exited with status 3" in err, err
    assert "exited with status 3: exited with status 3" not in err, err          # said once
    assert "exited with status 3: sys.exit(3) at quits.py:3 in <module>" in err, err   # where it exited
    assert "launcher.rank" not in err and "world generation" not in err, err
    st = yarnapp.status(app_id_from(err))      # the container whose rank exited 3 is not "failed elsewhere"
    named = next(c for c in st["containers"] if f"({c['id']})" in err)
    assert (named["exit_code"], named["exit"]) == (1, None), named      # was 3, "ended because ... elsewhere"
    lines = cli("status", app_id_from(err), check=0).stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(named["id"] + " "))
    assert " exit=1 (its rank's 3) " in lines[at], lines[at]       # (3 is the healthy containers' own status)
    assert lines[at + 1].strip() == "the application failed here: " + st["failure"]["reason"], lines
    assert_nothing_left(app_id_from(err))


def test_a_rank_aborted_by_gloo_on_mismatched_collectives_says_what_gloo_said_and_where(cli, tmp_path):
    """A DDP script whose rank 0 alone all-reduces a metric (a logging slip under `if rank ==
    0`): gloo aborts the process (a C++ exception nothing caught, SIGABRT), and the failure
    read "killed by signal 6" alone. It now carries gloo's own words and the user's line
    (the crash's faulthandler dump, launcher.failure.native_crash)."""
    job = _script_job(tmp_path, "slip", "import torch, torch.distributed as dist\n"
                      "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                      "dist.init_process_group('gloo')\n"
                      "model = DDP(torch.nn.Linear(20, 4))\n"
                      "for step in range(50):\n"
                      "    model(torch.randn(8, 20)).sum().backward()\n"
                      "    if dist.get_rank() == 0 and step == 3:\n"
                      "        dist.all_reduce(torch.zeros(1))\n", groups=[GROUPS[0], {**GROUPS[1], "instances": 1}])
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "Extension modules:" not in proc.stderr, proc.stderr          # the crash dump's boilerplate, not shown
    assert re.search(r"FAILED after 1 attempt\(s\): rank [01] \((big|small)_0\) killed by signal 6 \(SIGABRT\): a C\+\+ "
                     r"exception nothing caught, gloo::\w+: .*Is there a distributed collective mismatch in your code\? "
                     r"\(at slip\.py:[68] in <module> \(in [\w.]+:\d+ in \w+\)\) — log: ", err), err
    assert_nothing_left(app_id_from(err))


def test_a_segfault_names_the_line_that_made_it(tmp_path):
    """The same for a native crash of the interpreter (a broken extension's segfault): the
    rank's faulthandler, armed by launcher.stacks.enable, writes where its thread was."""
    from launcher.failure import native_crash
    script, log = tmp_path / "crash.py", tmp_path / "container.log"
    script.write_text("import ctypes, sys\nfrom launcher import stacks\nstacks.enable(sys.argv[1])\n\n"
                      "def native_step():\n    return ctypes.string_at(0)\n\nnative_step()\n")
    log.write_text("an earlier generation's lines\nFatal Python error: Aborted\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        rc = subprocess.run([sys.executable, str(script), str(tmp_path / "stack")], stderr=f,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))).returncode
    assert rc == -signal.SIGSEGV
    assert re.fullmatch(r"Fatal Python error: Segmentation fault \(at crash\.py:6 in native_step \(in __init__\.py:\d+ "
                        r"in string_at\)\)", native_crash(str(log), start)), log.read_text()
    assert native_crash(str(log), log.stat().st_size) == ""       # nothing of its own said: nothing made up


@pytest.mark.parametrize("ddp", [False, True, "destroyed"])
def test_a_torchrun_script_whose_rank_returns_early_fails_its_peers_instead_of_hanging(cli, tmp_path, ddp):
    """Rank 1 of an unmodified gloo script leaves with sys.exit(0) at step 3 while the
    others go on to all_reduce with it. Under torchrun its process would end and its peers
    fail with "Connection closed"; here the rank waited in the launcher's closing Barrier
    with its process group open, so the others waited for ever (no progress reports:
    nothing ever looked hung). Now the launcher closes the group the code left open, and
    when something still holds it (a DistributedDataParallel model: its sockets close only
    with the process), the rank's process ends at once instead of waiting for its peers.
    Restarts left are not spent: the ended rank's container has ended too. "destroyed": the
    tutorial's own destroy_process_group() before it leaves (no group left open, so the rank
    waited for its peers with the DDP model's sockets open, and they for it: 120 s)."""
    model = "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))\n" if ddp else ""
    step = ("    loss = model(torch.ones(4, 8)).sum()\n    loss.backward()\n" if ddp else
            "    t = torch.ones(1)\n    dist.all_reduce(t)\n")
    job = _script_job(tmp_path, "early",
                      "import os, sys, time\nimport torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\nrank = int(os.environ['RANK'])\n" + model +
                      "for i in range(200):\n"
                      "    if rank == 1 and i == 3:\n"
                      + ("        dist.destroy_process_group()\n" if ddp == "destroyed" else "") +
                      "        sys.exit(0)\n"
                      + step + "    time.sleep(0.05)\n"
                      "dist.destroy_process_group()\n", max_restarts=2)
    proc = cli("submit", job, "--wait", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    # gloo says either, depending on whether the peer's close or its reset arrives first
    assert "FAILED after 1 attempt(s)" in err and ("Connection closed" in err or "Connection reset" in err), err
    # not retried: rank 1's container had ended with it (each restart waited out the rendezvous, then
    # failed as "world not formed; missing: w_1")
    assert re.search(r"FAILED after 1 attempt\(s\): rank 1 \(small_0\) had ended \(exit 0\) while the others still "
                     r"ran collectives with it: every rank must run the same steps \(then rank \d \(\w+\) exited with "
                     r"status 1: RuntimeError: (?!\[)[^\n]*Connection (closed|reset) by peer[^\n]* \(early\.py:\d+ in "
                     r"<module>\)\); so it was not retried \(its container ended with it: a new world cannot form "
                     r"without it\) — log: ", err), err
    assert_nothing_left(app_id_from(err))


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
    job = _script_job(tmp_path, "writes", f"from training.context import current\n"
                                          f"open('{out}/rank%d' % current().rank, 'w').close()\n",
                      groups=[GROUPS[0]])
    umask = os.umask(0o022)         # the submitter's (the yarnapp it starts inherits it)
    try:
        cli("submit", job, "--wait", check=0)
    finally:
        os.umask(umask)
    assert oct(stat.S_IMODE(os.stat(out / "rank0").st_mode)) == oct(0o644)


def test_a_loop_whose_rank_runs_fewer_steps_names_it_not_a_hang_in_our_code(cli, tmp_path):
    """Rank 1 of a training.dist loop runs 19 optimizer steps, rank 0 20: rank 0 waits in the
    all-reduce of its 20th for ever. It was "rank 1 hung: no progress ... its main thread is
    at launcher/rank.py:371 in main" (the end's Barrier, yarnapp's own code, on the rank that
    had done nothing wrong but stop first)."""
    job = _script_job(tmp_path, "fewer",
                      "import torch\nimport training.dist as yd\nctx = yd.init()\nmodel = torch.nn.Linear(4, 1)\n"
                      "yd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
                      "opt = yd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)\n"
                      "for i in range(20 if ctx.rank == 0 else 19):\n"
                      "    opt.zero_grad()\n    model(torch.ones(2, 4)).sum().backward()\n    opt.step()\n",
                      groups=[GROUPS[0], dict(GROUPS[1], instances=1)])
    with open(job) as f:
        spec = yaml.safe_load(f)
    spec["launcher"] = {"heartbeat_timeout": "2s"}
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    proc = cli("submit", job, "--wait", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "rank 0 (big_0) waited" in err and "in a collective" in err, err
    assert ("for rank 1 (small_0), whose code had finished: it ran fewer steps than this rank; every rank must run "
            "the same steps") in err, err
    assert "launcher/rank.py" not in err and "collectives/ring.py" not in err, err
    assert_nothing_left(app_id_from(err))


def test_a_loop_that_never_reports_progress_and_whose_rank_ends_early_fails_in_seconds(cli, tmp_path):
    """Rank 0 of a loop of training.dist all-reduces (no optimizer steps, no reports: its
    liveness thread keeps every rank alive) leaves at step 3: it waited in the launcher's
    closing Barrier, rank 1 in its all-reduce, and the job hung for ever. Now the finished
    rank waits in the store, rank 1's agent finds its rank still in a collective a quarter of
    heartbeat_timeout after the peer's code finished and names both, and no restart is spent."""
    job = _script_job(tmp_path, "early-mpi",
                      "import sys, torch\nimport training.dist as yd\nctx = yd.init()\n"
                      "for step in range(100000):\n    yd.allreduce(torch.ones(1))\n"
                      "    if ctx.rank == 0 and step == 3:\n        sys.exit(0)\n",
                      groups=[GROUPS[0], dict(GROUPS[1], instances=1)], max_restarts=2)
    with open(job) as f:
        spec = yaml.safe_load(f)
    spec["launcher"] = {"heartbeat_timeout": "12s"}       # a quarter of it: 3 s (15 s by default)
    with open(job, "w") as f:
        yaml.safe_dump(spec, f)
    proc = cli("submit", job, "--wait", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"FAILED after 1 attempt\(s\): rank 1 \(small_0\) waited [34]s in a collective at ", err), err
    assert ("early-mpi.py:5 in <module> for rank 0 (big_0), whose code had finished: it ran fewer steps than this "
            "rank; every rank must run the same steps; every attempt would run the same steps, so it was not "
            "retried") in err, err
    assert_nothing_left(app_id_from(err))


def test_code_on_both_torch_distributed_and_the_mpi_world_whose_ranks_end_apart_succeeds(cli, tmp_path):
    """Code that uses torch.distributed and the MPI world (ctx.comm) and leaves its group
    open ends without the MPI Barrier; the ranks meet in the store instead, and one that
    ends long after the others (rank 0 writes a report for 5 s, beyond the 2 s the others
    wait: a sixth of launcher.heartbeat_timeout) still succeeds: no MPI call is made on peers
    that have left."""
    out = tmp_path / "out"
    out.mkdir()
    job = _script_job(tmp_path, "mixed",
                      "import json, time\nimport torch, torch.distributed as dist\n"
                      "from training.context import current\nctx = current()\nctx.init_process_group()\n"
                      "t = torch.ones(1)\ndist.all_reduce(t)\ns = ctx.comm.allreduce(ctx.rank)\n"
                      "if ctx.rank == 0:\n    time.sleep(5)\n"
                      f"open(f'{out}/rank{{ctx.rank}}.json', 'w').write(json.dumps([t.item(), s]))\n",
                      launcher={"heartbeat_timeout": "12s"})
    proc = cli("submit", job, "--wait", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)] == [[3.0, 3]] * 3
    assert_nothing_left(app_id_from(proc.stdout))


def test_a_users_model_with_the_wrong_number_of_outputs_fails_once_with_one_line(digits, cli, tmp_path):
    """13 outputs for digits' 10 classes: before, it trained and reported SUCCEEDED."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "nets.py").write_text("import torch.nn as nn\n\ndef wrong(num_classes, input_shape):\n"
                                  "    c, h, w = input_shape\n"
                                  "    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes + 3))\n")
    job = write_job(tmp_path / "wrong.yaml", {
        "name": "wrong", "groups": GROUPS, "max_restarts": 2, "run": {"files": [str(code / "nets.py")]},
        "training": {"model": "nets:wrong", "data": {"train": f"{digits}/train", "test": f"{digits}/test"}}})
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--- last lines of" not in proc.stderr, proc.stderr     # the job's mistake is its line: no log dump
    err = proc.stderr.strip().splitlines()[-1]
    assert "FAILED after 1 attempt(s)" in err and "model 'nets:wrong'" in err, err
    assert "gives outputs of shape (2, 13), but the data has 10 classes" in err, err
    assert_nothing_left(app_id_from(err))


def test_a_script_shipped_with_its_directory_runs_in_it_and_opens_files_beside_it(yarnapp_home, tmp_path):
    """`python train.py` in its directory opens data.txt beside it; so does the script as
    shipped by default (its directory, run.files unset) and submitted from there. Before, it
    ran in the container's working directory, one level up: FileNotFoundError: 'data.txt'."""
    job = _script_job(tmp_path, "train", "import os\nfrom training import context\n"
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
    job = _script_job(tmp_path, "epochs", "import time\nfrom training import context\nctx = context.current()\n"
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


def test_a_training_dist_loop_evaluating_on_rank_0_alone_is_not_hung_and_a_rank_asleep_is(cli, tmp_path):
    """Horovod's `if hvd.rank() == 0: validate()`: rank 0 evaluated past
    launcher.heartbeat_timeout while the others waited in their next step's sum, and the job
    failed "rank 0 hung" (retried, to fail again). A rank of the job's own code at work (CPU)
    is not hung, nor are its peers waiting for it; one asleep still is, named at its line.
    The 1-vcore rank spins in its waits: a rank in a call of training.dist is not at work."""
    script = ("import time, torch\nimport training.dist as yd\nctx = yd.init()\ntorch.manual_seed(0)\n"
              "model = torch.nn.Linear(64, 2)\nyd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
              "opt = yd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)\n"
              "for step in range(100000):\n"
              "    if step == 10 and ctx.rank == 0:\n"
              "        t, a = time.monotonic(), torch.rand(200, 200)\n"
              "        while time.monotonic() - t < 9:         # an evaluation on rank 0 alone\n"
              "            a = (a @ a).tanh()\n"
              "    if step == 30 and ctx.rank == 1:\n"
              "        time.sleep(3600)\n"
              "    opt.zero_grad()\n    model(torch.ones(8, 64)).sum().backward()\n    opt.step()\n"
              "    yd.report(step=step)\n    time.sleep(0.05)\n")
    job = _script_job(tmp_path, "hvd", script, launcher={"heartbeat_timeout": "3s"})
    proc = cli("submit", job, "--wait", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"FAILED after 1 attempt\(s\): rank 1 \(small_0\) hung: no progress for \d+\.\ds in train "
                     r"\(limit 3s: launcher\.heartbeat_timeout\); its main thread is at \S*/hvd\.py:14 in <module>, "
                     r"idle \(no CPU used\): if it waits there on something slow", err), err
    assert_nothing_left(app_id_from(err))


def test_a_hung_rank_of_an_unmodified_ddp_script_is_named_and_a_long_evaluation_is_not(cli, tmp_path):
    """An unmodified DDP script reports no progress: its rank 1 asleep at step 50 while the
    others waited in DDP's all-reduce ran on silently until gloo's own 30-minute timeout
    (`status`: every rank RUNNING). Its optimizer's steps are now progress the launcher sees:
    a rank without one for launcher.idle_timeout and idle meanwhile is hung, and the one asleep is
    named, not the ones waiting in loss.backward(). A rank busy that long without a step (an
    evaluation on rank 0 alone) is not taken for a hang, nor are its peers, idle in
    loss.backward() waiting for it (their agents read its agent's beat: busy)."""
    script = ("import os, sys, time\nimport torch, torch.distributed as dist\n"
              "dist.init_process_group('gloo')\nrank = int(os.environ['RANK'])\ntorch.manual_seed(0)\n"
              "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 2))\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "for step in range(80):\n"
              "    if step == 50 and sys.argv[1] == 'hang' and rank == 1:\n"
              "        time.sleep(3600)\n"
              "    if step == 50 and sys.argv[1] == 'evaluate' and rank == 0:\n"
              "        t, a = time.monotonic(), torch.rand(200, 200)\n"
              "        while time.monotonic() - t < 13:         # an evaluation: no optimizer step for 13 s\n"
              "            a = (a @ a).tanh()\n"
              "    opt.zero_grad()\n    model(torch.ones(8, 64)).sum().backward()\n    opt.step()\n"
              "    time.sleep(0.05)\n"
              "dist.destroy_process_group()\n")
    launcher = {"idle_timeout": "4s"}
    hang = _script_job(tmp_path, "ddp", script, launcher=launcher)
    with open(hang) as f:
        raw = yaml.safe_load(f)
    raw["run"]["args"] = ["hang"]
    write_job(hang, raw)
    t0 = time.monotonic()
    proc = cli("submit", hang, "--wait", timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"FAILED after 1 attempt\(s\): rank 1 \(small_0\) hung: no progress for \d+\.\ds in train "
                     r"\(limit 4s: launcher\.idle_timeout\); its main thread is at \S*/ddp\.py:10 in <module> and idle \(no "
                     r"optimizer step, no CPU used since\) — log", err), err
    assert time.monotonic() - t0 < 120, time.monotonic() - t0
    assert_nothing_left(app_id_from(err))

    raw["run"]["args"] = ["evaluate"]
    write_job(hang, raw)
    proc = cli("submit", hang, "--wait", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_killed_applications_code_gets_sigterm_and_time_to_end_on_its_own(cli, tmp_path):
    """`yarnapp kill` SIGKILLed every process of a container at once (the master's SIGTERM was
    followed by SIGKILL to its cgroup, and the agent SIGKILLed its rank): a script's SIGTERM
    handler (a save on preemption, as on a cluster) never ran, and status said signal 9. It
    runs once: a review found it run three times, each inside the one before."""
    out = tmp_path / "out"
    out.mkdir()
    job = _script_job(tmp_path, "term",
                      "import os, signal, sys, time\n"
                      f"OUT = {str(out)!r}\n"
                      "def on_term(signum, frame):\n"
                      "    with open(os.path.join(OUT, 'saved%s' % os.environ['RANK']), 'a') as f:\n"
                      "        f.write('once\\n')\n"
                      "    time.sleep(0.5)\n"
                      "    sys.exit(0)\n"
                      "signal.signal(signal.SIGTERM, on_term)\n"
                      "open(os.path.join(OUT, 'ready%s' % os.environ['RANK']), 'w').close()\n"
                      "time.sleep(120)\n")
    app = app_id_from(cli("submit", job, check=0).stdout)
    until("every rank to be ready", lambda: len(list(out.glob("ready*"))) == 3, timeout=60)
    cli("kill", app, check=0)
    assert sorted(p.name for p in out.glob("saved*")) == ["saved0", "saved1", "saved2"]
    # once each (the master's group signal, then its cgroup's, then the agent's: it ran three times)
    assert [p.read_text() for p in sorted(out.glob("saved*"))] == ["once\n"] * 3
    st = yarnapp.status(app)
    assert st["state"] == "KILLED" and all(c["exit_code"] != -9 for c in st["containers"]), st["containers"]
    assert_nothing_left(app)


def test_when_a_rank_fails_the_others_code_gets_sigterm_and_time_to_end_on_its_own(cli, tmp_path):
    """A peer's failure SIGKILLed the surviving ranks: their SIGTERM handlers (a save, as torchrun
    lets them run) and `finally` blocks never ran (a torch.distributed audit)."""
    out = tmp_path / "out"
    out.mkdir()
    job = _script_job(tmp_path, "peerfail",
                      "import os, signal, sys, time\n"
                      f"OUT = {str(out)!r}\n"
                      "def on_term(signum, frame):\n"
                      "    with open(os.path.join(OUT, 'saved%s' % os.environ['RANK']), 'a') as f:\n"
                      "        f.write('once\\n')\n"
                      "    sys.exit(0)\n"
                      "signal.signal(signal.SIGTERM, on_term)\n"
                      "open(os.path.join(OUT, 'ready%s' % os.environ['RANK']), 'w').close()\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    while len(os.listdir(OUT)) < 3:\n"
                      "        time.sleep(0.05)\n"
                      "    raise RuntimeError('rank 1 gives up')\n"
                      "time.sleep(120)\n")
    proc = cli("submit", job, "--wait", check=1, timeout=240)
    assert "RuntimeError: rank 1 gives up" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.glob("saved*")) == ["saved0", "saved2"]
    assert [p.read_text() for p in sorted(out.glob("saved*"))] == ["once\n"] * 2
    assert_nothing_left(app_id_from(proc.stdout + proc.stderr))
