"""AdamW and SGD acting on flat fp32 slices (a ZeRO shard of a bucket).

The arithmetic follows ``torch.optim.AdamW`` / ``torch.optim.SGD`` so a sharded run matches a
plain PyTorch run.  Weight decay is applied only to the ``decay`` segments ``[(a, b), ...]`` of
a slice: a flat shard mixes matrices (decayed) with biases and norm weights (not decayed).

``update`` multiplies the gradient by ``grad_mul`` (clipping and loss-scale factor) and may
overwrite ``grad`` (the caller's reduced-gradient buffer, consumed by the step).  Adam runs
PyTorch's fused single-pass kernel (``torch._fused_adamw_``; CPUs since torch 2.4, GPUs) when it
exists for the device: the unfused form reads and writes the 4 flat buffers about 8 times, a large
share of a CPU step.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

Segments = List[Tuple[int, int]]
Decoupled = Optional[Tuple[Segments, float]]  # (segments, their own rate): --decoupled-lr


class FlatAdamW:
    """Adam with decoupled weight decay (AdamW)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.fused_devices: Dict[str, bool] = {}  # device type -> whether torch has a fused kernel for it
        self.scalars: Dict[Tuple[str, str], torch.Tensor] = {}  # (device, name) -> the kernel's scalar

    def init_state(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {name: torch.zeros_like(master) for name in self.state_names}

    def update(self, master: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor],
               decay: Segments, lr: float, step: int, grad_mul: float = 1.0,
               decoupled: Decoupled = None) -> None:
        """One step; ``decoupled``: (segments, their rate) for parameters with a rate of their own
        (``--decoupled-lr``), None when every element runs at ``lr``."""
        m, v = state["exp_avg"], state["exp_avg_sq"]
        runs = _rate_runs(master.numel(), lr, decoupled)
        if self._fused((master, grad, m, v), decay, runs, step, grad_mul):
            return
        if self.weight_decay:
            for segments, rate in runs:
                for a, b in _intersect(decay, segments) if rate else ():
                    master[a:b].mul_(1.0 - rate * self.weight_decay)
        if grad_mul != 1.0:
            grad.mul_(grad_mul)
        m.lerp_(grad, 1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        bc1 = 1.0 - self.beta1 ** step
        bc2 = 1.0 - self.beta2 ** step
        denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
        if len(runs) == 1:  # one rate covers the whole slice
            master.addcdiv_(m, denom, value=-runs[0][1] / bc1)
            return
        for segments, rate in runs:
            for a, b in segments:
                master[a:b].addcdiv_(m[a:b], denom[a:b], value=-rate / bc1)

    def _scalar(self, device: torch.device, name: str, value: float) -> torch.Tensor:
        """The kernel's scalar ``name`` on ``device``, made once and refilled in place each step (a
        ``fill_`` is a kernel with the value as its argument: no host-to-device copy per bucket, as a
        new ``torch.tensor(value, device=...)`` would be)."""
        key = (str(device), name)
        if key not in self.scalars:
            self.scalars[key] = torch.empty((), dtype=torch.float32, device=device)
        return self.scalars[key].fill_(value)

    def _fused(self, flat, decay: Segments, runs, step: int, grad_mul: float) -> bool:
        """PyTorch's fused AdamW kernel on ``flat = (master, grad, exp_avg, exp_avg_sq)``, when this
        torch has one for the device (CPUs since 2.4); False (nothing done) otherwise.  For each rate
        of ``runs``, the decayed segments and the others go in as two lists of views, so the decay is
        applied inside the kernel's single pass instead of a pass of its own."""
        master, grad = flat[0], flat[1]
        fused = getattr(torch, "_fused_adamw_", None)
        if fused is None or grad.dtype != master.dtype or grad.device != master.device:
            return False
        if self.fused_devices.get(master.device.type) is False:
            return False
        step_t = self._scalar(master.device, "step", float(step))
        scale = None if grad_mul == 1.0 else self._scalar(master.device, "grad_scale", 1.0 / grad_mul)
        decayed = decay if self.weight_decay else []
        parts = [(_intersect(part, segments), wd, rate) for segments, rate in runs
                 for part, wd in ((decayed, self.weight_decay), (_complement(decayed, master.numel()), 0.0))]
        try:
            for segments, wd, rate in parts:
                if segments:
                    views = [[t[a:b] for a, b in segments] for t in flat]
                    fused(*views, [], [step_t] * len(segments), lr=rate, beta1=self.beta1, beta2=self.beta2,
                          weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False, grad_scale=scale)
        except (NotImplementedError, RuntimeError):
            if self.fused_devices.get(master.device.type):
                raise  # it worked before: a real error
            # no kernel for this device: raised before any write
            self.fused_devices[master.device.type] = False
            return False
        self.fused_devices[master.device.type] = True
        return True


def _rate_runs(n: int, lr: float, decoupled: Decoupled) -> List[Tuple[Segments, float]]:
    """``[(segments, rate)]`` covering ``[0, n)``: one run at ``lr``, or two with ``decoupled``."""
    if not decoupled or not decoupled[0]:
        return [([(0, n)], lr)]
    segments, rate = decoupled
    rest = _complement(segments, n)
    return ([(rest, lr)] if rest else []) + [(list(segments), rate)]


def _intersect(a: Segments, b: Segments) -> Segments:
    """The overlap of two sorted lists of disjoint ``(start, end)`` ranges."""
    out, j = [], 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            start, end = max(lo, b[k][0]), min(hi, b[k][1])
            if start < end:
                out.append((start, end))
            k += 1
    return out


def _complement(segments: Segments, n: int) -> Segments:
    """The parts of ``[0, n)`` outside the sorted, disjoint ``segments``."""
    out, start = [], 0
    for a, b in segments:
        if a > start:
            out.append((start, a))
        start = b
    if start < n:
        out.append((start, n))
    return out


class FlatSGD:
    """SGD with (coupled, L2) weight decay and heavy-ball momentum, as ``torch.optim.SGD``."""

    def __init__(self, momentum: float = 0.0, weight_decay: float = 0.0):
        self.momentum, self.weight_decay = momentum, weight_decay
        self.state_names = ("momentum_buffer",) if momentum else ()

    def init_state(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {name: torch.zeros_like(master) for name in self.state_names}

    def update(self, master: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor],
               decay: Segments, lr: float, step: int, grad_mul: float = 1.0,
               decoupled: Decoupled = None) -> None:
        if grad_mul != 1.0:
            grad.mul_(grad_mul)
        if self.weight_decay:
            for a, b in decay:
                grad[a:b].add_(master[a:b], alpha=self.weight_decay)
        if self.momentum:
            buf = state["momentum_buffer"]
            if step == 1:
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad)
            grad = buf
        runs = _rate_runs(master.numel(), lr, decoupled)
        if len(runs) == 1:  # one rate covers the whole slice
            master.add_(grad, alpha=-runs[0][1])
            return
        for segments, rate in runs:
            for a, b in segments:
                master[a:b].add_(grad[a:b], alpha=-rate)


def build_flat_optimizer(opt_cfg):
    """The flat optimizer an :class:`~megazero.config.OptimizerConfig` asks for."""
    if opt_cfg.optimizer == "adam":
        return FlatAdamW(opt_cfg.adam_beta1, opt_cfg.adam_beta2, opt_cfg.adam_eps, opt_cfg.weight_decay)
    if opt_cfg.optimizer == "sgd":
        return FlatSGD(opt_cfg.sgd_momentum, opt_cfg.weight_decay)
    raise ValueError(f"--optimizer must be adam or sgd, got {opt_cfg.optimizer!r}")
