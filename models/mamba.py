"""The Mamba-2 mixer: in-projection, depthwise causal conv1d, the SSD chunked scan, gated RMSNorm and
out-projection, tensor-parallel over heads and groups (as Megatron-core's Mamba mixer splits them).

Shapes: ``d_inner = heads * head_dim``; ``r = heads / groups`` heads read each group's ``B, C``
(``state_dim`` each).  The in-projection's output features are laid out by group,
``[group][z (r * head_dim), x (r * head_dim), B (state), C (state), dt (r)]``, and the convolution's
channels likewise, ``[group][x, B, C]``, so a contiguous TP slice holds whole groups (``groups % tp
== 0``) and TP shards concatenate to the TP = 1 weights.  ``A_log``, ``D`` and ``dt_bias`` are per
head, the norm's scale per channel (normalised per group of ``d_inner / groups`` channels, so a rank's
groups are normalised locally), all split with the heads.  The out-projection is row-parallel.

Hidden states are ``[seq, batch, hidden]`` (``[seq / tp, batch, hidden]`` under sequence parallelism,
gathered by the column-parallel in-projection and reduce-scattered by the row-parallel
out-projection).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init
from megazero.tensor_parallel.recompute import recompute
from .ssd import ssd_chunked
from .ssm_cp import conv_states, starting_states
from .ssm_common import CausalConv1d, GatedRMSNorm, a_log_init, constant_init, dt_bias_init, sharded_param


@dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 mixer's sizes and initialisation (Megatron-LM's defaults)."""
    hidden_size: int
    num_heads: int
    head_dim: int = 64
    state_dim: int = 128
    num_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    norm_eps: float = 1e-5
    conv_bias: bool = True
    bias: bool = False  # in- and out-projection biases
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_floor: float = 1e-4
    a_init_range: Tuple[float, float] = (1.0, 16.0)
    init_std: float = 0.02
    out_std: float = 0.02

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    def check(self, tp: int) -> None:
        """One-line errors naming the flag for sizes that cannot work."""
        if self.num_heads % self.num_groups:
            raise ValueError(f"--mamba-num-heads {self.num_heads} must be a multiple of --mamba-num-groups "
                             f"{self.num_groups}")
        if self.num_groups % tp:
            raise ValueError(f"--mamba-num-groups {self.num_groups} must be a multiple of "
                             f"--tensor-model-parallel-size {tp} (TP splits whole groups)")
        if self.chunk_size < 1:
            raise ValueError(f"--mamba-chunk-size must be positive, got {self.chunk_size}")


class MambaMixer(nn.Module):
    """A Mamba-2 mixer on this rank's heads and groups (the module docstring).  ``recompute_core``:
    keep only the in-projection's output for backward and replay the conv, scan and norm there."""

    def __init__(self, shape: MambaShape, mesh, layer_idx: int, *, seed: int = 0,
                 sequence_parallel: bool = False, onednn: bool = False, prefix: str = "mixer",
                 recompute_core: bool = False):
        super().__init__()
        tp = mesh.size("tp")
        shape.check(tp)
        self.shape, self.mesh, self.recompute_core = shape, mesh, recompute_core
        self.groups = shape.num_groups // tp
        self.heads = shape.num_heads // tp
        r, p, n = shape.heads_per_group, shape.head_dim, shape.state_dim
        self.split = [r * p, r * p + 2 * n, r]  # z, xBC, dt per group
        in_features = shape.num_groups * sum(self.split)
        self.in_proj = ColumnParallelLinear(
            shape.hidden_size, in_features, mesh, bias=shape.bias, sequence_parallel=sequence_parallel,
            onednn=onednn, init=normal_init(seed, layer_idx, f"{prefix}.in_proj.weight", shape.init_std))
        self.conv1d = CausalConv1d(shape.num_groups * (r * p + 2 * n), shape.conv_kernel, mesh,
                                   bias=shape.conv_bias, seed=seed, layer_idx=layer_idx,
                                   prefix=f"{prefix}.conv1d")
        h = shape.num_heads
        self.A_log = sharded_param(a_log_init(seed, layer_idx, f"{prefix}.A_log", *shape.a_init_range),
                                   (h,), mesh)
        self.D = sharded_param(constant_init(1.0), (h,), mesh)
        self.dt_bias = sharded_param(dt_bias_init(seed, layer_idx, f"{prefix}.dt_bias", shape.dt_min,
                                                  shape.dt_max, shape.dt_floor), (h,), mesh)
        self.norm = GatedRMSNorm(shape.d_inner, r * p, shape.norm_eps, mesh, norm_before_gate=False)
        self.out_proj = RowParallelLinear(
            shape.d_inner, shape.hidden_size, mesh, bias=shape.bias, sequence_parallel=sequence_parallel,
            onednn=onednn, init=normal_init(seed, layer_idx, f"{prefix}.out_proj.weight", shape.out_std))

    def mix(self, proj: torch.Tensor, state: Optional[dict] = None) -> torch.Tensor:
        """From the in-projection's output ``[b, s, local features]`` to the gated, normalised scan
        output ``[b, s, local d_inner]``.  ``state`` (generation): ``{"conv": [b, k - 1, channels],
        "ssm": [b, heads, head_dim, state_dim]}`` of this rank, read and replaced."""
        sh, g = self.shape, self.groups
        b, s, _ = proj.shape
        r, p, n = sh.heads_per_group, sh.head_dim, sh.state_dim
        z, xbc, dt = proj.view(b, s, g, sum(self.split)).split(self.split, dim=-1)
        xbc = xbc.reshape(b, s, g * (r * p + 2 * n))
        conv_in = None if state is None else state.get("conv")
        if state is not None:
            k = sh.conv_kernel - 1
            past = conv_in if conv_in is not None else xbc.new_zeros(b, k, xbc.shape[-1])
            state["conv"] = torch.cat([past, xbc], dim=1)[:, -k:] if k else past
        cp = self.mesh.size("cp") > 1 and state is None
        xbc = F.silu(self._conv_cp(xbc) if cp else self.conv1d(xbc, conv_in)).view(b, s, g, r * p + 2 * n)
        x, B, C = xbc.split([r * p, n, n], dim=-1)
        x = x.reshape(b, s, g * r, p)
        work = torch.promote_types(proj.dtype, torch.float32)  # the scan runs in fp32 at least
        dt = F.softplus(dt.reshape(b, s, g * r).to(work) + self.dt_bias.to(work))
        A = -torch.exp(self.A_log.to(work))
        if cp:
            y = self._scan_cp(x, dt, A, B, C)
        else:
            y, final = ssd_chunked(x, dt, A, B, C, sh.chunk_size, None if state is None else state.get("ssm"))
        if state is not None:
            state["ssm"] = final.detach()
        y = y + x.to(y.dtype) * self.D.to(y.dtype)[:, None]
        return self.norm(y.reshape(b, s, g * r * p).to(proj.dtype), z.reshape(b, s, g * r * p))

    def _conv_cp(self, xbc: torch.Tensor) -> torch.Tensor:
        """The conv over this CP rank's two chunks, each continuing from the chunk before it
        (:func:`megazero_models.ssm_cp.conv_states`)."""
        k, halves = self.shape.conv_kernel - 1, xbc.chunk(2, dim=1)
        if k > halves[0].shape[1]:
            raise ValueError(f"context parallelism: chunks of {halves[0].shape[1]} tokens are shorter than "
                             f"the Mamba conv's {k} past inputs; use a smaller --context-parallel-size")
        starts = conv_states([h[:, h.shape[1] - k:] for h in halves], self.mesh)
        return torch.cat([self.conv1d(h, st) for h, st in zip(halves, starts)], dim=1)

    def _scan_cp(self, x, dt, A, B, C) -> torch.Tensor:
        """The scan over this CP rank's two chunks from zero states, then what each reads of the
        state the chunks before it leave (:func:`megazero_models.ssm_cp.starting_states`; Mamba-2's
        transition is the chunk's total decay per head)."""
        parts = [t.chunk(2, dim=1) for t in (x, dt, B, C)]
        runs = [ssd_chunked(xh, dth, A, Bh, Ch, self.shape.chunk_size)
                for xh, dth, Bh, Ch in zip(*parts)]
        decays = [(dth * A).sum(1) for dth in parts[1]]  # [b, heads]
        starts = starting_states([f for _, f in runs], decays,
                                 lambda d, st: torch.exp(d)[..., None, None] * st, self.mesh)
        r = self.shape.heads_per_group
        ys = []
        for (y, _), dth, Ch, st in zip(runs, parts[1], parts[3], starts):
            seen = torch.exp((dth * A).cumsum(1))  # [b, s, heads]: the start state's decay to each token
            read = torch.einsum("bshn,bhpn->bshp", Ch.to(y.dtype).repeat_interleave(r, dim=2), st)
            ys.append(y + seen[..., None] * read)
        return torch.cat(ys, dim=1)

    def forward(self, hidden: torch.Tensor, state: Optional[dict] = None) -> torch.Tensor:
        """``hidden [s, b, hidden_size]`` (``[s / tp, ...]`` under sequence parallelism) -> the same shape."""
        proj = self.in_proj(hidden).transpose(0, 1)
        if self.recompute_core and state is None and torch.is_grad_enabled():  # keeps proj only
            return self.out_proj(recompute(self.mix, proj).transpose(0, 1))
        return self.out_proj(self.mix(proj, state).transpose(0, 1))
