"""Ring all-reduce and data-parallel gradients, in real MPI worlds of 1, 2 and 3 ranks
joined as containers join (tests/ranks/collectives.py runs the checks on the ranks;
each world is started once and runs every check of its size)."""
import pytest
import torch

import worlds

CHECKS = {1: ["sums", "training"], 2: ["sums", "wait_cpu", "training"], 3: ["sums", "sums_polite", "training"]}


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["1rank", "2ranks", "3ranks"])
def world(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp("collectives") / "weights.pt"
    return n, worlds.run("collectives", n, {"checks": CHECKS[n], "out": str(out)}, timeout=300), out


def test_allreduce_matches_numpy_sum(world):
    n, res, _ = world
    assert res["sums"] == ["OK"] * n


def test_polite_waits_give_the_same_sums(world):
    n, res, _ = world
    if n != 3:
        pytest.skip("checked on 3 ranks")
    assert res["sums_polite"] == ["OK"] * 3


def test_a_polite_wait_sleeps_instead_of_spinning(world):
    """MPICH spins in MPI_Wait (a 0.5-vcore rank would burn its quota waiting); the polite
    wait of a throttled rank leaves the CPU to others."""
    n, res, _ = world
    if n != 2:
        pytest.skip("checked on 2 ranks")
    (spin_wall, spin_cpu), (polite_wall, polite_cpu) = res["wait_cpu"]["False"], res["wait_cpu"]["True"]
    assert spin_wall > 0.5 and polite_wall > 0.5
    assert spin_cpu > 0.5 * spin_wall, res          # the plain wait burnt the CPU
    assert polite_cpu < 0.25 * polite_wall, res     # the polite one mostly slept


def test_gradient_equals_single_process_global_batch(world):
    n, res, _ = world
    assert res["training"] == ["OK"] * n


def test_three_ranks_gradients_and_bit_identical_reruns(world, tmp_path):
    """Shares 3:1:2 (and a rank with no rows) on 3 ranks, run twice: same weights."""
    n, res, first = world
    if n != 3:
        pytest.skip("checked on 3 ranks")
    again = tmp_path / "again.pt"
    assert worlds.run("collectives", 3, {"checks": ["training"], "out": str(again)})["training"] == ["OK"] * 3
    runs = [torch.load(first), torch.load(again)]
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k
