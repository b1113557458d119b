"""bf16 and fp16 training follow the fp32 loss curve on a tiny GPT.

Documented tolerance (README, "Mixed precision"): on this tiny model (2 layers, hidden 32,
Adam, 12 steps on mock data) the per-iteration loss of bf16 stays within 0.03 (absolute) of
fp32's and fp16 within 0.005; both curves fall as fp32's does.  A bf16 run under TP 2 x PP 2 x DP 2
with ZeRO-3 follows the single-process bf16 run within three times the distance bf16 rounding
puts the single-process run from fp32.
"""
import pytest

from megazero.process.local_ranks import run_ranks
from test_training import _cfg, _train_history

STEPS = 12
# Documented tolerances (README, "Mixed precision"), absolute on a loss of ~4.6: half precision
# against fp32 is a real rounding difference (bf16 unit roundoff 2^-8, fp16 2^-11), not a
# summation-order one. Measured here: bf16 0.0046, fp16 0.00095; with the unvectorised kernels
# (ATEN_CPU_CAPABILITY=default) 0.0075 and 0.0010, so the bf16 bound is 0.03 (4x the worst seen);
# a lost Adam step moves either curve by ~0.09, which both bounds still catch.
TOL = {"bf16": 0.03, "fp16": 0.005}


def _tiny(**extra):
    return _cfg(optimizer="adam", iters=STEPS, lr=1e-2, lr_decay_style="constant", lr_warmup_iters=2,
                num_layers=2, hidden_size=32,
                eval_interval=0, clip_grad=1.0, **extra)


@pytest.fixture(scope="module")
def fp32_curve():
    return [m["loss"] for m in _train_history(_tiny())]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_follows_fp32(dtype, fp32_curve):
    flags = {dtype: True}
    if dtype == "fp16":
        flags.update(initial_loss_scale=2.0 ** 12)
    hist = _train_history(_tiny(**flags))
    curve = [m["loss"] for m in hist]
    assert all(m["skipped"] == 0 for m in hist)
    diffs = [abs(a - b) for a, b in zip(curve, fp32_curve)]
    print(dtype, "max |loss - fp32 loss|", max(diffs), "fp32 curve", fp32_curve[0], fp32_curve[-1])
    assert max(diffs) < TOL[dtype], diffs
    assert curve[-1] < curve[0] - 0.3 and fp32_curve[-1] < fp32_curve[0] - 0.3
    # half precision is really in use: the curves are not bit-identical to fp32
    assert max(diffs) > 0


def test_bf16_3d_parallel_zero3_follows_single_process_bf16(fp32_curve):
    """Both bf16 runs are the fp32 computation plus bf16 rounding, at the same places in different
    summation orders, so each is about as far from fp32 as the other, and |3D - single| <=
    |3D - fp32| + |single - fp32| is about twice the single run's own distance from fp32.  The
    bound allows three times that distance, measured in this test (0.0011 here, 0.0020 with
    ATEN_CPU_CAPABILITY=default; 3D vs single 0.0013 and 0.0010).  A lost Adam step moves the
    curve by ~0.09."""
    single = [m["loss"] for m in _train_history(_tiny(bf16=True))]
    rounding = max(abs(a - b) for a, b in zip(single, fp32_curve))
    assert rounding > 0
    ranks = run_ranks(_train_history, 8, _tiny(bf16=True, tp=2, pp=2, zero=3))
    got = [m["loss"] for m in ranks[0]]
    diffs = [abs(a - b) for a, b in zip(got, single)]
    print("bf16 3D vs single max |diff|", max(diffs), "bf16 single vs fp32", rounding)
    assert max(diffs) <= 3 * rounding, diffs
    assert all(m["param_bytes"] > 0 for m in ranks[0])
