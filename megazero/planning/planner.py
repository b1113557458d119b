"""Layout planner: which TP x PP x DP + ZeRO layouts fit a cluster, and which is fastest.

:func:`enumerate_layouts` walks tensor parallelism (within a node, dividing heads, query groups,
hidden and FFN sizes), pipeline parallelism (dividing the layers, with virtual stages for the
interleaved schedule; or, for a PP size that does not divide them, the most even uneven split of
``--decoder-first/last-pipeline-num-layers``, as Llama 3 405B's 126 layers on 16 stages), data
parallelism, ZeRO stage (those that can hold the config's offload tiers), recomputation, sequence
parallelism and micro-batch size; for a mixture of experts every expert-parallel size dividing
``--num-experts``, with expert TP equal to TP or 1 (:func:`expert_layouts`); context parallelism
(the sequence split over CP ranks, ring attention) only when no layout fits without it.
:func:`plan` keeps the layouts that fit ``(1 - margin) x`` memory: a GPU's, for the most loaded rank
(:func:`megazero.planning.estimate.estimate_rank` of :func:`loaded_stages`); or a CPU host's, for the
sum of its ranks' process memory (:func:`host_memory`, with the host's disk holding their swap
files).  It ranks them by :func:`step_time`, a model of one optimizer step:

- compute: the slowest stage's forward + backward (2x forward) + recomputation's extra forward
  (:mod:`megazero.planning.flops` counts) per micro-batch, at ``efficiency x`` peak FLOP/s, over
  ``m + (pp - 1) / vp`` micro-batch slots (the 1F1B / interleaved bubble); with
  ``--delay-wgrad-compute`` (the default) a stage sends its input gradient before its weight
  gradients' products, so the bubble's slots last a micro-batch's compute less those products
  (the linear layers' and the head's forward FLOPs once more; an MoE layer's experts, whose
  products are not deferred, are counted too, which overstates the saving there);
- tensor parallelism: per layer and micro-batch two all-reduces forward and two backward of the
  ``[s, b, h]`` activations (all-gather + reduce-scatter pairs under sequence parallelism, the
  same bytes), two more forward with full recomputation; ring costs ``2 (n-1) (alpha + beta
  bytes / n)`` on the node's link;
- pipeline p2p: activations forward and gradients backward, ``alpha + beta bytes`` each, for
  ``vp m + pp - 1`` slots;
- data parallelism per ZeRO stage (this code base's schedule): 0 all-reduces the gradients after
  the last backward; 1 reduce-scatters them and all-gathers the parameters after the step; 2
  reduce-scatters every micro-batch and all-gathers after the step; 3 reduce-scatters every
  micro-batch and all-gathers the parameters for each micro-batch's forward and backward; each
  bucket is one collective and pays the link's latency.  Reductions overlap the backward that
  produces them, except the last bucket (a quarter of the model by default); the post-step
  all-gather is exposed; ZeRO-3's gathers overlap compute;
- context parallelism: a CP rank computes ``s / cp`` tokens; per layer and micro-batch the ring
  passes ``cp - 1`` K/V blocks forward and K/V plus dK/dV blocks backward (one more pass with
  recomputation), counted as exposed; gradients reduce over dp x cp;
- expert parallelism (:func:`ep_time`): per MoE layer and micro-batch the all-to-all of the rank's
  routed rows out and back, forward and backward, on the link spanning expert TP x EP ranks, and
  expert TP's gather and reduce-scatter; the experts' gradients reduce over expert DP, the rest
  over dp x cp;
- optimizer step: reading and writing the owned fp32 state at HBM bandwidth;
- NVMe offload tiers (:func:`nvme_time`): their bytes per step at the node's disk bandwidth
  (``plan.py --calibrate`` measures it; else an assumed 3 GB/s), shared by the node's ranks;
- a fixed overhead per layer and micro-batch (0 on GPUs by default; ``--calibrate`` fits it, the
  intercept of a real layer's time against its FLOPs, which matters for small models on CPUs);
- on CPUs, dropout (:func:`_dropout_s`): a mask drawn per element costs more than the element-wise
  work around it, and attention dropout moves SDPA from its fused kernel to the math one, so each
  hidden activation and attention score dropped costs its calibrated (or assumed) seconds.

On a CPU host (:class:`megazero.planning.hardware.Hardware`) a rank computes at its share of the
host's cores.  Ranks that share processors (``Hardware.oversubscription`` > 1: more CPU ranks than
cores, as in this project's tests) change two things: a rank waiting in the pipeline bubble hands
its processor to the others, so the step is a rank's own work (the *average* stage's, all
progressing together) unless the critical path at the full processor's speed is longer; and
communication is work for the same processors, so no reduction or gather is hidden behind compute.

Links follow the rank order ``tp-dp-pp``: a TP group stays in a node; a DP group (``tp x dp``
consecutive ranks) or a pipeline neighbour (``tp x dp`` ranks away) crosses nodes when that span
exceeds the node.  Each link is ``alpha`` seconds per message plus ``beta`` seconds per byte; the
defaults per GPU are nominal SXM figures, and ``--calibrate`` fits them (and the compute rate)
from measured collectives on the machine at hand (:mod:`megazero.planning.calibrate`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

from megazero.config import config_from_dict, validate
from megazero.config.hybrid import ATTENTION, linear_attention_layers
from megazero.offload.element_bytes import FP32, bytes_per_element, compute_bytes, grad_bytes
from megazero.offload.settings import optimizer_device, param_device
from megazero.pipeline.partition import balanced_split, stage_layer_counts
from megazero.planning.estimate import estimate_rank
from megazero.planning.flops import (hardware_flops_per_iteration, layer_forward_flops_per_token,
                                     model_flops_per_iteration)
from megazero.planning.gpu_model import micro_batch_seconds
from megazero.planning.hardware import (ALPHA_INTER, ALPHA_INTRA, DISK_BYTES_PER_S, GB, GPUS,  # noqa: F401
                                        Hardware, Link)

RECOMPUTE = ("none", "selective", "full")


@dataclass
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    zero_stage: int
    recompute: str
    sequence_parallel: bool
    micro_batch_size: int
    memory_bytes: int = 0  # the most loaded rank's (a CPU rank: its process memory)
    step: Dict[str, float] = field(default_factory=dict)
    cp: int = 1  # context-parallel size (proposed only when nothing fits without it)
    first: Optional[int] = None  # layers of the first / last pipeline stage when uneven
    last: Optional[int] = None
    host_bytes: int = 0  # CPU hosts: the busiest host's memory, its ranks together
    disk_bytes: int = 0  # CPU hosts: the busiest host's swap files
    ep: int = 1  # expert-parallel size (MoE models)
    etp: Optional[int] = None  # expert tensor-parallel size when it differs from tp (MoE models)

    def settings(self, num_layers: int) -> Dict[str, object]:
        """Config fields (``megazero.config`` names) of this layout."""
        out: Dict[str, object] = {"tensor_model_parallel_size": self.tp,
                                  "pipeline_model_parallel_size": self.pp,
                                  "zero_stage": self.zero_stage, "micro_batch_size": self.micro_batch_size,
                                  "sequence_parallel": self.sequence_parallel}
        if self.cp > 1:
            out["context_parallel_size"] = self.cp
        if self.vpp > 1:
            out["num_layers_per_virtual_pipeline_stage"] = num_layers // (self.pp * self.vpp)
        if self.first is not None:
            out.update(decoder_first_pipeline_num_layers=self.first,
                       decoder_last_pipeline_num_layers=self.last)
        if self.recompute != "none":
            out["recompute_granularity"] = self.recompute
        if self.ep > 1:
            out["expert_model_parallel_size"] = self.ep
        if self.etp is not None:
            out["expert_tensor_parallel_size"] = self.etp
        return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def min_zero_stage(cfg) -> int:
    """The lowest ZeRO stage the config's offload tiers allow: 3 with the parameters offloaded, 1
    with the optimizer state, else 0."""
    par = cfg.parallel
    if param_device(par) != "none":
        return 3
    return 1 if optimizer_device(par) != "none" else 0


def _pipeline_splits(num_layers: int, pp: int, max_vpp: int) -> List[tuple]:
    """``(vpp, first, last)`` of the ways ``pp`` stages hold the layers: even, with virtual stages
    that divide them; or, when ``pp`` does not divide the layers, the most even uneven split
    (:func:`megazero.pipeline.partition.balanced_split`, no virtual stages)."""
    if num_layers % pp == 0:
        return [(v, None, None) for v in range(1, max_vpp + 1) if (v == 1 or pp > 1)
                and num_layers % (pp * v) == 0]
    split = balanced_split(num_layers, pp)
    return [(1, *split)] if split else []


def enumerate_layouts(cfg, gpus: int, gpus_per_node: int, micro_batch_sizes: Optional[Sequence[int]] = None,
                      recompute: Sequence[str] = RECOMPUTE, zero_stages: Sequence[int] = (0, 1, 2, 3),
                      max_vpp: int = 4, context_parallel: bool = False) -> Iterable[Layout]:
    """Every layout the config's divisibility rules allow on ``gpus`` GPUs (validated configs);
    ``context_parallel``: only the layouts with CP > 1 (the sequence cut into 2 CP chunks).
    Pipeline sizes that do not divide the layers get the most even uneven split; the config's
    offload tiers keep the ZeRO stages that can hold them (:func:`min_zero_stage`, which a single
    data-parallel rank may then use)."""
    m, low = cfg.model, min_zero_stage(cfg)
    zero_stages = [z for z in zero_stages if z >= low]
    for tp in _divisors(min(gpus_per_node, gpus)):
        if any(x % tp for x in (m.num_attention_heads, m.num_query_groups, m.hidden_size, m.ffn_hidden_size)):
            continue
        for pp in (p for p in _divisors(gpus // tp) if p <= m.num_layers):
            cps = [c for c in _divisors(gpus // (tp * pp)) if c > 1 and m.seq_length % (2 * c) == 0
                   and m.attention_dropout == 0]  # dropout inside ring attention is not implemented
            for cp in (cps if context_parallel else [1]):
                for ep, etp in expert_layouts(cfg, gpus, tp, pp):
                    splits = _pipeline_splits(m.num_layers, pp, max_vpp)
                    yield from _layouts_of(cfg, tp, pp, cp, gpus // (tp * pp * cp), micro_batch_sizes,
                                           recompute, zero_stages, splits, low, ep, etp)


def expert_layouts(cfg, gpus: int, tp: int, pp: int) -> List[tuple]:
    """``(ep, etp)`` pairs for a TP x PP grid: ``(1, None)`` for a dense model; for a mixture of experts
    every expert-parallel size dividing ``--num-experts`` with expert TP equal to TP (``None``, the
    default; not for experts with biases under TP) or 1 (experts whole on each rank, when TP > 1), such that
    expert TP x EP x PP divides the GPUs (the rest is expert data parallelism)."""
    moe = cfg.moe
    if not moe.num_experts:
        return [(1, None)]
    # biased experts are never split (Megatron-LM's rule): expert TP 1 under TP
    etps = [None] if tp == 1 else [1] if cfg.model.add_bias_linear else [None, 1]
    return [(ep, etp) for ep in _divisors(moe.num_experts) for etp in etps
            if gpus % ((etp or tp) * ep * pp) == 0 and moe.moe_ffn_hidden_size % (etp or tp) == 0]


def _layouts_of(cfg, tp, pp, cp, dp, micro_batch_sizes, recompute, zero_stages, splits, low, ep=1, etp=None):
    """The layouts of one TP x PP x CP x DP (x EP) grid (:func:`enumerate_layouts`)."""
    m, gbs = cfg.model, cfg.training.global_batch_size
    if gbs % dp:
        return
    mbs = micro_batch_sizes or [b for b in (1, 2, 4, 8, 16) if (gbs // dp) % b == 0]
    # MoE layers under TP need sequence parallelism (Megatron-LM's rule)
    sps = ((True,) if cfg.moe.num_experts else (False, True)) if tp > 1 else (False,)
    for (vpp, first, last), mb, zero, rc, sp in itertools.product(splits, mbs, zero_stages, recompute, sps):
        n_micro = gbs // (dp * mb) if gbs % (dp * mb) == 0 else 0
        if not n_micro or (vpp > 1 and n_micro % pp) or (dp * cp == 1 and zero != low):
            continue
        if sp and m.seq_length // cp % tp:
            continue
        yield Layout(tp, pp, vpp, dp, zero, rc, sp, mb, cp=cp, first=first, last=last, ep=ep, etp=etp)


def layout_config(cfg, layout: Layout, gpus: int):
    """The validated config of ``layout`` (``cfg``'s model, batch and precision)."""
    settings = {f: getattr(section, f) for section in (cfg.model, cfg.training, cfg.optimizer, cfg.precision,
                                                       cfg.moe)
                for f in section.__dataclass_fields__ if f not in ("padded_vocab_size", "num_micro_batches",
                                                                   "expert_data_parallel_size",
                                                                   "expert_tensor_parallel_size")}
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        settings.pop(name, None)
    par = cfg.parallel
    settings.update(layout.settings(cfg.model.num_layers),
                    offload_optimizer=par.offload_optimizer and layout.zero_stage > 0)
    if layout.zero_stage > 0:  # the offload tiers of the base config (the optimizer's from ZeRO-1, the
        settings.update(offload_optimizer_device=par.offload_optimizer_device, nvme_path=par.nvme_path,
                        optimizer_offload_fraction=par.optimizer_offload_fraction)
        if layout.zero_stage == 3:  # parameters' at ZeRO-3)
            settings.update(offload_param_device=par.offload_param_device)
    return validate(config_from_dict(settings), gpus, check_data=False)


def loaded_stages(cfg) -> List[int]:
    """The pipeline stages that may hold the most: the first (the most micro-batches in flight),
    the second when the first holds fewer layers (uneven split), and the last (the head and the
    loss)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    uneven = cfg.parallel.decoder_first_pipeline_num_layers is not None
    return sorted({0, pp - 1} | ({1} if uneven and pp > 2 else set()))


def peak_memory(cfg, *, saved, states: Optional[dict] = None, attention: str = "flash") -> int:
    """Device bytes of the most loaded rank (:func:`loaded_stages`).  ``states``: model states of
    this search (:func:`megazero.planning.estimate.estimate_rank`); ``attention``: the kernel
    modelled (``unfused`` keeps the ``s x s`` scores)."""
    return max(int(estimate_rank(cfg, r, saved=saved, states=states, attention=attention)["total_bytes"])
               for r in loaded_stages(cfg))


def host_memory(cfg, hw: Hardware, *, saved, states: Optional[dict] = None) -> tuple:
    """CPU hosts, whose ranks share memory and disk: ``(rank, host, disk)`` bytes: the most loaded
    rank's process memory (its total and its host buffers), the sum over the ranks of the busiest
    host, and the swap files on the fullest host's disk.  Ranks are laid out ``tp-cp-dp-pp``, so a
    host of ``gpus_per_node`` consecutive ranks holds whole or partial pipeline stages."""
    par = cfg.parallel
    pp, world = par.pipeline_model_parallel_size, par.world_size
    rows = [estimate_rank(cfg, r, device="cpu", saved=saved, states=states, attention=hw.attention)
            for r in range(pp)]
    need = [int(e["total_bytes"]) + int(e["host_bytes"]) for e in rows]
    disk = [int(e["nvme_bytes"]) for e in rows]
    per_stage, per_host = world // pp, hw.gpus_per_node
    hosts = [range(h, min(h + per_host, world)) for h in range(0, world, per_host)]
    return (max(need), max(sum(need[g // per_stage] for g in host) for host in hosts),
            max(sum(disk[g // per_stage] for g in host) for host in hosts))


# ---- step time -------------------------------------------------------------------------------
def _link(span: int, hw: Hardware) -> Link:
    """The link a group of ``span`` consecutive ranks communicates over."""
    return hw.intra if span <= hw.gpus_per_node else hw.inter


def _stage_forward_flops(cfg, mean: bool = False) -> tuple:
    """``(FLOPs, layers, weight FLOPs)`` of one micro-batch's forward on the slowest pipeline stage
    (whole TP group): its layers, plus the output head on the last stage; ``mean``: averaged over
    the stages instead.  Weight FLOPs: the products with weights (the linear layers and the head,
    not attention's scores), which the weight gradients repeat in backward."""
    m, par = cfg.model, cfg.parallel
    pp = par.pipeline_model_parallel_size
    tokens = cfg.training.micro_batch_size * m.seq_length // par.context_parallel_size
    layer = layer_forward_flops_per_token(cfg)
    dense = layer["dense"] * tokens
    per_layer = dense + layer["attention"] * tokens
    head = 2 * m.hidden_size * m.padded_vocab_size * tokens
    if mean:
        layers = m.num_layers / pp
        return layers * per_layer + head / pp, layers, layers * dense + head / pp
    counts = stage_layer_counts(m.num_layers, pp, par.decoder_first_pipeline_num_layers,
                                par.decoder_last_pipeline_num_layers)
    busiest = max(counts[:-1], default=0)
    if busiest * per_layer > counts[-1] * per_layer + head:
        return busiest * per_layer, busiest, busiest * dense
    return counts[-1] * per_layer + head, counts[-1], counts[-1] * dense + head


def _dropout_s(cfg, hw: Hardware) -> float:
    """A CPU rank's seconds of dropout per layer and micro-batch, forward and backward: two hidden
    dropouts of this rank's ``[s, b, h]`` activations (split by SP) and, with attention dropout,
    the attention's scores (``b x heads x s x s`` on this rank; see
    :mod:`megazero.planning.calibrate`); full recomputation draws the forward's masks again.  A hybrid
    stack's layer has one hidden dropout, and only its attention layers (and the layers that keep
    attention beside ``--linear-attention-freq``'s Gated DeltaNet) drop scores: their share."""
    m, par = cfg.model, cfg.parallel
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    b, s = cfg.training.micro_batch_size, m.seq_length
    hidden, scores = 2, 1.0
    if m.hybrid_layer_pattern:
        hidden, scores = 1, m.hybrid_layer_pattern.count(ATTENTION) / m.num_layers
    elif linear_attention_layers(m) is not None:
        scores = 1.0 - sum(linear_attention_layers(m)) / m.num_layers
    seconds = 0.0
    if m.hidden_dropout > 0:
        seconds += hidden * b * s // cp * m.hidden_size / (tp if par.sequence_parallel else 1) * hw.dropout_s
    if m.attention_dropout > 0:
        seconds += b * m.num_attention_heads // tp * (s // cp) * s * hw.attention_dropout_s * scores
    return seconds * (1.5 if m.recompute_granularity == "full" else 1.0)


def _recompute_fraction(cfg) -> float:
    """Extra forward work of recomputation relative to the forward (hardware / model FLOPs)."""
    model = model_flops_per_iteration(cfg)
    return (hardware_flops_per_iteration(cfg) - model) / (model / 3.0)


def step_time(cfg, hw: Hardware, *, saved, states: Optional[dict] = None) -> Dict[str, float]:
    """Seconds per optimizer step and its parts (module docstring) for a validated config."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    tp, pp, dp, vp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                      par.data_parallel_size, par.virtual_pipeline_model_parallel_size)
    cp = par.context_parallel_size
    n_micro, E = tr.num_micro_batches, compute_bytes(cfg.precision)
    act = m.seq_length // cp * tr.micro_batch_size * m.hidden_size * E
    if hw.gpu is not None:  # by shape
        t = micro_batch_seconds(cfg, hw.gpu, hw.knee, hw.attention)
        fwd, compute, tp_comm = t["fwd"], t["compute"], t["tp_comm"] + t["cp_comm"]
        wgrad = t["wgrad"]
    else:
        rate = hw.peak_flops * hw.efficiency * tp
        # ranks sharing processors progress together: the average stage sets the pace, not the slowest
        flops, layers, weight_flops = _stage_forward_flops(cfg, mean=hw.oversubscription > 1)
        fwd, wgrad = flops / rate, weight_flops / rate
        per_layer = hw.layer_overhead_s + _dropout_s(cfg, hw)
        compute = fwd * (3.0 + _recompute_fraction(cfg)) + layers * per_layer
        n_tp = layers * (6 if m.recompute_granularity == "full" else 4) + 1  # + the embedding's reduction
        tp_comm = n_tp * _link(tp, hw).ring(act, tp, 2)  # gloo's ring (calibrated CPU ranks)
        if cp > 1:  # ring attention: per layer cp - 1 K/V blocks forward, K/V and dK/dV backward
            d = max(m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim) if m.multi_latent_attention \
                else m.kv_channels  # MLA: keys and padded values of the query's width
            kv = 2 * m.seq_length // cp * tr.micro_batch_size * m.num_query_groups // tp * d * E
            passes = 3 + (1 if m.recompute_granularity else 0)  # recomputation replays the forward ring
            tp_comm += layers * passes * (cp - 1) * _link(tp * cp, hw).p2p(kv)
    # a rank's own work, or the critical path through the bubble when that is longer: with ranks
    # sharing processors, the work was measured at the shared rate and a rank waiting in the bubble
    # hands its processor to the others, so the bubble costs 1/oversubscription of its length.  A
    # bubble slot passes the gradient on before the weight gradients when they are delayed.
    work = n_micro * (compute + tp_comm)
    bubble_slot = compute + tp_comm - (wgrad if par.delay_wgrad_compute and pp > 1 else 0.0)
    pipeline = max(work, (work + (pp - 1) / vp * bubble_slot) / hw.oversubscription)
    p2p_bytes = act / (tp if par.sequence_parallel else 1)
    p2p = 2 * (vp * n_micro + pp - 1) * _link(tp * cp * dp + 1, hw).p2p(p2p_bytes) if pp > 1 else 0.0
    dp_comm = _dp_time(cfg, hw, fwd, compute, saved, states)
    owned = estimate_rank_elements(cfg, saved=saved, states=states)
    optimizer = owned * (16 + 4) * 2 / hw.hbm_bytes_per_s
    nvme = nvme_time(cfg, hw, n_micro * compute, saved=saved, states=states)
    ep_comm = n_micro * ep_time(cfg, hw)
    total = pipeline + p2p + dp_comm + optimizer + nvme + ep_comm
    return {"compute_s": n_micro * compute, "tp_comm_s": n_micro * tp_comm, "bubble_s": pipeline - work,
            "p2p_s": p2p, "dp_comm_s": dp_comm, "optimizer_s": optimizer, "nvme_s": nvme,
            "ep_comm_s": ep_comm, "step_time_s": total}


def ep_time(cfg, hw: Hardware) -> float:
    """Seconds of one micro-batch's token traffic in the MoE layers of the busiest pipeline stage,
    exposed (0 for a dense model).  Per MoE layer: the all-to-all over the EP group sends a rank's
    routed pairs' rows (``P h`` elements, :func:`megazero.planning.activations.moe_dims`, balanced
    routing) out and their outputs back, forward and backward (once more each way forward under full
    recomputation), a share ``(ep - 1) / ep`` leaving the rank: ``(ep - 1)`` messages of ``P h E / ep``
    bytes each on the link spanning expert TP x EP consecutive ranks (Megatron-core's expert order
    etp-ep-edp-pp); with expert TP > 1, the received rows are all-gathered and the outputs
    reduce-scattered over expert TP (a ring each, forward and backward)."""
    from megazero.moe.settings import moe_layers
    from megazero.planning.activations import dims, moe_dims
    moe, par, m = cfg.moe, cfg.parallel, cfg.model
    layers = moe_layers(cfg)
    if not layers:
        return 0.0
    ep = moe.expert_model_parallel_size
    etp = moe.expert_tensor_parallel_size or par.tensor_model_parallel_size
    if ep == 1 and etp == 1:
        return 0.0
    D = dims(cfg, hw.device if hw.device == "cpu" else "cuda")
    M = moe_dims(cfg, D)
    rows = M.pairs * m.hidden_size * D.E  # bytes of one direction's rows on this rank
    passes = 4 + (2 if m.recompute_granularity == "full" else 0)
    a2a = 0.0
    if ep > 1:
        link = _link(etp * ep, hw)
        a2a = passes * (ep - 1) * link.p2p(rows / ep)
    if etp > 1:
        a2a += passes * _link(etp, hw).ring(M.rows * m.hidden_size * D.E, etp)
    per_stage = max(stage_layer_counts(m.num_layers, par.pipeline_model_parallel_size,
                                       par.decoder_first_pipeline_num_layers,
                                       par.decoder_last_pipeline_num_layers))
    share = len(layers) / m.num_layers  # MoE layers per layer, as the FLOPs count them
    return per_stage * share * a2a


def nvme_time(cfg, hw: Hardware, compute: float, *, saved, states: Optional[dict] = None) -> float:
    """Seconds a step waits on the NVMe tiers, from the bytes they move per step and the node's disk
    bandwidth shared by the node's ranks.  The optimizer's sub-groups (master weights and moments,
    read and written once) are counted whole: only the update overlaps them.  ZeRO-3 parameters
    (read for each micro-batch's forward and backward, written once) are fetched a unit ahead, so
    only what exceeds the step's compute (``compute`` seconds) counts.  An upper bound: the
    streamer's read-ahead into the next step also hides part of the optimizer's traffic."""
    par = cfg.parallel
    opt, prm = optimizer_device(par) == "nvme", param_device(par) == "nvme"
    if not (opt or prm):
        return 0.0
    per_rank = hw.disk_bytes_per_s / max(1, min(hw.gpus_per_node, par.world_size))
    owned, b = estimate_rank_elements(cfg, saved=saved, states=states), bytes_per_element(cfg)
    seconds = 0.0
    if opt:  # fp32 master + moments, read and written
        seconds += owned * float(par.optimizer_offload_fraction) * (FP32 + b["state"]) * 2 / per_rank
    if prm:
        passes = 2 * cfg.training.num_micro_batches + 1
        seconds += max(0.0, owned * b["P"] * passes / per_rank - compute)
    return seconds


def estimate_rank_elements(cfg, *, saved, states: Optional[dict] = None) -> float:
    """Parameters one rank updates in the optimizer step (its ZeRO shard, or all at stage 0; expert
    parameters sharded over expert DP)."""
    from megazero.planning.estimate import stage_params
    from megazero.planning.model_state import plan_buckets, rank_chunks
    par = cfg.parallel
    if par.zero_stage == 0 or not cfg.moe.num_experts:
        n = max(stage_params(cfg, r, saved=saved, states=states) for r in loaded_stages(cfg))
        return n if par.zero_stage == 0 else n / (par.data_parallel_size * par.context_parallel_size)
    return max(sum(b.shard for b in plan_buckets(cfg, rank_chunks(cfg, r, saved, states), par.zero_stage))
               for r in loaded_stages(cfg))


def _dp_time(cfg, hw: Hardware, fwd: float, compute: float, saved, states: Optional[dict] = None) -> float:
    """Exposed data-parallel communication of one step (module docstring).  Each bucket is one
    collective.  With ranks sharing processors nothing overlaps: communicating is work for the
    same processors (gloo copies and reduces on the CPU), so every reduction and gather counts."""
    from megazero.planning.estimate import stage_params
    from megazero.planning.model_state import EXPERT, plan_buckets, rank_chunks
    par = cfg.parallel
    dp, zero, tp = par.data_parallel_size * par.context_parallel_size, par.zero_stage, \
        par.tensor_model_parallel_size
    if not cfg.moe.num_experts:  # gradients reduce over dp x cp (one group of dp x cp ranks)
        if dp == 1:
            return 0.0
        n = max(stage_params(cfg, r, saved=saved, states=states) for r in loaded_stages(cfg))
        buckets = len(plan_buckets(cfg, rank_chunks(cfg, 0, saved, states), zero))
        return _group_dp_time(cfg, hw, fwd, compute, dp, n, buckets, tp * dp)
    # the experts' buckets reduce over expert DP, a group spanning the stage's world / pp consecutive
    # ranks (Megatron-core's etp-ep-edp-pp order), the others over dp x cp; each its own ring
    stage = max(loaded_stages(cfg), key=lambda r: stage_params(cfg, r, saved=saved, states=states))
    buckets = plan_buckets(cfg, rank_chunks(cfg, stage, saved, states), zero)
    out = 0.0
    for expert, span in ((False, tp * dp), (True, par.world_size // par.pipeline_model_parallel_size)):
        mine = [b for b in buckets if (b.kind == EXPERT) == expert]
        if mine and mine[0].group > 1:
            out += _group_dp_time(cfg, hw, fwd, compute, mine[0].group, sum(b.numel for b in mine), len(mine),
                                  span)
    return out


def _group_dp_time(cfg, hw: Hardware, fwd: float, compute: float, dp: int, n: int, buckets: int,
                   span: int) -> float:
    """:func:`_dp_time` of ``buckets`` buckets of ``n`` elements reduced over a group of ``dp`` ranks
    spanning ``span`` consecutive ranks."""
    zero, n_micro = cfg.parallel.zero_stage, cfg.training.num_micro_batches
    P, G = compute_bytes(cfg.precision), grad_bytes(cfg.precision)
    link = _link(span, hw)
    shared, bwd = hw.oversubscription > 1, compute - fwd

    def exposed(cost: float) -> float:  # behind the backward, except the last bucket (a quarter)
        return cost if shared else max(cost - bwd, cost / 4)
    reduce_scatter, all_gather = link.ring(G * n, dp, 1, buckets), link.ring(P * n, dp, 1, buckets)
    if zero == 0:
        if hw.gpu is None:  # the flat model (calibrated CPU ranks): gloo's ring
            return exposed(link.ring(G * n, dp, 2, buckets))
        return exposed(link.all_reduce(G * n, dp, buckets))
    if zero == 1:
        return exposed(reduce_scatter) + all_gather
    if zero == 2:
        return n_micro * exposed(reduce_scatter) + all_gather
    gathers = 2 * all_gather if shared else max(0.0, 2 * all_gather - compute)  # forward + backward
    return n_micro * (exposed(reduce_scatter) + gathers)


# ---- planning --------------------------------------------------------------------------------
def _timed(cfg, layout: Layout, gpus: int, hw: Hardware, lc, saved,
           states: Optional[dict] = None) -> Layout:
    """Fill in the layout's step-time parts (``lc``: its config)."""
    layout.step = step_time(lc, hw, saved=saved, states=states)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    layout.step["tokens_per_sec"] = tokens / layout.step["step_time_s"]
    layout.step["mfu"] = model_flops_per_iteration(lc) / (layout.step["step_time_s"] * gpus * hw.peak_flops)
    return layout


def measure_memory(lc, layout: Layout, hw: Hardware, *, saved, states: Optional[dict] = None) -> int:
    """Fill in the layout's memory (``lc``: its config) and return what the budget holds: the
    most loaded GPU's, or a CPU host's, its ranks together."""
    if hw.device != "cpu":
        layout.memory_bytes = peak_memory(lc, saved=saved, states=states, attention=hw.attention)
        return layout.memory_bytes
    need = host_memory(lc, hw, saved=saved, states=states)
    layout.memory_bytes, layout.host_bytes, layout.disk_bytes = need
    return layout.host_bytes


def fits(layout: Layout, hw: Hardware, budget: float) -> bool:
    """Whether a measured layout fits the budget (and a CPU host's disk its swap files)."""
    if hw.device != "cpu":
        return layout.memory_bytes <= budget
    return layout.host_bytes <= budget and (hw.disk_bytes is None or layout.disk_bytes <= hw.disk_bytes)


def plan(cfg, gpus: int, hw: Hardware, margin: float = 0.1, *, saved, states: Optional[dict] = None,
         **choices) -> List[Layout]:
    """The layouts that fit ``(1 - margin) x`` memory (a GPU's, or a CPU host's shared by its
    ranks), fastest first (``choices`` restrict the enumeration: ``micro_batch_sizes``,
    ``recompute``, ``zero_stages``; ``saved``: what the model saves for backward,
    :mod:`megazero.planning.activations`; ``states``: model states already computed,
    :func:`peak_memory`)."""
    budget = (1.0 - margin) * hw.memory_bytes
    states = {} if states is None else states
    found = []
    for context_parallel in (False, True):  # context parallelism only when nothing fits without it
        for layout in enumerate_layouts(cfg, gpus, hw.gpus_per_node, context_parallel=context_parallel,
                                        **choices):
            lc = layout_config(cfg, layout, gpus)
            measure_memory(lc, layout, hw, saved=saved, states=states)
            if fits(layout, hw, budget):
                found.append(_timed(cfg, layout, gpus, hw, lc, saved, states))
        if found:
            break
    return sorted(found, key=lambda x: (x.step["step_time_s"], x.memory_bytes))


def smallest_memory(cfg, gpus: int, hw: Hardware, *, saved, states: Optional[dict] = None,
                    **choices) -> Optional[Layout]:
    """The layout with the least memory per GPU, or per CPU host (whether it fits or not)."""
    best, least = None, None
    states = {} if states is None else states
    for layout in enumerate_layouts(cfg, gpus, hw.gpus_per_node, **choices):
        need = measure_memory(layout_config(cfg, layout, gpus), layout, hw, saved=saved, states=states)
        if least is None or need < least:
            best, least = layout, need
    return best
