"""Numerical faults: a NaN or inf loss or gradient norm stops the run (Megatron's
``--check-for-nan-in-loss-and-grad``, on by default), naming the iteration.

The optimizer already skips a step whose gradients hold an inf/NaN (every rank agrees, since the
gradient norm is global).  fp16 with the dynamic loss scaler expects such steps (they lower the
scale) and stops by itself when the scale would fall below ``--min-loss-scale``
(:class:`megazero.precision.LossScaleError`), so it is left alone.  Everywhere else (fp32, bf16,
a constant ``--loss-scale``) a non-finite step means divergence: :class:`NanGuard` lets through up
to ``--skip-nan-steps`` of them in all and then raises :class:`NumericalError` on every rank (the
loss and the norm are the same on every rank, so every rank decides alike).
"""
from __future__ import annotations

import math
from typing import Optional

from megazero.resilience.errors import NumericalError


def _finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(float(x))


class NanGuard:
    """Counts non-finite steps and raises once there are more than ``--skip-nan-steps``."""

    def __init__(self, res_cfg, dynamic_scaler: bool, precision: str):
        self.enabled = bool(res_cfg.check_for_nan_in_loss_and_grad) and not dynamic_scaler
        self.budget = int(res_cfg.skip_nan_steps)
        self.precision = precision
        self.seen = 0

    def check(self, iteration: int, loss: Optional[float], grad_norm: Optional[float], skipped: bool,
              loss_scale: float = 1.0) -> bool:
        """After the step of ``iteration``: True when it was non-finite (and skipped); raises
        :class:`NumericalError` when that exceeds the budget."""
        bad = skipped or not _finite(loss) or not _finite(grad_norm)
        if not (self.enabled and bad):
            return bad
        self.seen += 1
        if self.seen <= self.budget:
            return True
        what = []
        if not _finite(loss):
            what.append(f"the loss is {loss}")
        if not _finite(grad_norm) or skipped:
            what.append(f"the gradient norm is {grad_norm}")
        scale = f" under the constant loss scale {loss_scale:g}" if loss_scale != 1.0 else ""
        budget = (f" after {self.budget} skipped step{'s' if self.budget != 1 else ''} (--skip-nan-steps)"
                  if self.budget else "")
        raise NumericalError(
            f"iteration {iteration}: {' and '.join(what)} ({self.precision}{scale}){budget}: training "
            "diverged and the step was not applied; nothing was saved from it. Lower --lr (or --loss-scale), "
            "raise --lr-warmup-iters or --clip-grad, or resume from the last checkpoint; --skip-nan-steps K "
            "skips up to K such steps, --no-check-for-nan-in-loss-and-grad never stops")
