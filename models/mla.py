"""Multi-latent attention (MLA), as DeepSeek-V2/V3 and Megatron-core's ``MLASelfAttention`` define it.

Per token ``x [h]`` (``n`` heads, ``dn = --qk-head-dim``, ``dr = --qk-pos-emb-head-dim``,
``dv = --v-head-dim``, ranks ``rq = --q-lora-rank``, ``rkv = --kv-lora-rank``):

- query: ``q = W_qu norm(W_qd x)`` (``[n (dn + dr)]``), or ``q = W_q x`` without ``--q-lora-rank``;
- key/value latent: ``[c, k_pe] = W_kvd x`` (``[rkv + dr]``), ``c <- norm(c)``;
  ``[k_nope, v] = W_kvu c`` (``[n (dn + dv)]``);
- each head's key is ``[k_nope_i, rope(k_pe)]``: one rotary part shared by every head (the
  *decoupled* RoPE), its query ``[q_nope_i, rope(q_pe_i)]``;
- ``softmax(scale q k^T) v`` over ``dn + dr`` channels with ``scale = mscale^2 / sqrt(dn + dr)``,
  ``mscale = 0.1 --mscale-all-dim ln(--rotary-scaling-factor) + 1`` (1 for a factor <= 1), then
  ``W_o`` (``n dv -> h``).

The norms on the two latents come with ``--qk-layernorm`` (Megatron-LM's rule; DeepSeek's models
have them), of ``--normalization``.  RoPE rotates DeepSeek's interleaved pairs ``(2i, 2i + 1)``, as
Megatron-core and Hugging Face's DeepSeek-V3 do, so its weights need no permutation; with
``--rope-type yarn`` (the default with MLA) its frequencies and ``cos``/``sin`` factor are YaRN's
(:mod:`megazero_models.rope`).

Tensor parallelism splits heads: the up-projections ``W_qu``/``W_q`` and ``W_kvu`` are column-parallel
and ``W_o`` row-parallel; the down-projections ``W_qd``, ``W_kvd`` and the latent norms are
replicated.  Each rank computes the latents of its tokens (its part of the sequence under sequence
parallelism) and one collective hands every rank all of them: an all-gather along the sequence
under sequence parallelism (backward: reduce-scatter), else the identity whose backward
all-reduces the latents' gradient over TP (``rq + rkv + dr`` values a token rather than ``h``).  So
the replicated weights get complete gradients without sequence parallelism and partial ones
(marked ``sequence_parallel``, summed over TP) with it, as the layer norms do.

Attention itself runs in :meth:`Attention.core` (SDPA, the blockwise kernel, ring or Ulysses
context parallelism, windows, soft-capping, packed documents), with values zero-padded to the
query's ``dn + dr`` channels when ``dv`` differs (and the padding cut off after): every kernel then
sees one head size (SDPA's flash kernels need it; CPU's would fall back to its math kernel).

Generation caches the latent, not the keys and values: ``c`` and ``rope(k_pe)``, ``rkv + dr``
values a token and layer (:class:`models.layers.KVCache` holds them as its keys and values), and
attends in the latent space with the up-projections absorbed into the query and the output.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from megazero.config.patterns import layer_window
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, linear, normal_init
from megazero.tensor_parallel.mappings import copy_to_tp, gather_from_sp
from megazero.tensor_parallel.recompute import recompute
from .layers import Attention, KVCache, Norm, Rope
from .rope import apply_rope, yarn_mscale


def mla_rope_model(m):
    """MLA's rotary part as the ModelConfig of a RoPE model, for the rotary tables
    (:func:`models.rope.rope_tables`): ``--qk-pos-emb-head-dim`` channels rotated on every layer, by YaRN
    (``--rotary-scaling-factor``, ``--mscale``, ``--mscale-all-dim`` and the ``--yarn-*`` settings)
    unless ``--rope-type rope`` (plain RoPE of ``--rotary-base``), whatever ``--position-embedding-type``
    says (Megatron-core's rule)."""
    return replace(m, kv_channels=m.qk_pos_emb_head_dim, no_rope_freq=None,
                   position_embedding_type="rope" if m.rope_type == "rope" else "yarn")


def mla_softmax_scale(m) -> float:
    """``mscale^2 / sqrt(dn + dr)`` with YaRN's ``mscale`` of ``--mscale-all-dim`` (Megatron-core's and
    DeepSeek's score scale)."""
    mscale = yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim)
    return mscale * mscale / math.sqrt(m.qk_head_dim + m.qk_pos_emb_head_dim)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(x_2i, x_2i+1)``: the pairs gathered into halves, then rotated as
    :func:`apply_rope` rotates (the result in the half-split layout, for queries and keys alike)."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


class ReplicatedLinear(nn.Module):
    """A bias-free linear layer whose full weight every TP rank holds (MLA's down-projections),
    initialised from ``(seed, layer, name)`` like the others."""

    def __init__(self, in_features: int, out_features: int, mesh, init, sequence_parallel: bool):
        super().__init__()
        shape = (out_features, in_features)
        self.weight = new_param(shape, lambda: init(shape), mesh.device)
        self.weight.linear_weight = True
        self.weight.sequence_parallel = sequence_parallel  # partial gradients under SP only

    def forward(self, x: torch.Tensor, onednn: bool = False) -> torch.Tensor:
        return linear(x, self.weight, onednn=onednn)


class MLAttention(Attention):
    """Multi-latent attention in :class:`models.layers.Attention`'s place (same ``forward``
    signature, same core); parameter names ``q_down``, ``q_norm``, ``q_up`` (or ``q_proj``),
    ``kv_down``, ``kv_norm``, ``kv_up``, ``proj``."""

    def __init__(self, cfg, mesh, layer_idx: int, tracker, recompute_core: bool = False,
                 onednn: bool = False):
        nn.Module.__init__(self)
        m, seed, sp = cfg.model, cfg.training.seed, cfg.parallel.sequence_parallel
        tp = mesh.size("tp")
        self.mesh, self.tracker, self.onednn = mesh, tracker, onednn
        self.recompute_core, self.layer_idx = recompute_core, layer_idx
        self.cp_comm_type, self.sequence_parallel = cfg.parallel.cp_comm_type, sp
        self.dn, self.dr, self.dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        self.rq, self.rkv = m.q_lora_rank, m.kv_lora_rank
        self.heads = m.num_attention_heads // tp
        self.head_dim, self.q_per_group, self.groups = self.dn + self.dr, 1, self.heads
        self.dropout, self.window, self.rotary = m.attention_dropout, layer_window(m, layer_idx), True
        self.softcap, self.scale = m.attn_logit_softcapping, mla_softmax_scale(m)
        # what Attention.core reads besides: no chunked attention, no sinks (refused with MLA)
        self.chunk, self.softmax_type, self.sinks = None, "vanilla", None
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        h, n = m.hidden_size, m.num_attention_heads

        def init(name, s=std):
            return normal_init(seed, layer_idx, f"attention.{name}.weight", s)

        def norm(size):
            if not m.qk_layernorm:
                return None
            return Norm(size, m.normalization, m.norm_epsilon, mesh.device, sequence_parallel=sp)

        def column(inp, out, name, seq_par=False):
            return ColumnParallelLinear(inp, out, mesh, bias=False, sequence_parallel=seq_par, onednn=onednn,
                                        init=init(name))
        if self.rq:
            self.q_down = ReplicatedLinear(h, self.rq, mesh, init("q_down"), sp)
            self.q_norm = norm(self.rq)
            self.q_up = column(self.rq, n * self.head_dim, "q_up")
        else:  # one query projection, column-parallel on the hidden states themselves
            self.q_proj = column(h, n * self.head_dim, "q_proj", sp)
        self.kv_down = ReplicatedLinear(h, self.rkv + self.dr, mesh, init("kv_down"), sp)
        self.kv_norm = norm(self.rkv)
        self.kv_up = column(self.rkv, n * (self.dn + self.dv), "kv_up")
        self.proj = RowParallelLinear(n * self.dv, h, mesh, bias=m.add_bias_linear, sequence_parallel=sp,
                                      onednn=onednn, init=init("proj", out_std))

    # ---- the latents ------------------------------------------------------------------------
    @staticmethod
    def _norm(norm: Optional[Norm], x: torch.Tensor) -> torch.Tensor:
        return x if norm is None else norm(x)

    def latents(self, x: torch.Tensor):
        """``(q latent or None, c, k_pe)`` of every token, ``[s, b, *]`` on every TP rank, from this
        rank's hidden states ``x`` (``[s / tp, b, h]`` under sequence parallelism)."""
        parts = [self._norm(self.q_norm, self.q_down(x, self.onednn))] if self.rq else []
        c, k_pe = self.kv_down(x, self.onednn).split([self.rkv, self.dr], dim=-1)
        parts += [self._norm(self.kv_norm, c), k_pe]
        both = torch.cat(parts, dim=-1)
        both = gather_from_sp(both, self.mesh) if self.sequence_parallel else copy_to_tp(both, self.mesh)
        out = both.split(([self.rq] if self.rq else []) + [self.rkv, self.dr], dim=-1)
        return (None, *out) if not self.rq else out

    def queries(self, x: torch.Tensor, q_latent: Optional[torch.Tensor], rope: Rope):
        """``(q_nope [b, n, s, dn], rope(q_pe) [b, n, s, dr])`` of this rank's heads."""
        q = linear(q_latent, self.q_up.weight, onednn=self.onednn) if self.rq else self.q_proj(x)
        q = rearrange(q, "s b (n d) -> b n s d", n=self.heads)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        return q_nope, rope_interleaved(q_pe, *rope)

    # ---- attention ---------------------------------------------------------------------------
    def mla_core(self, q, k, v, mask=None):
        """:meth:`Attention.core` with the values zero-padded to the query's head size (and cut after)
        when the two differ: the kernels of context parallelism and soft-capping take one head size,
        and so do SDPA's flash kernels (with values narrower than queries CPU's SDPA falls back to its
        math kernel, which keeps the ``s x s`` probabilities)."""
        if self.dv == self.head_dim:
            return self.core(q, k, v, mask)
        width = max(self.dv, self.head_dim)
        q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return self.core(q, k, v, mask)[..., :self.dv]

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        q_latent, c, k_pe = self.latents(x)
        q_nope, q_pe = self.queries(x, q_latent, rope)
        k_pe = rope_interleaved(rearrange(k_pe, "s b d -> b 1 s d"), *rope)  # one rotary key for all heads
        if kv_cache is not None:
            out = self.latent_core(q_nope, q_pe, kv_cache, rearrange(c, "s b r -> b 1 s r"), k_pe)
            return self.proj(rearrange(out, "b n s d -> s b (n d)"))
        kv = rearrange(linear(c, self.kv_up.weight, onednn=self.onednn), "s b (n d) -> b n s d", n=self.heads)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.heads, -1, -1)], dim=-1)
        if self.recompute_core and torch.is_grad_enabled():
            out = recompute(self.mla_core, q, k, v, mask, tracker=self.tracker, device=x.device)
        else:
            out = self.mla_core(q, k, v, mask)
        return self.proj(rearrange(out, "b n s d -> s b (n d)"))

    def latent_core(self, q_nope, q_pe, kv_cache: KVCache, c, k_pe) -> torch.Tensor:
        """Generation: attention of the new positions over every cached latent, without forming keys
        and values: ``q_nope W_uk`` is scored against the latents ``c``, the weighted latents go
        through ``W_uv`` (the absorbed up-projection; no gradient)."""
        past = kv_cache.length
        # [b, 1, t, rkv], [b, 1, t, dr]; copies: the prompt's latent is a slice of all latents
        c, k_pe = kv_cache.extend(self.layer_idx, c.contiguous(), k_pe.contiguous())
        w = self.kv_up.weight.view(self.heads, self.dn + self.dv, self.rkv)
        w_uk, w_uv = w[:, :self.dn], w[:, self.dn:]
        q_latent = torch.einsum("bnsd,ndr->bnsr", q_nope, w_uk)
        scores = (torch.matmul(q_latent, c.transpose(-1, -2)) + torch.matmul(q_pe, k_pe.transpose(-1, -2)))
        scores = scores * self.scale
        qpos = torch.arange(past, past + q_nope.shape[2], device=c.device)[:, None]
        kpos = torch.arange(c.shape[2], device=c.device)[None, :]
        seen = kpos <= qpos
        if self.window is not None:
            seen = seen & (qpos - kpos <= self.window)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(c.dtype)
        return torch.einsum("bnsr,ndr->bnsd", torch.matmul(probs, c), w_uv)
