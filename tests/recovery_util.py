"""Fault injection against real running jobs: find a rank's process, wait for a step."""
import json
import os
import time

import yarnapp
from launcher import keys
from launcher.store import FileStore


def store_of(run):
    return FileStore(os.path.join(run.status()["app_dir"], "store"))


def rank_pid(run, rank, generation=0, timeout=120):
    """pid of `rank`'s process in world `generation` (published when the world formed)."""
    store = store_of(run)
    deadline = time.monotonic() + timeout
    while True:
        v = store.get(keys.formed(generation))
        if v:
            return next(m["pid"] for m in json.loads(v)["members"] if m["rank"] == rank)
        assert run.state in ("ACCEPTED", "RUNNING"), run.logs()
        assert time.monotonic() < deadline, "world never formed"
        time.sleep(0.05)


def wait_step(run, rank, step, timeout=300):
    """Block until `rank` reported at least `step`; return the step it reported."""
    deadline = time.monotonic() + timeout
    while True:
        p = (run.status().get("progress") or {}).get(rank) or {}
        if p.get("step", -1) >= step:
            return p["step"]
        assert run.state in ("ACCEPTED", "RUNNING"), run.status()
        assert time.monotonic() < deadline, f"rank {rank} never reached step {step}"
        time.sleep(0.02)


def digits_job(tmp_path, data, name, strategy="allreduce", steps=40, every=10, max_restarts=2,
               heartbeat="60s", env=None, instances=(1, 2)):
    """A 3-rank digits job writing checkpoints and the final model under tmp_path/name."""
    return {
        "name": name, "max_restarts": max_restarts,
        "groups": [{"name": "big", "instances": instances[0], "vcores": 1, "memory": "1 GiB", "env": env or {}},
                   {"name": "small", "instances": instances[1], "vcores": 0.5, "memory": "1 GiB",
                    "env": env or {}}][: 2 if instances[1] else 1],
        # a fixed kernel split: a measured one may differ between the runs compared
        "training": {"strategy": {"name": strategy, "split": [2, 1, 1][:sum(instances)]}
                     if strategy == "conv_model_parallel" else strategy, "model": "digits_cnn",
                     "data": {"train": f"{data}/train", "test": f"{data}/test"},
                     "batch_size": 48, "epochs": 100, "max_steps": steps, "log_every": 1, "seed": 3,
                     "lr": 0.05},
        "checkpoint": {"uri": str(tmp_path / name / "ckpt"), "every_steps": every},
        "tensorboard": {"logdir": str(tmp_path / name / "tb")},
        "launcher": {"heartbeat_timeout": heartbeat, "poll_interval": "100ms"},
    }


def final_weights(job):
    from training.checkpoint import load_final
    return load_final(job["checkpoint"]["uri"])


def run_to_end(job, timeout=600):
    run = yarnapp.submit(job)
    st = run.wait(timeout=timeout)
    assert st["state"] == "SUCCEEDED", (st.get("diagnostics"), run.logs())
    return run, st


def resumed_steps(run):
    """The step each generation after the first resumed from, as rank 0 logged it."""
    return [int(line.rsplit(" ", 1)[1]) for line in run.logs()["big_0"].splitlines()
            if "resumed from the checkpoint of step" in line]
