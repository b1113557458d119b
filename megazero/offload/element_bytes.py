"""Bytes per element of model state and activations: the one source for the memory model, the
planner, ZeRO's formula, the NVMe tier and the benchmarks.

* parameters (and activations) in the compute dtype: :data:`HALF` (2) under ``--bf16``/``--fp16``,
  else :data:`FP32` (4);
* gradients: fp32 with ``--grad-reduce-in-bf16`` off (``grad_reduce_dtype`` fp32), else as the
  parameters;
* the fp32 master copy (4) where it is a copy of its own: mixed precision, or an optimizer whose
  state is offloaded (its update runs on an fp32 copy on the host);
* optimizer state: Adam's two fp32 moments (8), SGD's momentum buffer (4) or nothing.

Mixed-precision Adam therefore keeps K = 4 + 8 = 12 bytes per parameter besides the parameter and
its gradient (docs/design.md, "ZeRO, stated correctly").  This module imports nothing at import time.
"""
from __future__ import annotations

from typing import Dict, Optional

FP32 = 4  #: bytes of an fp32 element
HALF = 2  #: bytes of a bf16 or fp16 element


def compute_bytes(precision) -> int:
    """Bytes of a parameter or activation element in the compute dtype (``cfg.precision``)."""
    return HALF if (precision.bf16 or precision.fp16) else FP32


def grad_bytes(precision) -> int:
    """Bytes of a gradient element (reduced in fp32 unless ``grad_reduce_dtype`` says otherwise)."""
    return FP32 if precision.grad_reduce_dtype == "fp32" else compute_bytes(precision)


def optimizer_state_bytes(optimizer: str, momentum: bool = False) -> int:
    """Bytes of optimizer state per element: Adam's two fp32 moments, SGD's momentum buffer or none."""
    return {"adam": 2 * FP32, "sgd": FP32 if momentum else 0}[optimizer]


def master_bytes(mixed_precision: bool, offloaded: bool = False) -> int:
    """Bytes of the fp32 master copy per element: none when the fp32 parameters are their own."""
    return FP32 if (mixed_precision or offloaded) else 0


def bytes_per_element(cfg, zero_stage: Optional[int] = None) -> Dict[str, int]:
    """``{"P", "G", "master", "state"}``: bytes per element of parameter, gradient, fp32 master copy
    and optimizer state for ``cfg`` under ``zero_stage`` (default ``cfg.parallel.zero_stage``; the
    optimizer is offloaded, so its master is a copy, only from stage 1 on)."""
    from megazero.offload.settings import optimizer_device
    pre, opt, par = cfg.precision, cfg.optimizer, cfg.parallel
    stage = par.zero_stage if zero_stage is None else zero_stage
    offloaded = stage >= 1 and optimizer_device(par) != "none"
    P = compute_bytes(pre)
    return {"P": P, "G": grad_bytes(pre), "master": master_bytes(P == HALF, offloaded),
            "state": optimizer_state_bytes(opt.optimizer, bool(opt.sgd_momentum))}
