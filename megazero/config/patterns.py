"""Per-layer attention settings: which layers attend within a sliding window, and which skip RoPE.

Megatron-LM's flags ``--window-size``, ``--window-attn-skip-freq`` and ``--no-rope-freq`` read as
Megatron-core reads them; pure functions of a ModelConfig (no torch), shared by the model and the
memory/FLOP estimates.

- ``--window-size L,R`` (flash-attention's ``window_size``): query ``i`` sees keys ``i - L .. i + R``;
  megazero's attention is causal, so ``R`` is 0 (and ``L = -1`` means no limit).  A Hugging Face
  ``sliding_window`` ``W`` (``W`` keys, the query's own included) is ``L = W - 1``.
- ``--window-attn-skip-freq``: ``N`` (every ``N``-th layer, counting from 1, attends to everything,
  the others within the window: Gemma 2 is ``N = 2``) or a per-layer list (``1``: windowed, ``0``:
  full), written as a list expression such as ``"[1,1,1,0]*3"``.
- ``--no-rope-freq``: ``N`` (every ``N``-th layer skips RoPE: SmolLM3 is ``N = 4``) or a per-layer
  list (``1``: no RoPE).
"""
from __future__ import annotations

import ast
from typing import List, Optional, Sequence, Union

Pattern = Union[int, List[int], None]
ROPE_TYPES = ("rope", "yarn")  # position embedding types that rotate queries and keys
GATED = ("swiglu", "geglu", "quick_geglu")  # gated MLP activations: a third weight, the gate


def uses_rope(m) -> bool:
    """Whether a ModelConfig rotates queries and keys (RoPE or YaRN)."""
    return m.position_embedding_type in ROPE_TYPES


def _list_expression(node) -> List[int]:
    """A list of ints from ``[..]``, ``+`` and ``* int`` only (no names, no calls)."""
    if isinstance(node, ast.List):
        values = []
        for elt in node.elts:
            if not (isinstance(elt, ast.Constant) and type(elt.value) is int):
                raise ValueError("list elements must be integers")
            values.append(elt.value)
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for lst, num in ((node.left, node.right), (node.right, node.left)):
            if isinstance(num, ast.Constant) and type(num.value) is int and num.value >= 0:
                return _list_expression(lst) * num.value
    raise ValueError("expected an integer or a list expression such as [1,1,0]*4 or ([0]*3+[1])*2")


def parse_pattern(text) -> Pattern:
    """``"4"`` -> 4; ``"[1,1,1,0]*2"`` -> ``[1, 1, 1, 0, 1, 1, 1, 0]``; ints and lists pass through."""
    if text is None or isinstance(text, (int, list)):
        return text
    text = str(text).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return _list_expression(ast.parse(text, mode="eval").body)
    except SyntaxError:
        raise ValueError(f"{text!r}: expected an integer or a list expression such as [1,1,0]*4") from None


def parse_pattern_arg(text) -> Pattern:
    """argparse type of the pattern flags (argparse turns the ValueError into a usage error)."""
    return parse_pattern(text)


parse_pattern_arg.__name__ = "pattern"


def parse_window(text) -> Optional[List[int]]:
    """``"4095,0"`` or ``"(4095, 0)"`` -> ``[4095, 0]`` (Megatron-LM's tuple); lists pass through."""
    if text is None or isinstance(text, list):
        return text
    if isinstance(text, tuple):
        return list(text)
    parts = [p.strip() for p in str(text).strip().strip("()[]").split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{text!r}: expected two integers LEFT,RIGHT such as 4095,0") from None
    if len(values) != 2:
        raise ValueError(f"{text!r}: expected two integers LEFT,RIGHT such as 4095,0")
    return values


parse_window.__name__ = "window"


def layer_flags(pattern: Pattern, num_layers: int) -> List[bool]:
    """Per-layer booleans of a pattern: ``N`` marks layers ``N, 2N, ...`` (1-based), a list is
    taken as is.  ValueError when a list's length is not ``num_layers``."""
    if isinstance(pattern, int):
        if pattern < 1:
            raise ValueError(f"must be a positive integer, got {pattern}")
        return [(i + 1) % pattern == 0 for i in range(num_layers)]
    if len(pattern) != num_layers:
        raise ValueError(f"lists {len(pattern)} layers for --num-layers {num_layers}")
    if any(v not in (0, 1) for v in pattern):
        raise ValueError(f"list entries must be 0 or 1, got {pattern}")
    return [bool(v) for v in pattern]


def windowed_layers(m) -> List[bool]:
    """Which layers (0-based) attend within ``--window-size`` (Megatron-core's rule)."""
    left = m.window_size[0] if m.window_size else -1
    if left < 0:
        return [False] * m.num_layers
    if m.window_attn_skip_freq is None:
        return [True] * m.num_layers
    if isinstance(m.window_attn_skip_freq, int):  # every N-th layer is global
        return [not f for f in layer_flags(m.window_attn_skip_freq, m.num_layers)]
    return layer_flags(m.window_attn_skip_freq, m.num_layers)


def layer_window(m, layer: int) -> Optional[int]:
    """Keys before its own that a query of ``layer`` sees (``L`` of ``--window-size``), or None."""
    return m.window_size[0] if windowed_layers(m)[layer] else None


def layer_uses_rope(m, layer: int) -> bool:
    """Whether ``layer`` rotates queries and keys (RoPE/YaRN, not a ``--no-rope-freq`` layer)."""
    if not uses_rope(m):
        return False
    return m.no_rope_freq is None or not layer_flags(m.no_rope_freq, m.num_layers)[layer]


def active_window(window: Optional[int], seq: int) -> Optional[int]:
    """``window`` when it hides keys from some query of a ``seq``-token sequence, else None."""
    return window if window is not None and window + 1 < seq else None


def pattern_text(flags: Sequence[bool]) -> List[int]:
    """A per-layer list pattern (1/0) of booleans."""
    return [int(bool(f)) for f in flags]
