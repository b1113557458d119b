"""The learning-rate schedule, Megatron-LM's: linear warm-up from ``--lr-warmup-init`` to ``--lr``,
then constant, linear or cosine decay to ``--min-lr``.

Counted, as in Megatron-LM, in optimizer steps already taken ``n`` (``n = iteration - 1``; skipped
fp16 steps do not count), or in samples already consumed with ``--train-samples``
(``n = (iteration - 1) x --global-batch-size``).  Iteration 1 therefore runs at
``--lr-warmup-init`` (default 0) when there is a warm-up; warm-up ends at ``n = warmup`` with
``--lr``.  Decay progress is ``(n - warmup) / (decay - warmup)``, and after ``decay`` steps the
rate stays at ``--min-lr``.  Warm-up length: ``--lr-warmup-iters`` (``--lr-warmup-samples``), or
``--lr-warmup-fraction`` of the decay length; decay length: ``--lr-decay-iters`` (default
``--train-iters``) or ``--lr-decay-samples`` (default ``--train-samples``).
"""
from __future__ import annotations

import math


def scheduled_lr(steps: float, lr: float, min_lr: float = 0.0, warmup: float = 0, decay: float = 0,
                 style: str = "cosine", init: float = 0.0) -> float:
    """The rate after ``steps`` steps (or samples) taken, with warm-up and decay lengths in the same unit."""
    if warmup > 0 and steps <= warmup:
        return init + (lr - init) * steps / warmup
    if style == "constant":
        return lr
    if steps > decay:
        return min_lr
    if decay <= warmup:
        return lr
    progress = (steps - warmup) / (decay - warmup)
    if style == "linear":
        return lr - (lr - min_lr) * progress
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"--lr-decay-style must be constant, linear or cosine, got {style!r}")


def learning_rate(iteration: int, lr: float, min_lr: float = 0.0, warmup_iters: int = 0,
                  decay_iters: int = 0, style: str = "cosine", init: float = 0.0) -> float:
    """Learning rate of 1-based ``iteration`` with iteration-based lengths."""
    return scheduled_lr(iteration - 1, lr, min_lr, warmup_iters, decay_iters, style, init)


def lr_from_config(cfg, iteration: int) -> float:
    """The rate of 1-based ``iteration`` (skipped steps already subtracted) for a validated config."""
    opt, tr = cfg.optimizer, cfg.training
    if tr.train_samples:
        steps = (iteration - 1) * tr.global_batch_size
        decay = opt.lr_decay_samples if opt.lr_decay_samples is not None else tr.train_samples
        warmup = opt.lr_warmup_samples
    else:
        steps = iteration - 1
        decay = opt.lr_decay_iters if opt.lr_decay_iters is not None else tr.train_iters
        warmup = opt.lr_warmup_iters
    if opt.lr_warmup_fraction is not None:
        warmup = opt.lr_warmup_fraction * decay
    return scheduled_lr(steps, opt.lr, opt.min_lr, warmup, decay, opt.lr_decay_style, opt.lr_warmup_init)
