"""DeepSpeed's learning-rate schedules of the ds_config ``scheduler`` section, as DeepSpeed defines them.

Each counts ``last_batch_iteration`` (-1 before the first ``step()``; the engine steps the schedule
after every applied update, not after a skipped fp16 step) and writes the rate into every parameter
group's ``lr``.  With ``n = last_batch_iteration`` and ``W = max(2, warmup_num_steps)`` the warm-up
factor is ``log(n + 1) / log(W)`` (``warmup_type`` log, the default) or ``n / W`` (linear) while
``n < W``, and 1 after:

- ``WarmupLR``: ``min + (max - min) * factor``, then ``max`` (``warmup_max_lr`` defaults to the
  optimizer's rate); before the first step, ``min``;
- ``WarmupDecayLR``: the same warm-up, then ``min + (max - min) * max(0, (T - n) / max(1, T - W))``
  with ``T = total_num_steps``;
- ``WarmupCosineLR``: a ratio of each group's initial rate: ``warmup_min_ratio`` rising to 1 by the
  same factor, then ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with progress
  ``p = min(1, (n - W + 1) / max(1, T - W))``; before the first step, 0.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from megazero.errors import ConfigError


class _Schedule:
    """The shared part: the counter, the warm-up factor, writing the rates, the state."""

    def __init__(self, optimizer, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        n = warmup_num_steps
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ConfigError(f"scheduler warmup_num_steps must be a positive integer, got {n!r}")
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler warmup_type must be log or linear, got {warmup_type!r}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[List[float]] = None

    def _warmup(self) -> float:
        n = self.last_batch_iteration
        if n >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return math.log(n + 1) / math.log(self.warmup_num_steps)
        return n / self.warmup_num_steps

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def _write(self) -> None:
        rates = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._write()

    def get_last_lr(self) -> List[float]:
        if self._last_lr is None:
            raise RuntimeError("the schedule has not set a rate yet: call step() first")
        return self._last_lr

    def state_dict(self) -> Dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])


def _per_group(optimizer, value, name: str) -> List[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"scheduler {name}: {len(value)} values for {n} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * n


class WarmupLR(_Schedule):
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        if last_batch_iteration == -1:
            self._write()

    def _factor(self) -> float:
        return self._warmup()

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        f = self._factor()
        return [lo + (hi - lo) * f for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _factor(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup()
        left = self.total_num_steps - self.last_batch_iteration
        return max(0.0, left / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write()

    def ratio(self) -> float:
        n = self.last_batch_iteration
        if n < 0:
            return 0.0
        if n < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup() * (1.0 - self.warmup_min_ratio)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (n - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> List[float]:
        r = self.ratio()
        return [lr * r for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(kind: str, params: dict, optimizer):
    """The ds_config ``scheduler`` section's schedule over ``optimizer``'s parameter groups."""
    return SCHEDULES[kind](optimizer, **params)
