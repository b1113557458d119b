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

from megazero.context_parallel import ring_attention
from megazero.recompute import recompute
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init

Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]


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


def rope_scaling_of(m) -> Dict[str, float]:
    """The RoPE scaling of a ModelConfig: ``{}`` or keys ``llama3`` (factor), ``low``, ``high``,
    ``original`` (LLaMA-3.x) and ``linear`` (position interpolation factor)."""
    out: Dict[str, float] = {}
    if m.use_rope_scaling:
        out.update(llama3=m.rope_scaling_factor, low=m.rope_scaling_low_freq_factor,
                   high=m.rope_scaling_high_freq_factor,
                   original=m.rope_scaling_original_max_position_embeddings)
    if m.rotary_seq_len_interpolation_factor is not None:
        out["linear"] = m.rotary_seq_len_interpolation_factor
    return out


def rope_inv_freq(dim: int, base: float, device, scaling: Optional[Dict[str, float]] = None) -> torch.Tensor:
    """fp32 rotary frequencies ``[dim / 2]``, with LLaMA-3.x scaling and/or linear position
    interpolation (``scaling`` from :func:`rope_scaling_of`), as Hugging Face computes them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = scaling or {}
    if "llama3" in scaling:
        factor, low, high, original = (scaling[k] for k in ("llama3", "low", "high", "original"))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long waves: slowed down
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    if "linear" in scaling:
        inv_freq = inv_freq / scaling["linear"]
    return inv_freq


def rope_cos_sin(seq: int, dim: int, base: float, device,
                 scaling: Optional[Dict[str, float]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[seq, dim]`` in Hugging Face's half-split layout."""
    inv_freq = rope_inv_freq(dim, base, device, scaling)
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, d]`` (HF ``rotate_half``: pairs are ``(i, i + d/2)``), in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


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


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads split over TP (column-parallel QKV,
    row-parallel output projection). ``recompute_core`` recomputes softmax(QK^T)V in backward."""

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
        qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        qkv_bias = m.add_bias_linear or m.add_qkv_bias
        self.qkv = ColumnParallelLinear(m.hidden_size, qkv_out, mesh, bias=qkv_bias,
                                        sequence_parallel=sp, onednn=onednn,
                                        init=normal_init(seed, layer_idx, "attention.qkv.weight", std))
        self.proj = RowParallelLinear(m.num_attention_heads * m.kv_channels, m.hidden_size, mesh,
                                      bias=m.add_bias_linear, sequence_parallel=sp, onednn=onednn,
                                      init=normal_init(seed, layer_idx, "attention.proj.weight", out_std))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) V, causal; ``q [b, heads, s, d]``, ``k, v [b, groups, s, d]``.
        Under context parallelism ``s`` is this CP rank's part of the sequence (the load-balanced
        split) and attention runs over the CP group: ring attention (p2p) or Ulysses (a2a), whose
        kernel never forms the s x s matrix and takes grouped K/V heads as they are."""
        if self.mesh.size("cp") > 1:
            return ring_attention(q, k, v, self.mesh.group("cp"), comm_type=self.cp_comm_type)
        if self.q_per_group > 1:  # grouped-query: each key/value head serves q_per_group query heads
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        if self.training and self.dropout > 0:
            with self.tracker.fork():  # heads are split over TP: a different mask on each rank
                return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def split_qkv(self, qkv: torch.Tensor):
        """``[s, b, groups * (q_per_group + 2) * d]`` -> ``q [b, heads, s, d]``, ``k, v [b, groups, s, d]``:
        views where the layout allows (one split, whose backward is a single concatenation)."""
        s, b, _ = qkv.shape
        n, g, d = self.q_per_group, self.groups, self.head_dim
        q, k, v = qkv.view(s, b, g, n + 2, d).split([n, 1, 1], dim=3)
        q = q.reshape(s, b, g * n, d)  # a view when n == 1 (plain multi-head attention)
        return q.permute(1, 2, 0, 3), k.squeeze(3).permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)

    def cached_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """Generation: queries of the positions after the ``past`` ones, keys and values of all."""
        k = k.repeat_interleave(self.q_per_group, dim=1)
        v = v.repeat_interleave(self.q_per_group, dim=1)
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # query i (position past + i) sees keys 0 .. past + i
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv(x))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            past = kv_cache.length
            out = self.cached_core(q, *kv_cache.extend(self.layer_idx, k, v), past)
        elif self.recompute_core and torch.is_grad_enabled():
            out = recompute(self.core, q, k, v, tracker=self.tracker, device=x.device)
        else:
            out = self.core(q, k, v)
        return self.proj(rearrange(out, "b n s d -> s b (n d)"))


class MLP(nn.Module):
    """GELU MLP (``gelu``: the tanh approximation; ``gelu_exact``: erf), or SwiGLU
    ``fc2(silu(gate(x)) * fc1(x))``; column- then row-parallel."""

    def __init__(self, cfg, mesh, layer_idx: int, onednn: bool = False):
        super().__init__()
        m, seed, sp = cfg.model, cfg.training.seed, cfg.parallel.sequence_parallel
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        self.swiglu = m.activation == "swiglu"
        self.gelu_approximation = "tanh" if m.activation == "gelu" else "none"  # gelu_exact: erf

        def column(name):
            init = normal_init(seed, layer_idx, f"mlp.{name}.weight", std)
            return ColumnParallelLinear(m.hidden_size, m.ffn_hidden_size, mesh, bias=m.add_bias_linear,
                                        sequence_parallel=sp, init=init, onednn=onednn)
        self.gate = column("gate") if self.swiglu else None
        self.fc1 = column("fc1")
        self.fc2 = RowParallelLinear(m.ffn_hidden_size, m.hidden_size, mesh, bias=m.add_bias_linear,
                                     sequence_parallel=sp, onednn=onednn,
                                     init=normal_init(seed, layer_idx, "mlp.fc2.weight", out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            h = F.silu(self.gate(x)) * h
        else:
            h = F.gelu(h, approximate=self.gelu_approximation)
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``.

    Hidden dropout acts on activations every TP rank holds in full, so it draws from the default
    generator (same mask on every TP rank); under sequence parallelism each rank holds a
    different part of the sequence, so it runs under the tracker's fork.

    ``onednn``: the linear layers' fp32 CPU products through oneDNN (``--cpu-matmul``, resolved
    once by the model, :func:`megazero.tensor_parallel.layers.resolve_cpu_matmul`).
    """

    def __init__(self, cfg, mesh, layer_idx: int, tracker, onednn: bool = False):
        super().__init__()
        m = cfg.model
        self.sequence_parallel = cfg.parallel.sequence_parallel
        self.tracker, self.dropout = tracker, m.hidden_dropout
        norm = lambda: Norm(m.hidden_size, m.normalization, m.norm_epsilon, mesh.device,  # noqa: E731
                            cfg.parallel.sequence_parallel)
        self.input_norm = norm()
        self.attention = Attention(cfg, mesh, layer_idx, tracker, m.recompute_granularity == "selective",
                                   onednn)
        self.post_attention_norm = norm()
        self.mlp = MLP(cfg, mesh, layer_idx, onednn)

    def hidden_dropout(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return h
        if self.sequence_parallel:
            with self.tracker.fork():
                return F.dropout(h, self.dropout)
        return F.dropout(h, self.dropout)

    def forward(self, x: torch.Tensor, rope: Rope = None, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        x = x + self.hidden_dropout(self.attention(self.input_norm(x), rope, kv_cache))
        return x + self.hidden_dropout(self.mlp(self.post_attention_norm(x)))
