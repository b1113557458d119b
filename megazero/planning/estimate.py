"""Per-rank memory of a configuration, per component, matched against measurement.

:func:`estimate_rank` gives one rank of pipeline stage ``pp_rank`` under a ZeRO stage, as device
bytes per component plus host bytes:

==========================  ===================================================================
component                   what it counts (where it comes from)
==========================  ===================================================================
``param_bytes``             the flat parameter buffer (ZeRO-3: this rank's shard)
``grad_bytes``              the flat gradient buffer (ZeRO-2/3: this rank's shard)
``optim_bytes``             fp32 master weights + optimizer moments (``master_bytes`` of it);
                            host memory with ``--offload-optimizer``
``comm_bytes``              gradient communication buffers in backward:
                            ``peak_grad_bytes - grad_bytes``, with up to
                            ``--max-reductions-in-flight`` reductions holding theirs
                            (:func:`megazero.planning.model_state.grad_peak`)
``gathered_param_bytes``    ZeRO-3: full buckets gathered for the units running now
``activation_bytes``        the peak over the schedule of the bytes autograd saves for backward
                            (:mod:`megazero.planning.activations`: embeddings, attention with the SDPA
                            kernel used, MLP, norms, logits and loss, recomputation replays)
``pipeline_buffer_bytes``   received stage inputs held until their backward that autograd does
                            not already hold (half precision without full recomputation), and
                            the two p2p tensors of one exchange
``temporary_bytes``         working memory of the largest single step: the logits and the
                            cross-entropy's fp32 temporaries on the last stage, a layer's
                            backward elsewhere (an approximation, not measured on CPU)
==========================  ===================================================================

Beside them (not in ``total_bytes``): ``generation_state_bytes``, what decoding micro-batch-size
sequences of ``--seq-length`` tokens holds between steps on this stage (attention layers' KV caches,
recurrent layers' conv and recurrent states; :mod:`megazero.planning.generation`).

Model state (``param/grad/optim``) is exact: :mod:`megazero.planning.model_state` replays the
optimizer's bucket layout.  Activations are exact for what autograd saves (checked by
``tests/test_memory.py`` against :mod:`megazero.training.measure`).  ``comm_bytes`` is an upper bound of
the measured high-water mark (a reduction that finishes early frees its buffers sooner), and the
ZeRO-3 working set an estimate.  ``total_bytes`` is the device total; ``host_bytes`` the host
memory of ``--offload-optimizer-device cpu`` (the optimizer state and one bucket's fp32 gradient
copy) or of the NVMe streaming buffers; ``nvme_bytes`` the swap files of
``--offload-optimizer-device nvme`` and ``--offload-param-device nvme`` (each tier per rank).  On
CPUs the device is the host: :func:`peak_rss` adds the runtime to both for a rank's peak resident
memory.

:func:`estimate` returns one row per ZeRO stage (0-3) for the pipeline stage that needs the most
memory, with the keys above plus ``zero_stage``, ``pp_rank``, ``params_per_rank``,
``total_bytes`` and ``optim_on_cpu``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from megazero.config.patterns import GATED
from megazero.planning.activations import dims, in_flight, schedule_peak, stage_activation_peak
from megazero.planning.generation import generation_state
from megazero.planning.model_state import bytes_per_element, model_state, rank_chunks
from megazero.pipeline.partition import chunk_layers

COMPONENTS = ("param_bytes", "grad_bytes", "optim_bytes", "comm_bytes", "gathered_param_bytes",
              "activation_bytes", "pipeline_buffer_bytes", "temporary_bytes")


# ---- parameter counts ------------------------------------------------------------------------
def _mlp_params(m, f: int) -> int:
    """Parameters of one MLP of hidden size ``f`` (two or, gated, three matrices, and biases)."""
    h, bias = m.hidden_size, m.add_bias_linear
    if m.activation in GATED:
        return 3 * h * f + ((2 * f + h) if bias else 0)
    return 2 * h * f + ((f + h) if bias else 0)


def mla_params(m) -> int:
    """Parameters of one multi-latent attention (``models/mla.py``; unsharded): the query's down- and
    up-projection with the latent's norm (or its one projection), the key/value latent's
    down-projection (with the rotary part), norm and up-projection, the output projection."""
    h, n, rq, rkv = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank
    dr = m.qk_pos_emb_head_dim
    norm = (2 if m.normalization == "LayerNorm" else 1) if m.qk_layernorm else 0
    q = n * (m.qk_head_dim + dr)
    query = h * rq + norm * rq + rq * q if rq else h * q
    kv = h * (rkv + dr) + norm * rkv + rkv * n * (m.qk_head_dim + m.v_head_dim)
    return query + kv + n * m.v_head_dim * h + (h if m.add_bias_linear else 0)


def layer_params(cfg, layer: Optional[int] = None, active: bool = False) -> int:
    """Parameters of transformer layer ``layer`` (unsharded; default a dense layer).  An MoE layer has
    the router, ``--num-experts`` experts (``active``: only the ``--moe-router-topk`` a token uses) and
    the shared expert with its gate in place of the MLP."""
    from megazero.moe.settings import moe_layers, mtp_moe_layers
    m = cfg.model
    h, d = m.hidden_size, m.kv_channels
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    bias = m.add_bias_linear
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if bias or m.add_qkv_bias else 0) + (h if bias else 0)
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    if m.qk_layernorm:
        attn += q + kv if m.qk_layernorm_scope == "all" else 2 * d * per_norm
    if m.softmax_type == "learnable":  # attention sinks: one logit per head
        attn += m.num_attention_heads
    if m.multi_latent_attention:
        attn = mla_params(m)
    mlp = _mlp_params(m, m.ffn_hidden_size)
    if layer is not None and (layer in moe_layers(cfg) or layer in mtp_moe_layers(cfg)):
        moe = cfg.moe
        experts = moe.moe_router_topk if active else moe.num_experts
        shared = moe.moe_shared_expert_intermediate_size
        mlp = moe.num_experts * (h + (1 if moe.moe_router_bias else 0)) + experts * _mlp_params(
            m, moe.moe_ffn_hidden_size)
        if shared:
            mlp += _mlp_params(m, shared) + (h if moe.moe_shared_expert_gate else 0)
    if m.attention_output_gate:  # Qwen3-Next's gate projection (with the QKV's bias)
        attn += h * q + (q if bias or m.add_qkv_bias else 0)
    if m.hybrid_layer_pattern and layer is not None and layer < m.num_layers:  # one mixer per layer
        from megazero.planning.hybrid_counts import hybrid_layer_params
        return hybrid_layer_params(m, layer, attn, mlp, h * per_norm)
    if m.experimental_attention_variant and layer is not None and layer < m.num_layers:
        from megazero.planning.hybrid_counts import deltanet_params, linear_attention_layers
        attn = deltanet_params(m) if linear_attention_layers(m)[layer] else attn
    norms = (4 if m.norm_position == "sandwich" else 2) * h * per_norm
    return attn + mlp + norms


def stage_params(cfg, pp_rank: int, *, saved, states: Optional[dict] = None) -> int:
    """Parameters one TP rank of stage ``pp_rank`` holds (all its virtual chunks; the vocabulary
    padded as the model pads it), read off the model (``saved.chunk_params``)."""
    return sum(p.numel for c in rank_chunks(cfg, pp_rank, saved, states) for p in c)


def total_params(cfg, padded: bool = False, active: bool = False) -> int:
    """Parameters of the whole model (unsharded, tied embedding counted once); ``padded``: with the
    vocabulary padded to ``padded_vocab_size``, as the ranks hold it; ``active``: a mixture of experts'
    parameters one token uses (its ``--moe-router-topk`` experts of each MoE layer)."""
    m = cfg.model
    h = m.hidden_size
    vocab = m.padded_vocab_size if padded else m.vocab_size
    layers = sum(layer_params(cfg, i, active) for i in range(m.num_layers))
    n = layers + vocab * h + (2 * h if m.normalization == "LayerNorm" else h)
    if m.position_embedding_type == "learned_absolute":
        n += m.max_position_embeddings * h
    if m.untie_embeddings_and_output_weights:
        n += vocab * h
    for i in range(m.num_layers, m.num_layers + (m.mtp_num_layers or 0)):  # multi-token prediction
        n += layer_params(cfg, i, active) + 2 * h * h + 3 * h * (2 if m.normalization == "LayerNorm" else 1)
    return n


def bytes_per_param(cfg) -> Dict[str, int]:
    """(param, grad, optimizer) bytes per parameter for the configured precision and optimizer
    (optimizer: fp32 master when it is a separate copy + moments)."""
    bpe = bytes_per_element(cfg)
    return {"param": bpe["P"], "grad": bpe["G"], "optim": bpe["master"] + bpe["state"]}


def activation_bytes(cfg, pp_rank: int = 0, device: str = "cuda", *, saved) -> int:
    """Peak activation bytes kept for backward on one rank of stage ``pp_rank``."""
    return stage_activation_peak(cfg, pp_rank, saved, device)


# ---- the other components ---------------------------------------------------------------------
def pipeline_input_bytes(cfg, pp_rank: int) -> int:
    """Peak bytes of received stage inputs the executor holds (each until its backward)."""
    D = dims(cfg)
    p2p = D.E * D.Tl * D.h
    n_chunks = len(chunk_layers(cfg, pp_rank))
    per_chunk = [(0, 0) if (pp_rank == 0 and v == 0) else (p2p, p2p) for v in range(n_chunks)]
    if cfg.parallel.pipeline_model_parallel_size == 1 and n_chunks == 1:
        return 0
    return schedule_peak(cfg, pp_rank, per_chunk)


def _pipeline_buffers(cfg, pp_rank: int) -> int:
    """Received inputs not already saved by autograd (module docstring), plus one exchange."""
    if cfg.parallel.pipeline_model_parallel_size == 1:
        return 0
    D = dims(cfg)
    saved_anyway = not D.half or cfg.model.recompute_granularity == "full"
    held = 0 if saved_anyway else pipeline_input_bytes(cfg, pp_rank)
    return held + 2 * D.E * D.Tl * D.h


def _temporary(cfg, pp_rank: int, device: str) -> int:
    """Working memory of the largest step (approximate): on the last stage the logits ``E T Vp``
    and the cross-entropy's fp32 temporaries (about three ``4 T Vp`` beyond the saved softmax);
    elsewhere a layer's backward (gradients of the MLP's intermediate and of the layer input)."""
    D = dims(cfg, device)
    layer = 2 * D.E * D.T * max(D.fp, D.h) + 2 * D.E * D.T * D.h
    if pp_rank == cfg.parallel.pipeline_model_parallel_size - 1:
        return max(layer, D.T * D.vp * (D.E + 12))
    return layer


def estimate_rank(cfg, pp_rank: int, zero_stage: Optional[int] = None, device: str = "cuda",
                  backend: Optional[str] = None, *, saved, states: Optional[dict] = None,
                  attention: str = "flash") -> Dict[str, object]:
    """Every component (module docstring) for one rank of stage ``pp_rank``; ``zero_stage``
    defaults to the config's, ``backend`` to gloo on CPU and NCCL on CUDA.  ``states``: a dict the
    caller keeps (one planner search) in which model states are looked up and stored.
    ``attention``: ``unfused`` models a stack whose attention keeps the ``s x s`` scores
    (:func:`megazero.planning.activations.dims`; the planner's ``--attention-backend``)."""
    stage = cfg.parallel.zero_stage if zero_stage is None else zero_stage
    backend = backend or ("gloo" if device == "cpu" else "nccl")
    ms = _model_state(cfg, pp_rank, stage, backend, states, saved)
    out: Dict[str, object] = {"zero_stage": stage, "pp_rank": pp_rank}
    keys = ("params_per_rank", "param_bytes", "grad_bytes", "optim_bytes", "master_bytes", "peak_grad_bytes",
            "settled_peak_grad_bytes", "gathered_param_bytes", "gathered_root_bytes", "optim_on_cpu")
    out.update({k: ms[k] for k in keys})
    out["comm_bytes"] = ms["peak_grad_bytes"] - ms["grad_bytes"]
    out["activation_bytes"] = stage_activation_peak(cfg, pp_rank, saved, device, attention)
    out["pipeline_input_bytes"] = pipeline_input_bytes(cfg, pp_rank)
    out["pipeline_buffer_bytes"] = _pipeline_buffers(cfg, pp_rank)
    out["temporary_bytes"] = _temporary(cfg, pp_rank, device)
    out["in_flight_micro_batches"] = in_flight(cfg, pp_rank)
    # decoding micro-batch-size sequences of --seq-length: KV caches, conv and recurrent states (not in
    # the total)
    out["generation_state_bytes"] = generation_state(cfg, pp_rank)["total"]
    out.update(_tiers(cfg, ms, device))
    out["total_bytes"] = sum(int(out[k]) for k in COMPONENTS) - out["offloaded_bytes"]
    return out


def _model_state(cfg, pp_rank: int, stage: int, backend: str, states: Optional[dict],
                 saved) -> Dict[str, int]:
    """:func:`model_state`, kept in ``states`` under everything it reads (the model, parallel, MoE,
    optimizer and precision sections): layouts that differ only in micro-batch size share it."""
    if states is None:
        return model_state(cfg, pp_rank, stage, backend, saved=saved)
    key = (pp_rank, stage, backend, repr(cfg.model), repr(cfg.parallel), repr(cfg.moe), repr(cfg.optimizer),
           repr(cfg.precision))
    if key not in states:
        states[key] = model_state(cfg, pp_rank, stage, backend, saved=saved, states=states)
    return states[key]


def _tiers(cfg, ms, device: str) -> Dict[str, object]:
    """Where the model state lives: ``optim_device``/``param_device`` (none, cpu, nvme),
    ``offloaded_bytes`` (left out of the device total), ``host_bytes`` (host RAM: a CPU-offloaded
    optimizer share, one bucket's fp32 gradient copy from a GPU, the NVMe streaming buffers) and
    ``nvme_bytes`` (the swap files: optimizer share and ZeRO-3 parameter shards)."""
    par = cfg.parallel
    dev, pdev = ms["optim_device"], ms["param_device"]
    moved = int(ms["optim_bytes"] * float(par.optimizer_offload_fraction)) if dev != "none" else 0
    largest_shard = ms["max_shard_elements"]
    staging = 4 * largest_shard if device != "cpu" and dev != "none" else 0
    params_moved = ms["param_bytes"] - ms["resident_param_bytes"] if pdev == "nvme" else 0
    buffers = par.nvme_buffer_count * par.nvme_buffer_size if dev == "nvme" else 0
    return {"optim_device": dev, "param_device": pdev, "offloaded_bytes": moved + params_moved,
            "host_bytes": (moved if dev == "cpu" else 0) + staging + buffers,
            "nvme_bytes": (moved if dev == "nvme" else 0) + (ms["param_bytes"] if pdev == "nvme" else 0)}


def peak_rss(row: Dict[str, object], runtime_bytes: int) -> int:
    """The peak resident memory of a rank on CPUs (where the device is the host), from its row of
    :func:`estimate_rank` for ``device="cpu"``: the runtime (interpreter, PyTorch and the program:
    ``runtime_bytes``, e.g. the estimating process's own resident memory,
    :func:`megazero.offload.host_memory.rss_bytes`), every component held in memory (``total_bytes``, with
    the likely gradient communication buffers, ``settled_peak_grad_bytes``, for the upper bound)
    and the offload's host buffers (``host_bytes``).  The gradient buffers exist in backward, and
    under ZeRO-3 the root units are released once backward reaches the layers, so the two overlap
    by at most the smaller of them.  It counts what tensors hold, as with ``--host-malloc
    release``; under ``keep`` (``auto``'s choice on CPUs with ZeRO 0-2 and nothing offloaded) the C
    heaps' fragments come on top (measured: 7 % more at DP 2 ZeRO-1, up to 17 % at PP 2;
    docs/performance.md)."""
    likely = int(row["settled_peak_grad_bytes"]) - int(row["peak_grad_bytes"])
    comm = max(int(row["comm_bytes"]) + likely, 0)
    overlap = min(int(row.get("gathered_root_bytes", 0)), comm)
    return int(runtime_bytes) + int(row["total_bytes"]) + likely - overlap + int(row["host_bytes"])


def estimate_stages(cfg, zero_stage: Optional[int] = None, device: str = "cuda",
                    backend: Optional[str] = None, *, saved) -> List[Dict[str, object]]:
    """:func:`estimate_rank` for every pipeline stage."""
    return [estimate_rank(cfg, r, zero_stage, device, backend, saved=saved)
            for r in range(cfg.parallel.pipeline_model_parallel_size)]


def estimate(cfg, device: str = "cuda", backend: Optional[str] = None, *, saved) -> List[Dict[str, object]]:
    """One row per ZeRO stage 0-3: the pipeline stage that needs the most device memory.
    ``--offload-optimizer`` applies to stages 1-3 (stage 0 keeps its optimizer on the device)."""
    rows = []
    for stage in range(4):
        per_stage = estimate_stages(cfg, stage, device, backend, saved=saved)
        rows.append(max(per_stage, key=lambda r: r["total_bytes"]))
    return rows
