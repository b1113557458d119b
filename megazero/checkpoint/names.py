"""How a parameter is stored in a checkpoint: under which name(s), with which layout.

Most parameters are stored under their own global name, as their tensor-parallel pieces
(:func:`param_info`: the TP-local shape, whether and along which dimension TP splits it).  A
mixture of experts' stacked expert parameters (``expert_parallel``: dim 0 indexes this rank's
``E_local`` experts, global expert ``ep_rank * E_local + j``) are stored one expert at a time,
``<module>.experts.<leaf>`` as ``<module>.experts.<e>.<leaf>`` (``decoder.3.mlp.experts.5.fc1_weight``),
each split over expert TP like a tensor-parallel weight (``"tp"``: the number of pieces, the expert-TP
size; ``"coord"`` entries of the shard index name the piece).  So a checkpoint loads at any EP size:
every rank reads its own experts by name, whichever ranks wrote them.  Pure functions of the parameter
and the mesh; no other megazero import.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np


def param_info(p, shape, pp_rank: int) -> dict:
    """How a parameter is laid out: its TP-local shape, whether and along which dim TP splits it."""
    split = bool(getattr(p, "tensor_model_parallel", False))
    return {"shape": [int(s) for s in shape], "split": split, "dim": int(p.partition_dim) if split else -1,
            "vocab_parallel": bool(getattr(p, "vocab_parallel", False)), "pp": int(pp_rank)}


def is_expert(p) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def expert_name(name: str, expert: int) -> str:
    """``a.experts.fc1_weight`` -> ``a.experts.<expert>.fc1_weight``."""
    prefix, leaf = name.rsplit(".", 1)
    return f"{prefix}.{expert}.{leaf}"


def split_coord(p, mesh) -> int:
    """This rank's piece of ``p`` over the group that splits it (expert TP for experts, else TP)."""
    return mesh.coord("etp") if is_expert(p) else mesh.coord("tp")


def writes(p, mesh) -> bool:
    """Whether this rank writes ``p`` (tied copies never; unsplit ones on split-coordinate 0 only)."""
    if getattr(p, "tied_copy", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or split_coord(p, mesh) == 0


def stored(name: str, p, shape, pp_rank: int, mesh) -> List[Tuple[str, dict]]:
    """``[(stored name, layout)]`` of parameter ``p`` (full ``shape`` on this rank)."""
    if not is_expert(p):
        return [(name, param_info(p, shape, pp_rank))]
    info = param_info(p, shape, pp_rank)
    info.update(shape=info["shape"][1:], dim=info["dim"] - 1 if info["split"] else -1,
                tp=int(mesh.size("etp")), expert=True)
    first = mesh.coord("ep") * int(shape[0])
    return [(expert_name(name, first + j), dict(info)) for j in range(int(shape[0]))]


def stored_ranges(name: str, p, shape, a: int, e: int, mesh) -> List[Tuple[str, int, int, int]]:
    """Elements ``[a, e)`` of ``p``'s flattened tensor (full ``shape`` on this rank) as ``(stored name,
    lo, hi, offset)``: elements ``[lo, hi)`` of that stored tensor, at ``offset`` from ``a``."""
    if not is_expert(p):
        return [(name, a, e, 0)]
    per = int(np.prod([int(s) for s in shape[1:]], dtype=np.int64))
    first = mesh.coord("ep") * int(shape[0])
    out = []
    for j in range(a // per, -(-e // per)):
        lo, hi = max(a, j * per), min(e, (j + 1) * per)
        out.append((expert_name(name, first + j), lo - j * per, hi - j * per, lo - a))
    return out
