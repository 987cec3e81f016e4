"""Where ranks compute (training.devices), and data parallelism across unlike devices:
the rules and the staging are tested here on the CPU; the GPU cases run where CUDA is
(the device machine) and are skipped, saying why, elsewhere."""
import io
import logging

import pytest
import torch

import conf
from conf import JobError
from training import devices, fsutil
from training.context import RankInfo
from training.precision import Precision
from training.strategies.shares import costly_ranks, second_rows, speed_weights, split_rows

pytestmark = pytest.mark.unit
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device here: runs on the GPU machine (the device tool)"


def info(gpus):
    return RankInfo(rank=0, group="g", instance=0, container="g_0", vcores=1.0, memory_mib=1024, gpus=gpus)


def test_a_rank_computes_on_its_gpu_only_when_it_has_one_and_cuda_is_there(caplog, monkeypatch):
    monkeypatch.setattr(devices, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="training.devices"):
        assert devices.rank_device(info(0)) == torch.device("cpu")
        assert not caplog.text
        assert devices.rank_device(info(1)) == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))
        devices.rank_device(info(1))
    # a container given a GPU that CUDA cannot use trained on the CPU without a word: said, once
    said = [r.message for r in caplog.records]
    assert said == ([] if CUDA else [said[0]]) and (CUDA or "holds 1 GPU(s)" in said[0] and "computes on the CPU"
                                                    in said[0]), said


def test_a_rank_that_costs_more_than_it_saves_is_named():
    # 1000 + 1000 rows/s and a rank 100x slower: a 64-row step is 32 ms of compute, and
    # the all-reduce the third rank adds costs more than the 0.3 ms its rows save.
    costly = costly_ranks([1000.0, 1000.0, 10.0], 64, ring_s=0.004)
    assert [r for r, *_ in costly] == [2]
    r, share, with_s, without_s = costly[0]
    assert share == pytest.approx(10 / 2010) and without_s < with_s
    assert costly_ranks([1000.0, 1000.0, 900.0], 64, ring_s=0.004) == []     # a fair third rank helps
    assert costly_ranks([1000.0], 64, ring_s=0.0) == []


def test_speed_shares_time_each_rank_again_on_its_own_share():
    """A GPU-like rank (3 ms of kernel launches, then 25,000 rows/s) beside two CPU-like
    ranks (10 ms, then 667 rows/s), a global batch of 256. Timed on 16 rows the GPU looks
    4,400 rows/s and the CPUs get 23 and 22 rows (their passes 44 ms, the GPU's 11 ms);
    timed again on those shares, each is weighed at its speed on its own rows: the CPUs
    get 7, the slowest pass halves, and the CPU ranks are named as costing more than
    they save (the GPU alone: 13 ms)."""
    def timing(a, rows_per_s):
        return lambda n: a + n / rows_per_s
    passes = [timing(0.003, 25000), timing(0.010, 667), timing(0.010, 667)]
    first = [t(16) for t in passes]
    rows = second_rows(256, 16, first)
    assert rows == split_rows(256, [16 / t for t in first]) == [211, 23, 22]
    weights, fits = speed_weights(16, first, rows, [t(n) for t, n in zip(passes, rows)])
    split = split_rows(256, weights)
    slowest = (lambda split: max(t(n) for t, n in zip(passes, split)))
    assert split == [242, 7, 7] and slowest(split) < 0.5 * slowest(rows)
    assert fits == [pytest.approx((0.003, 25000)), pytest.approx((0.010, 667)), pytest.approx((0.010, 667))]
    costly = costly_ranks(fits, 256, ring_s=0.001, weights=weights)
    assert costly and {r for r, *_ in costly} <= {1, 2}
    # CPUs alike but for speed (the half-speed one pays twice the fixed cost too): a row
    # moves to where it takes less, and no pass gets longer (66 and 68 ms; 67 and 66)
    alike = [timing(0.002, 1000), timing(0.004, 500)]
    first = [t(16) for t in alike]
    rows = second_rows(96, 16, first)
    again, _ = speed_weights(16, first, rows, [t(n) for t, n in zip(alike, rows)])
    assert rows == [64, 32] and split_rows(96, again) == [65, 31]
    assert max(t(n) for t, n in zip(alike, [65, 31])) < max(t(n) for t, n in zip(alike, rows))


def test_precision_on_a_cpu_rank_is_fp32_and_said_once(caplog):
    with caplog.at_level(logging.INFO, logger="training.precision"):
        p = Precision("bf16", "cpu")
    assert p.mode == "fp32" and p.scaler is None and p.state_dict() == {}
    assert "applies to GPU ranks" in caplog.text
    with pytest.raises(ValueError, match="training.precision"):
        Precision("fp8", "cpu")


def test_a_cpu_rank_beside_fp16_gpu_ranks_scales_its_loss_as_they_do():
    """The all-reduce sums every rank's gradient: a CPU rank that did not scale its loss
    added an unscaled gradient to the GPU ranks' scaled ones, and stepped on the scaled sum
    (the reviewer's reading; the GPU test test_dp_devices covers the mixed world). Scaled
    by the same power of two, its step is still fp32's exactly."""
    torch.manual_seed(0)
    plain, scaled = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    scaled.load_state_dict(plain.state_dict())
    x = torch.randn(5, 6)
    for model, p in ((plain, Precision("fp16", "cpu")), (scaled, Precision("fp16", "cpu", scaled=True))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with p.autocast():
            loss = model(x).square().mean()
        p.backward(loss)
        if p.scaler:
            assert p.scaler.get_scale() == 65536.0 and model.weight.grad.abs().max() > 100     # scaled, as a GPU's
        p.step(opt)
    assert Precision("fp16", "cpu").scaler is None and "grad_scaler" in Precision("fp16", "cpu", True).state_dict()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), scaled.parameters()))


@pytest.mark.parametrize("strategy,precision,words", [
    ("conv_model_parallel", "bf16", "is for the data-parallel strategies"),
    ("ps_central", "fp16", "needs the loss scaling of allreduce")])
def test_precision_a_strategy_cannot_honour_is_refused_in_one_line(strategy, precision, words):
    with pytest.raises(JobError) as e:
        conf.offline_job([1.0, 1.0], strategy=strategy, precision=precision)
    assert words in str(e.value) and "training.precision" in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_loads_on_the_cpu_whatever_wrote_it():
    """A checkpoint a GPU rank wrote names cuda:0 as its tensors' place; a CPU rank (or the
    client's Run.model()) must load it all the same. Without a GPU here, torch.save is made to
    tag the tensors as cuda:0, as a GPU rank's save does (torch.load alone refuses them here)."""
    import torch.serialization as ser

    def as_if_on_the_gpu(obj):
        return "cuda:0" if getattr(obj, "device", None) == torch.device("cpu") else None
    ser.register_package(0, as_if_on_the_gpu, lambda obj, location: None)
    try:
        buf = io.BytesIO()
        torch.save({"w": torch.ones(3)}, buf)
    finally:
        ser._package_registry[:] = [p for p in ser._package_registry if p[1] is not as_if_on_the_gpu]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA device"):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    w = fsutil.torch_load(buf.getvalue())["w"]
    assert w.device == torch.device("cpu") and w.tolist() == [1.0, 1.0, 1.0]
