"""Bucket layout: which parameters share a contiguous flat buffer slice and who owns what.

Parameters are laid out, per model chunk and per *kind*, in reverse registration order (the
order their gradients tend to arrive in backward) and cut into buckets of at most
``bucket_size`` elements.  Each bucket is padded to a multiple of the data-parallel size so
DP rank ``r`` owns the contiguous slice ``[r * numel / dp, (r + 1) * numel / dp)`` of every
bucket.  The buckets of all chunks follow each other in one flat index space, so one param
buffer and one grad buffer hold everything; parameters are views into them.

Kinds keep parameters that need an extra once-per-step reduction apart, so their buckets have
the same layout on every rank that sums them:

- ``"plain"``: ordinary parameters;
- ``"sequence_parallel"``: parameters replicated over TP that get partial gradients under sequence
  parallelism (summed over the TP group);
- ``"shared_embedding"``: the tied embedding and its copy (summed over the embedding group when
  pp > 1);
- ``"expert"``: the routed experts' weights (``expert_parallel``): reduced and sharded over the expert
  data-parallel group (``edp``) instead of dp x cp, so their buckets are padded to a multiple of the
  expert-DP size and each expert-DP rank owns its slice (:data:`REDUCTION_GROUPS`).

A :class:`Bucket` is layout only; what happens to it during a step lives in
:mod:`megazero.zero.reducers`.

Under ZeRO-3 each bucket holds parameters of one *unit* only (a transformer layer, or the rest of
a chunk), so a unit is gathered as a whole, one or more buckets (cut at the same bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

KINDS = ("plain", "sequence_parallel", "shared_embedding", "expert")
# the mesh group each kind's buckets are reduced and sharded over
REDUCTION_GROUPS = {"plain": ("dp", "cp"), "sequence_parallel": ("dp", "cp"),
                    "shared_embedding": ("dp", "cp"), "expert": ("edp",)}
MIN_BUCKET, MAX_BUCKET = 1_000_000, 40_000_000  # elements


def default_bucket_size(total: int) -> int:
    """Default elements per bucket: a quarter of the model, within ``[1M, 40M]``.

    Several buckets let reductions start while backward still runs and keep ZeRO-2/3's live
    bucket small (on 2 CPU ranks, a 4.3M-parameter model's ZeRO-2 step took 1.8x DDP's time with
    one bucket and 1.3x with four); below ~1M elements per-collective latency dominates, and
    40M is Megatron-LM's GPU default.  A model under 1M elements gets one bucket.
    """
    return min(max(-(-total // 4), MIN_BUCKET), MAX_BUCKET)


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's whole shape: ``p.shape``, or ``p.zero_shape`` while ``p.data`` is empty because
    the rank keeps only its slice elsewhere (a model built under :class:`megazero.engine.Init`)."""
    shape = getattr(p, "zero_shape", None)
    return p.shape if shape is None else shape


def param_kind(p: torch.nn.Parameter) -> str:
    """The reduction kind of a parameter (see module docstring)."""
    if getattr(p, "expert_parallel", False):
        return "expert"
    if getattr(p, "shared_embedding", False):
        return "shared_embedding"
    if getattr(p, "sequence_parallel", False):
        return "sequence_parallel"
    return "plain"


@dataclass
class Bucket:
    """A contiguous slice ``[offset, offset + numel)`` of the flat buffers; this rank's shard of it
    is ``[shard_offset, shard_offset + shard_numel)`` of the sharded buffers.  ``dp`` is the size of
    the mesh group ``group`` the bucket is reduced and sharded over (``("dp", "cp")``, or ``("edp",)``
    for experts)."""

    index: int
    chunk: int
    kind: str
    params: List[torch.nn.Parameter]
    starts: List[int]          # each param's start inside the bucket
    shapes: List[torch.Size]   # each param's full shape (ZeRO-3 frees ``param.data``)
    numel: int                 # padded to a multiple of dp
    dp: int
    offset: int = 0            # start in the flat param/grad buffers
    unit: Optional[int] = None  # ZeRO-3 gather unit
    shard_offset: int = 0      # start of this rank's shard in the sharded buffers
    group: Tuple[str, ...] = ("dp", "cp")  # the mesh group that reduces and shards it

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp

    def shard_range(self, dp_rank: int) -> Tuple[int, int]:
        """This DP rank's slice, in bucket-local coordinates."""
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def segments(self, lo: int, hi: int):
        """``(param, a, b)`` for each parameter overlapping bucket-local ``[lo, hi)``, clipped to it."""
        out = []
        for p, s, shape in zip(self.params, self.starts, self.shapes):
            a, b = max(lo, s), min(hi, s + shape.numel())
            if a < b:
                out.append((p, a, b))
        return out


def _padded(n: int, dp: int) -> int:
    return -(-max(n, 1) // dp) * dp


class Group(NamedTuple):
    """Items that :func:`cut_buckets` cuts together: ``unit`` numbers a ZeRO-3 gather unit (None below
    stage 3); ``block`` is the unit's block index in its chunk (None for the chunk's own items, or
    when the group is not a unit)."""
    chunk: int
    unit: Optional[int]
    items: List
    block: Optional[int] = None


def bucket_groups(chunks: Sequence[Sequence], block_of: Callable, stage: int,
                  split_blocks: bool) -> List[Group]:
    """How each chunk's items (registration order) are grouped before the cut.

    ``block_of(item)`` is the index of the block (:func:`find_units`) the item belongs to, or None
    for the chunk's own items.  Stage 3: one unit per block, then one for the chunk's own items.
    ``split_blocks`` (overlapped parameter gather, stages 1/2): the items before the first block
    item, the block items and those after, last part first (see :mod:`megazero.zero.param_gather`).
    Otherwise the whole chunk.
    """
    groups: List[Group] = []
    for c, items in enumerate(chunks):
        items = list(items)
        if stage == 3:
            for block in list(dict.fromkeys(b for b in map(block_of, items) if b is not None)) + [None]:
                groups.append(Group(c, len(groups), [x for x in items if block_of(x) == block], block))
            continue
        idx = [i for i, x in enumerate(items) if block_of(x) is not None]
        parts = ([items[:idx[0]], items[idx[0]:idx[-1] + 1], items[idx[-1] + 1:]] if split_blocks and idx
                 else [items])
        groups += [Group(c, None, part) for part in reversed(parts) if part]
    return groups


class BucketCut(NamedTuple):
    """One bucket of a plan: its chunk, unit, kind, members (in layout order) and padded size."""
    chunk: int
    unit: Optional[int]
    kind: str
    members: List
    numel: int


def cut_buckets(groups: Sequence[Group], dp: Union[int, Dict[str, int]], bucket_size: Optional[int],
                numel: Callable = lambda p: full_shape(p).numel(),
                kind: Callable = param_kind) -> List[BucketCut]:
    """The bucket plan: :func:`bucket_groups` cut into buckets, one kind at a time.

    Items are laid out in reverse order; a bucket closes before it would pass ``bucket_size``
    elements (default :func:`default_bucket_size` of all items), and never holds items of two groups
    (a ZeRO-3 unit is gathered as a whole, bucket by bucket; cut, a large item such as the word
    embedding has a bucket of its own, whose gradient buffer exists only once that gradient arrives,
    at the end of backward); each bucket is padded to a multiple of ``dp`` (its kind's entry when
    ``dp`` maps kinds to the sizes of their reduction groups).  Items are parameters for the
    optimizer (:func:`plan_buckets`) and parameter descriptions for the memory estimator, which
    passes its own ``numel`` and ``kind``: one rule serves both.
    """
    sizes = dp if isinstance(dp, dict) else {k: dp for k in KINDS}
    total = sum(numel(x) for g in groups for x in g.items)
    cap = bucket_size or default_bucket_size(total)
    out: List[BucketCut] = []
    for chunk, unit, items, _ in groups:
        for k in KINDS:
            current: List = []
            size = 0
            for x in [x for x in reversed(list(items)) if kind(x) == k]:
                if current and size + numel(x) > cap:
                    out.append(BucketCut(chunk, unit, k, current, _padded(size, sizes[k])))
                    current, size = [], 0
                current.append(x)
                size += numel(x)
            if current:
                out.append(BucketCut(chunk, unit, k, current, _padded(size, sizes[k])))
    return out


def plan_buckets(groups: Sequence[Group], dp: Union[int, Dict[str, int]],
                 bucket_size: Optional[int]) -> List[Bucket]:
    """:func:`cut_buckets` over parameters, as :class:`Bucket` s with their ``offset`` in one flat
    index space and their shards' in the sharded one.  ``dp``: the size of every kind's reduction
    group (:data:`REDUCTION_GROUPS`), or one size for all."""
    sizes = dp if isinstance(dp, dict) else {k: dp for k in KINDS}
    buckets: List[Bucket] = []
    offset = shard_offset = 0
    for cut in cut_buckets(groups, sizes, bucket_size):
        starts, n = [], 0
        for p in cut.members:
            starts.append(n)
            n += full_shape(p).numel()
        size = sizes[cut.kind]
        buckets.append(Bucket(len(buckets), cut.chunk, cut.kind, list(cut.members), starts,
                              [full_shape(p) for p in cut.members], cut.numel, size, offset, cut.unit,
                              shard_offset, REDUCTION_GROUPS[cut.kind]))
        offset += cut.numel
        shard_offset += cut.numel // size
    return buckets


def trainable_params(module: torch.nn.Module, seen: Dict[int, bool]) -> List[torch.nn.Parameter]:
    """Parameters of ``module`` that need gradients and are not yet in ``seen`` (marked there)."""
    out = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen[id(p)] = True
            out.append(p)
    return out


def find_units(chunk: torch.nn.Module) -> List[torch.nn.Module]:
    """ZeRO-3 gather units of a chunk: each block of its largest ``nn.ModuleList``/``nn.ModuleDict``
    (the transformer layers), the chunk itself last (for everything else).  A chunk without one is
    a single unit."""
    best, best_n = None, 0
    for m in chunk.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) and m is not chunk:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
    blocks = [b for b in best.children() if any(True for _ in b.parameters())] if best is not None else []
    return blocks + [chunk]


Blocks = List[Tuple[torch.nn.Module, List[torch.nn.Parameter]]]


def default_blocks(chunk: torch.nn.Module) -> Blocks:
    """``(module, parameters)`` per ZeRO-3 block of a chunk (:func:`find_units`, the chunk itself left
    out: its unit takes every parameter no block claims).  A parameter listed by two blocks belongs
    to the later one.  Another rule for another kind of model (any ``nn.Module``:
    :func:`megazero.engine.units.module_blocks`) is passed to :func:`megazero.zero.build_optimizer`."""
    return [(b, list(b.parameters())) for b in find_units(chunk)[:-1]]
