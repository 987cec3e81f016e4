"""Step time of ranks that synchronise, under CPU quotas and on shared cores.

The planner's formulas take a throttled rank's times as its unthrottled times / q.
That is the right average only if the rank never waits. A container of q < 1 vcores
is not slowed down evenly: Linux's CFS bandwidth control (what the local engine and
YARN's cgroups set) lets it run at full speed until it has spent q·P of CPU in the
current period P, then stops it until the period ends; quota left unused at the end
of a period is lost. A rank that computes faster than its peers while it has quota
waits for them, and its waits cost CPU too (a polite wait wakes every ~0.2 ms to test
its requests: ~10% of a CPU, `training.collectives.wait`), so it reaches its quota
sooner and then the others wait for it. Where a job has more ranks on this machine
than cores, runnable ranks also share the cores (in proportion to their cpu.shares,
the vcores).

`step_s` plays that out, event by event, for a repeating step of phases (compute,
then a synchronisation every rank takes part in) and returns the mean step time.
Without quotas or shared cores it is exactly Σ_k (max_r demand_r,k + sync_k), the
formulas' own answer.
"""
import dataclasses
from typing import Optional, Sequence

PERIOD_S = 0.1          # the CFS period the local engine sets: yarnapp/backends/local/cgroups.py
                        # PERIOD_US (training does not import the client side)
_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class Rank:
    """quota: fraction of its full speed per period (vcores / threads; 1 = no quota);
    threads: the cores it uses at full speed; weight: its cpu.shares (vcores);
    wait_cpu: fraction of its full speed it burns while it waits (1: spins; a polite
    rank's measured fraction; 0: blocks); wait_s: what each of its waits costs besides
    (full-speed seconds of CPU, run like its compute: they take its quota and, on shared
    cores, a core's time)."""
    quota: float = 1.0
    threads: int = 1
    weight: float = 1.0
    wait_cpu: float = 1.0
    wait_s: float = 0.0


def _shares(want, weights, cores):
    """Water-filling: each rank gets min(want_r, its weighted share of `cores`)."""
    got = [0.0] * len(want)
    left = set(r for r, w in enumerate(want) if w > 0)
    free = float(cores)
    while left and free > _EPS:
        total = sum(weights[r] for r in left)
        capped = [r for r in left if want[r] - got[r] <= free * weights[r] / total + _EPS]
        if not capped:
            for r in left:
                got[r] += free * weights[r] / total
            return got
        for r in capped:
            free -= want[r] - got[r]
            got[r] = want[r]
            left.discard(r)
    return got


def step_s(phases, syncs, ranks: Sequence[Rank], cores: Optional[float] = None,
           period_s=PERIOD_S, periods=40, offsets=None, waits=None):
    """Mean seconds per step.

    phases[k][r]: seconds rank r computes in phase k at its full speed (0: it waits);
    syncs[k]: seconds of the synchronisation that ends phase k (every rank waits), which
    starts once every rank has finished phase k and is not stopped by its quota;
    waits[k]: how many waits a rank has in phase k (each costs it rank.wait_s of CPU, run
    at the end of its compute in the phase);
    ranks: one Rank each; cores: the cores they share (None: each has its own);
    the mean is taken over the steps that end after the first period, within `periods`
    periods (and at least 8 steps); offsets: where each rank's period starts (default
    spread evenly: the cgroups were created at unrelated times).
    """
    n = len(ranks)
    closed = sum(max(p) for p in phases) + sum(syncs)
    throttled_any = any(rk.quota < 1.0 for rk in ranks)
    want_full = sum(rk.threads for rk in ranks)
    if not throttled_any and (cores is None or want_full <= cores):
        return closed
    if closed <= 0:
        return 0.0
    budget = [rk.quota * period_s for rk in ranks]
    offsets = list(offsets) if offsets is not None else [period_s * r / n for r in range(n)]
    next_reset = [period_s + o for o in offsets]
    used = [0.0] * n
    stopped = [False] * n
    weights = [rk.weight for rk in ranks]
    def demand(k):                              # a rank's full-speed seconds in phase k
        return [phases[k][r] + (waits[k] * ranks[r].wait_s if waits else 0.0) for r in range(n)]

    k, rem, sync_end = 0, demand(0), None
    t, ends = 0.0, []
    horizon = max(periods * period_s, 10 * closed)
    while t < horizon or len(ends) < 9:
        if sync_end is None and all(rem[r] <= _EPS and not stopped[r] for r in range(n)):
            sync_end = t + syncs[k]            # every rank is done and can take part
        if sync_end is not None and t >= sync_end - _EPS:
            sync_end = None
            k = (k + 1) % len(phases)
            rem = demand(k)
            if k == 0:
                ends.append(t)
            continue
        computing = [not stopped[r] and rem[r] > _EPS for r in range(n)]
        want = [0.0 if stopped[r] else ranks[r].threads * (1.0 if computing[r] else ranks[r].wait_cpu)
                for r in range(n)]
        got = want if cores is None else _shares(want, weights, cores)
        speed = [got[r] / ranks[r].threads for r in range(n)]        # fraction of full speed
        dt = float("inf")
        for r in range(n):
            if computing[r] and speed[r] > 0:
                dt = min(dt, rem[r] / speed[r])
            if ranks[r].quota < 1.0:
                dt = min(dt, next_reset[r] - t)
                if not stopped[r] and speed[r] > 0:
                    dt = min(dt, (budget[r] - used[r]) / speed[r])
        if sync_end is not None:
            dt = min(dt, sync_end - t)
        if dt == float("inf"):
            raise RuntimeError("quota_sim: no rank can make progress")
        dt = max(dt, 0.0)
        t += dt
        for r in range(n):
            if computing[r]:
                rem[r] -= speed[r] * dt
            used[r] += speed[r] * dt
            if ranks[r].quota < 1.0:
                if t >= next_reset[r] - _EPS:
                    next_reset[r] += period_s
                    used[r], stopped[r] = 0.0, False
                elif used[r] >= budget[r] - _EPS:
                    stopped[r] = True
    settled = [e for e in ends if e >= period_s] or ends
    if len(settled) < 2:
        return ends[-1] / len(ends)
    return (settled[-1] - settled[0]) / (len(settled) - 1)
