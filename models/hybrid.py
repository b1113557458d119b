"""The layers of a hybrid stack (``--hybrid-layer-pattern``, :mod:`megazero.config.hybrid`).

Each layer is one pre-norm residual block ``x + drop(f(norm(x)))`` around one mixer: a Mamba-2 mixer
(``M``, :class:`~megazero_models.mamba.MambaMixer`, parameters ``mixer.*``), attention (``*``,
``attention.*``), an MLP (``-``, ``mlp.*``), a mixture of experts (``E``, ``mlp.*``) or Gated DeltaNet
(``G``, :class:`~megazero_models.deltanet.GatedDeltaNet`, ``mixer.*``); the norm is ``input_norm``.
The block takes the transformer layer's arguments (``rope``, ``kv_cache``, ``masks``), so the model,
recomputation and the pipeline run it alike.  In generation the recurrent layers keep their conv
and recurrent states in ``kv_cache.recurrent[layer]`` (one token then costs the same at any length).
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.config.hybrid import (ATTENTION, DELTANET, MAMBA, MAMBA_CONV_KERNEL, MLP as MLP_KIND,
                                    layer_kind, mamba_num_heads)
from .deltanet import DeltaNetShape, GatedDeltaNet
from .layers import MLP, Attention, KVCache, Norm, Rope
from .mamba import MambaMixer, MambaShape


def mamba_shape(cfg) -> MambaShape:
    """The Mamba-2 mixers' sizes from the model settings (Megatron-core's: biases as
    ``--disable-bias-linear`` says, the out-projection's std scaled by ``1 / sqrt(2 x layers)``)."""
    m = cfg.model
    return MambaShape(hidden_size=m.hidden_size, num_heads=mamba_num_heads(m), head_dim=m.mamba_head_dim,
                      state_dim=m.mamba_state_dim, num_groups=m.mamba_num_groups,
                      chunk_size=m.mamba_chunk_size, conv_kernel=MAMBA_CONV_KERNEL,
                      norm_eps=m.norm_epsilon, bias=m.add_bias_linear, init_std=m.init_method_std,
                      out_std=m.init_method_std / math.sqrt(2 * m.num_layers))


def deltanet_shape(cfg) -> DeltaNetShape:
    m = cfg.model
    return DeltaNetShape(hidden_size=m.hidden_size, num_key_heads=m.linear_num_key_heads,
                         num_value_heads=m.linear_num_value_heads, key_head_dim=m.linear_key_head_dim,
                         value_head_dim=m.linear_value_head_dim, conv_kernel=m.linear_conv_kernel_dim,
                         chunk_size=m.linear_chunk_size, norm_eps=m.norm_epsilon, init_std=m.init_method_std,
                         out_std=m.init_method_std / math.sqrt(2 * m.num_layers))


class HybridLayer(nn.Module):
    """One layer of a hybrid stack (the module docstring).  ``mlp``: the MoE layer of an ``E`` layer."""

    def __init__(self, cfg, mesh, layer_idx: int, tracker, onednn: bool = False,
                 mlp: Optional[nn.Module] = None):
        super().__init__()
        m, sp = cfg.model, cfg.parallel.sequence_parallel
        self.kind, self.layer_idx = layer_kind(m, layer_idx), layer_idx
        self.sequence_parallel, self.tracker, self.dropout = sp, tracker, m.hidden_dropout
        self.input_norm = Norm(m.hidden_size, m.normalization, m.norm_epsilon, mesh.device, sp)
        # selective recomputation: the mixers keep their in-projection's output only (conv, scan and
        # norm replayed in backward), as attention keeps q, k, v and replays its core
        kw = dict(seed=cfg.training.seed, sequence_parallel=sp, onednn=onednn,
                  recompute_core=m.recompute_granularity == "selective")
        if self.kind == MAMBA:
            self.mixer = MambaMixer(mamba_shape(cfg), mesh, layer_idx, **kw)
        elif self.kind == DELTANET:
            self.mixer = GatedDeltaNet(deltanet_shape(cfg), mesh, layer_idx, **kw)
        elif self.kind == ATTENTION:  # the transformer layer's attention (multi-latent with its flag)
            attention = Attention
            if m.multi_latent_attention:
                from .mla import MLAttention as attention
            self.attention = attention(cfg, mesh, layer_idx, tracker, m.recompute_granularity == "selective",
                                       onednn)
        elif self.kind == MLP_KIND:
            self.mlp = MLP(cfg, mesh, layer_idx, onednn)
        else:  # E: the MoE layer the model built for it
            if mlp is None:
                raise ValueError(f"layer {layer_idx} is an E (mixture-of-experts) layer: add --num-experts")
            self.mlp = mlp

    def hidden_dropout(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return h
        if self.sequence_parallel:
            with self.tracker.fork():
                return F.dropout(h, self.dropout)
        return F.dropout(h, self.dropout)

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None,
                masks: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        h = self.input_norm(x)
        if self.kind in (MAMBA, DELTANET):
            state = None
            if kv_cache is not None:  # generation: this layer's conv and recurrent states
                store = kv_cache.__dict__.setdefault("recurrent", {})
                state = store.setdefault(self.layer_idx, {})
            h = self.mixer(h, state)
        elif self.kind == ATTENTION:
            h = self.attention(h, rope, kv_cache, (masks or {}).get(self.attention.window))
        else:
            h = self.mlp(h)
        return x + self.hidden_dropout(h)


class DeltaNetAttention(GatedDeltaNet):
    """Gated DeltaNet in a transformer layer's attention place (``--experimental-attention-variant
    gated_delta_net``, Megatron-LM's Qwen3-Next form): built and called as :class:`Attention` is
    (``rope`` and ``mask`` unused; in generation its conv and recurrent states live in
    ``kv_cache.recurrent[layer]``)."""

    def __init__(self, cfg, mesh, layer_idx: int, tracker, recompute_core: bool = False,
                 onednn: bool = False):
        super().__init__(deltanet_shape(cfg), mesh, layer_idx, seed=cfg.training.seed,
                         sequence_parallel=cfg.parallel.sequence_parallel, onednn=onednn,
                         prefix="attention", recompute_core=recompute_core)
        self.layer_idx, self.window = layer_idx, None

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        state = None
        if kv_cache is not None:
            state = kv_cache.__dict__.setdefault("recurrent", {}).setdefault(self.layer_idx, {})
        return super().forward(x, state)
