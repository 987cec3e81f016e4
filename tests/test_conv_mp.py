"""Conv-layer model parallelism: exact equivalence with the single-process model.

Each MPI world (2 and 3 ranks, joined as containers join) is started once (module
fixtures) and runs every check of the distributed layers and of the strategy
(tests/ranks/conv_mp.py); rank 0 also trains the single-process
reference from the same initial weights on the same data and reports the largest
differences, which the tests below assert. proportional_split is tested in-process.
"""
import pytest
import torch

import worlds
from training.strategies.conv_mp.calibrate import (corrected_speeds, kernel_block, proportional_split, slowest,
                                                    worth_resharding)

pytestmark = pytest.mark.multiprocess

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    return request.param, worlds.run("conv_mp", request.param, timeout=180)


def test_layers_forward_backward_equal_single_process(world):
    n, r = world
    assert r["layers_forward"] < TOL
    assert r["layers_loss"] < TOL
    assert len(set(r["layers_payload"])) == 1           # END carried the master's loss to all
    assert r["layers_fc_grad"] < TOL
    for name in ("conv1", "conv2"):
        assert r[f"layers_{name}_init"] == 0.0          # shards are slices of the same init
        assert r[f"layers_{name}_gw_norm"] > 1e-3        # the gradients compared are not trivially 0
        assert r["layers_conv_grads"][name] < TOL
    # uneven splits, including a rank that owns no kernel of conv2
    expected = {2: [[6, 9], [2, 7]], 3: [[5, 0], [2, 10], [1, 6]]}[n]
    assert r["rank_shards"] == expected
    assert r["layers_shapes"] == [[expected[0][0], 3, 3, 3], [expected[0][1], 8, 3, 3]]


def test_channel_wise_layers_in_the_shards_equal_single_process(world):
    n, r = world
    assert r["fused_forward"] < TOL and r["fused_fc_grad"] < TOL
    assert set(r["fused_conv_grads"]) == {"conv1", "conv2"}
    assert all(v < TOL for v in r["fused_conv_grads"].values())
    # conv1 linked to conv2: all-gathered on every rank, exact, also where a rank owns none of conv1
    assert r["linked_forward"] < TOL and set(r["linked_conv_grads"]) == {"conv1", "conv2"}
    assert all(v < TOL for v in r["linked_conv_grads"].values())
    # the strategy found F.relu and F.max_pool2d after both convs of SmallCNN, on every rank
    # and the classifier on conv2's flattened output, run row-parallel
    assert r["strategy_fused"] == ["conv1 + relu + max_pool2d; conv2 + relu + max_pool2d; conv1 -> conv2; "
                                   "conv2 -> fc row-parallel"] * n
    # and with `fuse: false` it keeps them on the master, as exact
    assert r["unfused"] == [[True, [0, 0]]] * n
    assert r["unfused_weights"] < TOL
    # nn.ReLU(inplace=True) and pooling modules inside nn.Sequential, through the trace
    assert r["modules_fused"] == ["features.0 + features.1 + features.2; "
                                  "features.3 + features.4 + features.5; features.0 -> features.3; "
                                  "features.3 -> fc row-parallel"] * n
    assert r["modules_weights"] < TOL
    # in-place ReLUs on a distributed layer's output (the classifier's in the shards; the convs' unfused)
    assert len(r["inplace_weights"]) == 2 and all(d < TOL for d in r["inplace_weights"]), r["inplace_weights"]


def test_misconfigurations_are_refused(world):
    n, r = world
    for errors in r["errors"]:                               # every rank refuses, none hangs
        assert f"split has {n + 1} entries for {n} ranks" in errors[0]
        assert "must be non-negative and sum to the layer's 8 kernels" in errors[1]
        assert "grouped convolutions" in errors[2]
        assert f"{n + 1} weights for {n} ranks" in errors[3]
        assert "['fc'] are not Conv2d layers" in errors[4] and "['conv1', 'conv2']" in errors[4]


def test_sgd_steps_equal_single_process(world):
    n, r = world
    split = {2: {"conv1": [6, 2], "conv2": [12, 4]},
             3: {"conv1": [5, 2, 1], "conv2": [10, 4, 2]}}[n]
    totals = [split["conv1"][i] + split["conv2"][i] for i in range(n)]
    assert r["strategy_split"] == [[split, totals]] * n     # manual split, the same on every rank
    assert r["strategy_slices"] == [[0, 6]] + [[0, 0]] * (n - 1)
    ref = r["ref_losses"]
    for rank_losses in r["strategy_losses"]:                # every rank knows loss and correct
        for (loss, correct, samples, compute_s, comm_s), (ref_loss, ref_correct) in zip(rank_losses, ref):
            assert abs(loss - ref_loss) < TOL
            assert correct == ref_correct and samples == 6
            assert compute_s >= 0 and comm_s > 0
    assert r["strategy_weights"] < TOL
    assert r["export_types"] == ["Conv2d", "Conv2d"]
    assert len(r["last_conv_s"]) == n and all(t > 0 for t in r["last_conv_s"])
    assert all(t > 0 for t in r["conv_s"])


def test_eval_step(world):
    n, r = world
    loss_sum, ref_sum, correct, ref_correct, samples = r["eval"]
    assert abs(loss_sum - ref_sum) < TOL * 6
    assert correct == ref_correct and samples == 6
    assert r["eval_workers"] == [[0.0, 0, 0]] * (n - 1)     # the others were given no rows


def test_checkpoint_resume_is_exact(world):
    n, r = world
    assert r["resume"] < TOL
    assert r["resume_split"] is True


def test_a_checkpoint_with_the_classifier_on_the_master_names_the_setting_that_loads_it(world):
    """Written with `fuse: false` (or before the classifier ran in the shards): refused on
    every rank in one line that says to resume with `fuse: false`."""
    n, r = world
    assert all(line and "classifier 'fc'" in line and "fuse: false" in line for line in r["kept_classifier"]), \
        r["kept_classifier"]
    assert len(r["kept_classifier"]) == n


def test_reshard_keeps_training_exact(world):
    n, r = world
    assert r["reshard"] < TOL
    assert r["reshard_split"] == [{"conv1": [1] * (n - 1) + [8 - (n - 1)],
                                   "conv2": [16 - (n - 1)] + [1] * (n - 1)}] * n


def test_calibrated_split(world):
    n, r = world
    splits = r["calibrated_split"]
    assert all(s == splits[0] for s in splits)              # every rank agrees
    assert sum(splits[0]["conv1"]) == 8 and sum(splits[0]["conv2"]) == 16
    assert all(c >= 1 for s in splits[0].values() for c in s)
    assert r["block"] == [kernel_block("cpu")] * n          # every rank's, agreed
    speeds = r["calibrated_speeds"][0]
    assert all(len(v) == n and all(x > 0 for x in v) for v in speeds.values())
    assert r["calibrated"] < TOL
    assert r["resumed_calibration"] == [[0, True, True]] * n     # a resumed run takes the checkpoint's


def test_manual_split_in_whole_vector_blocks(world):
    """Weights 1.3 : 1 [: 1] on convs of 48 and 64 kernels: the split the strategy makes on
    every rank is calibrate.proportional_split's with this machine's block (whole blocks of
    16 on AVX-512), and training stays exact."""
    n, r = world
    block, weights = kernel_block("cpu"), [1.3] + [1.0] * (n - 1)
    expected = {"conv1": proportional_split(48, weights, block), "conv2": proportional_split(64, weights, block)}
    assert r["wide_split"] == [expected] * n
    if block == 16:
        assert expected == {2: {"conv1": [32, 16], "conv2": [32, 32]},
                            3: {"conv1": [16, 16, 16], "conv2": [32, 16, 16]}}[n]
    assert r["wide"] < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ranks_equal_single_process():
    """Ranks on the GPU stage through host memory; the run stays equal to the CPU one."""
    results = worlds.run("conv_mp_gpu", 2, timeout=180)
    expected = {"[0, 1]": ["cpu", "cuda"], "[1, 0]": ["cuda", "cpu"], "[1, 1]": ["cuda", "cuda"]}
    assert {k: v["devices"] for k, v in results.items()} == expected
    for r in results.values():
        assert r["loss"] < TOL and r["weights"] < TOL


# -- proportional_split ----------------------------------------------------------------------

def test_proportional_split_exact_quotas():
    assert proportional_split(1500, [2, 1]) == [1000, 500]
    assert proportional_split(500, [1, 1, 1, 1]) == [125] * 4
    assert proportional_split(8, [5, 2, 1]) == [5, 2, 1]


def test_proportional_split_sums_and_largest_remainder():
    # quotas 3.33.., 3.33.., 3.33..: one leftover kernel, ties go to the lower rank
    assert proportional_split(10, [1, 1, 1]) == [4, 3, 3]
    # quotas 6.6, 3.3 (+0.1): floors 6, 3 leave one kernel for the largest remainder (0.6)
    assert proportional_split(10, [2, 1]) == [7, 3]
    # quotas 1.75, 5.25: floors 1, 5; leftover to the larger remainder .75
    assert proportional_split(7, [1, 3]) == [2, 5]
    for kernels in (3, 7, 16, 500, 1501):
        for speeds in ([1.0, 0.5], [3.0, 2.0, 1.0], [0.9, 1.1, 1.0, 0.3]):
            if kernels < len(speeds):
                continue
            split = proportional_split(kernels, speeds)
            assert sum(split) == kernels and all(c >= 1 for c in split)
            quota = [kernels * s / sum(speeds) for s in speeds]
            assert all(abs(c - q) < 1 for c, q in zip(split, quota))


def test_proportional_split_gives_every_rank_one_kernel():
    assert proportional_split(10, [1, 1, 100]) == [1, 1, 8]
    assert proportional_split(3, [1000, 1, 1]) == [1, 1, 1]


def test_proportional_split_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        proportional_split(2, [1, 1, 1])
    with pytest.raises(ValueError, match="positive"):
        proportional_split(8, [1, 0])
    with pytest.raises(ValueError, match="no ranks"):
        proportional_split(8, [])


def test_block_split_gives_whole_vector_blocks():
    # an AVX-512 core computes 16 kernels as one block: 65 cost as much as 80
    assert proportional_split(128, [1.0, 1.05], block=16) == [64, 64]     # not [62, 66]
    assert proportional_split(128, [1.3, 1.0], block=16) == [80, 48]      # not [72, 56]
    assert proportional_split(384, [2, 1], block=16) == [256, 128]
    # fewer kernels than a block per rank: plain proportional split
    assert proportional_split(16, [1, 1], block=16) == proportional_split(16, [1, 1]) == [8, 8]
    for kernels in (48, 100, 128, 384, 1500):
        for speeds in ([1.0, 0.5], [3.0, 2.0, 1.0], [0.9, 1.1, 1.0, 0.3]):
            split = proportional_split(kernels, speeds, block=16)
            assert sum(split) == kernels
            if split != proportional_split(kernels, speeds):       # else whole blocks
                assert all(c >= 16 for c in split) and sum(c % 16 != 0 for c in split) <= 1


def test_block_split_makes_the_slowest_rank_fastest():
    """Against every split in whole blocks (brute force) and the plain split, the chosen
    split's slowest rank (calibrate.share_cost / speed) is as fast as the best one's."""
    import itertools
    for kernels, speeds in ((128, [2.0, 1.0]), (200, [1.0, 0.7, 0.45]), (96, [1.0, 1.0, 3.0]), (130, [1.3, 1.0]),
                            (32, [1.0, 0.5]), (100, [1.0, 1.0])):
        units, rest = divmod(kernels, 16)
        candidates = [proportional_split(kernels, speeds)] + [
            [16 * u + (rest if q == r else 0) for q, u in enumerate(us)]
            for us in itertools.product(range(1, units + 1), repeat=len(speeds)) if sum(us) == units
            for r in range(len(speeds))]
        best = min(slowest(c, speeds, 16) for c in candidates)
        assert slowest(proportional_split(kernels, speeds, block=16), speeds, 16) == pytest.approx(best)
    # a partial block costs nearly a whole one, but not quite: [21, 11] beats [16, 16] at 2:1
    assert proportional_split(32, [1.0, 0.5], block=16) == [21, 11]


def test_kernel_block():
    assert kernel_block("cuda") == 1                  # not assumed for a GPU
    expected = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 1)
    assert kernel_block("cpu") == expected


# -- corrected_speeds (recalibration from measured training times) ---------------------------

def test_corrected_speeds_moves_work_off_the_slower_rank():
    # calibration said equal; training measured rank 1 twice as slow on the same share
    speeds = corrected_speeds({"conv": [10.0, 10.0]}, {"conv": [5, 5]}, {"conv": [0.5, 1.0]})
    assert speeds["conv"][0] == 10.0 and abs(speeds["conv"][1] - 10.0 / 2 ** 0.5) < 1e-12  # damped: sqrt
    assert proportional_split(10, speeds["conv"]) == [6, 4]


def test_corrected_speeds_corrects_each_layer_by_its_own_times():
    # calibration misjudged layer a (rank 1 measured 2x faster than it is); layer b was right
    speeds = {"a": [10.0, 20.0], "b": [30.0, 15.0]}
    split = {"a": [4, 8], "b": [20, 10]}
    new = corrected_speeds(speeds, split, {"a": [0.4, 0.8], "b": [20 / 30, 10 / 15]})
    assert new["b"] == speeds["b"]                               # predicted = measured: unchanged
    assert new["a"][0] == 10.0 and abs(new["a"][1] - 20.0 / 2 ** 0.5) < 1e-12
    assert proportional_split(12, new["a"]) == [5, 7]              # moving towards the true [6, 6]


def test_recalibration_converges_to_the_true_speed_ratio():
    true = [2.0, 1.0]                        # rank 1 really runs at half speed
    speeds = {"conv": [1.0, 1.0]}            # but calibration measured them equal
    split = {"conv": proportional_split(300, speeds["conv"])}
    for _ in range(12):
        seconds = {"conv": [c / t for c, t in zip(split["conv"], true)]}
        speeds = corrected_speeds(speeds, split, seconds)
        split = {"conv": proportional_split(300, speeds["conv"])}
    assert split["conv"] == [200, 100]


def test_a_kernel_or_two_of_noise_does_not_reshard():
    assert not worth_resharding([384, 384], [383, 385], [1.0, 0.995])     # 0.26% predicted gain
    assert worth_resharding([384, 384], [512, 256], [2.0, 1.0])            # 25%: move
    assert not worth_resharding([512, 256], [512, 256], [2.0, 1.0])
    # in blocks of 16, a kernel more costs a whole block: [65, 63] is slower than [64, 64]
    assert not worth_resharding([64, 64], [65, 63], [1.0, 0.98], block=16)
    assert worth_resharding([64, 64], [80, 48], [1.6, 1.0], block=16)


def _share_seconds_after(vcores, timings, step_s, step_cpu, device="cpu", rank=1):
    """ConvModelParallelStrategy._share_seconds of a rank whose layers timed `timings`
    ({layer: (wall, CPU)}) in a step of `step_s` seconds so far, `step_cpu` of CPU."""
    import time
    from types import SimpleNamespace
    from training.context import RankInfo
    from training.strategies.conv_mp.comm import Timings
    from training.strategies.conv_mp.strategy import ConvModelParallelStrategy
    me = RankInfo(rank=rank, group="w", instance=rank, container=f"w_{rank}", vcores=vcores, memory_mib=512, gpus=0)
    layers = {n: SimpleNamespace(timings=Timings(conv_s=wall, conv_cpu_s=cpu)) for n, (wall, cpu) in timings.items()}
    stand_in = SimpleNamespace(layers=layers, ctx=SimpleNamespace(me=me), device=torch.device(device),
                               _step_start=(time.perf_counter() - step_s, time.process_time() - step_cpu))
    return ConvModelParallelStrategy._share_seconds(stand_in)


def test_recalibration_of_quota_bound_ranks_charged_their_whole_cpu_settles_where_it_balances():
    """Two 0.5-vcore ranks, one conv of 384 kernels (200 ms of CPU), each rank with CPU
    outside its shares (the master 40 ms a step: the rest of the network; the worker
    10 ms). Charged its whole CPU, a rank's cost per kernel grows as its kernels shrink;
    recalibration (the strategy's own functions, every step) must still stop where the
    ranks' whole CPU over their vcores balances, not drain the master (a review's worry),
    and stay there."""
    per_kernel, fixed, vcores = 0.2 / 384, [0.040, 0.010], 0.5

    def charged(r, kernels):
        """rank r's effective conv seconds after a step with `kernels`: quota-bound, its wall
        step its whole CPU over its quota."""
        share = kernels * per_kernel
        step_cpu = share + fixed[r]
        return _share_seconds_after(vcores, {"conv": (share, share)}, step_cpu / vcores, step_cpu, rank=r)[1][0]

    split, speeds, seen = [192, 192], {"conv": [1.0, 1.0]}, []
    for _ in range(40):
        seconds = {"conv": [charged(r, split[r]) for r in range(2)]}
        speeds = corrected_speeds(speeds, {"conv": split}, seconds, block=16)
        new = proportional_split(384, speeds["conv"], 16)
        if worth_resharding(split, new, speeds["conv"], block=16):
            split = new
        seen.append(split[0])
    # balanced: k0 c + 40 ms = k1 c + 10 ms, k0 + k1 = 384: k0 = 163.2, in blocks of 16 160 or 176
    whole = [(split[r] * per_kernel + fixed[r]) / vcores for r in range(2)]
    assert split[0] in (160, 176) and abs(whole[0] - whole[1]) <= 16 * per_kernel / vcores, (split, whole)
    assert set(seen[-10:]) == {split[0]}, seen                        # and it stays there


def test_a_throttled_rank_reports_its_cpu_seconds_over_its_quota():
    """Recalibration balances what each rank's shares cost the others: wall time on a rank
    with its cores, CPU seconds / vcores (at least the wall time) on a CPU rank held back
    by its CPU quota in the step (busy for most of it): its wall time leaves out the
    quota's stops, in which the others wait for it. There each share is charged its part
    of the whole step's CPU (protocol, optimizer, waits): the quota pays for all of it."""
    def seconds(vcores, busy, device="cpu", step=0.08):
        """[wall, effective] of a rank whose step so far (`step` seconds) used `busy` CPUs on
        average, 0.032 CPU-s of it in its shares."""
        timings = {"conv1": (0.010, 0.008), "conv2": (0.030, 0.024)}
        return _share_seconds_after(vcores, timings, step, step * busy, device).ravel().tolist()

    wall = [0.010, 0.030]
    assert seconds(1.0, busy=1.0) == wall + wall                                  # its own core
    # 0.5 vcore, 0.0392 CPU-s in the step, 0.032 of it in shares: CPU x 1.225 / 0.5 vcore
    assert seconds(0.5, busy=0.49) == pytest.approx(wall + [0.0196, 0.0588], rel=0.02)
    assert seconds(0.5, busy=0.2) == wall + wall                 # under a quota it does not use up
    # 1.5 vcores, 2 threads: the process's CPU over its 1.5 vcores (not over 0.75 a thread):
    # 0.116 CPU-s in the step, 0.032 of it in shares, CPU x 3.625 / 1.5 vcores
    assert seconds(1.5, busy=1.45) == pytest.approx(wall + [0.0193, 0.058], rel=0.02)
    assert seconds(1.5, busy=1.45, step=0.03) == wall + wall     # below the wall time: the wall time
    assert seconds(0.5, busy=0.49, device="cuda") == wall + wall                 # a GPU's share: wall
