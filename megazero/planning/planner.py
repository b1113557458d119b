"""Layout planner: which TP x PP x DP + ZeRO layouts fit a cluster, and which is fastest.

:func:`enumerate_layouts` walks tensor parallelism (within a node, dividing heads, query groups,
hidden and FFN sizes), pipeline parallelism (dividing the layers) with virtual stages (the
interleaved schedule), data parallelism, ZeRO stage, recomputation, sequence parallelism and
micro-batch size; context parallelism (the sequence split over CP ranks, ring attention) only when
no layout fits without it.  :func:`plan` keeps the layouts whose most loaded rank
(:func:`megazero.planning.estimate.estimate_stages`) fits ``(1 - margin) x`` GPU memory and ranks them by
:func:`step_time`, a model of one optimizer step:

- compute: the slowest stage's forward + backward (2x forward) + recomputation's extra forward
  (:mod:`megazero.planning.flops` counts) per micro-batch, at ``efficiency x`` peak FLOP/s, over
  ``m + (pp - 1) / vp`` micro-batch slots (the 1F1B / interleaved bubble);
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
- optimizer step: reading and writing the owned fp32 state at HBM bandwidth;
- NVMe offload tiers (:func:`nvme_time`): their bytes per step at the node's disk bandwidth
  (``plan.py --calibrate`` measures it; else an assumed 3 GB/s), shared by the node's ranks;
- a fixed overhead per layer and micro-batch (0 on GPUs by default; ``--calibrate`` fits it, the
  intercept of a real layer's time against its FLOPs, which matters for small models on CPUs).

Ranks that share processors (``Hardware.oversubscription`` > 1: more CPU ranks than cores, as in
this project's tests) change two things: a rank waiting in the pipeline bubble hands its processor
to the others, so the step is a rank's own work (the *average* stage's, all progressing together)
unless the critical path at the full processor's speed is longer; and communication is work for
the same processors, so no reduction or gather is hidden behind compute.

Links follow the rank order ``tp-dp-pp``: a TP group stays in a node; a DP group (``tp x dp``
consecutive ranks) or a pipeline neighbour (``tp x dp`` ranks away) crosses nodes when that span
exceeds the node.  Each link is ``alpha`` seconds per message plus ``beta`` seconds per byte; the
defaults per GPU are nominal SXM figures, and ``--calibrate`` fits them (and the compute rate)
from measured collectives on the machine at hand (:mod:`megazero.planning.calibrate`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Optional, Sequence

from megazero.config import ConfigError, config_from_dict, parse_args, validate
from megazero.element_bytes import FP32, bytes_per_element, compute_bytes, grad_bytes
from megazero.offload.settings import optimizer_device, param_device
from megazero.planning.estimate import estimate_rank
from megazero.planning.flops import (hardware_flops_per_iteration, layer_forward_flops_per_token,
                                     model_flops_per_iteration)
from megazero.planning.gpu_model import GPU_TYPES, KNEE, GpuType, Link, micro_batch_seconds

GB = 1e9
# a node's disk for the NVMe offload tiers when nothing measured it (plan.py --calibrate does):
# assumed, one PCIe 4.0 NVMe drive with reads and writes mixed
DISK_BYTES_PER_S = 3.0e9
# name: (bf16 dense TFLOP/s, memory GB, intra-node GB/s per GPU per direction, inter-node GB/s per
# GPU, HBM GB/s): gpu_model.GPU_TYPES, where each figure's source is given
GPUS = {name: (g.peak_tflops, g.memory_gb, g.link_gbs, g.net_gbs, g.hbm_gbs) for name, g in GPU_TYPES.items()}
ALPHA_INTRA, ALPHA_INTER = 5e-6, 15e-6  # seconds per message (NCCL over NVLink / InfiniBand)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Hardware:
    peak_flops: float
    efficiency: float
    memory_bytes: float
    intra: Link
    inter: Link
    hbm_bytes_per_s: float
    gpus_per_node: int
    layer_overhead_s: float = 0.0  # per layer and micro-batch, forward + backward (calibrated)
    oversubscription: float = 1.0  # ranks sharing one processor (CPU ranks beyond the cores; 1 on GPUs)
    gpu: Optional[GpuType] = None  # compute by shape (gpu_model) instead of a flat efficiency
    attention: str = "flash"  # the attention kernel the shape model times: flash | unfused
    knee: float = KNEE
    disk_bytes_per_s: float = DISK_BYTES_PER_S  # a node's disk for NVMe offload, shared by its ranks

    @classmethod
    def for_gpu(cls, gpu: GpuType, gpus_per_node: int = 8, attention: str = "flash",
                knee: float = KNEE, memory_gb: Optional[float] = None) -> "Hardware":
        """A cluster of ``gpu``s timed by shape (:mod:`megazero.planning.gpu_model`)."""
        return cls(gpu.peak_tflops * 1e12, gpu.gemm_max, (memory_gb or gpu.memory_gb) * GB,
                   Link(gpu.alpha_intra, 1 / (gpu.link_gbs * GB * gpu.busbw)),
                   Link(gpu.alpha_inter, 1 / (gpu.net_gbs * GB * gpu.busbw)), gpu.hbm_gbs * GB,
                   gpus_per_node, gpu=gpu, attention=attention, knee=knee)

    @classmethod
    def from_calibration(cls, cal: Dict[str, object], memory_bytes: float, hbm_bytes_per_s: float,
                         gpus_per_node: int) -> "Hardware":
        """The machine a ``plan.py --calibrate`` JSON describes (its compute rate is per rank with
        every rank busy, so the efficiency is 1)."""
        return cls(cal["flops"], 1.0, memory_bytes, Link(*cal["intra"]), Link(*cal["inter"]), hbm_bytes_per_s,
                   gpus_per_node, cal.get("layer_overhead_s", 0.0),
                   max(1.0, cal.get("oversubscription", 1.0)),
                   disk_bytes_per_s=cal.get("disk_bytes_per_s", DISK_BYTES_PER_S))


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
    memory_bytes: int = 0
    step: Dict[str, float] = field(default_factory=dict)
    cp: int = 1  # context-parallel size (proposed only when nothing fits without it)

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
        if self.recompute != "none":
            out["recompute_granularity"] = self.recompute
        return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg, gpus: int, gpus_per_node: int, micro_batch_sizes: Optional[Sequence[int]] = None,
                      recompute: Sequence[str] = RECOMPUTE, zero_stages: Sequence[int] = (0, 1, 2, 3),
                      max_vpp: int = 4, context_parallel: bool = False) -> Iterable[Layout]:
    """Every layout the config's divisibility rules allow on ``gpus`` GPUs (validated configs);
    ``context_parallel``: only the layouts with CP > 1 (the sequence cut into 2 CP chunks)."""
    m, gbs = cfg.model, cfg.training.global_batch_size
    for tp, pp in itertools.product(_divisors(min(gpus_per_node, gpus)), _divisors(m.num_layers)):
        if gpus % (tp * pp) or any(x % tp for x in (m.num_attention_heads, m.num_query_groups,
                                                    m.hidden_size, m.ffn_hidden_size)):
            continue
        cps = [c for c in _divisors(gpus // (tp * pp)) if c > 1 and m.seq_length % (2 * c) == 0
               and m.attention_dropout == 0]  # dropout inside ring attention is not implemented
        for cp in (cps if context_parallel else [1]):
            dp = gpus // (tp * pp * cp)
            if gbs % dp:
                continue
            mbs = micro_batch_sizes or [b for b in (1, 2, 4, 8, 16) if (gbs // dp) % b == 0]
            vpps = [v for v in range(1, max_vpp + 1) if pp > 1 and m.num_layers % (pp * v) == 0] or [1]
            for vpp, mb, zero, rc, sp in itertools.product(vpps, mbs, zero_stages, recompute,
                                                           (False, True) if tp > 1 else (False,)):
                n_micro = gbs // (dp * mb) if gbs % (dp * mb) == 0 else 0
                if not n_micro or (vpp > 1 and n_micro % pp) or (dp * cp == 1 and zero > 0):
                    continue
                if sp and m.seq_length // cp % tp:
                    continue
                yield Layout(tp, pp, vpp, dp, zero, rc, sp, mb, cp=cp)


def layout_config(cfg, layout: Layout, gpus: int):
    """The validated config of ``layout`` (``cfg``'s model, batch and precision)."""
    settings = {f: getattr(section, f) for section in (cfg.model, cfg.training, cfg.optimizer, cfg.precision)
                for f in section.__dataclass_fields__ if f not in ("padded_vocab_size", "num_micro_batches")}
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


def peak_memory(cfg, *, saved, states: Optional[dict] = None) -> int:
    """Device bytes of the most loaded rank: the first and the last stage hold the most (the
    first has the most micro-batches in flight, the last the head and the loss).  ``states``:
    model states of this search (:func:`megazero.planning.estimate.estimate_rank`)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    return max(int(estimate_rank(cfg, r, saved=saved, states=states)["total_bytes"])
               for r in sorted({0, pp - 1}))


# ---- step time -------------------------------------------------------------------------------
def _link(span: int, hw: Hardware) -> Link:
    """The link a group of ``span`` consecutive ranks communicates over."""
    return hw.intra if span <= hw.gpus_per_node else hw.inter


def _stage_forward_flops(cfg, mean: bool = False) -> float:
    """Forward FLOPs of one micro-batch on the slowest pipeline stage (whole TP group): its layers,
    plus the output head on the last stage; ``mean``: averaged over the stages instead."""
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    tokens = cfg.training.micro_batch_size * m.seq_length // cfg.parallel.context_parallel_size
    layer = layer_forward_flops_per_token(cfg)
    per_layer = (layer["dense"] + layer["attention"]) * tokens
    head = 2 * m.hidden_size * m.padded_vocab_size * tokens
    return m.num_layers // pp * per_layer + (head / pp if mean else head)


def _recompute_fraction(cfg) -> float:
    """Extra forward work of recomputation relative to the forward (hardware / model FLOPs)."""
    model = model_flops_per_iteration(cfg)
    return (hardware_flops_per_iteration(cfg) - model) / (model / 3.0)


def step_time(cfg, hw: Hardware) -> Dict[str, float]:
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
    else:
        rate = hw.peak_flops * hw.efficiency * tp
        # ranks sharing processors progress together: the average stage sets the pace, not the slowest
        fwd = _stage_forward_flops(cfg, mean=hw.oversubscription > 1) / rate
        compute = fwd * (3.0 + _recompute_fraction(cfg)) + hw.layer_overhead_s * m.num_layers // pp
        layers = m.num_layers // pp
        n_tp = layers * (6 if m.recompute_granularity == "full" else 4) + 1  # + the embedding's reduction
        tp_comm = n_tp * _link(tp, hw).ring(act, tp, 2)  # gloo's ring (calibrated CPU ranks)
        if cp > 1:  # ring attention: per layer cp - 1 K/V blocks forward, K/V and dK/dV backward
            kv = 2 * m.seq_length // cp * tr.micro_batch_size * m.num_query_groups // tp * m.kv_channels * E
            passes = 3 + (1 if m.recompute_granularity else 0)  # recomputation replays the forward ring
            tp_comm += layers * passes * (cp - 1) * _link(tp * cp, hw).p2p(kv)
    slots = n_micro + (pp - 1) / vp
    # a rank's own work, or the critical path through the bubble when that is longer: with ranks
    # sharing processors, the work was measured at the shared rate and a rank waiting in the bubble
    # hands its processor to the others, so the bubble costs 1/oversubscription of its length
    work = n_micro * (compute + tp_comm)
    pipeline = max(work, slots * (compute + tp_comm) / hw.oversubscription)
    p2p_bytes = act / (tp if par.sequence_parallel else 1)
    p2p = 2 * (vp * n_micro + pp - 1) * _link(tp * cp * dp + 1, hw).p2p(p2p_bytes) if pp > 1 else 0.0
    dp_comm = _dp_time(cfg, hw, fwd, compute)
    owned = estimate_rank_elements(cfg)
    optimizer = owned * (16 + 4) * 2 / hw.hbm_bytes_per_s
    nvme = nvme_time(cfg, hw, n_micro * compute)
    total = pipeline + p2p + dp_comm + optimizer + nvme
    return {"compute_s": n_micro * compute, "tp_comm_s": n_micro * tp_comm, "bubble_s": pipeline - work,
            "p2p_s": p2p, "dp_comm_s": dp_comm, "optimizer_s": optimizer, "nvme_s": nvme,
            "step_time_s": total}


def nvme_time(cfg, hw: Hardware, compute: float) -> float:
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
    owned, b = estimate_rank_elements(cfg), bytes_per_element(cfg)
    seconds = 0.0
    if opt:  # fp32 master + moments, read and written
        seconds += owned * float(par.optimizer_offload_fraction) * (FP32 + b["state"]) * 2 / per_rank
    if prm:
        passes = 2 * cfg.training.num_micro_batches + 1
        seconds += max(0.0, owned * b["P"] * passes / per_rank - compute)
    return seconds


def estimate_rank_elements(cfg) -> float:
    """Parameters one rank updates in the optimizer step (its ZeRO shard, or all at stage 0)."""
    from megazero.planning.estimate import stage_params
    n = max(stage_params(cfg, r) for r in {0, cfg.parallel.pipeline_model_parallel_size - 1})
    par = cfg.parallel
    return n if par.zero_stage == 0 else n / (par.data_parallel_size * par.context_parallel_size)


def _dp_time(cfg, hw: Hardware, fwd: float, compute: float) -> float:
    """Exposed data-parallel communication of one step (module docstring).  Each bucket is one
    collective.  With ranks sharing processors nothing overlaps: communicating is work for the
    same processors (gloo copies and reduces on the CPU), so every reduction and gather counts."""
    from megazero.planning.estimate import stage_params
    from megazero.planning.model_state import plan_buckets, rank_chunks
    par, pre = cfg.parallel, cfg.precision
    # gradients reduce over dp x cp (one data-parallel group of dp x cp ranks)
    dp, zero, n_micro = par.data_parallel_size * par.context_parallel_size, par.zero_stage, \
        cfg.training.num_micro_batches
    if dp == 1:
        return 0.0
    n = max(stage_params(cfg, r) for r in {0, par.pipeline_model_parallel_size - 1})
    buckets = len(plan_buckets(cfg, rank_chunks(cfg, 0), zero))
    P, G = compute_bytes(pre), grad_bytes(pre)
    link = _link(par.tensor_model_parallel_size * dp, hw)
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
def _timed(cfg, layout: Layout, gpus: int, hw: Hardware, lc) -> Layout:
    """Fill in the layout's step-time parts (``lc``: its config)."""
    layout.step = step_time(lc, hw)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    layout.step["tokens_per_sec"] = tokens / layout.step["step_time_s"]
    layout.step["mfu"] = model_flops_per_iteration(lc) / (layout.step["step_time_s"] * gpus * hw.peak_flops)
    return layout


def plan(cfg, gpus: int, hw: Hardware, margin: float = 0.1, *, saved, states: Optional[dict] = None,
         **choices) -> List[Layout]:
    """The layouts that fit ``(1 - margin) x`` memory, fastest first (``choices`` restrict the
    enumeration: ``micro_batch_sizes``, ``recompute``, ``zero_stages``; ``saved``: what the model
    saves for backward, :mod:`megazero.planning.activations`; ``states``: model states already
    computed, :func:`peak_memory`)."""
    budget = (1.0 - margin) * hw.memory_bytes
    states = {} if states is None else states
    fits = []
    for context_parallel in (False, True):  # context parallelism only when nothing fits without it
        for layout in enumerate_layouts(cfg, gpus, hw.gpus_per_node, context_parallel=context_parallel,
                                        **choices):
            lc = layout_config(cfg, layout, gpus)
            layout.memory_bytes = peak_memory(lc, saved=saved, states=states)
            if layout.memory_bytes <= budget:
                fits.append(_timed(cfg, layout, gpus, hw, lc))
        if fits:
            break
    return sorted(fits, key=lambda x: (x.step["step_time_s"], x.memory_bytes))


def smallest_memory(cfg, gpus: int, hw: Hardware, *, saved, states: Optional[dict] = None,
                    **choices) -> Optional[Layout]:
    """The layout with the least memory per rank (whether it fits or not)."""
    best = None
    states = {} if states is None else states
    for layout in enumerate_layouts(cfg, gpus, hw.gpus_per_node, **choices):
        layout.memory_bytes = peak_memory(layout_config(cfg, layout, gpus), saved=saved, states=states)
        if best is None or layout.memory_bytes < best.memory_bytes:
            best = layout
    return best


def advice(cfg, gpus: int, hw: Hardware, margin: float, choices: Dict[str, object], *, saved) -> str:
    """The smallest change that makes something fit: lift the given restrictions (micro-batch
    sizes, recomputation, ZeRO stages), offload the optimizer, more GPUs, or more memory."""
    budget = (1.0 - margin) * hw.memory_bytes
    states: dict = {}  # model states, shared by the searches below (keyed by the whole config)
    if any(v is not None for v in choices.values()):
        found = plan(cfg, gpus, hw, margin, saved=saved, states=states)
        if found:
            return (f"allow every micro-batch size, recomputation and ZeRO stage: e.g. {describe(found[0])} "
                    f"fits in {found[0].memory_bytes / GB:.1f} GB")
    offloaded = ""
    if not cfg.parallel.offload_optimizer:
        offloaded = " (--offload-optimizer alone is not enough)"
        par = cfg.parallel
        off = validate(cfg.replace(parallel={"offload_optimizer": True,
                                             "zero_stage": max(1, par.zero_stage)}),
                       par.world_size, check_data=False)
        found = plan(off, gpus, hw, margin, saved=saved, states=states, zero_stages=(1, 2, 3))
        if found:
            return (f"add --offload-optimizer (optimizer state in host memory): {describe(found[0])} needs "
                    f"{found[0].memory_bytes / GB:.1f} GB per GPU")
    if param_device(cfg.parallel) != "nvme":
        nvme = validate(cfg.replace(parallel={"offload_optimizer": False, "offload_optimizer_device": "nvme",
                                              "offload_param_device": "nvme", "zero_stage": 3,
                                              "nvme_path": cfg.parallel.nvme_path or "NVME_DIR"}),
                        cfg.parallel.world_size, check_data=False)
        found = plan(nvme, gpus, hw, margin, saved=saved, states=states, zero_stages=(3,))
        if found:
            disk = estimate_rank(layout_config(nvme, found[0], gpus), 0, saved=saved,
                                 states=states)["nvme_bytes"]
            return (f"only with ZeRO-Infinity offload: add --offload-optimizer-device nvme "
                    f"--offload-param-device nvme --nvme-path DIR (model state on a local disk): "
                    f"{describe(found[0])} needs {found[0].memory_bytes / GB:.1f} GB per GPU and "
                    f"{disk / GB:.1f} GB of disk per rank; predicted {found[0].step['step_time_s']:.3g} s "
                    f"per step, {found[0].step['nvme_s']:.3g} s of it waiting on a disk of "
                    f"{hw.disk_bytes_per_s / GB:.1f} GB/s per node")
        offloaded = " (offloading the optimizer and the parameters to NVMe is not enough)"
    for factor in (2, 4, 8, 16):
        more = gpus * factor
        found = plan(cfg, more, hw, margin, saved=saved, states=states)
        if found:
            return (f"use {more} GPUs (x{factor}): {describe(found[0])} needs "
                    f"{found[0].memory_bytes / GB:.1f} GB{offloaded}")
    least = smallest_memory(cfg, gpus, hw, saved=saved, states=states)
    if least is None:
        return "no layout divides this model and batch on these GPUs; change --gpus or --global-batch-size"
    return (f"GPUs with at least {least.memory_bytes / (1 - margin) / GB:.0f} GB, or more than {gpus * 16} "
            f"GPUs{offloaded}: {describe(least)}, the leanest layout here, needs "
            f"{least.memory_bytes / GB:.1f} GB per rank against a budget of {budget / GB:.1f} GB")


def describe(x: Layout) -> str:
    rc = "" if x.recompute == "none" else f" recompute {x.recompute}"
    cp = f" x CP {x.cp}" if x.cp > 1 else ""
    return (f"TP {x.tp}{' SP' if x.sequence_parallel else ''}{cp} x PP {x.pp}"
            f"{f' (vpp {x.vpp})' if x.vpp > 1 else ''} x DP {x.dp}, ZeRO-{x.zero_stage}{rc}, "
            f"micro-batch {x.micro_batch_size}")


def flags(layout: Layout, model_args: Sequence[str], cfg) -> List[str]:
    """The exact ``pretrain_gpt.py`` flags of a layout (model flags as given, then the layout's)."""
    out = list(model_args) + ["--seq-length", str(cfg.model.seq_length),
                              "--global-batch-size", str(cfg.training.global_batch_size),
                              "--micro-batch-size", str(layout.micro_batch_size),
                              "--tensor-model-parallel-size", str(layout.tp),
                              "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.cp > 1:
        out += ["--context-parallel-size", str(layout.cp)]
    if layout.vpp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage",
                str(cfg.model.num_layers // (layout.pp * layout.vpp))]
    if layout.sequence_parallel:
        out.append("--sequence-parallel")
    if layout.zero_stage:
        out += ["--zero-stage", str(layout.zero_stage)]
    if layout.recompute != "none":
        out += ["--recompute-granularity", layout.recompute]
    par = cfg.parallel
    if layout.zero_stage and optimizer_device(par) != "none":
        out += (["--offload-optimizer"] if optimizer_device(par) == "cpu" and not par.offload_optimizer_device
                else ["--offload-optimizer-device", optimizer_device(par)])
    if layout.zero_stage == 3 and param_device(par) != "none":
        out += ["--offload-param-device", param_device(par)]
    if "nvme" in (optimizer_device(par), param_device(par)) and layout.zero_stage:
        out += ["--nvme-path", par.nvme_path]
    if cfg.precision.bf16:
        out.append("--bf16")
    elif cfg.precision.fp16:
        out.append("--fp16")
    return out


def to_dict(layout: Layout, model_args: Sequence[str], cfg) -> Dict[str, object]:
    """The JSON form of one planned layout."""
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "vpp": layout.vpp, "dp": layout.dp,
            "zero_stage": layout.zero_stage, "recompute": layout.recompute,
            "sequence_parallel": layout.sequence_parallel, "micro_batch_size": layout.micro_batch_size,
            "memory_gb": round(layout.memory_bytes / GB, 3), "step_time_s": layout.step["step_time_s"],
            "tokens_per_sec": layout.step["tokens_per_sec"], "mfu": layout.step["mfu"],
            "breakdown": {k: v for k, v in layout.step.items() if k.endswith("_s") and k != "step_time_s"},
            "flags": " ".join(flags(layout, model_args, cfg))}


# ---- command line ----------------------------------------------------------------------------
def hardware(args) -> Hardware:
    """The :class:`Hardware` the flags describe (ConfigError naming a bad flag): the ``--gpu`` type
    timed by shape (:mod:`megazero.planning.gpu_model`), or at a flat ``--efficiency`` of peak."""
    if args.gpu not in GPU_TYPES:
        raise ConfigError(f"--gpu {args.gpu}: unknown GPU type; choose one of {', '.join(GPU_TYPES)}, or the "
                          "closest one with --gpu-tflops, --gpu-memory-gb and the bandwidths set to yours")
    for flag, v in (("--gpu-memory-gb", args.gpu_memory_gb), ("--gpu-tflops", args.gpu_tflops),
                    ("--intra-node-bandwidth", args.intra_node_bandwidth),
                    ("--inter-node-bandwidth", args.inter_node_bandwidth)):
        if v is not None and not v > 0:
            raise ConfigError(f"{flag} must be > 0, got {v}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if not 0 <= args.margin < 1:
        raise ConfigError(f"--margin must be in [0, 1), got {args.margin}")
    gpu = GPU_TYPES[args.gpu]
    gpu = replace(gpu, peak_tflops=args.gpu_tflops or gpu.peak_tflops,
                  memory_gb=args.gpu_memory_gb or gpu.memory_gb,
                  link_gbs=args.intra_node_bandwidth or gpu.link_gbs,
                  net_gbs=args.inter_node_bandwidth or gpu.net_gbs,
                  alpha_intra=args.intra_node_latency_us * 1e-6,
                  alpha_inter=args.inter_node_latency_us * 1e-6)
    if args.calibration:
        from megazero.planning.calibrate import load_calibration
        return Hardware.from_calibration(load_calibration(args.calibration), gpu.memory_gb * GB,
                                         gpu.hbm_gbs * GB, args.gpus_per_node)
    if args.efficiency is None:
        return Hardware.for_gpu(gpu, args.gpus_per_node)
    return Hardware(gpu.peak_tflops * 1e12, args.efficiency, gpu.memory_gb * GB,
                    Link(gpu.alpha_intra, 1 / (gpu.link_gbs * GB)),
                    Link(gpu.alpha_inter, 1 / (gpu.net_gbs * GB)),
                    gpu.hbm_gbs * GB, args.gpus_per_node)


LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--zero-stage",
                "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size", "--sequence-parallel",
                "--recompute-granularity", "--use-distributed-optimizer", "--pipeline-schedule")


def model_config(model_args: Sequence[str], presets, seq_length: Optional[int], global_batch_size: int,
                 fp32: bool):
    """The base config (model, batch, precision) the layouts share; ConfigError on bad flags."""
    given = [a for a in model_args if a.split("=")[0] in LAYOUT_FLAGS]
    if given:
        raise ConfigError(f"{given[0].split('=')[0]}: the planner chooses the layout; drop the flag "
                          "(restrict with --micro-batch-sizes, --recompute, --zero-stages)")
    if global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be a positive integer, got {global_batch_size}")
    argv = list(model_args) + ["--global-batch-size", str(global_batch_size), "--micro-batch-size", "1"]
    if seq_length is not None:
        argv += ["--seq-length", str(seq_length)]
    if not fp32 and "--fp16" not in argv and "--bf16" not in argv:
        argv.append("--bf16")
    return parse_args(argv, presets=presets, world_size=1, check_data=False)
