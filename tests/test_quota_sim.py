"""quota_sim: the step of synchronising ranks under CFS quotas and on shared cores."""
import pytest

from training.perf.quota_sim import Rank, step_s

pytestmark = pytest.mark.unit

FREE = Rank()                       # no quota, spins while it waits
HALF = Rank(quota=0.5, weight=0.5, wait_cpu=0.0)


def test_without_quotas_or_shared_cores_it_is_the_formula():
    phases = [[0.03, 0.02], [0.001, 0.004]]
    assert step_s(phases, [0.005, 0.0], [FREE, FREE]) == pytest.approx(0.03 + 0.005 + 0.004)
    assert step_s(phases, [0.005, 0.0], [FREE, FREE], cores=2) == pytest.approx(0.039)


def test_a_throttled_rank_alone_runs_at_its_quota():
    # 20 ms of work per step at 0.5 of a core: 2.5 steps per 100 ms period, 40 ms each
    assert step_s([[0.02]], [0.0], [HALF]) == pytest.approx(0.04, rel=0.02)
    assert step_s([[0.02]], [0.0], [Rank(quota=0.25, wait_cpu=0.0)]) == pytest.approx(0.08, rel=0.02)
    # ten waits a step at 1 ms of CPU each: 30 ms of its quota a step
    waiting = Rank(quota=0.5, wait_cpu=0.0, wait_s=1e-3)
    assert step_s([[0.02]], [0.0], [waiting], waits=[10]) == pytest.approx(0.06, rel=0.02)
    # without a quota the waits' CPU delays nothing
    assert step_s([[0.02]], [0.0], [Rank(wait_cpu=0.0, wait_s=1e-3)], waits=[10]) == pytest.approx(0.02)


def test_waiting_spends_a_polite_ranks_quota():
    # the small rank computes 20 ms at full speed and waits 20 ms for the big one while it
    # has quota: waits that cost nothing leave the pair at max(40, 20 / 0.5) ms ...
    asleep = step_s([[0.04, 0.02]], [0.0], [FREE, HALF])
    assert asleep == pytest.approx(0.04, rel=0.02)
    # ... waits that burn 10% of a CPU use its quota up before the period ends, and then
    # the big rank waits for it
    awake = step_s([[0.04, 0.02]], [0.0], [FREE, Rank(quota=0.5, weight=0.5, wait_cpu=0.1)])
    assert awake > 1.04 * asleep
    # a rank that spins while it waits (MPICH's own wait) burns its whole quota waiting
    spinning = step_s([[0.04, 0.02]], [0.0], [FREE, Rank(quota=0.5, weight=0.5, wait_cpu=1.0)])
    assert spinning > 1.2 * awake


def test_ranks_share_the_cores_in_proportion_to_their_weights():
    # three free ranks of 10 ms on 2 cores: 30 ms of CPU per step, 15 ms of wall
    assert step_s([[0.01, 0.01, 0.01]], [0.0], [FREE] * 3, cores=2) == pytest.approx(0.015)
    # weights 2:1:1 on 2 cores: the heavy rank has a core, the others half of one each
    heavy = Rank(weight=2.0)
    assert step_s([[0.01, 0.01, 0.01]], [0.0], [heavy, FREE, FREE], cores=2) == pytest.approx(0.02)


def test_a_waits_cpu_takes_core_time_where_cores_are_shared():
    # three ranks of 10 ms on 2 cores whose 2 waits a step cost 1 ms of CPU each (polite
    # ranks' spin and first sleeps): 36 ms of CPU per step on 2 cores, not 30
    polite = Rank(wait_cpu=0.0, wait_s=1e-3)
    assert step_s([[0.01, 0.01, 0.01]], [0.0], [polite] * 3, cores=2, waits=[2]) == pytest.approx(0.018)
    # with a core each they overlap the waiting and delay nothing (the formula)
    assert step_s([[0.01, 0.01, 0.01]], [0.0], [polite] * 3, cores=3, waits=[2]) == pytest.approx(0.01)
