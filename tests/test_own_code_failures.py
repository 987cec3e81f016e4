"""Users' own code that fails, hangs or ends apart: each says what went wrong in one line,
is retried only where a retry can help, and leaves nothing behind. Real `yarnapp submit`s
on the local engine: real containers, cgroups, MPI world, gloo."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

import yarnapp
from own_code_util import GROUPS, JOBS, script_job
from util import app_id_from, assert_nothing_left, tb_scalars, until, write_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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


def test_a_script_exiting_non_zero_silently_is_described_by_its_status_not_our_log(cli, tmp_path):
    """Every rank of a script that prints to stdout only and exits with status 3: the
    reason is "exited with status 3", the same on every rank, so it is not retried (before,
    it was the launcher's own last log line, which differs per rank: a restart was spent)."""
    job = script_job(tmp_path, "quits", "import sys\nprint('nothing to do')\nsys.exit(3)\n", max_restarts=3)
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
    job = script_job(tmp_path, "slip", "import torch, torch.distributed as dist\n"
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
    job = script_job(tmp_path, "early",
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


def test_a_loop_whose_rank_runs_fewer_steps_names_it_not_a_hang_in_our_code(cli, tmp_path):
    """Rank 1 of a training.dist loop runs 19 optimizer steps, rank 0 20: rank 0 waits in the
    all-reduce of its 20th for ever. It was "rank 1 hung: no progress ... its main thread is
    at launcher/rank.py:371 in main" (the end's Barrier, yarnapp's own code, on the rank that
    had done nothing wrong but stop first)."""
    job = script_job(tmp_path, "fewer",
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
    job = script_job(tmp_path, "early-mpi",
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
    job = script_job(tmp_path, "mixed",
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
    job = script_job(tmp_path, "hvd", script, launcher={"heartbeat_timeout": "3s"})
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
    hang = script_job(tmp_path, "ddp", script, launcher=launcher)
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
    job = script_job(tmp_path, "term",
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
    job = script_job(tmp_path, "peerfail",
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
