"""Per-rank memory estimate: model states per ZeRO stage plus activations.

Counts the parameters that one rank holds for a validated config (its pipeline stage, its
tensor-parallel shard; the worst stage is reported, usually the first or last because of the
embedding), then applies ZeRO's sharding over the data-parallel ranks:

=====  =====================  ==================================
stage  sharded                bytes per rank (mixed precision)
=====  =====================  ==================================
0      nothing                (P + G + K) * psi
1      optimizer state        (P + G) * psi + K * psi / N
2      + gradients            P * psi + (G + K) * psi / N
3      + parameters           (P + G + K) * psi / N
=====  =====================  ==================================

with ``P`` the bytes of a parameter in the compute dtype, ``G`` of a gradient (fp32 unless
``--grad-reduce-dtype param``), and ``K`` the optimizer bytes per parameter (Adam: fp32 master
when training in half precision + two fp32 moments; SGD: master + momentum if any).
Activation bytes follow Korthikanti et al. (2022), per layer ``s*b*h*(34 + 5*a*s/h)`` in half
precision, divided by TP where the activations are split, and reduced by recomputation.
"""
from __future__ import annotations

from typing import Dict, List

from megazero.pipeline.partition import chunk_layers
from megazero.zero.memory import optimizer_bytes_per_param, zero_model_state_bytes


def layer_params(cfg) -> int:
    """Parameters of one transformer layer (unsharded)."""
    m = cfg.model
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.kv_channels
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    bias = m.add_bias_linear
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) + h if bias else 0)
    if m.activation == "swiglu":
        mlp = 3 * h * f + ((2 * f + h) if bias else 0)
    else:
        mlp = 2 * h * f + ((f + h) if bias else 0)
    norms = 2 * (2 * h if m.normalization == "LayerNorm" else h)
    return attn + mlp + norms


def _layer_params_per_tp_rank(cfg) -> int:
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    h = m.hidden_size
    norms = 2 * (2 * h if m.normalization == "LayerNorm" else h)
    replicated = norms + (h * 2 if m.add_bias_linear else 0)  # norms + the two row-parallel biases
    return (layer_params(cfg) - replicated) // tp + replicated


def stage_params(cfg, pp_rank: int) -> int:
    """Parameters held by one TP rank of pipeline stage ``pp_rank`` (all its virtual chunks)."""
    m, par = cfg.model, cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    n_layers = sum(len(r) for r in chunk_layers(cfg, pp_rank))
    total = n_layers * _layer_params_per_tp_rank(cfg)
    h = m.hidden_size
    if pp_rank == 0:
        total += m.padded_vocab_size * h // tp
        if m.position_embedding_type == "learned_absolute":
            total += m.max_position_embeddings * h
    if pp_rank == pp - 1:
        total += 2 * h if m.normalization == "LayerNorm" else h
        if m.untie_embeddings_and_output_weights or pp > 1:  # untied head, or the tied copy
            total += m.padded_vocab_size * h // tp
    return total


def total_params(cfg) -> int:
    """Parameters of the whole model (unsharded, tied embedding counted once)."""
    m = cfg.model
    h = m.hidden_size
    n = m.num_layers * layer_params(cfg) + m.vocab_size * h + (2 * h if m.normalization == "LayerNorm" else h)
    if m.position_embedding_type == "learned_absolute":
        n += m.max_position_embeddings * h
    if m.untie_embeddings_and_output_weights:
        n += m.vocab_size * h
    return n


def bytes_per_param(cfg) -> Dict[str, int]:
    """(param, grad, optimizer) bytes per parameter for the configured precision and optimizer."""
    pre, opt = cfg.precision, cfg.optimizer
    half = pre.bf16 or pre.fp16
    p = 2 if half else 4
    g = 4 if pre.grad_reduce_dtype == "fp32" else p
    k = optimizer_bytes_per_param(opt.optimizer, mixed_precision=half, momentum=bool(opt.sgd_momentum),
                                  offload=cfg.parallel.offload_optimizer)
    return {"param": p, "grad": g, "optim": k}


def activation_bytes(cfg, pp_rank: int = 0) -> int:
    """Activation bytes held by one rank of stage ``pp_rank`` at the pipeline's peak."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    s, b, h, a = m.seq_length, tr.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    scale = (2 if (cfg.precision.bf16 or cfg.precision.fp16) else 4) / 2  # the formula counts half bytes
    sp = tp if par.sequence_parallel else 1
    # Korthikanti et al.: 10 sbh unsplit (norms, dropouts, inputs) + 24 sbh split + 5 a s^2 b split
    full_layer = s * b * h * (10 / sp + 24 / tp) + 5 * a * s * s * b / tp
    selective_layer = s * b * h * (10 / sp + 24 / tp)
    input_only = 2 * s * b * h / sp
    n_layers = sum(len(r) for r in chunk_layers(cfg, pp_rank))
    if m.recompute_granularity == "full":
        k = m.recompute_num_layers or 1
        if m.recompute_method == "block":
            per_stage = min(k, n_layers) * input_only + max(n_layers - k, 0) * full_layer
        else:
            groups = -(-n_layers // k)
            per_stage = groups * input_only + min(k, n_layers) * full_layer  # one group rebuilt at a time
    elif m.recompute_granularity == "selective":
        per_stage = n_layers * selective_layer
    else:
        per_stage = n_layers * full_layer
    in_flight = min(pp - pp_rank, tr.num_micro_batches) if par.pipeline_schedule != "gpipe" \
        else tr.num_micro_batches
    return int(per_stage * in_flight * scale)


def estimate(cfg) -> List[Dict[str, int]]:
    """Per-ZeRO-stage bytes per rank for the stage with the most parameters.

    ``total_bytes`` is device memory: with ``--offload-optimizer`` (stages 1-3) ``optim_bytes``
    live in host memory and are left out of it (``optim_on_cpu``)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    worst = max(range(pp), key=lambda r: stage_params(cfg, r))
    psi = stage_params(cfg, worst)
    n = cfg.parallel.data_parallel_size
    bp = bytes_per_param(cfg)
    act = activation_bytes(cfg, worst)
    rows = []
    for stage in range(4):
        b = zero_model_state_bytes(psi, stage, n, bp["param"], bp["grad"], bp["optim"])
        on_cpu = bool(cfg.parallel.offload_optimizer and stage >= 1)  # host memory, not the device's
        device = b["param_bytes"] + b["grad_bytes"] + (0 if on_cpu else b["optim_bytes"])
        rows.append({"zero_stage": stage, "params_per_rank": psi, "param_bytes": int(b["param_bytes"]),
                     "grad_bytes": int(b["grad_bytes"]), "optim_bytes": int(b["optim_bytes"]),
                     "activation_bytes": act, "total_bytes": int(device) + act, "optim_on_cpu": on_cpu})
    return rows
