"""Numerical faults: a NaN or inf loss or gradient norm stops the run (Megatron's
``--check-for-nan-in-loss-and-grad``, on by default), naming the iteration; so does a loss spike
(``--loss-spike-factor``).

The optimizer already skips a step whose gradients hold an inf/NaN (every rank agrees, since the
gradient norm is global).  fp16 with the dynamic loss scaler expects such *gradient* overflows (they
lower the scale) and stops by itself when the scale would fall below ``--min-loss-scale``
(:class:`megazero.optim.precision.LossScaleError)`, so those are left to it.  A non-finite *forward* loss
is never an overflow of the scaled backward pass: the weights or activations themselves diverged, so
it counts with every scaler.  Everywhere else (fp32, bf16, a constant ``--loss-scale``) any
non-finite step means divergence.  :class:`NanGuard` lets through up to ``--skip-nan-steps`` such
steps in all and then raises :class:`NumericalError` on every rank (the loss and the norm are the
same on every rank, so every rank decides alike).

:class:`LossSpikeGuard` (``--loss-spike-factor K``): a finite loss above ``K`` times the median of
the last ``--loss-spike-window`` losses is a divergence too; it raises before anything is saved from
that iteration.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

from megazero.resilience.errors import NumericalError

ADVICE = ("Lower --lr (or --loss-scale), raise --lr-warmup-iters or --clip-grad; --skip-nan-steps K "
          "skips up to K such steps, --no-check-for-nan-in-loss-and-grad never stops")


def _finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(float(x))


class NanGuard:
    """Counts non-finite steps and raises once there are more than ``--skip-nan-steps``."""

    def __init__(self, res_cfg, dynamic_scaler: bool, precision: str):
        self.enabled = bool(res_cfg.check_for_nan_in_loss_and_grad)
        self.dynamic = bool(dynamic_scaler)
        self.budget = int(res_cfg.skip_nan_steps)
        self.precision = precision
        self.seen = 0

    def check(self, iteration: int, loss: Optional[float], grad_norm: Optional[float], skipped: bool,
              loss_scale: float = 1.0) -> bool:
        """After the step of ``iteration``: True when it was non-finite (and skipped); raises
        :class:`NumericalError` when that exceeds the budget.  With the dynamic loss scaler only a
        non-finite forward loss counts (a gradient overflow is the scaler's business)."""
        bad = skipped or not _finite(loss) or not _finite(grad_norm)
        counted = not _finite(loss) if self.dynamic else bad
        if not (self.enabled and counted):
            return bad
        self.seen += 1
        if self.seen <= self.budget:
            return True
        what = []
        if not _finite(loss):
            what.append(f"the loss is {loss}")
        if not _finite(grad_norm) or (skipped and not self.dynamic):
            what.append(f"the gradient norm is {grad_norm}")
        if self.dynamic:
            scale = f" with the dynamic loss scaler at {loss_scale:g}: a forward loss is never an overflow"
        else:
            scale = f" under the constant loss scale {loss_scale:g}" if loss_scale != 1.0 else ""
        budget = (f" after {self.budget} skipped step{'s' if self.budget != 1 else ''} (--skip-nan-steps)"
                  if self.budget else "")
        raise NumericalError(
            f"iteration {iteration}: {' and '.join(what)} ({self.precision}{scale}){budget}: training "
            f"diverged and the step was not applied; nothing was saved from it. {ADVICE}.")


class LossSpikeGuard:
    """``--loss-spike-factor K``: a loss over ``K`` times the median of the last ``window`` finite
    losses (from the first iteration that has one before it) raises :class:`NumericalError` with
    ``action`` "stop"; with "skip" the training loop asks :meth:`over` before the update and does not
    apply it, and :meth:`check` raises only at a spike after ``max_skips`` skipped ones in a row.
    A spike's loss never enters the median."""

    def __init__(self, factor: Optional[float], window: int, action: str = "stop", max_skips: int = 10):
        self.factor = float(factor) if factor else None  # None or 0: off
        self.history: deque = deque(maxlen=max(1, int(window)))
        self.skips = action == "skip" and self.factor is not None
        self.max_skips = int(max_skips)
        self.in_a_row = 0
        self.skipped = False  # the last checked iteration was a spike whose update was not applied

    def over(self, loss: Optional[float]) -> Optional[float]:
        """The median ``loss`` is a spike over (None when it is none, or non-finite)."""
        if self.factor is None or loss is None or not math.isfinite(float(loss)) or not self.history:
            return None
        median = statistics.median(self.history)
        return median if float(loss) > self.factor * median else None

    def check(self, iteration: int, loss: Optional[float]) -> None:
        median = self.over(loss)
        self.skipped = False
        if median is None:
            if self.factor is not None and loss is not None and math.isfinite(float(loss)):
                self.history.append(float(loss))
                self.in_a_row = 0
            return
        if self.skips and self.in_a_row < self.max_skips:
            self.in_a_row += 1
            self.skipped = True
            return
        after = (f", after {self.in_a_row} spiking batches in a row were skipped (--loss-spike-max-skips "
                 f"{self.max_skips}); the update was not applied" if self.skips else "")
        raise NumericalError(
            f"iteration {iteration}: the loss {float(loss):.6g} is over --loss-spike-factor "
            f"{self.factor:g} times the median {median:.6g} of the last {len(self.history)} "
            f"losses{after}: training diverged; nothing was saved from it. Lower --lr, raise "
            "--lr-warmup-iters or --clip-grad, or raise --loss-spike-factor if such jumps are "
            "expected.")
