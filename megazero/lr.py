"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay to ``--min-lr``.

Iterations are counted from 1 (the step being taken, as the console and metrics file show it).
Warm-up rises linearly and reaches ``--lr`` at iteration ``--lr-warmup-iters`` (no step is
wasted at rate 0).  Decay follows Megatron-LM: with ``n = iteration - 1`` steps already taken,
progress is ``(n - warmup) / (decay - warmup)``, so the first step after warm-up runs at
``--lr`` and the rate reaches ``--min-lr`` after ``--lr-decay-iters`` (default
``--train-iters``) steps, staying there afterwards.
"""
from __future__ import annotations

import math


def learning_rate(iteration: int, lr: float, min_lr: float = 0.0, warmup_iters: int = 0,
                  decay_iters: int = 0, style: str = "cosine") -> float:
    """Learning rate for 1-based ``iteration``."""
    if warmup_iters > 0 and iteration <= warmup_iters:
        return lr * iteration / warmup_iters
    if style == "constant":
        return lr
    if iteration > decay_iters:
        return min_lr
    progress = (iteration - 1 - warmup_iters) / max(1, decay_iters - warmup_iters)
    if style == "linear":
        return lr - (lr - min_lr) * progress
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"--lr-decay-style must be constant, linear or cosine, got {style!r}")


def lr_from_config(cfg, iteration: int) -> float:
    """``learning_rate`` with the settings of a validated config."""
    opt = cfg.optimizer
    decay = opt.lr_decay_iters if opt.lr_decay_iters is not None else cfg.training.train_iters
    return learning_rate(iteration, opt.lr, opt.min_lr, opt.lr_warmup_iters, decay, opt.lr_decay_style)
