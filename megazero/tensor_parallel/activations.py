"""The MLP activations, shared by the dense MLP and the experts (elementwise: any TP split of the hidden
features computes them alike).

Plain: ``gelu_exact`` (erf), ``gelu`` (tanh approximation), ``squared_relu`` (``relu(x)^2``: Nemotron-H,
Megatron-LM's ``--squared-relu``).  Gated, ``act(gate) * linear``: ``swiglu``
(SiLU), ``geglu`` (tanh GELU), ``quick_geglu`` (``x sigmoid(1.702 x)``, Megatron-LM's ``--quick-geglu``).
gpt-oss's clamped SwiGLU is ``quick_geglu`` with ``--activation-func-clamp-value 7`` (the gate clamped
to at most 7, the linear part to [-7, 7]) and ``--glu-linear-offset 1`` (``linear + 1``), as
Megatron-core's GLU computes it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

QUICK_GELU_ALPHA = 1.702


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


class Activation:
    """``m``'s activation (a ModelConfig's ``activation``, ``glu_linear_offset`` and
    ``activation_func_clamp_value``): ``act(h)``, or gated ``act(h, gate)``."""

    def __init__(self, m):
        kind = m.activation
        self.kind = kind
        self.offset = getattr(m, "glu_linear_offset", 0.0) or 0.0
        self.clamp = getattr(m, "activation_func_clamp_value", None)
        self.approximate = "none" if kind == "gelu_exact" else "tanh"

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(x)
        if self.kind == "quick_geglu":
            return quick_gelu(x)
        if self.kind == "squared_relu":
            return F.relu(x).square()
        return F.gelu(x, approximate=self.approximate)

    def __call__(self, h: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate is None:
            return self.act(h)
        if self.clamp is not None:
            gate, h = gate.clamp(max=self.clamp), h.clamp(-self.clamp, self.clamp)
        if self.offset:
            h = h + self.offset
        return self.act(gate) * h
