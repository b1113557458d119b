"""Which transformer layers each pipeline stage (and virtual chunk) owns.

Uniform by default; an uneven split fixes the first and/or last stage's layer count
(``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``) and spreads
the rest evenly.  With virtual stages (interleaved schedule) stage ``r`` owns chunks
``v = 0 .. vp-1``, chunk ``v`` holding the ``(v * pp + r)``-th block of
``--num-layers-per-virtual-pipeline-stage`` layers, as in Megatron-LM.  The embedding lives on
the first stage's first chunk, the final norm, output head and loss on the last stage's last chunk.
"""
from __future__ import annotations

from typing import List, Optional, Tuple


def check_layout(num_layers: int, pp: int, vp_layers: Optional[int] = None, first: Optional[int] = None,
                 last: Optional[int] = None) -> None:
    """Raise ValueError (naming the flags) unless the layers split over the stages as asked."""
    if pp > num_layers:
        raise ValueError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers {num_layers}; "
                         "every stage needs at least one layer")
    uneven = first is not None or last is not None
    if vp_layers is not None:
        if vp_layers < 1:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {vp_layers}")
        if uneven:
            raise ValueError("--num-layers-per-virtual-pipeline-stage cannot be combined with "
                             "--decoder-first/last-pipeline-num-layers; use one or the other")
        if num_layers % (pp * vp_layers):
            raise ValueError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                             f"{pp} x --num-layers-per-virtual-pipeline-stage {vp_layers} = {pp * vp_layers}")
        return
    if not uneven:
        if num_layers % pp:
            raise ValueError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                             f"{pp}; choose a divisor or give an uneven split with "
                             "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        return
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if min(first or 0, last or 0, rest) < 0 or (middle == 0 and rest != 0) \
            or (middle > 0 and (rest % middle or rest // middle < 1)):
        raise ValueError(f"cannot split {num_layers} layers over {pp} stages with first={first}, last={last} "
                         f"(--decoder-first/last-pipeline-num-layers): the {rest} layers left cannot be "
                         f"split evenly over the other {middle} pipeline stages")


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> List[int]:
    """Layers per pipeline stage (no virtual stages)."""
    check_layout(num_layers, pp, None, first, last)
    if first is None and last is None:
        return [num_layers // pp] * pp
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    counts = [rest // middle if middle else 0] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def balanced_split(num_layers: int, pp: int) -> Optional[Tuple[int, int]]:
    """``(first, last)`` layer counts of the most even uneven split when ``pp`` does not divide
    ``num_layers`` (None when it does, or when ``pp`` exceeds the layers): every middle stage holds
    ``c = ceil(num_layers / pp)`` layers (``floor`` when that leaves fewer than one layer for each
    end) and the first and the last share the rest, the last taking the odd one.  Llama 3 405B's
    126 layers on 16 stages give ``(7, 7)``: one layer fewer at each end, as Grattafiori et al.
    (2024) placed them."""
    if pp < 2 or pp > num_layers or num_layers % pp == 0:
        return None
    for c in (-(-num_layers // pp), num_layers // pp):
        rest = num_layers - (pp - 2) * c
        if rest >= 2:
            return rest // 2, rest - rest // 2
    return None


def stage_layers(num_layers: int, pp: int, pp_rank: int, vp_layers: Optional[int] = None,
                 first: Optional[int] = None, last: Optional[int] = None) -> List[range]:
    """Global layer indices owned by stage ``pp_rank``: one range per (virtual) model chunk."""
    if vp_layers is not None:
        check_layout(num_layers, pp, vp_layers)
        vp = num_layers // (pp * vp_layers)
        return [range((v * pp + pp_rank) * vp_layers, (v * pp + pp_rank + 1) * vp_layers) for v in range(vp)]
    counts = stage_layer_counts(num_layers, pp, first, last)
    start = sum(counts[:pp_rank])
    return [range(start, start + counts[pp_rank])]


def chunk_layers(cfg, pp_rank: int) -> List[range]:
    """``stage_layers`` from a validated :class:`~megazero.config.MegazeroConfig`."""
    par = cfg.parallel
    return stage_layers(cfg.model.num_layers, par.pipeline_model_parallel_size, pp_rank,
                        par.num_layers_per_virtual_pipeline_stage, par.decoder_first_pipeline_num_layers,
                        par.decoder_last_pipeline_num_layers)
