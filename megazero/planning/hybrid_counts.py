"""Parameters and forward FLOPs of a hybrid stack's layers (``--hybrid-layer-pattern``), each kind its own.

Parameters (unsharded, :func:`hybrid_layer_params`): the layer's norm and its one mixer, as
``megazero_models.mamba`` / ``deltanet`` build them.  FLOPs per token, counted as Megatron-LM counts
them for its hybrid models:

* ``M`` (Mamba-2): the in-projection ``2 h (2 d_in + 2 groups state + heads)``, the scan
  ``7 d_in state`` and the out-projection ``2 d_in h``, with ``d_in = heads x head_dim`` (Megatron-LM
  takes ``2 h``, the same at its default head count); the conv is not counted;
* ``G`` (Gated DeltaNet): ``2 (h (2 K + 2 V + 2 Hv) + conv (2 K + V) + 4 Hv dv^2 + h V)`` with
  ``K`` the query/key and ``V`` the value channels, ``Hv`` value heads of ``dv`` channels;
* ``*``: the attention layer's projections (the output gate's ``2 h q`` too) and core, as a
  transformer layer's (:func:`megazero.planning.flops.layer_forward_flops_per_token`);
* ``-`` and ``E``: the dense MLP or the MoE layer's active part.

Returned like the transformer's count, as the mean over the layers: ``dense`` (projections and
MLPs) and ``attention`` (what selective recomputation replays: attention cores, and the Mamba-2 and
Gated DeltaNet mixers' scan or rule, conv and norm, counted as their scan or rule).
"""
from __future__ import annotations

from megazero.config.hybrid import (ATTENTION, DELTANET, MAMBA, MAMBA_CONV_KERNEL, MLP, MOE,
                                    linear_attention_layers, mamba_num_heads)
from megazero.config.patterns import layer_uses_rope, layer_window


def mamba_flops(m):
    """``(projections, scan)`` forward FLOPs per token of one Mamba-2 layer."""
    heads = mamba_num_heads(m)
    d_in, gn, h = heads * m.mamba_head_dim, m.mamba_num_groups * m.mamba_state_dim, m.hidden_size
    return 2 * h * (2 * d_in + 2 * gn + heads) + 2 * d_in * h, 7 * d_in * m.mamba_state_dim


def deltanet_flops(m):
    """``(projections, rule and conv)`` forward FLOPs per token of one Gated DeltaNet layer."""
    h, hv, dv = m.hidden_size, m.linear_num_value_heads, m.linear_value_head_dim
    k, v = m.linear_num_key_heads * m.linear_key_head_dim, hv * dv
    rule = 2 * (m.linear_conv_kernel_dim * (2 * k + v) + 4 * hv * dv * dv)
    return 2 * (h * (2 * k + 2 * v + 2 * hv) + h * v), rule


def hybrid_layer_flops(cfg, mlp_flops, mla_flops) -> dict:
    """The mean forward FLOPs per token over the ``--num-layers`` layers (the module docstring);
    ``mlp_flops(cfg, moe_layer)`` and ``mla_flops(m, keys)`` are the transformer count's."""
    m = cfg.model
    h, s = m.hidden_size, m.seq_length
    q = m.num_attention_heads * (m.kv_channels or h // m.num_attention_heads)
    kv = (m.num_query_groups or m.num_attention_heads) * (m.kv_channels or h // m.num_attention_heads)
    dense = attention = 0.0
    per_layer = 1 if m.hybrid_layer_pattern else 2  # kinds a layer holds
    for j, kind in enumerate(_kinds(cfg)):
        i = j // per_layer
        if kind == ATTENTION:
            w, c = layer_window(m, i), m.attention_chunk_size if layer_uses_rope(m, i) else None
            keys = min(s, s if w is None else w + 1, c or s)
            if m.multi_latent_attention:
                projections, core = mla_flops(m, keys)
            else:
                projections, core = 2 * h * (q + 2 * kv) + 2 * q * h, 4 * keys * q
            dense += projections + (2 * h * q if m.attention_output_gate else 0)
            attention += core
        elif kind in (MLP, MOE):
            dense += mlp_flops(cfg, kind == MOE)
        elif kind in (MAMBA, DELTANET):
            projections, core = mamba_flops(m) if kind == MAMBA else deltanet_flops(m)
            dense, attention = dense + projections, attention + core
    return {"dense": dense / m.num_layers, "attention": attention / m.num_layers}


def _kinds(cfg) -> str:
    """The pattern; for Gated DeltaNet inside transformer layers (``--experimental-attention-variant``)
    each layer's attention or Gated DeltaNet followed by its MLP (``E`` in an MoE layer), two kinds a
    layer."""
    m = cfg.model
    if m.hybrid_layer_pattern:
        return m.hybrid_layer_pattern
    from megazero.moe.settings import moe_layers
    moe = set(moe_layers(cfg))
    return "".join((DELTANET if linear else ATTENTION) + (MOE if i in moe else MLP)
                   for i, linear in enumerate(linear_attention_layers(m)))


def mamba_params(m) -> int:
    """One Mamba-2 mixer: in-projection, conv (with bias), ``A_log``, ``D``, ``dt_bias``, norm scale,
    out-projection (and the projections' biases with ``--add-bias-linear``)."""
    heads = mamba_num_heads(m)
    d_in, h = heads * m.mamba_head_dim, m.hidden_size
    proj = 2 * d_in + 2 * m.mamba_num_groups * m.mamba_state_dim + heads
    conv = d_in + 2 * m.mamba_num_groups * m.mamba_state_dim
    bias = (proj + h) if m.add_bias_linear else 0
    return h * proj + conv * (MAMBA_CONV_KERNEL + 1) + 3 * heads + d_in + d_in * h + bias


def deltanet_params(m) -> int:
    """One Gated DeltaNet mixer: in-projection, conv (no bias), ``A_log``, ``dt_bias``, the shared
    norm scale, out-projection."""
    h, hv, dv = m.hidden_size, m.linear_num_value_heads, m.linear_value_head_dim
    k, v = m.linear_num_key_heads * m.linear_key_head_dim, hv * dv
    return h * (2 * k + 2 * v + 2 * hv) + (2 * k + v) * m.linear_conv_kernel_dim + 2 * hv + dv + v * h


def hybrid_layer_params(m, layer: int, attention: int, mlp: int, norm: int) -> int:
    """Layer ``layer`` of the pattern: its norm (``norm`` parameters) and its mixer; ``attention`` and
    ``mlp`` are what a transformer layer's attention and MLP (or MoE layer) hold."""
    kind = m.hybrid_layer_pattern[layer]
    mixer = {ATTENTION: attention, MLP: mlp, MOE: mlp}.get(kind)
    if mixer is None:
        mixer = mamba_params(m) if kind == MAMBA else deltanet_params(m)
    return norm + mixer
