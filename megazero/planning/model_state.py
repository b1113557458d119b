"""Model-state bytes of one rank, exactly as the ZeRO optimizer lays them out.

The parameters are the model's own: each chunk is built on the meta device and read with the
optimizer's rules (:func:`provider_params`), never described a second time here.

The optimizer (``megazero/zero``) puts every trainable parameter of a rank into flat buffers cut
into buckets: per model chunk (per gather unit under ZeRO-3: each transformer layer, then the rest
of the chunk) and per reduction *kind* (``dense``; ``sp`` for parameters replicated over TP with
a partial gradient under sequence parallelism: norms and row-parallel biases; ``emb`` for the tied
embedding and its copy when pp > 1), in reverse registration order, at most ``bucket_size``
elements a bucket (a ZeRO-3 unit too), each padded to a multiple of the data-parallel
size ``N`` (dp x cp; the routed experts' kind ``expert`` is reduced and sharded over the
expert-data-parallel group instead, ``world / (expert TP x EP x PP)`` ranks, and ``n / N`` below
is then the sum of every bucket's shard over its own group).  With ``n`` the padded elements of
all buckets, ``P``/``G`` the bytes of a parameter / gradient element, ``K`` the optimizer's bytes
per element:

- ``param_bytes``: ``P n`` (stage 3: ``P n / N``);
- ``grad_bytes``: ``G n`` (stages 2/3: ``G n / N``);
- ``optim_bytes``: ``K n`` (stages 1-3: ``K n / N``), of which ``master_bytes`` ``4 n`` (or
  ``4 n / N``) for the fp32 master copy (half precision, or offload); fp32 parameters on the
  device are their own master weights;
- ``peak_grad_bytes``: gradients plus the communication buffers of backward, from
  :func:`grad_peak` (a replay of the optimizer's bucket life cycle, assuming no reduction finishes
  early: an upper bound of ``memory_bytes()["peak_grad_bytes"]``); ``settled_peak_grad_bytes`` the
  same when each reduction is over before the next bucket starts (the likely figure on one host);
- ZeRO-3 (``N > 1``): ``gathered_param_bytes``, the full buckets gathered while a unit runs (the
  chunk's root unit, the current layer and the prefetched one).  Nothing more: the views of
  gathered weights that autograd saves (``weight.t()`` in a linear layer) hold no memory once
  ZeRO-3 frees the bucket (its storage is resized to 0 and refilled before the backward;
  :mod:`megazero.zero.stage3`), which ``tests/test_memory.py`` measures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from megazero.offload.element_bytes import bytes_per_element
from megazero.mesh import ParallelMesh, axis_groups
from megazero.zero.buckets import (KINDS, bucket_groups, cut_buckets, default_blocks, param_kind,
                                   trainable_params)
from megazero.zero.stages import overlaps_param_gather

PLAIN, SP, EMB, EXPERT = KINDS


class ParamSpec(NamedTuple):
    """One parameter: elements, reduction kind (:data:`megazero.zero.buckets.KINDS`), ZeRO-3 unit
    (layer index, or None for the chunk's root unit), gradient parts per backward (2: the word
    embedding tied to the head in one chunk, whose head part arrives first, through write_grad)."""
    numel: int
    kind: str
    unit: Optional[int]
    parts: int = 1


@dataclass
class BucketSpec:
    chunk: int
    unit: Optional[int]
    kind: str
    params: List[int]   # indices into the chunk's ParamSpec list
    numel: int          # padded to a multiple of its group's size
    root: bool          # holds the chunk's own parameters (embedding, final norm, head)
    group: int = 1      # the ranks it is reduced and sharded over (dp x cp; expert DP for experts)

    @property
    def shard(self) -> int:
        return self.numel // self.group


# settings that place a rank's parameters (how they are sharded, reduced, offloaded) without shaping them:
# layouts of one search that differ only in these share their chunks' parameter lists
PLACING = frozenset({
    "zero_stage", "offload_optimizer", "offload_optimizer_device", "optimizer_offload_fraction",
    "offload_param_device", "nvme_path", "nvme_block_size", "nvme_io_threads", "nvme_buffer_count",
    "nvme_buffer_size", "ddp_bucket_size", "overlap_grad_reduce", "max_reductions_in_flight",
    "overlap_param_gather", "pipeline_schedule", "delay_wgrad_compute", "world_size", "data_parallel_size",
    "recompute_granularity", "recompute_method", "recompute_num_layers"})


def _shaping(section) -> tuple:
    return tuple((f, repr(getattr(section, f))) for f in section.__dataclass_fields__ if f not in PLACING)


def rank_chunks(cfg, pp_rank: int, saved, states: Optional[dict] = None) -> List[List[ParamSpec]]:
    """ParamSpecs of each of stage ``pp_rank``'s chunks: ``saved.chunk_params`` (the model's declaration,
    :mod:`megazero_models.saved_activations`), which reads them off the model (:func:`provider_params`).
    ``states``: a dict one search keeps, in which they are kept under the settings that shape them."""
    if states is None:
        return saved.chunk_params(cfg, pp_rank)
    key = ("params", pp_rank, _shaping(cfg.model), _shaping(cfg.parallel), repr(cfg.moe), repr(cfg.precision))
    if key not in states:
        states[key] = saved.chunk_params(cfg, pp_rank)
    return states[key]


def stage_rank(cfg, pp_rank: int) -> int:
    """The first global rank of pipeline stage ``pp_rank`` (TP, CP and DP coordinates 0)."""
    par = cfg.parallel
    sizes = {"tp": par.tensor_model_parallel_size, "cp": par.context_parallel_size,
             "dp": par.data_parallel_size, "pp": par.pipeline_model_parallel_size, "ep": 1}
    return axis_groups(sizes, par.rank_order, ["pp"])[0][pp_rank]


def provider_params(cfg, pp_rank: int, model_provider: Callable) -> List[List[ParamSpec]]:
    """:class:`ParamSpec` of every trainable parameter of each of stage ``pp_rank``'s chunks, in
    registration order, read off the model itself rather than described a second time:
    ``model_provider(cfg, mesh)`` builds the stage's chunks on the meta device (no memory; about 15 ms
    for a 32-layer 8B model) on a mesh with the layout's sizes and coordinates but no process groups
    (:meth:`megazero.mesh.ParallelMesh.layout`), and the optimizer's own rules read them:
    :func:`~megazero.zero.buckets.trainable_params` (order; a tied weight once),
    :func:`~megazero.zero.buckets.param_kind` and :func:`~megazero.zero.buckets.default_blocks` (the
    ZeRO-3 unit: the block index, None for the chunk's own unit).  Gradient parts: 2 for a tied
    embedding whose head part arrives through write_grad (parameters and gradients of one dtype)."""
    par, moe = cfg.parallel, cfg.moe
    mesh = ParallelMesh.layout(par.world_size, stage_rank(cfg, pp_rank), par.tensor_model_parallel_size,
                               par.pipeline_model_parallel_size, par.rank_order, par.context_parallel_size,
                               moe.expert_model_parallel_size, moe.expert_tensor_parallel_size)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        chunks = list(model_provider(cfg, mesh))
    bpe = bytes_per_element(cfg)
    seen: Dict[int, bool] = {}
    out = []
    for chunk in chunks:
        block_of = {id(p): i for i, (_, ps) in enumerate(default_blocks(chunk)) for p in ps}
        out.append([ParamSpec(p.numel(), param_kind(p), block_of.get(id(p)),
                              2 if getattr(p, "grad_arrivals", 1) == 2 and bpe["P"] == bpe["G"] else 1)
                    for p in trainable_params(chunk, seen)])
    return out


def group_sizes(cfg) -> Dict[str, int]:
    """Ranks each reduction kind's buckets are reduced and sharded over: dp x cp, and for the routed
    experts' weights the expert-data-parallel group (``world / (expert TP x EP x PP)``)."""
    par = cfg.parallel
    dp = par.data_parallel_size * par.context_parallel_size  # ZeRO shards over dp x cp
    sizes = {k: dp for k in KINDS}
    sizes[EXPERT] = cfg.moe.expert_data_parallel_size  # experts: over expert DP
    return sizes


def plan_buckets(cfg, chunks: List[List[ParamSpec]], zero_stage: int) -> List[BucketSpec]:
    """The optimizer's bucket layout, by the optimizer's own functions
    (:func:`megazero.zero.buckets.bucket_groups` and :func:`~megazero.zero.buckets.cut_buckets`)
    over the chunks' parameter descriptions."""
    par = cfg.parallel
    dp = par.data_parallel_size * par.context_parallel_size  # ZeRO shards over dp x cp
    sizes = group_sizes(cfg)
    items = [[(c, i) for i in range(len(specs))] for c, specs in enumerate(chunks)]
    groups = bucket_groups(items, lambda x: chunks[x[0]][x[1]].unit, zero_stage,
                           overlaps_param_gather(zero_stage, dp, par.overlap_param_gather))
    cuts = cut_buckets(groups, sizes, par.ddp_bucket_size,
                       numel=lambda x: chunks[x[0]][x[1]].numel, kind=lambda x: chunks[x[0]][x[1]].kind)
    return [BucketSpec(cut.chunk, cut.unit, cut.kind, [i for _, i in cut.members], cut.numel,
                       chunks[cut.chunk][cut.members[0][1]].unit is None, sizes[cut.kind]) for cut in cuts]


def grad_peak(cfg, chunks, buckets: List[BucketSpec], zero_stage: int, persistent: int,
              backend: str = "nccl", settled: bool = False) -> int:
    """Most gradient bytes held in backward: ``persistent`` plus the buckets' temporaries.

    Replays :class:`megazero.zero.ZeroOptimizer`'s life cycle (:mod:`megazero.zero.reducers`) with
    gradients arriving in reverse registration order (the tied embedding's head part first) and at
    most ``K = cfg.parallel.max_reductions_in_flight`` reductions in flight (:class:`InFlight`:
    before a launch the oldest are retired until ``K - 1`` remain).  Stage 0 reduces in place;
    stage 1 reduces each complete bucket (last micro-batch) through a full-bucket receive buffer on
    gloo fp32, so up to ``K`` receive buffers live at once (counted as the ``K`` largest buckets: an
    upper bound); stages 2/3 copy a bucket's gradients into a full-bucket temporary from its first
    gradient on (:func:`_partial_peak`).  The transient ``finish_bytes`` of a retirement (a shard) is
    smaller than the input it replaces, so it never sets the peak.  ``settled``: every reduction is
    over by the time the next bucket's first gradient arrives (the collectives faster than backward,
    as between the ranks of one host), so ``retire_finished`` retires it then: the likely peak rather
    than the upper bound."""
    G = bytes_per_element(cfg)["G"]
    K = cfg.parallel.max_reductions_in_flight
    gloo_fp32 = backend == "gloo" and G == 4
    if zero_stage == 0:
        return persistent
    if zero_stage == 1:  # buckets over a group of one rank are averaged in place
        largest = sorted((b.numel for b in buckets if b.group > 1), reverse=True)[:K]
        return persistent + (sum(largest) * G if gloo_fp32 else 0)
    return _partial_peak(chunks, buckets, persistent, G, K, gloo_fp32, settled)


def _partial_peak(chunks, buckets: List[BucketSpec], persistent: int, G: int, K: int,
                  gloo_fp32: bool, settled: bool = False) -> int:
    """Stages 2/3: a bucket's temporary (its gradient, full size) lives from its first gradient part
    on; complete, the bucket retires down to ``K - 1`` reductions and launches its own, which holds
    the temporary plus a receive buffer (gloo fp32: full bucket; native reduce-scatter: a shard)
    until retired.  A bucket of one parameter with two parts (the tied embedding) reduces its head
    part at once, after every reduction in flight: with several ranks computed and reduced a piece
    of rows (``PIECE_BYTES``) at a time, with one into a temporary of the bucket's size; its lookup
    part arrives as rows, added into the shard without a buffer of the bucket's size (the gathered
    rows are activation-sized).  No reduction is
    assumed to finish early (``retire_finished`` retires nothing), and those in flight when one
    chunk's backward ends are still held during the next chunk's: an upper bound of
    ``memory_bytes()["peak_grad_bytes"]``, exact when the collectives are slower than backward."""
    from megazero.zero.comm import PIECE_BYTES
    peak = live = persistent
    pending: List[int] = []                       # bytes each reduction in flight holds, oldest first
    for c, specs in enumerate(chunks):
        where = {i: b for b in buckets if b.chunk == c for i in b.params}
        parts = {id(b): sum(specs[i].parts for i in b.params) for b in where.values()}
        arrived: Dict[int, int] = {}
        held: Dict[int, bool] = {}
        for i in [i for i, p in enumerate(specs) if p.parts > 1] + list(reversed(range(len(specs)))):
            b = where[i]
            size = b.numel * G
            if len(b.params) == 1 and arrived.get(id(b), 0) > 0:
                continue                           # the lookup's part: rows added into the shard
            if len(b.params) == 1 and parts[id(b)] > 1 and b.group > 1:
                live -= sum(pending)               # the head's part: reduced a piece of rows at a time
                pending = []                       # after the reductions in flight
                peak = max(peak, live + min(PIECE_BYTES, size))
                arrived[id(b)] = 1
                continue
            if id(b) not in held:
                if settled:                        # retire_finished: every earlier reduction is over
                    live -= sum(pending)
                    pending = []
                held[id(b)] = True
                live += size
                peak = max(peak, live)
            arrived[id(b)] = arrived.get(id(b), 0) + 1
            part = arrived[id(b)] < parts[id(b)]
            if part and len(b.params) > 1:
                continue
            del held[id(b)]
            if b.group == 1:
                live -= size                       # added into the shard at once
                continue
            while len(pending) > K - 1:            # retire the oldest until K - 1 remain
                live -= pending.pop(0)
            if parts[id(b)] > len(b.params):       # reduced in pieces and waited for, with all in flight
                peak = max(peak, live + (min(PIECE_BYTES, size) if gloo_fp32 else b.shard * G))
                live -= size + sum(pending)
                pending = []
                continue
            recv = size if gloo_fp32 else b.shard * G
            pending.append(size + recv)
            live += recv
            peak = max(peak, live)
    return peak


def zero3_buffers(cfg, buckets: List[BucketSpec], layers: int = 2, shards: bool = False) -> int:
    """ZeRO-3 with dp > 1: the gathered working set, each chunk's root unit (gathered for the
    chunk's whole forward and its backward until the layers') plus the ``layers`` largest layer
    units (two: the current one and the prefetch; a bucket of a group of one is its own shard,
    nothing gathered); ``shards``: this rank's shards of those units instead."""
    P = bytes_per_element(cfg)["P"]
    units: Dict[Tuple[int, bool], int] = {}
    for b in buckets:
        if b.group == 1 and not shards:
            continue
        units[(b.unit, b.root)] = units.get((b.unit, b.root), 0) + (b.shard if shards else b.numel) * P
    roots = max((v for (u, root), v in units.items() if root), default=0)
    largest = sorted((v for (u, root), v in units.items() if not root), reverse=True)
    return roots + sum(largest[:layers])


def model_state(cfg, pp_rank: int, zero_stage: int, backend: str = "nccl", *, saved,
                states: Optional[dict] = None) -> Dict[str, int]:
    """Model-state bytes of one rank of stage ``pp_rank`` under ``zero_stage`` (module docstring);
    ``saved``: the model's declaration (:mod:`megazero_models.saved_activations`), whose
    ``chunk_params`` lists the parameters."""
    par = cfg.parallel
    chunks = rank_chunks(cfg, pp_rank, saved, states)
    buckets = plan_buckets(cfg, chunks, zero_stage)
    n = sum(b.numel for b in buckets)
    shard = sum(b.shard for b in buckets)  # expert buckets: over expert DP
    bpe = bytes_per_element(cfg, zero_stage)
    from megazero.offload.settings import optimizer_device, param_device
    device = optimizer_device(par) if zero_stage >= 1 else "none"
    offload = device != "none"
    master = bpe["master"]
    owned = n if zero_stage == 0 else shard
    out = {"params_per_rank": sum(p.numel for c in chunks for p in c),
           "param_bytes": bpe["P"] * (shard if zero_stage == 3 else n),
           "grad_bytes": bpe["G"] * (shard if zero_stage >= 2 else n),
           "master_bytes": master * owned, "optim_bytes": (master + bpe["state"]) * owned,
           "optim_on_cpu": offload, "optim_device": device,
           "param_device": param_device(par) if zero_stage == 3 else "none",
           "max_bucket_elements": max(b.numel for b in buckets),
           "max_shard_elements": max(b.shard for b in buckets)}
    out["peak_grad_bytes"] = grad_peak(cfg, chunks, buckets, zero_stage, out["grad_bytes"], backend)
    sharded = any(b.group > 1 for b in buckets)
    out["settled_peak_grad_bytes"] = grad_peak(cfg, chunks, buckets, zero_stage, out["grad_bytes"], backend,
                                               settled=True)
    out["gathered_param_bytes"] = 0 if zero_stage != 3 or not sharded else zero3_buffers(cfg, buckets)
    # of which the root units: released once backward reaches the layers (zero3_free_root_in_backward)
    out["gathered_root_bytes"] = (0 if zero_stage != 3 or not sharded
                                  else zero3_buffers(cfg, buckets, layers=0))
    out["resident_param_bytes"] = (resident_shards(cfg, buckets) if out["param_device"] == "nvme"
                                   else out["param_bytes"])
    return out


def resident_shards(cfg, buckets: List[BucketSpec]) -> int:
    """ZeRO-3 parameters on NVMe: the shard bytes in memory at once (:mod:`megazero.zero.param_swap`).
    One DP rank uses the shards of the units in use as they are (the root and two layers), the one
    being read held twice (the aligned copy the disk fills and the shard); several read the next
    unit's shard into the aligned copy alone, which feeds its all-gather and is dropped after it."""
    layer = max(_layer_shards(cfg, buckets), default=0)
    if not any(b.group > 1 for b in buckets):
        return zero3_buffers(cfg, buckets, shards=True) + layer
    return layer


def _layer_shards(cfg, buckets: List[BucketSpec]) -> List[int]:
    """This rank's shard bytes of each layer unit (each bucket over its own group)."""
    P = bytes_per_element(cfg)["P"]
    units: Dict[Tuple[int, Optional[int]], int] = {}
    for b in buckets:
        if not b.root:
            units[(b.chunk, b.unit)] = units.get((b.chunk, b.unit), 0) + b.shard * P
    return list(units.values())
