"""Shared assertions for tests that run applications."""
import glob
import os
import time

import yaml

from yarnapp.backends.local.state import app_processes


def assert_nothing_left(app_id, wait=5.0):
    """No process of the application runs, and its cgroups are gone."""
    deadline = time.monotonic() + wait
    while True:
        left = app_processes(app_id)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes of {app_id} still running: {[(p.pid, p.cmdline()) for p in left]}"
    assert not glob.glob(f"/sys/fs/cgroup/*/yarnapp/{app_id}"), "cgroups of the application remain"


def write_job(path, job):
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return str(path)


def app_id_from(output):
    for word in output.split():
        if word.startswith("app_"):
            return word.rstrip(":")
    raise AssertionError(f"no application id in {output!r}")


def apps(home):
    d = os.path.join(home, "apps")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def tb_scalars(run_dir, tag):
    """[(step, value)] of scalar `tag` in a run's event files, as TensorBoard's server loads
    them (its plugin loader, the one `yarnapp tensorboard` runs with --load_fast=false): a
    restart's purge included, which its first session start does not make."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def until(what, fn, timeout=90, interval=0.3):
    """fn()'s first true value, polled; fails the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up after {timeout}s waiting for {what}"
        time.sleep(interval)
