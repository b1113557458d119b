"""Generation memory per rank: what a model's decode holds between tokens (``models/generate.py``).

Each attention layer keeps its keys and values for every past position (``models.layers.KVCache``,
``[b, groups / tp, positions, head_dim]`` each, in the compute dtype; multi-latent attention its
latent ``kv_lora_rank`` and rotary key ``qk_pos_emb_head_dim`` per position, on every TP rank): it
grows with the context.  A recurrent layer (Mamba-2 ``M``, Gated DeltaNet ``G`` or
``--linear-attention-freq``'s) keeps, whatever the context, its conv's last ``kernel - 1`` inputs
``[b, kernel - 1, conv channels / tp]`` in the compute dtype and its recurrent state in fp32
(Mamba-2: ``[b, heads / tp, head_dim, state_dim]``; Gated DeltaNet: ``[b, value heads / tp,
key_head_dim, value_head_dim]``).  MLP and MoE layers keep nothing.  Counted is the storage these
tensors hold between single-token steps: the conv state is a view of the ``kernel``-long
concatenation it was cut from (one position more), and Mamba-2's final state a view of the scan's
pair of chunk-boundary states (twice the state); after a prompt of ``n`` tokens, until the next
step, they hold ``kernel - 1 + n`` positions and ``ceil(n / chunk) + 1`` states.

:func:`generation_state` sums a pipeline stage's layers (``tests/test_memory_hybrid.py`` holds it to
the cache a decode builds, byte for byte); the estimator reports it as ``generation_state_bytes``
(micro-batch size sequences of ``--seq-length`` positions) beside the training components, outside
``total_bytes``.
"""
from __future__ import annotations

from typing import Dict, Optional

from megazero.config.hybrid import ATTENTION, DELTANET, MAMBA, layer_kind, linear_attention_layers
from megazero.offload.element_bytes import FP32, compute_bytes
from megazero.pipeline.partition import chunk_layers
from megazero.planning.activations import ssm_dims


def layer_state(cfg, layer: int, batch: int, positions: int) -> Dict[str, int]:
    """Bytes layer ``layer`` keeps on one TP rank for ``batch`` sequences of ``positions`` tokens:
    ``kv_cache`` (attention), ``conv_state`` and ``recurrent_state`` (M and G layers)."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    E = compute_bytes(cfg.precision)
    kind = layer_kind(m, layer)
    linear = linear_attention_layers(m)
    if kind in (MAMBA, DELTANET) or (kind is None and linear is not None and linear[layer]):
        S = ssm_dims(cfg, MAMBA if kind == MAMBA else DELTANET, tp)
        pair = 2 if S.kind == MAMBA else 1  # Mamba-2's final state views the scan's [start, end] pair
        return {"conv_state": E * batch * S.kernel * S.ch,
                "recurrent_state": pair * FP32 * batch * S.heads * S.head_dim * S.state}
    if kind is not None and kind != ATTENTION:  # an MLP or MoE layer
        return {}
    if m.multi_latent_attention:
        return {"kv_cache": E * batch * positions * (m.kv_lora_rank + m.qk_pos_emb_head_dim)}
    return {"kv_cache": 2 * E * batch * (m.num_query_groups // tp) * positions * m.kv_channels}


def generation_state(cfg, pp_rank: int = 0, batch: Optional[int] = None,
                     positions: Optional[int] = None) -> Dict[str, int]:
    """Stage ``pp_rank``'s layers' :func:`layer_state` summed by part, and ``total``; ``batch``
    defaults to the micro-batch size, ``positions`` to ``--seq-length``."""
    batch = cfg.training.micro_batch_size if batch is None else batch
    positions = cfg.model.seq_length if positions is None else positions
    out = {"kv_cache": 0, "conv_state": 0, "recurrent_state": 0}
    for layers in chunk_layers(cfg, pp_rank):
        for layer in layers:
            for part, n in layer_state(cfg, layer, batch, positions).items():
                out[part] += n
    out["total"] = sum(out.values())
    return out
