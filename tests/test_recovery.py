"""Failed and hung workers are restarted and training resumes exactly from the last
complete checkpoint (real processes, real signals, real MPI worlds)."""
import json
import os
import random
import signal
import time

import pytest
import torch

import yarnapp
from launcher import keys
from recovery_util import digits_job, final_weights, rank_pid, run_to_end, store_of, wait_step
from util import assert_nothing_left

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits):
    """Uninterrupted runs, one per strategy, computed once."""
    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("YARNAPP_HOME")
    os.environ["YARNAPP_HOME"] = str(home)
    out = {}
    tmp = tmp_path_factory.mktemp("ref")
    try:
        for strategy in ("allreduce", "conv_model_parallel"):
            job = digits_job(tmp, digits, f"ref-{strategy.replace('_', '-')}", strategy)
            run, st = run_to_end(job)
            assert st["final"]["steps"] == 40 and st["final"]["resumed_from"] == 0
            out[strategy] = final_weights(job)
            assert_nothing_left(run.app_id)
    finally:
        if old is None:
            os.environ.pop("YARNAPP_HOME")
        else:
            os.environ["YARNAPP_HOME"] = old
    return out


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["allreduce", "conv_model_parallel"])
def test_sigkill_one_of_three_ranks_resumes_bit_identically(strategy, reference, digits, tmp_path, yarnapp_home):
    kill_at = random.Random(f"kill-{strategy}").randint(12, 30)
    job = digits_job(tmp_path, digits, "killed", strategy)
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=1)
    wait_step(run, rank=1, step=kill_at)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["generation"] for r in st["restarts"]] == [1]
    assert "rank 1 (small_0) killed by signal 9" in st["restarts"][0]["reason"]
    resumed = st["final"]["resumed_from"]
    assert kill_at - 10 <= resumed <= kill_at + 1, (kill_at, resumed)   # at most one interval recomputed
    assert _equal(final_weights(job), reference[strategy])
    formed1 = json.loads(store_of(run).get(keys.formed(1)))
    print(f"{strategy}: killed at step {kill_at}, resumed from {resumed}, world re-formed "
          f"{formed1['time'] - t_kill:.1f}s after the kill")
    assert_nothing_left(run.app_id)


def test_sigkill_with_augmentation_and_unequal_shares_resumes_bit_identically(digits, tmp_path, yarnapp_home):
    """Random crops and flips drawn per (seed, epoch, row), shares 3:1:2, a rank killed
    mid-epoch: the resumed run reads and augments exactly the rows the uninterrupted
    one did, so the final weights are equal."""
    def job(name):
        j = digits_job(tmp_path, digits, name, steps=45, every=10)
        j["training"]["shares"] = [3, 1, 2]
        j["training"]["data"].update({"augment": [{"random_crop": {"size": 8, "padding": 1}}, "hflip"],
                                      "shuffle_window": "16 KiB"})     # windows of one block
        return j
    ref = job("aug-ref")
    run_to_end(ref)
    killed = job("aug-killed")
    run = yarnapp.submit(killed)
    pid = rank_pid(run, rank=2)
    kill_at = random.Random("kill-augment").randint(33, 42)          # in the second epoch (29 steps each)
    wait_step(run, rank=2, step=kill_at)
    os.kill(pid, signal.SIGKILL)
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    assert [r["generation"] for r in st["restarts"]] == [1]
    resumed = st["final"]["resumed_from"]
    assert resumed in (30, 40) and resumed <= kill_at + 1, (kill_at, resumed)
    assert _equal(final_weights(killed), final_weights(ref))
    print(f"augmented: killed at step {kill_at}, resumed from {resumed}")
    assert_nothing_left(run.app_id)


def test_sigstopped_rank_is_detected_and_recovered(reference, digits, tmp_path, yarnapp_home):
    job = digits_job(tmp_path, digits, "stopped", heartbeat="4s")
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=2)
    wait_step(run, rank=2, step=15)
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.time()
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    abort = json.loads(store_of(run).get(keys.abort(0)))
    assert "hung" in abort["reason"] and abort["container"] == "small_1", abort
    assert abort["time"] - t_stop <= 4 + 2, abort["time"] - t_stop      # heartbeat timeout + 2 s
    assert _equal(final_weights(job), reference["allreduce"])
    assert_nothing_left(run.app_id)


def test_crash_while_writing_a_checkpoint_resumes_from_the_previous_one(reference, digits, tmp_path, yarnapp_home):
    job = digits_job(tmp_path, digits, "ckptcrash", env={"YARNAPP_FAULT": "crash_in_checkpoint:20:1"})
    run, st = run_to_end(job)
    assert st["final"]["resumed_from"] == 10          # step 20's checkpoint never completed
    assert "exited with status 99" in st["restarts"][0]["reason"]
    assert _equal(final_weights(job), reference["allreduce"])
    steps = sorted(os.listdir(job["checkpoint"]["uri"]))
    assert not [s for s in steps if ".tmp" in s], steps
    assert_nothing_left(run.app_id)


def test_a_rank_that_always_fails_spends_the_budget_then_fails(tmp_path, cli, yarnapp_home):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfrom training.context import current\n"
                      "if current().rank == 1:\n    sys.exit(5)\nimport time\ntime.sleep(120)\n")
    job = tmp_path / "fail.yaml"
    import yaml
    job.write_text(yaml.safe_dump({
        "name": "always-fails", "max_restarts": 2, "run": {"script": str(script)},
        "groups": [{"name": "w", "instances": 3, "vcores": 0.5, "memory": "256 MiB"}]}))
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert "FAILED after 3 attempt(s)" in err and "w_1" in err and "exited with status 5" in err, err
    app = err.split()[1]
    st = yarnapp.status(app)
    store = store_of(yarnapp.Run(app))
    assert [g for g in range(5) if store.get(keys.abort(g))] == [0, 1, 2]     # exactly max_restarts + 1
    assert [r["generation"] for r in st["restarts"]] == [1, 2]
    assert "restart 1" in cli("status", app).stdout
    assert_nothing_left(app)
