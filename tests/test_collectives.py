"""Ring all-reduce and data-parallel gradients, in real MPI worlds of 1, 2 and 3 ranks
joined as containers join (tests/ranks/collectives.py runs the checks on the ranks;
each world is started once and runs every check of its size)."""
import pytest
import torch

import worlds

pytestmark = pytest.mark.multiprocess
# The world of 2 ranks measures CPU rates and latencies (wait_cpu, doorbell): the tests of
# those come first and alone, so that it starts alone; the others' verdicts are sums and bits.

# Three ranks on this 2-core machine sum with polite waits only: spinning ones, two to a
# core, take turns by the scheduler's tick (13 s against 8 s); they spin in worlds 1 and 2.
CHECKS = {1: ["sums", "training"], 2: ["sums", "shm", "wait_cpu", "doorbell", "dist_doorbell", "training", "doorbell_netns"],
          3: ["sums_polite", "shm", "training"]}


def _world(n, tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives") / "weights.pt"
    return worlds.run("collectives", n, {"checks": CHECKS[n], "out": str(out)}, timeout=300), out


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return _world(1, tmp_path_factory)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _world(2, tmp_path_factory)


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return _world(3, tmp_path_factory)


@pytest.mark.alone
def test_a_polite_wait_sleeps_instead_of_spinning(world2):
    """MPICH spins in MPI_Wait (a 0.5-vcore rank would burn its quota waiting); the polite
    wait of a throttled rank leaves the CPU to others."""
    res, _ = world2
    (spin_wall, spin_cpu), (polite_wall, polite_cpu) = res["wait_cpu"]["False"], res["wait_cpu"]["True"]
    assert spin_wall > 0.5 and polite_wall > 0.5
    assert spin_cpu > 0.5 * spin_wall, res          # the plain wait burnt the CPU
    assert polite_cpu < 0.25 * polite_wall, res     # the polite one mostly slept


@pytest.mark.alone
def test_a_polite_wait_on_one_host_sleeps_until_another_rank_waits(world2):
    """With doorbells (every rank on one host) a polite wait sleeps until a peer starts a
    wait of its own (or BELL_TIMEOUT_S), instead of waking every pause to test: each
    wake-up costs a throttled rank ~30-40 µs of its quota. Rings nobody waits for are
    dropped, and the wait gets the message all the same."""
    res, _ = world2
    d = res["doorbell"]
    assert d["bound"] == [False, True]          # only the polite rank has a doorbell
    assert d["timed"] > 200, d                  # 0.3 s at <= 200 µs pauses
    # the sleeps without a ring grow from BELL_TIMEOUT_S (2 ms) to MAX_BELL_TIMEOUT_S (8 ms):
    # ~40 in 0.3 s (150 at 2 ms each)
    assert d["bells"] < 60, d


@pytest.mark.parametrize("n,check", [(1, "sums"), (2, "sums"), (3, "sums_polite")])
def test_allreduce_matches_numpy_sum(n, check, request):
    """Spinning waits on 1 and 2 ranks, polite (sleeping) ones on 3: the same sums."""
    res, _ = request.getfixturevalue(f"world{n}")
    assert res[check] == ["OK"] * n


@pytest.mark.parametrize("n", [2, 3])
def test_shared_memory_sums_are_the_rings_bit_for_bit(n, request):
    """Ranks of one host sum through shared memory (training.collectives.shm): the same
    bits as the ring for odd sizes and several chunks, waits spinning or polite, and the
    segments are unlinked from /dev/shm as soon as every rank has mapped them."""
    res, _ = request.getfixturevalue(f"world{n}")
    assert res["shm"] == ["OK"] * n


def test_a_throttled_rank_of_a_loop_on_training_dist_sleeps_until_rung(world2):
    """A user's own loop on training.dist waits as the runner's ranks do: its 0.5-vcore
    rank politely, woken by doorbells, armed by the first collective it makes (init()
    alone makes no MPI call: a rank may call it alone)."""
    res, _ = world2
    assert res["dist_doorbell"] == [[False, False, False], [True, False, True]]


def test_doorbells_are_not_armed_where_a_ring_cannot_reach(world2):
    """A rank in a network namespace of its own (an emulated host) on the same machine,
    with the same host name: abstract sockets are not shared, so no rank arms doorbells
    (the polite rank keeps its timed pauses instead of sleeping 2 ms for rings that never
    come)."""
    res, _ = world2
    if res["doorbell_netns"] is None:
        pytest.skip("no network namespace of its own for a rank here (needs root)")
    assert res["doorbell_netns"] == [False, False]


def test_a_full_doorbell_still_counts_as_reachable_and_a_missing_one_does_not():
    """The check that arms doorbells asks the ringer's side: a doorbell whose queue is full
    (a host with more ranks than the ~10 datagrams a Unix socket queues) is there; a name
    nobody bound (another network namespace) is not."""
    import socket
    import uuid

    from training.collectives import waits
    name = f"\0yarnapp-bell-test-{uuid.uuid4().hex}".encode()
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bell.bind(name)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    try:
        waits._ringer = (sender, [name] * 64)       # far past the queue's length
        assert waits.ring()
        waits._ringer = (sender, [name, name + b"-nobody"])
        assert not waits.ring()
    finally:
        waits._ringer = None
        sender.close()
        bell.close()


@pytest.mark.parametrize("n", [1, 2])
def test_gradient_equals_single_process_global_batch(n, request):
    res, _ = request.getfixturevalue(f"world{n}")
    assert res["training"] == ["OK"] * n


def test_three_ranks_gradients_and_bit_identical_reruns(world3, tmp_path):
    """Shares 3:1:2 (and a rank with no rows) on 3 ranks, run twice: same weights."""
    res, first = world3
    assert res["training"] == ["OK"] * 3
    again = tmp_path / "again.pt"
    assert worlds.run("collectives", 3, {"checks": ["training"], "out": str(again)})["training"] == ["OK"] * 3
    runs = [torch.load(first), torch.load(again)]
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k
