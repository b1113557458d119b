"""What the recurrent mixers save for backward: a Mamba-2 layer (``M``, :mod:`megazero_models.mamba` with
:mod:`megazero_models.ssd`) and a Gated DeltaNet layer (``G``, :mod:`megazero_models.deltanet` with
:mod:`megazero_models.delta_rule`), per micro-batch on one rank, in the notation of
:class:`megazero.planning.activations.Dims` and :class:`megazero.planning.activations.SSMDims`
(``H`` this rank's heads, ``g`` its groups (Mamba-2) or key heads (Gated DeltaNet), ``ch`` its conv
channels, ``F`` its in-projection features, ``c = ceil(s / L)`` chunks of ``L`` positions and
``S = c L`` the padded length).  ``tests/test_memory_hybrid.py`` measures what autograd keeps and
holds these figures to it, byte for byte.

Both mixers keep the in-projection's input ``E T h`` (the gathered copy under sequence parallelism),
the conv's zero-padded input ``E b ch (s + k - 1)``, the SiLU's input ``E T ch`` and the
out-projection's input ``E T d`` (``d``: this rank's inner channels).  The scan and the rule run in
fp32 (4 bytes whatever the compute dtype) on the padded length, and their chunked form keeps
``[L, L]`` matrices per chunk and head (decays, scores, the solved system) and per-chunk states:
terms in ``b H c L^2`` and ``b H c p n`` next to the ones linear in ``S``.  The gated norm keeps
fp32 copies (a half-precision input is widened first).

Where a reshape is a view rather than a copy (one group or key head on the rank: TP = groups, or one
head per group), the tensor a later op saves is the storage it views: the in-projection's output (the
gate ``z``) or the SiLU's output (Mamba-2's ``x``); and where a product's operand already has the
layout it needs (one chunk, one sequence, one group) it is not copied.  The figures follow the cases
measured; not held exactly (measured): Mamba-2 under context parallelism at micro-batch 1 (a few
``4 b H`` scalars a layer; 1.4 % over when each half is a single chunk), and a Gated DeltaNet layer
recomputed alone (``--recompute-method block``), whose replay's peak is one or two ``4 b H`` scalars
higher.

Context parallelism (each rank holds two halves of its share, :mod:`megazero_models.ssm_cp`): the conv
and the scan or rule run per half, and the chunk states chain across the ``2 cp`` chunks
(:func:`_mamba_cp`, :func:`_deltanet_cp`); the CP ranks keep different amounts, and the figure is
the largest.

Selective recomputation (``recompute_core``): the mixer keeps its in-projection's input and output
``E T F`` and the out-projection's input; the conv, scan and norm replay in backward and hold what
:func:`replay_bytes` says while the replay's backward runs.
"""
from __future__ import annotations

from megazero.offload.element_bytes import FP32


def _chunks(D, s=None) -> tuple:
    L = D.ssm.chunk
    c = -(-(D.s if s is None else s) // L)
    return L, c, c * L


def _mamba_scan(D, s: int) -> int:
    """:func:`megazero_models.ssd.ssd_chunked` over ``s`` positions: B and C laid out for its three
    products, the segment sums' masks and decays, C.B per group, the intra-chunk weights, x dt and its
    decayed copy, the chunk states."""
    M, b = D.ssm, D.b
    H, p, n, g = M.heads, M.head_dim, M.state, M.groups
    L, c, S = _chunks(D, s)
    # B and C's copies for the products: two fewer in one chunk (without CP), or with one group on the
    # rank when the batch is one sequence or under context parallelism (B and C halves; measured)
    operands = 2 if (g == 1 and (b == 1 or D.cp > 1)) or (c == 1 and D.cp == 1) else 4
    scan = operands * FP32 * b * S * g * n + 2 * L * L + 2 * (c + 1) ** 2
    scan += FP32 * b * c * L * L * (2 * H + g) + FP32 * b * H * (c + 1) ** 2
    xdt = 3 if (c == 1 and (b == 1 or g == 1 or H == g)) else 4  # x dt: one copy fewer then (measured)
    scan += xdt * FP32 * b * S * H * p + 2 * FP32 * b * H * S
    # the states at the chunk boundaries (c + 1) and the starts laid out for their read-out (c); with one
    # chunk and one head per group the read-out takes the boundary states as they are (all c + 1 kept)
    starts = c + 1 if (c == 1 and H == g) else c
    return scan + FP32 * b * H * p * n * (c + 1 + starts)


def _mamba_cp(D) -> int:
    """Context parallelism (``MambaMixer._scan_cp``): the scan over this rank's two halves from zero
    states, the chain of ``2 cp`` chunk states every rank runs (each step keeps its decay ``4 b H`` and
    the state it decays ``4 b H p n``: every rank keeps the ``2 cp`` decays, rank ``r`` the ``2 cp - r``
    states up to its second half's start (measured), and what each half reads of its start: the decay to each
    position, the read-out and ``C`` repeated to the heads (not where the start is the zero state:
    rank 0's first half).  The figure is the largest over the CP ranks."""
    M, b, cp = D.ssm, D.b, D.cp
    H, p, n = M.heads, M.head_dim, M.state
    half = D.s // 2
    scans = 2 * _mamba_scan(D, half)
    read = 2 * FP32 * b * half * H * (1 + p)
    C = FP32 * b * H * half * n

    def rank(r):
        return 2 * cp * FP32 * b * H + (2 * cp - r) * FP32 * b * H * p * n + (1 if r == 0 else 2) * C
    return scans + read + max(rank(0), rank(1))


def _common(D) -> dict:
    """In- and out-projection inputs, the conv's padded input and the SiLU's input."""
    M, E = D.ssm, D.E
    return {"in_proj_input": E * D.T * D.h, "conv_input": E * D.b * M.ch * (D.s + M.kernel - 1),
            "silu_input": E * D.T * M.ch, "out_proj_input": E * D.T * M.d}


def mamba_parts(D) -> dict:
    """A Mamba-2 mixer's kept bytes by part (no recomputation); ``H`` heads of ``p`` channels, ``g``
    groups of ``B, C`` with ``n`` states."""
    M, T, b = D.ssm, D.T, D.b
    H, g = M.heads, M.groups
    parts = _common(D)
    parts["dt_A"] = 2 * FP32 * T * H + 2 * FP32 * H  # softplus input and output, exp(A_log), A
    x_view = (g == 1 or H == g) and not D.half  # x reshapes as a view of the SiLU's output
    parts["x_fp32"] = D.E * T * M.ch if x_view else FP32 * T * M.d
    parts["scan"] = _mamba_cp(D) if D.cp > 1 else _mamba_scan(D, D.s)
    if D.cp > 1:  # the conv runs on each half from the tail of the chunk before it
        parts["conv_input"] = D.E * b * M.ch * (D.s + 2 * (M.kernel - 1))
    # the D skip, the gated norm (fp32): its input, the gate's input and SiLU, the gated product, the
    # rsqrt per group, the normalised product; in half precision fp32 copies of x, D and the scale
    gate_input = D.E * T * M.F if _z_views_proj(D) else FP32 * T * M.d
    parts["norm"] = 4 * FP32 * T * M.d + gate_input + FP32 * T * g
    if D.half:
        parts["norm"] += FP32 * T * M.d + FP32 * H + FP32 * M.d
    return parts


def deltanet_parts(D) -> dict:
    """A Gated DeltaNet mixer's kept bytes by part (no recomputation); ``g`` key heads of ``dk``
    channels (``n``), ``H`` value heads of ``dv`` channels (``p``)."""
    M, T, b = D.ssm, D.T, D.b
    H, dv, dk, g = M.heads, M.head_dim, M.state, M.groups
    S = _chunks(D)[2]
    parts = _common(D)
    # q and k's L2 norms: their inputs (the SiLU's output, or fp32 copies of q and k) and rsqrt
    qk = FP32 * 2 * T * g * dk if D.half else D.E * T * M.ch
    parts["qk_norm"] = qk + 2 * FP32 * T * g
    parts["gates"] = 3 * FP32 * T * H + 2 * FP32 * H  # sigmoid, softplus input and output, exp, -exp
    parts["rule"] = _deltanet_cp(D) if D.cp > 1 else _delta_rule(D, D.s, dv)
    if D.cp > 1:  # the conv runs on each half from the tail of the chunk before it
        parts["conv_input"] = D.E * b * M.ch * (D.s + 2 * (M.kernel - 1))
    # the norm (fp32): the gate's input and SiLU, its input (padded o, or a copy), rsqrt, products
    gate_input = D.E * T * M.F if _z_views_proj(D) else FP32 * T * M.d
    o_in = FP32 * T * M.d + FP32 * dv if D.half else FP32 * b * H * (S if D.cp == 1 else D.s) * dv
    parts["norm"] = gate_input + o_in + FP32 * T * H + 3 * FP32 * T * M.d
    return parts


def _delta_rule(D, s: int, dv: int) -> int:
    """:func:`megazero_models.delta_rule.gated_delta_chunked` over ``s`` positions with values of ``dv``
    channels from a zero state: the masks, decays, ``k k^T`` and ``q k^T`` laid out for their products,
    the system and its solution, padded q, k, v, beta, the exp(G)s; each chunk's state, u and decay."""
    M, b = D.ssm, D.b
    H, dk = M.heads, M.state
    L, c, S = _chunks(D, s)
    rule = 2 * L * L + FP32 * b * H * c * L * L * 6
    # q and k's copies for k k^T and q k^T: one chunk of one sequence needs none (measured)
    dk_terms = 3 if (c == 1 and b == 1) else 7
    rule += FP32 * b * H * S * (dk_terms * dk + dv + 5) + FP32 * b * H * S * (dv + dk)
    rule += c * FP32 * b * H * (dk * dv + L * dv + 1)
    if c > 1:
        rule += FP32 * b * H * S * dk  # q exp(G), kept once a chunk's state needs a gradient
    return rule


def _deltanet_cp(D) -> int:
    """Context parallelism (``GatedDeltaNet._rule_cp``): per half the rule from a zero state and the
    rule on zero values from the identity (values of ``dk`` channels; its first state the ``[dk, dk]``
    identity), the gathered ``[dk, dk]`` transitions of the ``2 cp`` chunks, the chain's states (rank
    ``r`` the ``2 cp - r`` up to its second half's start) and each half's read-out of its start (not
    rank 0's first half, whose start is zero).  The largest CP rank's figure."""
    M, b, cp = D.ssm, D.b, D.cp
    H, dv, dk = M.heads, M.head_dim, M.state
    half = D.s // 2
    _, _, S = _chunks(D, half)
    identity_run = _delta_rule(D, half, dk) - FP32 * b * H * dk * dk + FP32 * dk * dk
    runs = 2 * _delta_rule(D, half, dv) + 2 * identity_run
    trans = FP32 * 2 * cp * b * H * dk * dk
    read = FP32 * b * H * S * dk

    def rank(r):
        return (2 * cp - r) * FP32 * b * H * dk * dv + (1 if r == 0 else 2) * read
    return runs + trans + max(rank(0), rank(1))


def mixer_parts(D) -> dict:
    return mamba_parts(D) if D.ssm.kind == "M" else deltanet_parts(D)


def mixer_bytes(D) -> int:
    return sum(mixer_parts(D).values())


def selective_kept(D) -> int:
    """Under selective recomputation: the in-projection's input and output and the out-projection's input."""
    c = _common(D)
    return c["in_proj_input"] + D.E * D.T * D.ssm.F + c["out_proj_input"]


def replay_bytes(D) -> int:
    """What the replayed conv, scan and norm save in backward beyond the kept in-projection output
    (the out-projection's input is the forward's)."""
    parts = mixer_parts(D)
    replay = sum(parts.values()) - parts["in_proj_input"] - parts["out_proj_input"]
    return replay - (D.E * D.T * D.ssm.F if _z_views_proj(D) else 0)  # the gate's view of the kept output


def _z_views_proj(D) -> bool:
    """Whether the gate ``z`` reaches the norm's fp32 SiLU as a view of the in-projection's output
    (its reshape needs no copy, and fp32 needs no cast): one group or key head on the rank, or for
    Gated DeltaNet one value head per key head."""
    M = D.ssm
    return (M.groups == 1 or (M.kind == "G" and M.heads == M.groups)) and not D.half
