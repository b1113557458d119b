"""Loss scalers: Megatron-style dynamic scaling with hysteresis and a hard minimum."""
import pytest
import torch

from megazero.config import PrecisionConfig
from megazero.optim.precision import (ConstantLossScaler, DynamicLossScaler, LossScaleError,
                                      build_loss_scaler, compute_dtype)


def test_scale_halves_only_after_hysteresis_overflows():
    s = DynamicLossScaler(initial_scale=2.0 ** 16, min_scale=1.0, growth_interval=1000, hysteresis=3)
    s.update(True)
    s.update(True)
    assert s.scale == 2.0 ** 16
    s.update(True)
    assert s.scale == 2.0 ** 15
    s.update(True)  # hysteresis used up: every further overflow halves until a growth refills it
    assert s.scale == 2.0 ** 14


def test_scale_grows_after_window_of_clean_steps_and_overflow_resets_the_count():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    for _ in range(2):
        s.update(False)
    s.update(True)  # resets the clean-step count, no halving yet
    assert s.scale == 8.0
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0 and s.hysteresis_tracker == 2


def test_scale_below_minimum_is_a_clear_error():
    s = DynamicLossScaler(initial_scale=4.0, min_scale=2.0, growth_interval=10, hysteresis=1)
    s.update(True)
    assert s.scale == 2.0
    with pytest.raises(LossScaleError, match="loss scale fell below --min-loss-scale 2"):
        s.update(True)


def test_state_dict_round_trip():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=5, hysteresis=2)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler(initial_scale=1.0, growth_interval=5, hysteresis=2)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.hysteresis_tracker) == (64.0, 1, 1)


def test_constant_and_builder():
    assert isinstance(build_loss_scaler(PrecisionConfig(fp16=True)), DynamicLossScaler)
    const = build_loss_scaler(PrecisionConfig(fp16=True, loss_scale=128.0))
    assert isinstance(const, ConstantLossScaler) and const.scale == 128.0
    const.update(True)
    assert const.scale == 128.0
    assert build_loss_scaler(PrecisionConfig(bf16=True)).scale == 1.0
    assert compute_dtype(PrecisionConfig(bf16=True)) == torch.bfloat16
    assert compute_dtype(PrecisionConfig(fp16=True)) == torch.float16
    assert compute_dtype(PrecisionConfig()) == torch.float32
    with pytest.raises(ValueError, match="--initial-loss-scale"):
        DynamicLossScaler(initial_scale=0.5, min_scale=1.0)


def test_saved_scaler_state_loads_only_dynamic_into_dynamic():
    dynamic = DynamicLossScaler(initial_scale=2.0 ** 32)
    dynamic.update(True)
    dynamic.update(True)  # halved: 2 ** 31, hysteresis used up
    const = ConstantLossScaler(128.0)
    const.load_state_dict(dynamic.state_dict())  # --loss-scale wins over the saved dynamic scale
    assert const.scale == 128.0
    fresh = DynamicLossScaler(initial_scale=2.0 ** 10)
    fresh.load_state_dict(ConstantLossScaler(1.0).state_dict())  # saved under fp32/bf16
    assert (fresh.scale, fresh.growth_tracker, fresh.hysteresis_tracker) == (2.0 ** 10, 0, 2)
    fresh.load_state_dict({"scale": 1.0})  # a constant state written before the "dynamic" tag
    assert fresh.scale == 2.0 ** 10
    fresh.load_state_dict({"scale": 8.0, "growth_tracker": 3, "hysteresis_tracker": 1})  # untagged dynamic
    assert (fresh.scale, fresh.growth_tracker, fresh.hysteresis_tracker) == (8.0, 3, 1)
