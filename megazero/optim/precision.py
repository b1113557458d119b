"""Mixed precision: the compute dtype and the loss scaler.

Parameters and activations run in bf16 or fp16 while the ZeRO optimizer keeps fp32 master
weights (see :mod:`megazero.zero`).  fp16 needs loss scaling: the loss is multiplied by
``scale`` before backward and gradients divided by it before the update.

:class:`DynamicLossScaler` follows Megatron-LM's ``DynamicGradScaler``:

- an overflow (inf/NaN in any rank's gradients) skips the step and uses up one unit of
  ``hysteresis``; once none is left the scale is halved (and keeps being halved on each
  further overflow until a growth refills the hysteresis);
- after ``loss_scale_window`` consecutive clean steps the scale doubles and the hysteresis
  is refilled;
- a scale that would fall below ``min_loss_scale`` raises :class:`LossScaleError` instead of
  silently skipping every step forever.

:class:`ConstantLossScaler` keeps one scale (``--loss-scale``, or 1.0 for bf16/fp32); overflowing
steps are still skipped.

Resuming (``load_state_dict``): a saved scaler state is taken over only when both the saving and
the loading run use the dynamic scaler (fp16 without ``--loss-scale``).  The constant scaler
ignores any saved state (as Megatron's does), and a dynamic scaler given the state of a constant
one (a run saved under bf16/fp32 or ``--loss-scale``) keeps its ``--initial-loss-scale``: the
new run's configured scale applies.
"""
from __future__ import annotations

from typing import Dict

import torch

from megazero.errors import MegazeroError


class LossScaleError(MegazeroError, RuntimeError):
    """The dynamic loss scale fell below ``--min-loss-scale``: training has diverged."""


def compute_dtype(precision) -> torch.dtype:
    """The parameter/activation dtype a :class:`~megazero.config.PrecisionConfig` (or a whole
    :class:`~megazero.config.MegazeroConfig`) asks for: bf16, fp16 or fp32."""
    precision = getattr(precision, "precision", precision)
    if precision.bf16:
        return torch.bfloat16
    if precision.fp16:
        return torch.float16
    return torch.float32


class ConstantLossScaler:
    """A fixed loss scale; overflowing steps are skipped but the scale never changes."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if scale <= 0:
            raise ValueError(f"--loss-scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """Nothing to adapt for a constant scale."""

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "dynamic": False}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Ignored: a constant scale is whatever this run configures (``--loss-scale`` or 1.0)."""


class DynamicLossScaler:
    """Megatron-style dynamic loss scale with hysteresis and a hard minimum."""

    dynamic = True

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_interval: int = 1000,
                 hysteresis: int = 2, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if not (min_scale > 0 and initial_scale >= min_scale):
            raise ValueError(f"--initial-loss-scale {initial_scale} must be >= --min-loss-scale "
                             f"{min_scale} > 0")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("--loss-scale-window and --hysteresis must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step; ``found_inf`` must be the same on every rank."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                new = self.scale * self.backoff_factor
                if new < self.min_scale:
                    raise LossScaleError(
                        f"loss scale fell below --min-loss-scale {self.min_scale:g} (would be {new:g} after "
                        f"another overflow): gradients keep overflowing in fp16. Lower --lr, use --bf16, "
                        f"or lower --min-loss-scale")
                self.scale = new
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker, "dynamic": True}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Continue a saved dynamic scale; the state of a constant scaler is ignored (this run
        starts at its ``--initial-loss-scale``)."""
        if not is_dynamic_state(state):
            return
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


def is_dynamic_state(state: Dict[str, float]) -> bool:
    """Whether a scaler state dict was saved by a :class:`DynamicLossScaler` (states written before
    the ``dynamic`` tag are recognised by their ``growth_tracker``)."""
    return bool(state.get("dynamic", "growth_tracker" in state))


def apply_tf32(precision, device: torch.device) -> bool:
    """``--tf32`` on a CUDA device: fp32 matrix products (cuBLAS) and convolutions (cuDNN) may run
    in TF32.  Process-wide torch settings; without the flag, or on another device, nothing is
    changed (PyTorch's defaults, or what the environment chose, stay).  Returns whether it set them."""
    if not getattr(precision, "tf32", False) or torch.device(device).type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def build_loss_scaler(precision):
    """The scaler a :class:`~megazero.config.PrecisionConfig` asks for: dynamic for fp16 without
    ``--loss-scale``, otherwise constant (1.0 for bf16/fp32 unless ``--loss-scale`` is given)."""
    if precision.fp16 and precision.loss_scale is None:
        return DynamicLossScaler(precision.initial_loss_scale, precision.min_loss_scale,
                                 precision.loss_scale_window, precision.hysteresis)
    return ConstantLossScaler(precision.loss_scale if precision.loss_scale is not None else 1.0)
