"""Faults around recovery, with real processes and real kernels: a container over its
memory limit (the cgroup's OOM killer), named as such with the limit to raise."""
import os

import pytest

import yarnapp
from util import app_id_from, assert_nothing_left, write_job

pytestmark = pytest.mark.slow
CGROUPS = os.geteuid() == 0 and os.path.isfile("/sys/fs/cgroup/memory/memory.oom_control")


@pytest.mark.skipif(not CGROUPS, reason="memory limits need root and cgroup v1")
def test_a_container_over_its_memory_limit_is_named_with_the_limit_to_raise(cli, tmp_path):
    (tmp_path / "hog.py").write_text(
        "import time\nfrom training.context import current\nctx = current()\nchunks = []\n"
        "while ctx.rank == 1:\n    chunks.append(bytearray(32 * 2**20))\n    time.sleep(0.01)\n"
        "ctx.comm.Barrier()\n")
    job = write_job(tmp_path / "hog.yaml", {
        "name": "hog", "max_restarts": 0, "run": {"script": str(tmp_path / "hog.py")},
        "groups": [{"name": "big", "instances": 1, "vcores": 1, "memory": "512 MiB"},
                   {"name": "small", "instances": 1, "vcores": 0.5, "memory": "256 MiB"}]})
    proc = cli("submit", job, "--wait")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert ("rank 1 (small_0) was killed by the kernel: small_0 exceeded its memory limit of 256 MiB "
            "(peak 256 MiB): raise groups[1].memory") in err, err
    app = app_id_from(err)
    status = cli("status", app, check=0).stdout
    assert "exceeded its memory limit of 256 MiB" in status.splitlines()[0], status
    assert "(peak 256 MiB)" in status, status
    assert_nothing_left(app)
