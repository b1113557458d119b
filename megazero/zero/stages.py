"""What each ZeRO stage shards over the data-parallel ranks, and the rule for valid settings.

=====  ========================================================
stage  sharded over DP (each rank keeps its slice of every bucket)
=====  ========================================================
0      nothing (plain data parallelism)
1      fp32 master weights and optimizer state
2      + gradients
3      + parameters (gathered one unit at a time for compute)
=====  ========================================================
"""
from __future__ import annotations

STAGES = (0, 1, 2, 3)


def check_stage(stage: int, offload: bool = False) -> None:
    """Raise ValueError (naming the flag) unless ``stage``/``offload`` is a valid combination."""
    if stage not in STAGES:
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {stage}")
    if offload and stage == 0:
        raise ValueError("--offload-optimizer needs --zero-stage 1, 2 or 3 "
                         "(stage 0 keeps no sharded optimizer state)")


def shards_optimizer(stage: int) -> bool:
    return stage >= 1


def shards_gradients(stage: int) -> bool:
    return stage >= 2


def shards_parameters(stage: int) -> bool:
    return stage >= 3


def overlaps_param_gather(stage: int, dp: int, requested: bool) -> bool:
    """Whether stages 1/2 gather updated parameters during the next forward (``--overlap-param-gather``
    with several DP ranks); the bucket layout then cuts around the blocks."""
    return bool(requested) and stage in (1, 2) and dp > 1
