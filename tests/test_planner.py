"""The planner: seed formulas against hand-computed values, predictions of synthetic
profiles, a real (tiny) measurement, the link ping-pong, and `yarnapp plan` end to end."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import conf
from training import planner, probes
from training.planner import Case, Device, Layer, Link, Profile

pytestmark = pytest.mark.multiprocess


def predict(name, devices, link, batch=64, shares="equal", sched=planner.Scheduling(), conv_layers=(), own=None,
            **config):
    """A strategy's cost model on one cluster, with its default configuration but `config`."""
    cfg = conf.strategy_config(name).model_copy(update=config)
    return planner.predict(name, Case(devices, link, batch, shares, sched, tuple(conv_layers), own or {}), cfg)

# -- seed 4 (Šlampa 2017) and seed 1 (Marques et al. 2018) formulas ------------------------


def test_seed4_step_times_by_hand():
    # c = 0.1 s per |W| transfer, g = 1 s of gradient compute
    assert planner.ring_allreduce_s(4, 0.1, 1.0) == pytest.approx(1.0 + 2 * 3 / 4 * 0.1)      # 1.15
    assert planner.central_ps_s(3, 0.1, 1.0) == pytest.approx((1.4, 1.6))                    # (n+1)c+g, 2nc+g
    assert planner.sharded_ps_s(4, 0.1, 1.0) == pytest.approx(1.15)                          # 2c(n-1)/n + g
    assert planner.sharded_ps_s(1, 0.1, 1.0) == 1.0 and planner.ring_allreduce_s(1, 0.1, 1.0) == 1.0
    # the central server's worst case grows linearly in n, the sharded one stays below 2c + g
    assert planner.central_ps_s(16, 0.1, 1.0)[1] == pytest.approx(4.2)
    assert planner.sharded_ps_s(16, 0.1, 1.0) == pytest.approx(1.1875)


def test_seed1_bound_by_hand():
    assert planner.amdahl_bound(0.8, 4) == pytest.approx(2.5)            # 1 / (0.2 + 0.2)
    assert planner.amdahl_bound(0.9, 4) == pytest.approx(1 / 0.325)       # 3.0769
    assert planner.amdahl_bound(1.0, 7) == pytest.approx(7.0)
    assert planner.amdahl_bound(0.6, 1) == pytest.approx(1.0)
    assert planner.proportional_s([1.0, 2.0]) == pytest.approx(2 / 3)     # 1 / (1 + 1/2)


# -- predictions from synthetic profiles (no timing involved) -----------------------------

def _conv(name, seconds, kernels, in_bytes=0, out_bytes=0, needs=True, params=0):
    return Layer(name=name, kind="conv", seconds=seconds, params=params, param_bytes=4 * params,
                 in_bytes=in_bytes, out_bytes=out_bytes, out_channels=kernels,
                 needs_input_grad=needs, distributable=True)


def _profile(step=0.1, opt=0.01, param_bytes=4_000_000, layers=(), intercept=0.0):
    return Profile(device="cpu", threads=1, batch=64, layers=list(layers), step_s=step,
                   intercept_s=intercept, optimizer_s=opt, params=param_bytes // 4, param_bytes=param_bytes)


def test_conv_split_in_whole_vector_blocks_as_the_strategy_splits():
    """The planner splits conv-MP's kernels as the strategy does: in whole blocks of the
    profile's kernel_block where that makes the slowest rank faster (65 kernels cost as
    much as 80 on an AVX-512 core), plainly where the profile has no block."""
    from training.strategies.conv_mp.cost import conv_split
    for block, expected in ((1, [33, 31]), (16, [32, 32])):
        prof = dataclasses.replace(_profile(layers=[_conv("conv1", 0.01, 64)]), kernel_block=block)
        devs = [Device("fast", prof, speed=1.05), Device("cpu", prof)]
        assert conv_split(devs, ["conv1"], None) == {"conv1": expected}


def test_data_parallel_predictions_by_hand():
    prof = _profile()
    devs = [Device("cpu", prof)] * 4
    link = Link(latency_s=0.0, bandwidth_Bps=1e8)          # c = 4e6 / 1e8 = 0.04 s
    ring = predict("allreduce", devs, link, 64)
    assert ring["split"] == [16, 16, 16, 16]
    assert ring["step_s"] == pytest.approx(0.025 + 0.01 + 2 * 3 / 4 * 0.04)   # g + o + ring
    assert ring["speedup"] == pytest.approx(0.11 / 0.095)
    central = predict("ps_central", devs, link, 64)
    assert central["step_s"] == pytest.approx(0.025 + 2 * 3 * 0.04 + 0.01)    # g + 2(n-1)c + o_0
    assert central["bounds"] == pytest.approx([0.025 + 4 * 0.04 + 0.01, 0.275])
    sharded = predict("ps_sharded", devs, link, 64)
    assert sharded["step_s"] == pytest.approx(0.025 + 2 * 0.04 * 3 / 4 + 0.01 / 4)


def test_ranks_on_one_host_exchange_through_shared_memory():
    """With the shared-memory all-reduce measured (link.shared_Bps), allreduce's exchange
    is max(1, n/2)|W|/β_shm + 2α instead of the ring's; shared_memory: false keeps the ring."""
    prof = _profile()
    devs = [Device("cpu", prof)] * 4
    link = Link(latency_s=1e-5, bandwidth_Bps=1e8, shared_Bps=1e9)
    shm = predict("allreduce", devs, link, 64, sched=planner.Scheduling(wait_s=0.0, wait_cpu=0.0))
    assert shm["comm_s"] == pytest.approx(2 * 4e6 / 1e9 + 2e-5 + 2 * 2 * 1e-5)   # + the 2 small all-reduces
    ring = predict("allreduce", devs, link, 64, sched=planner.Scheduling(wait_s=0.0, wait_cpu=0.0),
                   shared_memory=False)
    assert ring["comm_s"] == pytest.approx(2 * 3 / 4 * 4e6 / 1e8 + 6e-5 + 2 * 2 * 1e-5)
    # simulated clusters put each rank on a machine of its own: no shared memory there
    assert link.between_machines().shared_Bps is None


def test_shares_and_quota_shape_the_data_parallel_step():
    prof = _profile(opt=0.0, param_bytes=4)
    free = Link(0.0, 1e15)
    big, small = Device("big", prof, vcores=1.0), Device("small", prof, vcores=0.5, quota=0.5)
    # vcores shares: 43 / 21 rows; the small rank computes 21 rows at half speed
    asleep = planner.Scheduling(wait_s=0.0, wait_cpu=0.0)
    p = predict("allreduce", [big, small], free, 64, "vcores", asleep)
    assert p["split"] == [43, 21]
    assert p["rank_s"] == pytest.approx([0.1 * 43 / 64, 2 * 0.1 * 21 / 64])
    # waits that cost no CPU: the step is the slowest rank's compute + communication
    assert p["compute_s"] == pytest.approx(max(p["rank_s"]))
    assert p["step_s"] == pytest.approx(p["compute_s"] + p["comm_s"])
    # waits that burn 10% of a CPU use up the small rank's quota while it waits for the
    # big one (quota_sim): the step gets longer
    q = predict("allreduce", [big, small], free, 64, "vcores", planner.Scheduling(wait_s=0.0, wait_cpu=0.1))
    assert q["step_s"] > 1.01 * p["step_s"]
    # and each of its 4 waits a step (rows, loss, the ring's 2 exchanges) costs it 1 ms
    r = predict("allreduce", [big, small], free, 64, "vcores", planner.Scheduling(wait_s=1e-3, wait_cpu=0.0),
                ring_threshold_kb=0.0)
    assert r["step_s"] == pytest.approx(2 * (0.1 * 21 / 64 + 4e-3), rel=0.02)
    # the strategy's own CPU (hooks, copies: measure_strategy_cpu), 2 ms a step on the
    # small rank, comes out of its quota too: it computes 4 ms longer at half speed, and
    # the step is its compute; rank 0's 1 ms has room
    o = predict("allreduce", [big, small], free, 64, "vcores", asleep, own={"allreduce": (1e-3, 2e-3)})
    assert o["rank_s"] == pytest.approx([0.1 * 43 / 64 + 1e-3, 2 * (0.1 * 21 / 64 + 2e-3)])
    assert o["step_s"] == pytest.approx(o["rank_s"][1], rel=0.01) and o["step_s"] > p["step_s"] + 2e-3
    # equal shares on a simulated 2x faster device: the slow one bounds the compute
    fast = Device("gpu", prof, speed=2.0)
    q = predict("allreduce", [fast, Device("cpu", prof)], free, 64, "equal")
    assert q["compute_s"] == pytest.approx(0.05) and q["speedup"] == pytest.approx(0.05 / 0.05)
    r = predict("allreduce", [fast, Device("cpu", prof)], free, 64, "speed")
    assert r["split"] == [43, 21] and r["step_s"] < q["step_s"]


def test_conv_model_parallel_reaches_the_bound_on_a_free_network():
    layers = [_conv("conv1", 0.03, 8), _conv("conv2", 0.05, 16)]
    prof = _profile(step=0.1, opt=0.0, layers=layers)
    free = Link(0.0, 1e15)
    p = predict("conv_model_parallel", [Device("a", prof), Device("b", prof)], free, conv_layers=["conv1", "conv2"])
    assert p["split"] == {"conv1": [4, 4], "conv2": [8, 8]}
    assert p["step_s"] == pytest.approx(0.02 + 0.04)                 # rest + half of the convs
    assert p["conv_fraction"] == pytest.approx(0.8)
    assert p["bound"] == pytest.approx(1 / (0.2 + 0.4))
    assert p["speedup"] == pytest.approx(p["bound"])                 # S = 1/((1-f)+f/k)


def test_the_conv_share_is_at_most_the_whole_step():
    """Layers timed one by one can add up past the step timed back to back; f stays 1 and
    the bound k, not more."""
    prof = _profile(step=0.1, opt=0.0, layers=[_conv("conv1", 0.06, 8), _conv("conv2", 0.05, 16)])
    p = predict("conv_model_parallel", [Device("a", prof), Device("b", prof)], Link(0.0, 1e15),
                conv_layers=["conv1", "conv2"])
    assert p["conv_fraction"] == 1.0 and p["bound"] == pytest.approx(2.0)


def test_conv_model_parallel_heterogeneous_split_and_communication_by_hand():
    layers = [_conv("conv1", 0.03, 8, in_bytes=100_000, out_bytes=1_000_000, needs=False),
              _conv("conv2", 0.05, 16, in_bytes=1_000_000, out_bytes=2_000_000, needs=True)]
    prof = _profile(step=0.1, opt=0.0, layers=layers)
    devs = [Device("fast", prof), Device("slow", prof, speed=0.5)]
    p = predict("conv_model_parallel", devs, Link(0.0, 1e15), conv_layers=["conv1", "conv2"])
    # kernels in proportion to speed (2:1), rounded by largest remainder
    assert p["split"] == {"conv1": [5, 3], "conv2": [11, 5]}
    conv = max(5 / 8 * 0.03, 3 / 8 * 0.06) + max(11 / 16 * 0.05, 5 / 16 * 0.1)
    assert p["step_s"] == pytest.approx(0.02 + conv)
    assert p["conv_ideal_s"] == pytest.approx(0.03 / 1.5 + 0.05 / 1.5)
    assert p["bound"] == pytest.approx(1 / (0.2 + 0.8 / 1.5))        # k = (1 + 1/2) / 1
    # with a 1 GB/s link: Bcast X, Gatherv/Scatterv of the slow rank's channels, Reduce dX
    q = predict("conv_model_parallel", devs, Link(0.0, 1e9), conv_layers=["conv1", "conv2"])
    comm1 = 100_000 / 1e9 + 2 * (3 / 8) * 1_000_000 / 1e9
    comm2 = 1_000_000 / 1e9 + 2 * (5 / 16) * 2_000_000 / 1e9 + 1_000_000 / 1e9
    assert q["comm_s"] == pytest.approx(comm1 + comm2)
    assert q["step_s"] == pytest.approx(p["step_s"] + comm1 + comm2)
    # a layer with fewer kernels than ranks cannot be split
    assert predict("conv_model_parallel", [Device("a", prof)] * 9, Link(0.0, 1e9), conv_layers=["conv1"]) is None
    # conv1 linked to conv2 (its output goes to conv2 alone): conv1's Y all-gathered and dY
    # exchanged rank to rank (the fast rank receives the slow one's 3/8, the slow one the
    # fast one's 5/8), and conv2's X is neither broadcast nor its dX reduced
    linked = dataclasses.replace(prof, layers=[dataclasses.replace(layers[0], feeds="conv2"), layers[1]])
    devs = [Device("fast", linked), Device("slow", linked, speed=0.5)]
    r = predict("conv_model_parallel", devs, Link(0.0, 1e9), conv_layers=["conv1", "conv2"])
    link1 = 100_000 / 1e9 + 2 * (5 / 8) * 1_000_000 / 1e9
    assert r["comm_s"] == pytest.approx(link1 + 2 * (5 / 16) * 2_000_000 / 1e9)
    # only where both convs are distributed, and only with fuse
    assert predict("conv_model_parallel", devs, Link(0.0, 1e9), conv_layers=["conv1"])["comm_s"] == \
        pytest.approx(comm1)


def test_recalibration_moves_kernels_off_a_quota_bound_rank_as_the_strategy_does():
    """With recalibrate_every, the plan is of the split recalibration settles on: a 0.5-vcore
    worker whose own CPU (protocol, copies, polite waits) takes its quota too is charged
    its whole step's CPU (ConvModelParallelStrategy._share_seconds), so it keeps fewer
    kernels than its speed gives it at start, and the step is shorter. Before, the plan
    showed the split at start (seed network, 1 + 0.5 vcore: conv2 [256, 128] predicted,
    [272, 112] settled in training)."""
    layers = [_conv("conv1", 0.03, 64, needs=False), _conv("conv2", 0.06, 128)]
    prof = _profile(step=0.1, opt=0.002, layers=layers)
    devs = [Device("big", prof, vcores=1.0), Device("small", prof, vcores=0.5, quota=0.5)]
    own = {"conv_model_parallel": (0.002, 0.01)}
    free = Link(0.0, 1e15)
    start = predict("conv_model_parallel", devs, free, own=own, conv_layers=["conv1", "conv2"])
    settled = predict("conv_model_parallel", devs, free, own=own, conv_layers=["conv1", "conv2"],
                      recalibrate_every=3)
    assert start["split"] == {"conv1": [43, 21], "conv2": [85, 43]}          # by speed, 2:1
    assert settled["split"]["conv1"][1] < 21 and settled["split"]["conv2"][1] < 43, settled["split"]
    assert settled["step_s"] < 0.95 * start["step_s"]
    # where no rank is under a quota, or the split is manual, there is nothing to settle
    equal = [Device("a", prof), Device("b", prof)]
    assert predict("conv_model_parallel", equal, free, own=own, conv_layers=["conv1", "conv2"],
                   recalibrate_every=3)["split"] == {"conv1": [32, 32], "conv2": [64, 64]}
    assert predict("conv_model_parallel", devs, free, own=own, conv_layers=["conv1", "conv2"], recalibrate_every=3,
                   split=[2, 1])["split"] == start["split"]


# -- real measurements ---------------------------------------------------------------------

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(self.relu(self.conv2(self.relu(self.conv1(x)))))
        return self.fc(x.flatten(1))


def test_measure_profile_of_a_real_model():
    torch.manual_seed(0)
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = planner.measure_profile(model, (3, 8, 8), 16, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                   threads=1, min_time=0.0)
    assert [lay.name for lay in prof.layers] == ["conv1", "relu", "conv2", "relu", "pool", "fc"]
    conv1, conv2 = prof.layer("conv1")[0], prof.layer("conv2")[0]
    assert (conv1.out_channels, conv2.out_channels) == (8, 16)
    assert not conv1.needs_input_grad and conv2.needs_input_grad     # conv1 reads the data
    assert conv2.in_bytes == 16 * 8 * 8 * 8 * 4 and conv2.out_bytes == 16 * 16 * 8 * 8 * 4
    assert prof.params == sum(p.numel() for p in model.parameters())
    assert all(lay.seconds > 0 for lay in prof.layers) and prof.optimizer_s > 0
    assert sum(lay.seconds for lay in prof.layers) <= prof.step_s * (1 + 1e-9)
    assert prof.fwd_bwd_s(0) == 0.0 and prof.fwd_bwd_s(16) == pytest.approx(prof.step_s)
    assert 0 <= prof.intercept_s <= prof.step_s
    from training.strategies.conv_mp.cost import conv_layers_of
    assert conv_layers_of(prof) == ["conv1", "conv2"]
    # the rows and kernel shares ranks will really get are timed as such, not interpolated
    fit = prof.fwd_bwd_s(5)
    planner.measure_rows(prof, model, (3, 8, 8), [5, 11, 0], min_time=0.0)
    assert sorted(prof.rows_s) == [5, 11] and prof.fwd_bwd_s(5) == prof.rows_s[5] > 0
    assert prof.fwd_bwd_s(5) != fit and prof.fwd_bwd_s(7) > 0           # 7: still the fit
    planner.measure_shares(prof, model, (3, 8, 8), {"conv2": [12, 4]}, min_time=0.0)
    assert sorted(prof.shares_s) == ["conv2/12", "conv2/4"]
    assert prof.share_s("conv2", 4) == prof.shares_s["conv2/4"] > 0
    assert prof.share_s("conv1", 4) == pytest.approx(prof.layer("conv1")[0].seconds / 2)   # not measured
    assert prof.share_s("conv2", 0) == 0.0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # left untouched
    # one ReLU serves both convs: nothing runs in the shards, and conv1 is not linked to conv2
    assert (conv1.chain_out_bytes, conv1.feeds, conv2.feeds) == (0, "", "")


def test_measured_profile_records_conv_mp_links():
    """The seed network's conv1 (+ ReLU + pooling) feeds conv2 alone: a link the planner
    models; conv2's output, flattened, feeds the classifier alone, which runs row-parallel
    in conv2's shards: timed as the end of its chain, what is gathered is its output."""
    from training.models import build_model
    model = build_model("seed_cnn", (3, 8, 8), 10, {"conv1": 4, "conv2": 8})
    prof = planner.measure_profile(model, (3, 8, 8), 4, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                   threads=1, min_time=0.0)
    conv1, conv2 = prof.layer("conv1")[0], prof.layer("conv2")[0]
    assert (conv1.feeds, conv2.feeds) == ("conv2", "")
    assert conv1.chain_out_bytes == 4 * 4 * 4 * 4 * 4                     # pooled: 4 x 4 x 4 x 4 floats
    assert (conv1.head, conv2.head) == ("", "fc")
    assert conv2.chain_out_bytes == 4 * 10 * 4                            # the logits: 4 x 10 floats
    assert conv2.head_bytes == (8 * 2 * 2 * 10 + 10) * 4                  # fc's weight and bias


@pytest.mark.alone      # latencies it measures
def test_measure_link_with_a_real_ping_pong():
    link = planner.measure_link(trials=2, shared=True)
    assert 0 < link.latency_s < 0.01
    assert link.shared_Bps > link.bandwidth_Bps          # the shared-memory all-reduce, on one host
    assert link.bandwidth_Bps > 1e7                     # shared memory: far above 10 MB/s
    assert link.seconds(1 << 20) > link.seconds(8)
    # more ranks than cores: a synchronisation waits for the scheduler (and no hog is left)
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loaded = planner.measure_link(trials=2, busy=os.cpu_count() - 1, polite=True)
    assert loaded.latency_s > 5 * link.latency_s and "100% busy" in loaded.source
    # simulated clusters (a machine per rank) get the idle latency, not this machine's contention
    assert loaded.between_machines().latency_s == loaded.idle_latency_s < loaded.latency_s
    assert link.between_machines().shared_Bps is None and loaded.shared_Bps is None
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    import conf
    job = conf.load_job({"name": "t", "groups": [{"name": "a", "instances": os.cpu_count() + 1, "vcores": 0.5}],
                         "training": {"data": {"train": "file:///x"}}})
    assert planner.local_load(job) == {"busy": 1, "polite": True, "duty": 0.5}
    assert planner.on_one_host(job)
    assert not planner.on_one_host(conf.load_job({**job.model_dump(), "network": {"nodes": 2}}))


@pytest.mark.alone      # CPU it measures
def test_measure_wait_cpu_with_real_polite_waits():
    # a polite wait costs a fixed part (its spin, the first short sleeps), a part per
    # second it lasts (a wake-up every ~0.2 ms): far less than a spinning wait's whole
    # CPU; and a part per byte it receives (MPI's copy), well under 10 ms per MB
    a, r, b = planner.measure_wait_cpu()                # as the planner measures it
    assert 0 < a < 2e-3
    assert 0 < r < 0.5
    assert 0 < b < 1e-8


@pytest.mark.alone      # every probe process on the machine
def test_cli_plan_stopped_by_kill_leaves_nothing_behind(yarnapp_home):
    """`kill` (SIGTERM) in the middle of `yarnapp plan`'s measurements stops it as Ctrl-C
    does: one line, status 143 (SIGTERM's; Ctrl-C's is 130), and none of its probes, co-runners or busy processes left
    (they run in sessions of their own, so nothing else would stop them)."""
    assert not _probe_processes(), "probe processes of an earlier test still run"
    plan = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "plan", "conf/examples/digits.yaml"],
                            cwd=probes.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _probe_processes() and plan.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plan.poll() is None, "the plan ended before any probe started"
        plan.terminate()
        out, err = plan.communicate(timeout=60)
    finally:
        if plan.poll() is None:
            plan.kill()
    assert plan.returncode == 143, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    deadline = time.monotonic() + 10
    while _probe_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _probe_processes()
    for proc in left:
        proc.kill()
    assert not left, [p.info["cmdline"] for p in left]


def test_measure_strategy_cpu_runs_every_strategy_on_two_ranks():
    # what each strategy spends per step beyond the model, its shares, the optimizer and
    # the waits (hooks, copies, the conv-MP protocol's Python, MPI calls): some, far below
    # a step, on the master (its protocol) and on the worker of conv-MP alike; with
    # `yarnapp plan --quick`'s 5 steps after 1 warm-up
    own = planner.measure_strategy_cpu("digits_cnn", {}, (1, 8, 8), 10, 16, ["conv1", "conv2"], steps=5)
    assert set(own) == set(planner.modelled())
    assert all(0 < v < 0.05 for v in own["conv_model_parallel"]), own["conv_model_parallel"]
    for name in ("allreduce", "ps_central", "ps_sharded"):
        assert all(0 <= v < 0.05 for v in own[name]) and sum(own[name]) > 0, (name, own[name])


def test_a_strategy_that_cannot_run_the_model_is_left_out_of_the_probe_at_once(monkeypatch):
    """conv_model_parallel's step raised on a model (an in-place ReLU, before it took one):
    its peer waited in a collective until the probe's 180 s timeout, and `yarnapp plan`
    failed, telling the user to give --bandwidth. The strategy is now left out, with its
    error, and the others are measured."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs"))
    t0 = time.monotonic()
    own, cannot = planner.measure_strategy_cpu("user_model:make_whole_conv_net", {}, (1, 8, 8), 10, 16,
                                               ["conv1", "conv2"], steps=2, with_failures=True)
    assert time.monotonic() - t0 < 60
    assert set(own) == set(planner.modelled()) - {"conv_model_parallel"}
    assert cannot == {"conv_model_parallel": "RuntimeError: conv2 is a DistributedConv2d: this model needs "
                                             "nn.Conv2d layers"}, cannot
    # the plan: no prediction for it, the others' recommended, the table saying why
    from training.planner import present
    case = _regression_cases()["digits-example"]
    measured = dataclasses.replace(planner.Measured.from_dict(case["measured"]), cannot_run=cannot)
    plan = planner.plan_from(conf.load_job(case["job"]), measured)
    assert plan["strategies"]["conv_model_parallel"] is None and plan["cannot_run"] == cannot
    assert plan["recommended"]["strategy"] != "conv_model_parallel"
    assert all(row["strategies"]["conv_model_parallel"] is None for row in plan["scaling"])   # nor simulated
    row = next(ln for ln in present.format_table(plan).splitlines() if ln.startswith("conv_model_parallel "))
    assert row.endswith(": cannot run this model: RuntimeError: conv2 is a DistributedConv2d: this model needs "
                        "nn.Conv2d layers"), row


# -- yarnapp plan ----------------------------------------------------------------------------

def _probe_processes():
    import psutil
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and \
                any("training.probes" in part for part in proc.info["cmdline"] or ()):
            out.append(proc)
    return out


def test_cli_plan_prints_a_table_and_writes_png_and_json(cli, tmp_path):
    """... the JSON to stdout with `--json -` (a scripting audit: it wrote a file named "-"),
    alone there, strict JSON; the table and the notes then go to stderr."""
    png = tmp_path / "plan"      # a plot's name without an extension gets .png
    proc = cli("plan", "conf/examples/digits.yaml", "--bandwidth", "1gbit,10gbit", "--quick",
               "--gpu-speed", "8", "--png", png, "--json", "-", check=0, timeout=120)
    out = proc.stderr
    assert not os.path.exists(os.path.join(probes.ROOT, "-"))      # (the cli fixture runs there)
    assert f"written {png}.png" in out and (tmp_path / "plan.png").is_file() and not png.exists()
    from training import strategies
    for name in strategies.names():
        assert name in out
    assert "seed 4" not in out and "best/worst case" in out     # the method, not where it comes from
    assert "recommended:" in out and "1 Gbit/s" in out and "latency 50.0 us" in out
    plan = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the plan's JSON"))
    assert plan["link"]["bandwidth_bps"] == 1e9
    assert [d["quota"] for d in plan["devices"]] == [1.0, 0.5, 0.5]
    assert plan["recommended"]["strategy"] in planner.modelled()
    # Eserol 2019's comparison: volume per sample and balance of every way to split the model
    methods = [r["method"] for r in plan["volumes"]["rows"]]
    assert methods == ["hypergraph", "conv_split", "pipeline", "data_parallel"]
    assert all(r["volume_bytes_per_sample"] > 0 for r in plan["volumes"]["rows"])
    assert "hypergraph" in out and "traffic saved vs data parallel" in out
    ring = plan["strategies"]["allreduce"]
    assert ring["split"] == [32, 16, 16]                          # shares: vcores
    assert ring["comm_s"] == pytest.approx(2 * 2 / 3 * plan["model"]["param_bytes"] * 8 / 1e9
                                           + 2 * 2 * 50e-6 + 2 * 2 * 50e-6, rel=1e-3)
    conv = plan["strategies"]["conv_model_parallel"]
    assert conv["split"]["conv2"] == [32, 16, 16] and 0 < conv["conv_fraction"] < 1
    assert {(r["cluster"], r["bandwidth_bps"], r["machines"]) for r in plan["scaling"]} == {
        (c, b, m) for c in ("cpu", "gpu+cpu") for b in (1e9, 1e10) for m in (1, 2, 4, 8, 16)}
    one = [r for r in plan["scaling"] if r["machines"] == 1 and r["cluster"] == "cpu"][0]
    assert all(math.isclose(v["speedup"], 1.0, rel_tol=1e-6) for v in one["strategies"].values())

    import matplotlib.image
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(tmp_path / "plan.png"))
    assert img.shape[0] >= 400 and img.shape[1] >= 1000            # two panels
    colours = {tuple(px) for px in (img[::4, ::4, :3] * 255).astype(int).reshape(-1, 3).tolist()}
    assert len(colours) > 50, "the plot looks blank"


def test_cli_plan_errors_are_one_line(cli, tmp_path):
    proc = cli("plan", "conf/examples/hello.yaml", "--bandwidth", "1gbit", check=1)
    assert proc.stderr.startswith("Error: ") and "training section" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = cli("plan", "conf/examples/digits.yaml", "--bandwidth", "fast", check=1)
    assert proc.stderr.startswith("Error: ") and "cannot parse 'fast' as a rate" in proc.stderr
    for flags, says in ((["--latency", "1 parsec"], "--latency: cannot parse"),
                        (["--machines", "a,b"], "--machines: expected positive integers"),
                        (["--machines", "4,1000"], "--machines: at most 512 machines are simulated, got 1000"),
                        (["--machines", "1,,2"], "--machines: expected positive integers"),
                        (["--classes", "0"], "--classes: must be at least 1, got 0"),
                        # nan and inf ended in tracebacks after the measuring
                        (["--gpu-speed", "nan"], "--gpu-speed: must be a finite number > 0, got nan"),
                        (["--gpu-speed", "inf"], "--gpu-speed: must be a finite number > 0, got inf"),
                        (["--json", "/nonexistent-yarnapp/x.json"], "directory /nonexistent-yarnapp does not exist"),
                        # found after the measuring before, or not at all (the plot went beside the directory)
                        (["--json", str(tmp_path)], "is a directory; give a file name"),
                        (["--png", str(tmp_path)], "is a directory; give a file name"),
                        (["--json", "/proc/x.json"], "cannot create a file in /proc"),
                        (["--png", str(tmp_path / "plot.v1")], "cannot draw a .v1 file")):
        proc = cli("plan", "conf/examples/digits.yaml", *flags, check=1)      # before any measuring
        assert proc.stderr.startswith("Error: --") and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_yarnapp_plan_checks_its_flags_and_the_job_without_importing_torch():
    """Its flag errors came after `import torch` (5-10 s on a busy machine, for a typo):
    training.planner imports its measuring modules on first use."""
    code = ("import sys, conf, training.planner as p\n"
            "p.check_plannable(conf.load_job('conf/examples/digits.yaml'))\n"
            "assert p.parse_options(bandwidth='1gbit', latency='0.05ms', machines='1,2').machines == (1, 2)\n"
            "try:\n    p.check_plannable(conf.load_job('conf/examples/hello.yaml'))\n"
            "except p.PlanError as e:\n    assert str(e).startswith('training: the job has none')\n"
            "else:\n    raise AssertionError('hello.yaml was plannable')\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=probes.ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    assert callable(planner.plan_job) and planner.cpu.measure_wait_cpu is planner.measure_wait_cpu


def test_the_table_marks_a_simulated_speedup_beyond_the_machines_it_has():
    """3.68x on 2 machines (noisy timings on a busy machine) stood in the table as a prediction."""
    from training.planner import present
    plan = _regression_cases()["digits-example"]["plan"] | {"volumes": {}}
    assert "!" not in present.format_table(plan)
    row = next(r for r in plan["scaling"] if r["machines"] == 2 and r["cluster"] == "cpu")
    row["strategies"]["allreduce"] = dict(row["strategies"]["allreduce"], speedup=3.68)
    out = present.format_table(plan)
    assert "3.68!" in out and "! more than m times faster on m machines" in out, out


def test_the_table_says_when_no_strategy_beats_one_container():
    """Every prediction under 1x (a model too small to spread): it recommended the fastest,
    speedup 0.82, without saying that one container is faster still; then it said both
    (a new user read two recommendations): one container is the one recommended."""
    from training.planner import present
    plan = _regression_cases()["digits-example"]["plan"] | {"volumes": {}}
    assert "recommended: one container" not in present.format_table(plan)
    plan["recommended"] = dict(plan["recommended"], speedup=0.82, one_container=True)   # as --json says too
    out = present.format_table(plan)
    assert ("recommended: one container like rank 0's: every strategy is predicted slower than it, so spreading "
            "this model costs more than it saves") in out
    assert [line for line in out.splitlines() if line.startswith("recommended:")] == [
        line for line in out.splitlines() if line.startswith("recommended: one container")]
    assert f"(the fastest spread: {plan['recommended']['strategy']} (" in out and "speedup 0.82)" in out


# -- the predictions from fixed measurements (a regression guard) ---------------------------

REGRESSION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "planner_regression.json")


def _regression_cases():
    with open(REGRESSION) as f:
        return {c["name"]: c for c in json.load(f)["jobs"]}


@pytest.mark.parametrize("name", sorted(_regression_cases()))
def test_predictions_from_fixed_measurements_are_unchanged(name):
    """The same measured profiles, link, waits and strategies' CPU give the very plan the
    planner gave when the fixture was recorded (tests/data/planner_regression.json)."""
    import conf
    case = _regression_cases()[name]
    o = case["options"]
    options = planner.PlanOptions(bandwidths_bps=tuple(o.get("bandwidths_bps", ())), latency_s=o.get("latency_s"),
                                  machines=tuple(o["machines"]), gpu_speed=o.get("gpu_speed"))
    plan = planner.plan_from(conf.load_job(case["job"]), planner.Measured.from_dict(case["measured"]), options)
    plan.pop("volumes")
    assert json.loads(json.dumps(plan)) == case["plan"]


def test_the_table_says_when_the_jobs_own_strategy_is_within_the_planners_error():
    """The recommendation is the fastest prediction; when the job runs another strategy
    the table says how far behind it is predicted, and a gap inside the planner's error
    is called a tie (the example's allreduce against ps_sharded), not a reason to switch."""
    from training.planner import present
    cases = _regression_cases()

    def line(name):
        out = present.format_table(cases[name]["plan"] | {"volumes": {}})
        return [ln for ln in out.splitlines() if ln.startswith("the job's")]

    assert line("yarn-gpu-resnet") == ["the job's allreduce: 30.48 ms/step, speedup 2.14, 1.7% slower "
                                       "(within the planner's error: either will do; keep the job's)"]
    far = line("seed-cnn-3-ranks")
    assert len(far) == 1 and "conv_model_parallel" in far[0] and "80.0% slower" in far[0]
    assert "within" not in far[0]
    assert "within" not in line("digits-example")[0]           # 6.3% apart: past the tie
    assert line("one-rank-mlp") == []                          # the job's own is the recommendation
    # one container recommended: the job's own against that ("keep the job's", said beside the
    # fastest spread strategy, read as overruling the recommendation)
    plan = cases["digits-example"]["plan"]
    slow = plan | {"volumes": {}, "recommended": plan["recommended"] | {"one_container": True, "speedup": 0.62},
                   "strategies": plan["strategies"] | {"allreduce": plan["strategies"]["allreduce"] | {"speedup": 0.61}}}
    out = present.format_table(slow).splitlines()
    assert [ln for ln in out if ln.startswith("the job's")] == [
        "the job's allreduce on its 3 containers: 34.81 ms/step, speedup 0.61: slower than one container"], out


def test_one_rank_keeps_the_jobs_own_strategy():
    """On one rank there is nothing to spread: every strategy runs the whole model, so a
    prediction that puts one ahead (conv-MP's model once said 9% faster on one digits rank,
    where conv_mp.py measures it 5-7% slower) is its model's error, and the job's own is kept."""
    import conf
    case = _regression_cases()["one-rank-mlp"]
    measured = planner.Measured.from_dict(case["measured"])
    options = planner.PlanOptions(machines=(1,))
    for name in ("ps_sharded", "ps_central", "allreduce"):
        job = conf.load_job(dict(case["job"], training=dict(case["job"]["training"], strategy=name)))
        plan = planner.plan_from(job, measured, options)
        assert plan["recommended"]["strategy"] == name, plan["recommended"]
        assert plan["recommended"]["why"].startswith("one rank:")
        assert plan["recommended"]["one_container"] is False        # one rank: nothing spread to advise against
    job = conf.load_job(dict(case["job"], training=dict(case["job"]["training"], strategy="hypergraph")))
    r = planner.plan_from(job, measured, options)["recommended"]
    assert r["strategy"] == "allreduce" and "hypergraph has no step-time model" in r["why"], r


HOGGING_PLANNER = """
import os, subprocess, sys, time
from training import probes
hog = subprocess.Popen([sys.executable, "-m", "training.probes.hog", "0.5", str(os.getpid())],
                       env=probes.environment(), start_new_session=True)    # as training.planner.link does
print(hog.pid, flush=True)
time.sleep(600)
"""


CO_RUNNING_PLANNER = """
import sys, time
import conf
from training.planner import co_runners
job = conf.offline_job([1.0, 1.0], model="digits_cnn", batch_size=8)
with co_runners(job, (1, 8, 8), 10) as procs:
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"     # a zombie has stopped
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("planner_script", [
    pytest.param(CO_RUNNING_PLANNER, id="co-runners", marks=pytest.mark.skipif(
        (os.cpu_count() or 1) < 2, reason="co-runners run only where there is a second core")),
    pytest.param(HOGGING_PLANNER, id="busy-process")])
def test_planner_processes_stop_when_the_planner_is_killed(planner_script):
    """The planner's co-runners (the other ranks' work while it measures) and busy processes
    (ranks beyond the cores, while it measures the link) run in sessions of their own and
    loop until stopped: killed with SIGKILL, the planner cannot stop them, so each stops
    itself once its parent is gone."""
    planner_proc = subprocess.Popen([sys.executable, "-c", planner_script], stdout=subprocess.PIPE, text=True,
                                    env=probes.environment())
    try:
        pids = [int(p) for p in planner_proc.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
    finally:
        planner_proc.kill()
        planner_proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:          # a failing run leaves nothing behind either
        os.kill(p, 9)
    assert not left, f"processes {left} still run after the planner was killed"


def test_a_gpu_beside_cpus_is_judged_only_where_its_speed_is_known():
    """Without CUDA or --gpu-speed the GPU group is planned as its CPU threads: that speed
    was called "the GPU alone", and the advice to drop the CPU ranks rested on it."""
    from training.planner import present

    def plan(gpu_name):
        return {"devices": [{"name": gpu_name}, {"name": "cpu (1 vcores, 1 thread)"}], "model": {"batch": 64},
                "single_s": 0.1, "speed_shares": {"allreduce": {"step_s": 0.08, "split": [40, 24]}}}
    assumed = present._gpu_beside_cpus(plan("gpu (gpu ~ cpu x20, assumed)"))
    assert assumed[1].startswith("gpu + cpus: the GPU alone 640.0 samples/s") and "they help" in assumed[1]
    unknown = present._gpu_beside_cpus(plan("gpu (gpu not measured: no CUDA here, planned as its 1 CPU thread; "
                                            "--gpu-speed N assumes a GPU N x that)"))
    assert unknown[1].startswith("gpu + cpus: not judged, for the GPU was not measured")
    assert "samples/s" not in unknown[1]


def test_plan_refuses_a_model_whose_forward_is_not_logits_in_one_line(tmp_path, monkeypatch):
    """A model returning (logits, aux) was a 33-line traceback from the probe's first
    forward; it is the runner's own one-line ModelError, before anything is measured."""
    from training.models import ModelError
    from training.planner.job import measure_job
    (tmp_path / "auxnet.py").write_text(
        "import torch\nfrom torch import nn\n\nclass Aux(nn.Module):\n"
        "    def __init__(self, num_classes=10):\n        super().__init__()\n"
        "        self.fc, self.aux = nn.Linear(64, num_classes), nn.Linear(64, num_classes)\n\n"
        "    def forward(self, x):\n        h = torch.flatten(x, 1)\n        return self.fc(h), self.aux(h)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = conf.load_job({"name": "t", "groups": [{"name": "w", "instances": 2, "vcores": 0.5}],
                         "training": {"model": "auxnet:Aux", "data": {"train": "unused", "shape": [1, 8, 8]}}})
    with pytest.raises(ModelError, match=r"^model 'auxnet:Aux': its forward returns a tuple; the built-in runner "
                                         r"needs one tensor of logits"):
        measure_job(job, planner.PlanOptions(input_shape=(1, 8, 8), num_classes=10))
    # a width other than the classes assumed (no data read, no --num-classes) is not refused
    from training.models import check_output
    check_output(nn.Linear(4, 100), "wide", torch.zeros(2, 4), None)
    with pytest.raises(ModelError, match="gives outputs of shape"):
        check_output(nn.Linear(4, 100), "wide", torch.zeros(2, 4), 10)
