"""Data parallelism across unlike devices on ranks joined as containers join
(tests/ranks/dp_devices.py): every strategy against one process on the global batch.
The GPU cases run where CUDA is (the device machine) and are skipped, saying why, elsewhere."""
import pytest
import torch

import worlds

pytestmark = pytest.mark.multiprocess
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device here: runs on the GPU machine (the device tool)"


def test_three_cpu_ranks_with_unequal_shares_match_one_process():
    """The module the GPU cases run, on the CPU (the parameter servers' CPU paths: test_ps.py)."""
    out = worlds.run("dp_devices", 3, {"strategy": "allreduce", "gpus": [0, 0, 0], "shares": [3, 1, 2]})
    assert [r["device"] for r in out] == ["cpu"] * 3
    assert max(r["worst"] for r in out) < 1e-5, out


@pytest.mark.parametrize("gpus", [0, pytest.param(1, marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA))])
def test_one_rank_alone_matches_one_process(gpus):
    """A world of one reduces nothing (training.collectives.buckets: `alone`): on a GPU its
    gradients stay on the device, and nothing waits for it to copy them out."""
    out = worlds.run("dp_devices", 1, {"strategy": "allreduce", "gpus": [gpus], "shares": [1]})
    assert [r["device"] for r in out] == ["cuda" if gpus else "cpu"]
    assert out[0]["worst"] < 1e-5, out


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("strategy", ["allreduce", "ps_central", "ps_sharded"])
def test_one_gpu_rank_and_two_cpu_ranks_match_one_process(strategy):
    out = worlds.run("dp_devices", 3, {"strategy": strategy, "gpus": [1, 0, 0], "shares": [3, 1, 1]})
    assert [r["device"] for r in out] == ["cuda", "cpu", "cpu"]
    assert max(r["worst"] for r in out) < 1e-4, out


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_the_gpu_rank_trains(precision):
    out = worlds.run("dp_devices", 3, {"strategy": "allreduce", "gpus": [1, 0, 0], "precision": precision})
    losses = out[0]["losses"]
    assert all(l == l and l < 10 for l in losses), out              # finite
    assert max(r["worst"] for r in out) < 5e-2, out                  # close to fp32, not equal
