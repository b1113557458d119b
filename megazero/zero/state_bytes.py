"""Model-state bytes per rank under ZeRO (docs/design.md, "ZeRO, stated precisely").

With Ψ parameters, ``param_bytes``/``grad_bytes`` bytes per element of parameters and gradients,
``optim_bytes`` per parameter of fp32 master weights + optimizer moments (K; 12 for
mixed-precision Adam, 8 for fp32 Adam whose parameters are their own master copy) and N
data-parallel ranks:

=====  ================================
stage  bytes per rank
=====  ================================
0      (P + G + K) Ψ
1      P Ψ + G Ψ + K Ψ / N
2      P Ψ + (G + K) Ψ / N
3      (P + G + K) Ψ / N
=====  ================================
"""
from __future__ import annotations

from typing import Dict

from megazero.offload.element_bytes import master_bytes, optimizer_state_bytes
from megazero.zero.stages import check_stage, shards_gradients, shards_optimizer, shards_parameters


def optimizer_bytes_per_param(optimizer: str = "adam", mixed_precision: bool = True, momentum: bool = False,
                              offload: bool = False) -> int:
    """K: bytes of fp32 master weights (when they are a separate copy) + optimizer state per parameter
    (:mod:`megazero.offload.element_bytes`)."""
    return optimizer_state_bytes(optimizer, momentum) + master_bytes(mixed_precision, offload)


def zero_model_state_bytes(num_params: int, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                           optim_bytes: int = 12) -> Dict[str, float]:
    """Per-rank ``param_bytes``, ``grad_bytes``, ``optim_bytes`` and ``total_bytes`` by the formula."""
    check_stage(stage)
    n = float(num_params)
    out = {"param_bytes": param_bytes * n / (dp if shards_parameters(stage) else 1),
           "grad_bytes": grad_bytes * n / (dp if shards_gradients(stage) else 1),
           "optim_bytes": optim_bytes * n / (dp if shards_optimizer(stage) else 1)}
    out["total_bytes"] = sum(out.values())
    return out
