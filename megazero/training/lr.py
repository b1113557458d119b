"""The learning-rate schedule, Megatron-LM's: linear warm-up from ``--lr-warmup-init`` to ``--lr``,
then constant, linear, cosine, inverse-square-root or WSD (warmup-stable-decay) decay to ``--min-lr``.

Counted, as in Megatron-LM's ``OptimizerParamScheduler``, in samples already consumed by the
optimizer steps taken (skipped fp16 steps do not count): iteration ``i`` of a run with a constant
global batch ``G`` runs at ``n = (i - 1) x G``.  Lengths given in iterations are converted with the
global batch size (``--lr-warmup-iters x G``, ``--lr-decay-iters x G``, ``--lr-wsd-decay-iters x G``;
with a batch-size schedule ``G`` is its final batch size); with ``--train-samples`` they are given
in samples.  So iteration 1 runs at ``--lr-warmup-init`` (default 0) when there is a warm-up and
warm-up ends at ``n = warmup`` with ``--lr``.  After warm-up, with progress
``p = (n - warmup) / (decay - warmup)``:

- ``linear``: ``min + (1 - p)(lr - min)``; ``cosine``: ``min + (cos(pi p) + 1)/2 (lr - min)``;
- ``inverse-square-root``: ``max(min, lr sqrt(max(warmup, 1)) / sqrt(max(n, 1)))``;
- ``WSD``: ``lr`` until ``decay - wsd``, then over the last ``wsd`` samples, with ``r`` the fraction
  of them consumed, ``min + c(r)(lr - min)``: ``c = 2 * 0.5^r - 1`` (exponential), ``1 - r``
  (linear), ``(cos(pi r) + 1)/2`` (cosine) or ``1 - sqrt(r)`` (minus_sqrt);

and after ``decay`` the rate stays at ``--min-lr`` (``constant`` stays at ``--lr``).  With
``--decoupled-lr`` the input embedding and the output layer follow the same schedule from
``--decoupled-lr`` to ``--decoupled-min-lr`` (default ``--min-lr``), as in Megatron-LM.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _wsd_coefficient(steps: float, decay: float, wsd: float, style: str) -> float:
    anneal_start = decay - wsd
    if steps <= anneal_start:
        return 1.0
    ratio = (steps - anneal_start) / wsd
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"--lr-wsd-decay-style must be one of {', '.join(WSD_STYLES)}, got {style!r}")


def scheduled_lr(steps: float, lr: float, min_lr: float = 0.0, warmup: float = 0, decay: float = 0,
                 style: str = "linear", init: float = 0.0, wsd_decay: Optional[float] = None,
                 wsd_style: str = "exponential") -> float:
    """The rate after ``steps`` samples (or steps) consumed, with the lengths in the same unit."""
    if warmup > 0 and steps <= warmup:
        return init + (lr - init) * float(steps) / float(warmup)
    if style == "constant":
        return lr
    if steps > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * max(warmup, 1) ** 0.5 / (max(steps, 1) ** 0.5))
    if decay <= warmup:
        return lr
    progress = float(steps - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - progress
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    elif style == "WSD":
        if not wsd_decay:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
        coeff = _wsd_coefficient(steps, decay, wsd_decay, wsd_style)
    else:
        raise ValueError(f"--lr-decay-style must be one of {', '.join(STYLES)}, got {style!r}")
    return min_lr + coeff * (lr - min_lr)


def learning_rate(iteration: int, lr: float, min_lr: float = 0.0, warmup_iters: int = 0,
                  decay_iters: int = 0, style: str = "linear", init: float = 0.0) -> float:
    """Learning rate of 1-based ``iteration`` with iteration-based lengths (a constant batch size)."""
    return scheduled_lr(iteration - 1, lr, min_lr, warmup_iters, decay_iters, style, init)


def schedule_lengths(cfg) -> Tuple[float, float, Optional[float]]:
    """(warm-up, decay, WSD decay) lengths in samples for a validated config."""
    opt, tr = cfg.optimizer, cfg.training
    if tr.train_samples:
        decay = opt.lr_decay_samples if opt.lr_decay_samples is not None else tr.train_samples
        warmup, wsd = opt.lr_warmup_samples, opt.lr_wsd_decay_samples
    else:
        g = tr.global_batch_size
        decay = (opt.lr_decay_iters if opt.lr_decay_iters is not None else tr.train_iters) * g
        warmup = opt.lr_warmup_iters * g
        wsd = opt.lr_wsd_decay_iters * g if opt.lr_wsd_decay_iters is not None else None
    if opt.lr_warmup_fraction is not None:
        warmup = opt.lr_warmup_fraction * decay
    return warmup, decay, wsd


def lrs_at(cfg, samples: float) -> Tuple[float, Optional[float]]:
    """``(lr, decoupled lr)`` after ``samples`` samples consumed by the optimizer steps taken; the
    second is None without ``--decoupled-lr``."""
    opt = cfg.optimizer
    warmup, decay, wsd = schedule_lengths(cfg)

    def at(peak: float, floor: float) -> float:
        return scheduled_lr(samples, peak, floor, warmup, decay, opt.lr_decay_style, opt.lr_warmup_init, wsd,
                            opt.lr_wsd_decay_style)
    decoupled = None
    if opt.decoupled_lr is not None:
        floor = opt.decoupled_min_lr if opt.decoupled_min_lr is not None else opt.min_lr
        decoupled = at(opt.decoupled_lr, floor)
    return at(opt.lr, opt.min_lr), decoupled


def lr_from_config(cfg, iteration: int) -> float:
    """The rate of 1-based ``iteration`` (skipped steps already subtracted) for a validated config
    with a constant global batch size."""
    return lrs_at(cfg, (iteration - 1) * cfg.training.global_batch_size)[0]
