"""Parameter servers (central and sharded): every step equals single-process training.

Each MPI world (2 and 3 ranks, joined as containers join) is started once (module
fixture) and runs every case (tests/ranks/ps.py):
both strategies, equal and unequal shares (one with a rank that reads no rows), SGD
with momentum and weight decay and Adam. Every rank also trains the single-process
reference on the whole batch from the same initial weights and reports its largest
difference; rank 0 collects them and reports one result the tests assert on.
"""
import pytest

import worlds

pytestmark = pytest.mark.multiprocess

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def world(request):
    return request.param, worlds.run("ps", request.param, timeout=240)


@pytest.mark.parametrize("strategy", ["ps_central", "ps_sharded"])
@pytest.mark.parametrize("shares", ["equal", "unequal", "vcores", "starved"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_update_equals_single_process(world, strategy, shares, opt):
    n, res = world
    r = res[f"{strategy}/{shares}/{opt}"]
    assert r["param_diff"] < TOL, r
    assert r["loss_diff"] < TOL, r
    assert r["identical"], "ranks ended with different parameters"
    assert sum(r["rows"]) == (6 if shares == "starved" else 12)
    if shares == "unequal":
        assert r["rows"] == {2: [9, 3], 3: [8, 3, 1]}[n]
    if shares == "vcores":
        assert r["rows"] == {2: [8, 4], 3: [6, 3, 3]}[n]
    if shares == "starved" and n == 3:
        assert r["rows"][2] == 0


@pytest.mark.parametrize("strategy", ["ps_central", "ps_sharded"])
def test_state_dict_round_trip_resumes_exactly(world, strategy):
    _, res = world
    r = res[f"{strategy}/resume"]
    assert r["differed_before"] > 0, "the second model should start from other weights"
    assert r["exact"], r


@pytest.mark.parametrize("strategy", ["ps_central", "ps_sharded"])
def test_floating_buffers_stay_identical(world, strategy):
    _, res = world
    assert res[f"{strategy}/batchnorm"]["identical"]
