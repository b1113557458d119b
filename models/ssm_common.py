"""Pieces shared by the recurrent mixers (:mod:`megazero_models.mamba`, :mod:`megazero_models.deltanet`).

- seeded initialisers in the style of :func:`megazero.tensor_parallel.layers.init_full`: every
  tensor is computed full on the CPU from ``(seed, global layer index, name)`` and this TP rank keeps
  its slice, so TP shards concatenate exactly to the TP = 1 tensor;
- :func:`causal_conv1d`: the depthwise causal convolution over the sequence (the short conv);
- :func:`gated_rms_norm`: RMSNorm over groups of channels with a SiLU gate, before or after the norm.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import mark_tensor_parallel, shard, shard_shape

Init = Callable[[Sequence[int]], torch.Tensor]


def generator(seed: int, layer_idx: int, name: str) -> torch.Generator:
    """A CPU generator seeded by a CRC32 of ``(seed, layer, name)`` (the key ``init_full`` uses)."""
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}/{layer_idx}/{name}".encode()))


def uniform_init(seed: int, layer_idx: int, name: str, low: float, high: float) -> Init:
    """Full fp32 tensors ~ U(low, high), the same for the same key in every process."""
    def make(shape):
        return torch.empty(tuple(shape)).uniform_(low, high, generator=generator(seed, layer_idx, name))
    return make


def a_log_init(seed: int, layer_idx: int, name: str, low: float, high: float) -> Init:
    """``log(A)`` with ``A ~ U(low, high)`` per head (the decay rates, stored as logs)."""
    draw = uniform_init(seed, layer_idx, name, low, high)
    return lambda shape: torch.log(draw(shape))


def dt_bias_init(seed: int, layer_idx: int, name: str, dt_min: float, dt_max: float, floor: float) -> Init:
    """Mamba's time-step bias: ``softplus^-1(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]``
    (at least ``floor``), so that ``softplus(dt_bias)`` starts in that range."""
    draw = uniform_init(seed, layer_idx, name, math.log(dt_min), math.log(dt_max))

    def make(shape):
        dt = torch.exp(draw(shape)).clamp(min=floor)
        return dt + torch.log(-torch.expm1(-dt))
    return make


def constant_init(value: float) -> Init:
    return lambda shape: torch.full(tuple(shape), float(value))


def sharded_param(init: Init, shape: Sequence[int], mesh, dim: Optional[int] = 0) -> nn.Parameter:
    """This TP rank's slice along ``dim`` of ``init(shape)`` (tagged ``tensor_model_parallel``), or
    the whole tensor, replicated over TP and tagged ``sequence_parallel`` (its gradient is a partial
    sum on each TP rank, summed over TP like the norms'), when ``dim`` is None.  Deferred when built
    on the meta device (:func:`megazero.tensor_parallel.deferred.new_param`)."""
    if dim is None:
        p = new_param(tuple(shape), lambda: init(shape), mesh.device)
        p.sequence_parallel = True
        return p
    local = shard_shape(shape, mesh, dim)
    return mark_tensor_parallel(new_param(local, lambda: shard(init(shape), mesh, dim), mesh.device), dim)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution along the sequence: ``x [b, s, ch]``, ``weight [ch, k]``:
    ``y[t] = bias + sum_j weight[:, j] * x[t - (k - 1) + j]`` (zeros before the start, or the ``k - 1``
    positions of ``state [b, k - 1, ch]`` when given)."""
    k = weight.shape[1]
    xt = x.transpose(1, 2)
    if state is not None:
        xt = torch.cat([state.transpose(1, 2).to(x.dtype), xt], dim=2)
    else:
        xt = F.pad(xt, (k - 1, 0))
    y = F.conv1d(xt, weight.unsqueeze(1).to(x.dtype), None if bias is None else bias.to(x.dtype),
                 groups=weight.shape[0])
    return y.transpose(1, 2)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   norm_before_gate: bool) -> torch.Tensor:
    """``x [..., ch]`` normalised by the RMS of each group of ``group_size`` consecutive channels,
    scaled by ``weight`` (``[ch]``, or ``[group_size]`` shared by the groups) and gated by
    ``silu(gate)``: after the norm (``norm_before_gate``, Qwen3-Next) or before it (Mamba-2).
    Computed in fp32 (or float64) whatever the input dtype."""
    dtype = x.dtype
    work = torch.promote_types(dtype, torch.float32)
    xf, gf = x.to(work), F.silu(gate.to(work))
    if not norm_before_gate:
        xf = xf * gf
    shape = xf.shape
    grouped = xf.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    if weight.shape[0] == group_size:
        y = grouped * weight.to(work)
    else:
        y = grouped * weight.to(work).view(shape[-1] // group_size, group_size)
    y = y.reshape(shape)
    if norm_before_gate:
        y = y * gf
    return y.to(dtype)


class CausalConv1d(nn.Module):
    """The depthwise causal convolution as a module: ``weight [channels / tp, 1, kernel]`` and
    ``bias [channels / tp]`` (nn.Conv1d's shapes), this TP rank's channels."""

    def __init__(self, channels: int, kernel: int, mesh, *, bias: bool, seed: int, layer_idx: int,
                 prefix: str):
        super().__init__()
        bound = 1.0 / math.sqrt(kernel)  # nn.Conv1d's default for a depthwise kernel (fan-in = kernel)
        self.weight = sharded_param(uniform_init(seed, layer_idx, f"{prefix}.weight", -bound, bound),
                                    (channels, 1, kernel), mesh, 0)
        self.bias = (sharded_param(uniform_init(seed, layer_idx, f"{prefix}.bias", -bound, bound),
                                   (channels,), mesh, 0) if bias else None)

    def forward(self, x: torch.Tensor, state: Optional[torch.Tensor] = None) -> torch.Tensor:
        return causal_conv1d(x, self.weight.squeeze(1), self.bias, state)


class GatedRMSNorm(nn.Module):
    """:func:`gated_rms_norm` with its scale: ``[channels / tp]`` split over TP with the channels, or,
    ``shared`` (one ``[group_size]`` scale for every group, Qwen3-Next's), replicated over TP."""

    def __init__(self, channels: int, group_size: int, eps: float, mesh, *, norm_before_gate: bool,
                 shared: bool = False):
        super().__init__()
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        self.weight = sharded_param(constant_init(1.0), (group_size if shared else channels,), mesh,
                                    None if shared else 0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps, self.norm_before_gate)
