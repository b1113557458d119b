"""What multi-token prediction (:mod:`megazero_models.mtp`) saves for backward, per micro-batch on the
last stage's rank, in the notation of :class:`megazero.planning.activations.Dims` (the companion of
:mod:`megazero_models.saved_activations`, which re-exports :func:`mtp_segments`).

Per depth: the shifted token ids ``8 T`` (with TP > 1 the shifted ids and the out-of-range mask,
``9 T``) and the embedding's dropout mask, the ``enorm`` and ``hnorm`` norms, the ``2h -> h``
projection's input ``E T 2h`` (the sequence-gathered copy under sequence parallelism; there the layer's
input is a slice of the gathered output ``E T h``, whose whole storage a first norm keeps), one transformer
layer (``Dl``: an MoE layer when the last decoder layer is one), the depth's final norm, and its masked
mean (the shifted loss mask over the whole sequence ``4 T cp`` and the token count, a scalar).
Once: the RoPE tables the depths' layers rotate with (built again for them).  The shared head then runs
on ``(1 + N) T`` tokens: each depth adds the head's input ``E T h`` and the cross-entropy's per-token
terms (``4 T V + 8 T`` at TP 1, ``4 T Vp + 8 T + T`` at TP > 1).
"""
from __future__ import annotations

from typing import List

from megazero.offload.element_bytes import FP32
from megazero.planning.activations import Dims, Segment


def _inputs(D: Dims) -> int:
    """The shifted ids, the embedding's dropout mask, the two input norms and the projection's input."""
    from .saved_activations import dropout_bytes, norm_bytes
    ids = 8 * D.T if D.tp == 1 else 9 * D.T
    # under sequence parallelism the layer's input is this rank's slice, a view of the gathered
    # projection output: a first norm that keeps its input itself keeps that whole storage
    whole = D.sp and D.norms != "post" and not (D.rms and D.half)
    gathered = D.E * (D.T - D.Tl) * D.h if whole else 0
    return ids + dropout_bytes(D) + 2 * norm_bytes(D) + D.E * D.T * 2 * D.h + gathered


def _head_share(D: Dims) -> int:
    """One depth's share of the shared head's input and cross-entropy."""
    ce = FP32 * D.T * D.v + 8 * D.T if D.tp == 1 else FP32 * D.T * D.vp + 9 * D.T
    softcap = D.E * D.T * D.vp if D.final_softcap else 0
    return D.E * D.T * D.h + softcap + ce


def mtp_segments(D: Dims, Dl: Dims, depths: int, selective: bool = False) -> List[Segment]:
    """The ``depths`` depths' segments in forward order (``D``: the chunk's Dims, ``Dl``: the MTP layer's),
    then the head's extra tokens."""
    from .saved_activations import layer_segments, norm_bytes, rope_bytes
    segs = [Segment(rope_bytes(Dl))]
    for _ in range(depths):
        segs.append(Segment(_inputs(D)))
        segs += layer_segments(Dl, selective)
        segs.append(Segment(norm_bytes(D) + FP32 * D.T * D.cp + FP32))
    segs.append(Segment(depths * _head_share(D)))
    return segs
