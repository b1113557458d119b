"""Gated DeltaNet, Qwen3-Next's linear attention, tensor-parallel over heads.

Per token: an in-projection gives queries and keys (``key_heads x key_head_dim`` each), values and
the output gate ``z`` (``value_heads x value_head_dim`` each), and ``b``, ``a`` (one per value head);
a depthwise causal conv1d (no bias) and SiLU act on ``[q, k, v]``; queries and keys are
L2-normalised per head and queries scaled by ``key_head_dim ** -0.5``; ``beta = sigmoid(b)`` and the
log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule
(:mod:`megazero_models.delta_rule`) runs per value head, ``value_heads / key_heads`` value heads
sharing each query/key head; its output is RMS-normalised per head (one ``[value_head_dim]`` scale
for all heads) and gated by ``silu(z)``; a row-parallel out-projection closes.

Layout: the in-projection's output features are grouped by key head,
``[key head][q, k, v (r heads), z (r heads), b (r), a (r)]`` with ``r = value_heads / key_heads``, and
the convolution's channels ``[key head][q, k, v]``, so a contiguous TP slice holds whole key heads
(``key_heads % tp == 0``) with their value heads; ``A_log`` and ``dt_bias`` are split with the value
heads; the shared norm scale is replicated (its gradient summed over TP).  Hidden states are
``[seq, batch, hidden]`` (``[seq / tp, ...]`` under sequence parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init
from megazero.tensor_parallel.recompute import recompute
from .delta_rule import gated_delta_chunked
from .ssm_cp import conv_states, starting_states
from .ssm_common import CausalConv1d, GatedRMSNorm, a_log_init, constant_init, sharded_param


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet mixer's sizes (Megatron-LM's ``--linear-*`` flags; Qwen3-Next's defaults)."""
    hidden_size: int
    num_key_heads: int = 16
    num_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-6
    a_init_range: Tuple[float, float] = (0.01, 16.0)
    init_std: float = 0.02
    out_std: float = 0.02

    @property
    def heads_per_key(self) -> int:
        return self.num_value_heads // self.num_key_heads

    def check(self, tp: int) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"--linear-num-value-heads {self.num_value_heads} must be a multiple of "
                             f"--linear-num-key-heads {self.num_key_heads}")
        if self.num_key_heads % tp:
            raise ValueError(f"--linear-num-key-heads {self.num_key_heads} must be a multiple of "
                             f"--tensor-model-parallel-size {tp} (TP splits whole key heads)")
        if self.chunk_size < 1:
            raise ValueError(f"--linear-chunk-size must be positive, got {self.chunk_size}")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension (the FLA / Qwen3-Next form)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """The mixer of the module docstring on this rank's heads.  ``recompute_core``: keep only the
    in-projection's output for backward and replay the conv, the delta rule and the norm there."""

    def __init__(self, shape: DeltaNetShape, mesh, layer_idx: int, *, seed: int = 0,
                 sequence_parallel: bool = False, onednn: bool = False, prefix: str = "mixer",
                 recompute_core: bool = False):
        super().__init__()
        tp = mesh.size("tp")
        shape.check(tp)
        self.shape, self.mesh, self.recompute_core = shape, mesh, recompute_core
        self.key_heads = shape.num_key_heads // tp
        r, dk, dv = shape.heads_per_key, shape.key_head_dim, shape.value_head_dim
        self.split = [dk, dk, r * dv, r * dv, r, r]  # q, k, v, z, b, a per key head
        self.in_proj = ColumnParallelLinear(
            shape.hidden_size, shape.num_key_heads * sum(self.split), mesh, bias=False,
            sequence_parallel=sequence_parallel, onednn=onednn,
            init=normal_init(seed, layer_idx, f"{prefix}.in_proj.weight", shape.init_std))
        self.conv1d = CausalConv1d(shape.num_key_heads * (2 * dk + r * dv), shape.conv_kernel, mesh,
                                   bias=False, seed=seed, layer_idx=layer_idx, prefix=f"{prefix}.conv1d")
        hv = shape.num_value_heads
        self.A_log = sharded_param(a_log_init(seed, layer_idx, f"{prefix}.A_log", *shape.a_init_range),
                                   (hv,), mesh)
        self.dt_bias = sharded_param(constant_init(1.0), (hv,), mesh)
        self.norm = GatedRMSNorm(hv * dv, dv, shape.norm_eps, mesh, norm_before_gate=True, shared=True)
        self.out_proj = RowParallelLinear(
            hv * dv, shape.hidden_size, mesh, bias=False, sequence_parallel=sequence_parallel, onednn=onednn,
            init=normal_init(seed, layer_idx, f"{prefix}.out_proj.weight", shape.out_std))

    def mix(self, proj: torch.Tensor, state: Optional[dict] = None) -> torch.Tensor:
        """From the in-projection's output ``[b, s, local features]`` to the normalised, gated rule
        output ``[b, s, local value features]``.  ``state`` (generation): ``{"conv": [b, k - 1,
        channels], "recurrent": [b, value heads, dk, dv]}`` of this rank, read and replaced."""
        sh, kh = self.shape, self.key_heads
        b, s, _ = proj.shape
        r, dk, dv = sh.heads_per_key, sh.key_head_dim, sh.value_head_dim
        q, k, v, z, beta, a = proj.view(b, s, kh, sum(self.split)).split(self.split, dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).reshape(b, s, kh * (2 * dk + r * dv))
        conv_in = None if state is None else state.get("conv")
        if state is not None:
            width = sh.conv_kernel - 1
            past = conv_in if conv_in is not None else qkv.new_zeros(b, width, qkv.shape[-1])
            state["conv"] = torch.cat([past, qkv], dim=1)[:, -width:] if width else past
        cp = self.mesh.size("cp") > 1 and state is None
        qkv = F.silu(self._conv_cp(qkv) if cp else self.conv1d(qkv, conv_in)).view(b, s, kh, 2 * dk + r * dv)
        q, k, v = qkv.split([dk, dk, r * dv], dim=-1)
        work = torch.promote_types(proj.dtype, torch.float32)
        q = l2_normalize(q.to(work)).repeat_interleave(r, dim=2) * dk ** -0.5
        k = l2_normalize(k.to(work)).repeat_interleave(r, dim=2)
        v = v.reshape(b, s, kh * r, dv)
        beta = torch.sigmoid(beta.reshape(b, s, kh * r).to(work))
        a = a.reshape(b, s, kh * r).to(work)
        g = -torch.exp(self.A_log.to(work)) * F.softplus(a + self.dt_bias.to(work))
        if cp:
            o = self._rule_cp(q, k, v, g, beta)
        else:
            o, final = gated_delta_chunked(q, k, v, g, beta, sh.chunk_size,
                                           None if state is None else state.get("recurrent"))
        if state is not None:
            state["recurrent"] = final.detach()
        return self.norm(o.to(proj.dtype), z.reshape(b, s, kh * r, dv)).reshape(b, s, kh * r * dv)

    def _conv_cp(self, qkv: torch.Tensor) -> torch.Tensor:
        """The conv over this CP rank's two chunks, each continuing from the chunk before it."""
        width, halves = self.shape.conv_kernel - 1, qkv.chunk(2, dim=1)
        if width > halves[0].shape[1]:
            raise ValueError(f"context parallelism: chunks of {halves[0].shape[1]} tokens are shorter than "
                             f"the conv's {width} past inputs; use a smaller --context-parallel-size")
        starts = conv_states([h[:, h.shape[1] - width:] for h in halves], self.mesh)
        return torch.cat([self.conv1d(h, st) for h, st in zip(halves, starts)], dim=1)

    def _rule_cp(self, q, k, v, g, beta) -> torch.Tensor:
        """The delta rule over this CP rank's two chunks from zero states, plus what each position
        reads of its chunk's true starting state.  Every operation of the rule multiplies the state
        from the left, so a chunk's end state is ``M S_start + S_zero`` and its outputs ``o_zero +
        R S_start``, with ``M [dk, dk]`` and ``R [s, dk]`` the rule run on zero values from the
        identity; the starting states follow from every chunk's ``(M, S_zero)``
        (:func:`megazero_models.ssm_cp.starting_states`)."""
        L, dk = self.shape.chunk_size, q.shape[-1]
        outs, finals, maps, reads = [], [], [], []
        for qh, kh, vh, gh, bh in zip(*(t.chunk(2, dim=1) for t in (q, k, v, g, beta))):
            o, final = gated_delta_chunked(qh, kh, vh, gh, bh, L)
            eye = torch.eye(dk, dtype=final.dtype, device=final.device).expand(*final.shape[:2], dk, dk)
            read, transition = gated_delta_chunked(qh, kh, kh.new_zeros(*kh.shape), gh, bh, L, eye)
            outs.append(o), finals.append(final), maps.append(transition), reads.append(read)
        starts = starting_states(finals, maps, torch.matmul, self.mesh)
        return torch.cat([o + torch.einsum("bshk,bhkv->bshv", read, st)
                          for o, read, st in zip(outs, reads, starts)], dim=1)

    def forward(self, hidden: torch.Tensor, state: Optional[dict] = None) -> torch.Tensor:
        """``hidden [s, b, hidden_size]`` (``[s / tp, ...]`` under sequence parallelism) -> the same shape."""
        proj = self.in_proj(hidden).transpose(0, 1)
        if self.recompute_core and state is None and torch.is_grad_enabled():  # keeps proj only
            return self.out_proj(recompute(self.mix, proj).transpose(0, 1))
        return self.out_proj(self.mix(proj, state).transpose(0, 1))
