"""The transformer layer of the GPT family: norms, rotary embeddings, attention and MLP.

What each module here saves for backward is declared in :mod:`megazero_models.saved_activations`
(the memory estimator's input): change a forward, change its entry there (``tests/test_memory.py``
measures both).

Hidden states are ``[seq, batch, hidden]`` (``[seq / tp, batch, hidden]`` under sequence
parallelism). Weights are initialised full from ``(seed, global layer index, parameter name)``
and sliced for this TP rank (see :mod:`megazero.tensor_parallel.layers`).

The fused QKV weight is laid out by key/value group: output features
``[group][q_1 .. q_{heads/groups}, k, v][head_dim]``, so a contiguous TP slice holds whole
groups and TP shards concatenate to the TP = 1 weight.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from megazero.config.hybrid import linear_attention_layers
from megazero.config.patterns import GATED, layer_uses_rope, layer_window
from megazero.context_parallel import blockwise_attention, ring_attention
from megazero.tensor_parallel.recompute import recompute
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.activations import Activation
from megazero.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, mark_tensor_parallel,
                                             normal_init, shard)
from megazero.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from .attention_ops import eager_attention, l2_norm, sink_sdpa, temperature_scales, with_chunks
from .rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_scaling_of  # noqa: F401 - public names

Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]

SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa exists


def native_gqa(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether grouped-query attention goes to SDPA as it is (``enable_gqa=True``, no K/V copies):
    on CUDA in half precision without a mask, where SDPA's flash kernel reads each key/value head
    for its group.  Elsewhere the keys and values are repeated: fp32, a mask (the memory-efficient
    and math kernels would repeat them anyway) and the CPU, whose kernel sums the key/value
    gradients of a group in another order (same outputs, last-bit differences in those
    gradients): CPU results stay those of the repeated form."""
    return SDPA_GQA and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None


class Norm(nn.Module):
    """LayerNorm or RMSNorm computed in fp32 whatever the parameter / activation dtype.

    Its parameters are replicated over TP; under sequence parallelism each rank sees only its
    part of the sequence, so they are marked ``sequence_parallel`` (grads summed over TP).
    """

    def __init__(self, hidden: int, kind: str, eps: float, device, sequence_parallel: bool = False):
        super().__init__()
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {kind!r}")
        self.kind, self.eps = kind, eps
        self.weight = new_param((hidden,), lambda: torch.ones(hidden, device="cpu"), device)
        self.bias = (new_param((hidden,), lambda: torch.zeros(hidden, device="cpu"), device)
                     if kind == "LayerNorm" else None)
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch's fused kernels accumulate in fp32 for bf16/fp16 inputs and round once at the end,
        # as an explicit upcast would, without the two casts (and their backward) around them
        if self.kind == "LayerNorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, accumulated in fp32."""
    fused = getattr(F, "rms_norm", None)
    if fused is not None:
        return fused(x, x.shape[-1:], weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class KVCache:
    """Past keys and values of every layer, for generation: ``[b, groups (/ tp), s, head_dim]`` per
    layer, and ``length``, the number of positions already in it (the caller advances it after
    each forward pass over all layers)."""

    def __init__(self):
        self.keys: Dict[int, torch.Tensor] = {}
        self.values: Dict[int, torch.Tensor] = {}
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys and values of ``layer``; returns all of them."""
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class HeadsRMSNorm(nn.Module):
    """RMSNorm over all heads of a token's query (or key) projection, OLMo 2's q/k norm, on
    ``[b, heads / tp, s, d]``: the sum of squares is all-reduced over TP (forward and backward), the
    scale ``[heads * d]`` is split over TP with the heads (``tensor_model_parallel``, dim 0)."""

    def __init__(self, heads: int, head_dim: int, eps: float, mesh):
        super().__init__()
        tp = mesh.size("tp")
        self.mesh, self.eps, self.total, self.heads = mesh, eps, heads * head_dim, heads // tp
        local = heads // tp * head_dim
        self.weight = new_param((local,), lambda: torch.ones(local, device="cpu"), mesh.device)
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(dim=(1, 3), keepdim=True)  # [b, 1, s, 1]: this rank's heads
        if self.mesh.size("tp") > 1:  # all-reduce in forward and in backward
            squares = reduce_from_tp(copy_to_tp(squares, self.mesh), self.mesh)
        y = xf * torch.rsqrt(squares / self.total + self.eps)
        return (y * self.weight.float().view(self.heads, 1, -1)).to(x.dtype)


def _qk_norms(m, mesh, heads: int, groups: int):
    """The query and key norms of ``--qk-layernorm`` (None, None without it).  Per head, their
    scales ``[d]`` are replicated over TP while each rank normalises its own heads: marked
    ``sequence_parallel`` (gradients summed over TP)."""
    if not m.qk_layernorm:
        return None, None
    if m.qk_layernorm_scope == "all":
        return (HeadsRMSNorm(heads, m.kv_channels, m.norm_epsilon, mesh),
                HeadsRMSNorm(groups, m.kv_channels, m.norm_epsilon, mesh))
    return tuple(Norm(m.kv_channels, m.normalization, m.norm_epsilon, mesh.device, sequence_parallel=True)
                 for _ in range(2))


def window_mask(seq: int, window: int, dtype, device) -> torch.Tensor:
    """Additive ``[seq, seq]`` mask (0 where seen, -inf where hidden) of causal attention within a
    window: query ``i`` sees keys ``i - window .. i``.  In the attention's dtype, so that
    ``scaled_dot_product_attention`` keeps this tensor for backward instead of a converted copy."""
    i = torch.arange(seq, device=device)
    hidden = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] > window)
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads split over TP (column-parallel QKV,
    row-parallel output projection). ``recompute_core`` recomputes softmax(QK^T)V in backward.

    Per layer (:mod:`megazero.config.patterns`): a sliding window (``self.window``: keys before its
    own a query sees), RoPE or not (``--no-rope-freq``), Gemma 3's local RoPE base on windowed layers,
    Llama 4's chunked attention (``self.chunk``, on RoPE layers), L2 q/k norm and attention temperature
    (on NoPE layers); per model: q/k norms before RoPE, the score scale, the soft-cap of the scores and
    attention sinks (``--softmax-type``: ``self.sinks [heads / tp]``, split over TP with the heads;
    :mod:`models.attention_ops`)."""

    def __init__(self, cfg, mesh, layer_idx: int, tracker, recompute_core: bool = False,
                 onednn: bool = False):
        super().__init__()
        m, seed, sp = cfg.model, cfg.training.seed, cfg.parallel.sequence_parallel
        self.mesh, self.tracker = mesh, tracker
        self.recompute_core, self.layer_idx = recompute_core, layer_idx
        self.cp_comm_type = cfg.parallel.cp_comm_type
        self.head_dim, self.dropout = m.kv_channels, m.attention_dropout
        self.q_per_group = m.num_attention_heads // m.num_query_groups
        self.groups = m.num_query_groups // mesh.size("tp")
        self.window, self.rotary = layer_window(m, layer_idx), layer_uses_rope(m, layer_idx)
        self.softcap, self.scale = m.attn_logit_softcapping, m.softmax_scale
        qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        qkv_bias = m.add_bias_linear or m.add_qkv_bias
        self.qkv = ColumnParallelLinear(m.hidden_size, qkv_out, mesh, bias=qkv_bias,
                                        sequence_parallel=sp, onednn=onednn,
                                        init=normal_init(seed, layer_idx, "attention.qkv.weight", std))
        self.proj = RowParallelLinear(m.num_attention_heads * m.kv_channels, m.hidden_size, mesh,
                                      bias=m.add_bias_linear, sequence_parallel=sp, onednn=onednn,
                                      init=normal_init(seed, layer_idx, "attention.proj.weight", out_std))
        self.q_norm, self.k_norm = _qk_norms(m, mesh, m.num_attention_heads, m.num_query_groups)
        self.gate = None  # Qwen3-Next's gated attention: the output times sigmoid(x W_gate), per channel
        if m.attention_output_gate:  # column-parallel: each rank gates its own heads
            self.gate = ColumnParallelLinear(m.hidden_size, m.num_attention_heads * m.kv_channels, mesh,
                                             bias=qkv_bias, sequence_parallel=sp, onednn=onednn,
                                             init=normal_init(seed, layer_idx, "attention.gate.weight", std))
        self.chunk = m.attention_chunk_size if self.rotary else None
        self.local_rope = m.rotary_base_local is not None and self.window is not None
        l2 = m.qk_l2_norm and (m.qk_l2_norm_scope == "all" or self.rotary)
        self.l2_eps = m.norm_epsilon if l2 else None
        self.temperature = ((m.attn_temperature_floor_scale, m.attn_temperature_scale)
                            if m.attn_temperature_tuning and not self.rotary else None)
        self.softmax_type, self.sinks = m.softmax_type, None
        if m.softmax_type == "learnable":  # one logit per head, this rank's heads
            heads, init = m.num_attention_heads, normal_init(seed, layer_idx, "attention.sinks", std)
            self.sinks = mark_tensor_parallel(new_param(
                (heads // mesh.size("tp"),), lambda: shard(init((heads,)), mesh, 0), mesh.device), 0)

    def sink_logits(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's heads' sink logits ``[heads / tp]`` (zeros for off-by-one), or None."""
        if self.softmax_type == "off-by-one":
            return torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
        return self.sinks

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V, causal; ``q [b, heads, s, d]``, ``k, v [b, groups, s, d]``.
        Under context parallelism ``s`` is this CP rank's part of the sequence (the load-balanced
        split) and attention runs over the CP group: ring attention (p2p) or Ulysses (a2a), whose
        kernel never forms the s x s matrix, takes grouped K/V heads as they are and skips the tiles
        outside the window.  Soft-capped scores run in that kernel on one rank too (no s x s matrix
        either); a window otherwise goes to SDPA as the additive ``mask`` (shared by the layers).  Packed
        documents (``--reset-attention-mask``) come as a ``[b, 1, s, s]`` mask that holds the window
        too for SDPA; with soft-capping as the document ids ``[b, s]``, which the blockwise kernel
        compares tile by tile; under context parallelism as every CP rank's document ids ``[b, s / cp]``
        (a list), which the ring/Ulysses kernel compares."""
        sinks = self.sink_logits(q)
        if self.mesh.size("cp") > 1:  # mask: None, or every CP rank's document ids (packed documents)
            return ring_attention(q, k, v, self.mesh.group("cp"), comm_type=self.cp_comm_type,
                                  scale=self.scale, window=self.window, softcap=self.softcap,
                                  documents=mask, chunk=self.chunk, sinks=sinks)
        if self.softcap is not None:  # mask: None, or the document ids (packed documents)
            return blockwise_attention(q, k, v, scale=self.scale, window=self.window, softcap=self.softcap,
                                       q_documents=mask, k_documents=mask, chunk=self.chunk, sinks=sinks)[0]
        if self.chunk is not None and self.chunk < q.shape[2]:  # keys outside the query's chunk hidden too
            mask = with_chunks(mask, q.shape[2], self.chunk, q.dtype, q.device)
        if sinks is not None:
            return self._sink_core(q, k, v, sinks, mask)
        kw = dict(attn_mask=mask) if mask is not None else dict(is_causal=True)
        if self.q_per_group > 1 and native_gqa(q, mask):  # the kernel reads each K/V head per group
            kw["enable_gqa"] = True
        elif self.q_per_group > 1:  # grouped-query: each key/value head serves q_per_group query heads
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        if self.training and self.dropout > 0:
            with self.tracker.fork():  # heads are split over TP: a different mask on each rank
                return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, scale=self.scale, **kw)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, **kw)

    def _sink_core(self, q, k, v, sinks, mask):
        """SDPA with the sink logits as one more key (:func:`models.attention_ops.sink_sdpa`)."""
        k = k.repeat_interleave(self.q_per_group, dim=1)
        v = v.repeat_interleave(self.q_per_group, dim=1)
        if self.training and self.dropout > 0:
            with self.tracker.fork():  # heads are split over TP: a different mask on each rank
                return sink_sdpa(q, k, v, sinks, mask, self.scale, self.dropout)
        return sink_sdpa(q, k, v, sinks, mask, self.scale)

    def split_qkv(self, qkv: torch.Tensor):
        """``[s, b, groups * (q_per_group + 2) * d]`` -> ``q [b, heads, s, d]``, ``k, v [b, groups, s, d]``:
        views where the layout allows (one split, whose backward is a single concatenation)."""
        s, b, _ = qkv.shape
        n, g, d = self.q_per_group, self.groups, self.head_dim
        q, k, v = qkv.view(s, b, g, n + 2, d).split([n, 1, 1], dim=3)
        q = q.reshape(s, b, g * n, d)  # a view when n == 1 (plain multi-head attention)
        return q.permute(1, 2, 0, 3), k.squeeze(3).permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)

    def cached_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """Generation: queries of the positions after the ``past`` ones, keys and values of all
        (the window and the soft-cap as in training; no gradient)."""
        k = k.repeat_interleave(self.q_per_group, dim=1)
        v = v.repeat_interleave(self.q_per_group, dim=1)
        qpos = torch.arange(past, past + q.shape[2], device=q.device)[:, None]
        kpos = torch.arange(k.shape[2], device=q.device)[None, :]
        seen = kpos <= qpos
        if self.window is not None:
            seen = seen & (qpos - kpos <= self.window)
        if self.chunk is not None:
            seen = seen & (qpos // self.chunk == kpos // self.chunk)
        sinks = self.sink_logits(q)
        if self.softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=self.scale)
        return eager_attention(q, k, v, seen, self.scale, self.softcap, sinks)

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.l2_eps is not None:  # before RoPE, as Megatron-LM (RoPE keeps the RMS: Llama 4's order alike)
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if rope is not None and self.rotary:
            cos, sin = rope.local if self.local_rope else rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.temperature is not None and rope is not None:
            q = (q * temperature_scales(rope.positions, *self.temperature)).to(q.dtype)
        if kv_cache is not None:
            past = kv_cache.length
            out = self.cached_core(q, *kv_cache.extend(self.layer_idx, k, v), past)
        elif self.recompute_core and torch.is_grad_enabled():
            out = recompute(self.core, q, k, v, mask, tracker=self.tracker, device=x.device)
        else:
            out = self.core(q, k, v, mask)
        out = rearrange(out, "b n s d -> s b (n d)")
        if self.gate is not None:  # --attention-output-gate
            out = out * torch.sigmoid(self.gate(x))
        return self.proj(out)


class MLP(nn.Module):
    """GELU MLP (``gelu``: the tanh approximation; ``gelu_exact``: erf), or gated:
    ``fc2(act(gate(x)) * fc1(x))`` with SiLU (``swiglu``) or the tanh GELU (``geglu``);
    column- then row-parallel.  ``ffn_hidden_size`` (default ``--ffn-hidden-size``) and ``prefix``
    (the init key's, default ``mlp``) serve the MoE layer's shared expert
    (:mod:`megazero_models.moe`)."""

    def __init__(self, cfg, mesh, layer_idx: int, onednn: bool = False, ffn_hidden_size: Optional[int] = None,
                 prefix: str = "mlp"):
        super().__init__()
        m, seed, sp = cfg.model, cfg.training.seed, cfg.parallel.sequence_parallel
        ffn = ffn_hidden_size or m.ffn_hidden_size
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        self.gated, self.act = m.activation in GATED, Activation(m)

        def column(name):
            init = normal_init(seed, layer_idx, f"{prefix}.{name}.weight", std)
            return ColumnParallelLinear(m.hidden_size, ffn, mesh, bias=m.add_bias_linear,
                                        sequence_parallel=sp, init=init, onednn=onednn)
        self.gate = column("gate") if self.gated else None
        self.fc1 = column("fc1")
        self.fc2 = RowParallelLinear(ffn, m.hidden_size, mesh, bias=m.add_bias_linear,
                                     sequence_parallel=sp, onednn=onednn,
                                     init=normal_init(seed, layer_idx, f"{prefix}.fc2.weight", out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = self.act(h, self.gate(x)) if self.gated else self.act(h)
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``; with
    ``--norm-position post`` the norms act on the sublayer outputs instead, ``x + drop(norm(attn(x)))``
    (OLMo 2), and ``sandwich`` has both (Gemma 2).  Parameter names: ``input_norm`` and
    ``post_attention_norm`` before attention and the MLP, ``attention_output_norm`` and
    ``mlp_output_norm`` after them.

    Hidden dropout acts on activations every TP rank holds in full, so it draws from the default
    generator (same mask on every TP rank); under sequence parallelism each rank holds a
    different part of the sequence, so it runs under the tracker's fork.

    ``onednn``: the linear layers' fp32 CPU products through oneDNN (``--cpu-matmul``, resolved
    once by the model, :func:`megazero.tensor_parallel.cpu_matmul.resolve_cpu_matmul`).  ``mlp``: the module
    in the MLP's place (an MoE layer, :mod:`megazero_models.moe`); default the dense :class:`MLP`.
    """

    def __init__(self, cfg, mesh, layer_idx: int, tracker, onednn: bool = False,
                 mlp: Optional[nn.Module] = None):
        super().__init__()
        m = cfg.model
        self.sequence_parallel = cfg.parallel.sequence_parallel
        self.tracker, self.dropout = tracker, m.hidden_dropout
        norm = lambda: Norm(m.hidden_size, m.normalization, m.norm_epsilon, mesh.device,  # noqa: E731
                            cfg.parallel.sequence_parallel)
        pre, post = m.norm_position in ("pre", "sandwich"), m.norm_position in ("post", "sandwich")
        self.input_norm = norm() if pre else None
        attention = Attention
        if m.multi_latent_attention:  # DeepSeek's multi-latent attention (models/mla.py, which imports this)
            from .mla import MLAttention as attention
        elif m.experimental_attention_variant and linear_attention_layers(m)[layer_idx]:  # Qwen3-Next's form
            from .hybrid import DeltaNetAttention as attention
        self.attention = attention(cfg, mesh, layer_idx, tracker, m.recompute_granularity == "selective",
                                   onednn)
        self.attention_output_norm = norm() if post else None
        self.post_attention_norm = norm() if pre else None
        self.mlp = mlp if mlp is not None else MLP(cfg, mesh, layer_idx, onednn)
        self.mlp_output_norm = norm() if post else None

    def hidden_dropout(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return h
        if self.sequence_parallel:
            with self.tracker.fork():
                return F.dropout(h, self.dropout)
        return F.dropout(h, self.dropout)

    @staticmethod
    def _norm(norm: Optional[Norm], x: torch.Tensor) -> torch.Tensor:
        return x if norm is None else norm(x)

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None,
                masks: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        mask = (masks or {}).get(self.attention.window)
        a = self.attention(self._norm(self.input_norm, x), rope, kv_cache, mask)
        x = x + self.hidden_dropout(self._norm(self.attention_output_norm, a))
        h = self.mlp(self._norm(self.post_attention_norm, x))
        return x + self.hidden_dropout(self._norm(self.mlp_output_norm, h))
