"""Memory-efficient attention on one rank: blockwise online softmax that also returns the log-sum-exp.

Layout: ``q [batch, heads, sq, dim]``, ``k, v [batch, groups, sk, dim]`` with ``heads % groups == 0``
(grouped-query attention: query head ``h`` reads key/value head ``h // (heads // groups)``, as
``repeat_interleave`` would pair them). The ``n = heads // groups`` query heads of a group are folded
into the row dimension of one matrix product, so K and V are never expanded to ``heads`` heads.

The causal mask is given by *global positions*: query ``i`` sees key ``j`` when
``k_pos[j] <= q_pos[i]`` and, with a sliding ``window``, ``q_pos[i] - k_pos[j] <= window``. Any two
token sets can therefore be combined (a chunk with itself, an early chunk's keys for a late chunk's
queries, or the reverse, which is fully masked), whatever their lengths. Queries and keys are cut
into tiles of at most ``block_size`` tokens, also cut where the positions jump (so a tile never
straddles two chunks of the load-balanced split); a tile pair is

- skipped when every key is after every query, or (window) too far before every query,
- computed without a mask when every query sees every key,
- masked elementwise otherwise (the diagonal, the window's edge).

Packed documents (``--reset-attention-mask``): with document ids ``[b, tokens]`` for the queries and
the keys, a query also sees only keys of its own document.  They are compared on the device, tile
by tile.  Where the ids live on the host (a CPU run: reading them syncs nothing) a tile pair is also
skipped when, in every row, the keys' documents all end before the queries' first document, and
computed without the document comparison when queries and keys all lie in one document (ids never
decrease along a tile, so its first and last tokens bound its documents).  On an accelerator the
pairs are decided by positions alone, as reading the ids would stall the device.

A ``softcap`` replaces each scaled score ``s`` by ``cap tanh(s / cap)`` (Gemma 2) before the softmax;
backward multiplies the score gradient by ``1 - tanh^2``, recomputed from the capped score.

Chunked attention (Llama 4's ``attention_chunk_size`` ``C``): a query also sees only keys of its own
chunk of positions, ``k_pos // C == q_pos // C``; tile pairs in different chunks are skipped.

Attention sinks (gpt-oss; Megatron-LM's ``--softmax-type learnable``): a logit ``sink_h`` per head
joins each softmax denominator without a value, ``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^sink)``.
With ``lse`` over the keys, that is ``out_keys sigmoid(lse - sink)`` and the row's log-sum-exp becomes
``logaddexp(lse, sink)`` (:func:`add_sinks`), applied once to the finished rows: differentiable
through the kernel's ``lse`` output, so the tile loops are untouched.

Forward keeps, per query row, the running maximum ``m``, the running sum ``l`` of ``exp(s - m)``
and the unnormalised output ``acc``; a new key tile with scores ``s`` updates them as
``m' = max(m, max s)``, ``l' = l e^(m - m') + sum e^(s - m')``, ``acc' = acc e^(m - m') + e^(s - m') V``.
At the end ``out = acc / l`` and ``lse = m + log l``. Only a ``tile x tile`` score matrix exists at a
time. Backward recomputes each tile's probabilities from the saved ``lse`` (``p = e^(s - lse)``),
as flash attention does, so the autograd graph keeps ``q, k, v, out, lse``: O(s), not O(s^2).

Half-precision inputs are computed in float32 (scores, softmax and accumulators); float32 and
float64 inputs in their own precision. A query row that sees no key at all gets ``out = 0`` and
``lse = -inf``.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch

SKIP, FULL, PARTIAL = 0, 1, 2


class Visibility(NamedTuple):
    """Which keys a query sees, and the score transform: causal (``k_pos <= q_pos``), within
    ``window`` positions before it (None: no limit), scores soft-capped at ``softcap`` (None: not),
    within its own ``chunk`` of positions (``k_pos // chunk == q_pos // chunk``; None: no chunks)."""
    causal: bool = True
    window: Optional[int] = None
    softcap: Optional[float] = None
    chunk: Optional[int] = None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision scores and accumulators are computed in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Tiles:
    """A token set's global positions: on the device for masks, and on the host as tiles
    ``(start, end, lowest position, highest position)`` of at most ``block`` consecutive tokens.
    ``documents``: the tokens' document ids ``[b, tokens]`` on the device (packed documents), or None."""

    def __init__(self, positions: torch.Tensor, block: int, device,
                 documents: Optional[torch.Tensor] = None):
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
        if documents is not None and (documents.dim() != 2 or documents.shape[1] != positions.numel()):
            raise ValueError(f"document ids must be [batch, {positions.numel()}], got "
                             f"{tuple(documents.shape)}")
        self.documents = documents
        self.doc_bounds = None  # (first, last) document id of each tile, [b, tiles]: host ids only
        if block < 1:
            raise ValueError(f"block_size must be positive, got {block}")
        self.length = positions.numel()
        self.device_positions = positions.to(device=device, dtype=torch.long)
        host = positions.detach().to("cpu", torch.long)
        cuts = [0] + (torch.nonzero(host[1:] != host[:-1] + 1).flatten() + 1).tolist() + [self.length]
        self.tiles: List[Tuple[int, int, int, int]] = []
        for seg_start, seg_end in zip(cuts[:-1], cuts[1:]):
            for start in range(seg_start, seg_end, block):
                end = min(start + block, seg_end)
                piece = host[start:end]
                self.tiles.append((start, end, int(piece.min()), int(piece.max())))
        if documents is not None and documents.device.type == "cpu":
            starts = torch.tensor([t[0] for t in self.tiles], dtype=torch.long)
            ends = torch.tensor([t[1] - 1 for t in self.tiles], dtype=torch.long)
            self.doc_bounds = (documents[:, starts], documents[:, ends])


def document_kinds(q_tiles: "Tiles", k_tiles: "Tiles") -> Optional[List[List[int]]]:
    """Per tile pair, what packed documents leave of it (module docstring): SKIP (no query shares a
    document with a key), FULL (one document: no comparison needed) or PARTIAL; None without host ids."""
    if q_tiles.doc_bounds is None or k_tiles.doc_bounds is None:
        return None
    (q_first, q_last), (k_first, k_last) = q_tiles.doc_bounds, k_tiles.doc_bounds
    before = (k_last[:, None, :] < q_first[:, :, None]).all(0)  # [q tiles, k tiles]
    after = (k_first[:, None, :] > q_last[:, :, None]).all(0)
    one = ((q_first == q_last)[:, :, None] & (k_first == k_last)[:, None, :]
           & (q_first[:, :, None] == k_first[:, None, :])).all(0)
    kinds = torch.full(before.shape, PARTIAL, dtype=torch.long)
    kinds[one] = FULL
    kinds[before | after] = SKIP
    return kinds.tolist()


def _visibility(q_tile, k_tile, vis: Visibility) -> int:
    if not vis.causal:
        return FULL
    if k_tile[2] > q_tile[3]:  # every key after every query
        return SKIP
    if vis.window is not None and q_tile[2] - k_tile[3] > vis.window:  # every key too far back
        return SKIP
    if vis.chunk is not None and k_tile[3] // vis.chunk < q_tile[2] // vis.chunk:  # keys in earlier chunks
        return SKIP
    one_chunk = vis.chunk is None or min(q_tile[2], k_tile[2]) // vis.chunk == max(q_tile[3], k_tile[3]) \
        // vis.chunk
    if k_tile[3] <= q_tile[2] and (vis.window is None or q_tile[3] - k_tile[2] <= vis.window) and one_chunk:
        return FULL
    return PARTIAL


def _pair_kind(q_tile, k_tile, vis: Visibility, docs, qi: int, ki: int) -> Tuple[int, bool]:
    """``(kind by positions, compare documents)`` of a tile pair; kind SKIP when either rule skips it."""
    kind = _visibility(q_tile, k_tile, vis)
    if docs is None or kind == SKIP:
        return kind, True
    by_docs = docs[qi][ki]
    return (SKIP if by_docs == SKIP else kind), by_docs == PARTIAL


def tile_pairs(q_tiles: Tiles, k_tiles: Tiles, vis: Visibility) -> int:
    """How many tile pairs the kernel computes (the others are skipped)."""
    docs = document_kinds(q_tiles, k_tiles)
    return sum(_pair_kind(qt, kt, vis, docs, qi, ki)[0] != SKIP
               for qi, qt in enumerate(q_tiles.tiles) for ki, kt in enumerate(k_tiles.tiles))


def _scores(qb, k, q_tiles: Tiles, k_tiles: Tiles, q_tile, k_tile, kind: int, n: int, vis: Visibility,
            documents: bool = True):
    """Scaled (and soft-capped) scores ``[b, g, n * bq, bk]`` of one tile pair, -inf where hidden
    (``documents``: compare the document ids, when there are any)."""
    j0, j1 = k_tile[0], k_tile[1]
    s = qb @ k[:, :, j0:j1].transpose(-1, -2)
    if vis.softcap is not None:
        s = torch.tanh(s / vis.softcap) * vis.softcap
    hidden = None
    if kind == PARTIAL:
        qpos = q_tiles.device_positions[q_tile[0]:q_tile[1]][:, None]
        kpos = k_tiles.device_positions[j0:j1][None, :]
        hidden = kpos > qpos  # [bq, bk]
        if vis.window is not None:
            hidden = hidden | (qpos - kpos > vis.window)
        if vis.chunk is not None:
            hidden = hidden | (qpos // vis.chunk != kpos // vis.chunk)
    if documents and q_tiles.documents is not None and k_tiles.documents is not None:  # [b, 1, 1, bq, bk]
        other = q_tiles.documents[:, q_tile[0]:q_tile[1], None] != k_tiles.documents[:, None, j0:j1]
        hidden = other[:, None, None] if hidden is None else other[:, None, None] | hidden
    if hidden is not None:
        b, g, rows, bk = s.shape
        s = s.view(b, g, n, rows // n, bk).masked_fill(hidden, float("-inf")).view(b, g, rows, bk)
    return s


def _query_tile(q5, q_tile, scale):
    """Rows ``q_tile`` of ``q5 [b, g, n, sq, d]`` as ``[b, g, n * bq, d]``, times ``scale``."""
    b, g, n, _, d = q5.shape
    return q5[:, :, :, q_tile[0]:q_tile[1]].reshape(b, g, n * (q_tile[1] - q_tile[0]), d) * scale


def forward_pair(q, k, v, q_tiles: Tiles, k_tiles: Tiles, scale: float, vis: Visibility):
    """Attention of queries ``q`` over keys/values ``k, v`` (all in the compute dtype).

    Returns ``(out [b, h, sq, d], lse [b, h, sq])``, or ``None`` when no query sees any key."""
    b, h, sq, d = q.shape
    g = k.shape[1]
    n = h // g
    q5 = q.reshape(b, g, n, sq, d)
    out = q.new_zeros(b, g, n, sq, d)
    lse = q.new_full((b, g, n, sq), float("-inf"))
    any_work = False
    docs = document_kinds(q_tiles, k_tiles)
    for qi, q_tile in enumerate(q_tiles.tiles):
        qb, m, l, acc = _query_tile(q5, q_tile, scale), None, None, None
        for ki, k_tile in enumerate(k_tiles.tiles):
            kind, compare = _pair_kind(q_tile, k_tile, vis, docs, qi, ki)
            if kind == SKIP:
                continue
            s = _scores(qb, k, q_tiles, k_tiles, q_tile, k_tile, kind, n, vis, compare)
            m_new = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that saw nothing yet
            p = torch.exp(s - m_safe[..., None])
            pv = p @ v[:, :, k_tile[0]:k_tile[1]]
            if m is None:
                l, acc = p.sum(-1), pv
            else:
                alpha = torch.exp(m - m_safe)
                l, acc = l * alpha + p.sum(-1), acc * alpha[..., None] + pv
            m = m_new
        if m is None:
            continue
        any_work = True
        bq = q_tile[1] - q_tile[0]
        m_safe = m.masked_fill(m == float("-inf"), 0.0)
        out[:, :, :, q_tile[0]:q_tile[1]] = (acc / torch.where(l > 0, l, 1.0)[..., None]).view(b, g, n, bq, d)
        lse[:, :, :, q_tile[0]:q_tile[1]] = (m_safe + torch.log(l)).view(b, g, n, bq)
    if not any_work:
        return None
    return out.view(b, h, sq, d), lse.view(b, h, sq)


def backward_pair(q, k, v, dout, lse, delta, q_tiles: Tiles, k_tiles: Tiles, scale: float, vis: Visibility,
                  dq, dk, dv) -> None:
    """Add this tile set's gradient contributions to ``dq [b, h, sq, d]`` and ``dk, dv [b, g, sk, d]``.

    ``lse`` is the log-sum-exp of the *whole* softmax row (over every key the query sees anywhere)
    and ``delta = rowsum(dout * out) - dlse`` with the final ``out``; then, per tile,
    ``p = e^(s - lse)``, ``dV += p^T dO``, ``dS = p (dO V^T - delta)``, ``dQ += scale dS K``,
    ``dK += scale dS^T Q``. All tensors are in the compute dtype."""
    b, h, sq, d = q.shape
    g = k.shape[1]
    n = h // g
    q5, do5, dq5 = q.reshape(b, g, n, sq, d), dout.reshape(b, g, n, sq, d), dq.view(b, g, n, sq, d)
    lse4 = lse.masked_fill(lse == float("-inf"), 0.0).reshape(b, g, n, sq)  # such rows see no key
    delta4 = delta.reshape(b, g, n, sq)
    docs = document_kinds(q_tiles, k_tiles)
    for qi, q_tile in enumerate(q_tiles.tiles):
        i0, i1 = q_tile[0], q_tile[1]
        rows = n * (i1 - i0)
        qb, dqb = _query_tile(q5, q_tile, scale), None
        dob = do5[:, :, :, i0:i1].reshape(b, g, rows, d)
        lse_b = lse4[:, :, :, i0:i1].reshape(b, g, rows, 1)
        delta_b = delta4[:, :, :, i0:i1].reshape(b, g, rows, 1)
        for ki, k_tile in enumerate(k_tiles.tiles):
            kind, compare = _pair_kind(q_tile, k_tile, vis, docs, qi, ki)
            if kind == SKIP:
                continue
            j0, j1 = k_tile[0], k_tile[1]
            s = _scores(qb, k, q_tiles, k_tiles, q_tile, k_tile, kind, n, vis, compare)
            p = torch.exp(s - lse_b)
            dv[:, :, j0:j1] += p.transpose(-1, -2) @ dob
            ds = p * (dob @ v[:, :, j0:j1].transpose(-1, -2) - delta_b)
            if vis.softcap is not None:  # d(cap tanh(x / cap))/dx = 1 - tanh^2; hidden entries have p = 0
                ds = ds * (1 - (s / vis.softcap).square()).nan_to_num(0.0, 0.0, 0.0)
            dk[:, :, j0:j1] += ds.transpose(-1, -2) @ qb  # qb carries the scale
            dqb = ds @ k[:, :, j0:j1] if dqb is None else dqb + ds @ k[:, :, j0:j1]
        if dqb is not None:
            dq5[:, :, :, i0:i1] += (dqb * scale).view(b, g, n, i1 - i0, d)


def merge(out, lse, part_out, part_lse):
    """Combine two partial attentions over disjoint key sets (the log-sum-exp rule):
    ``lse = log(e^lse1 + e^lse2)``, ``out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2``."""
    if out is None:
        return part_out, part_lse
    new = torch.logaddexp(lse, part_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    out = out * torch.exp(lse - safe)[..., None] + part_out * torch.exp(part_lse - safe)[..., None]
    return out, new


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys ``(out [b, h, s, d], lse [b, h, s])`` -> attention whose softmax also holds
    one logit ``sinks [h]`` per head without a value: ``(out sigmoid(lse - sink), logaddexp(lse, sink))``.
    A row that saw no key keeps ``out = 0``; differentiable in all three (in ``lse``'s precision)."""
    if sinks.dim() != 1 or sinks.numel() != out.shape[1]:
        raise ValueError(f"attention sinks must be one logit per head [{out.shape[1]}], got "
                         f"{tuple(sinks.shape)}")
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    keep = torch.sigmoid(lse - sink)  # e^lse / (e^lse + e^sink): 0 where lse = -inf
    return (out.to(lse.dtype) * keep[..., None]).to(out.dtype), torch.logaddexp(lse, sink)


def check_shapes(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [b, heads, sq, d] and k, v [b, groups, sk, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim, or the "
                         f"{q.shape[1]} query heads are not a multiple of the {k.shape[1]} key/value heads")


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_tiles, k_tiles, vis, scale):
        cd = compute_dtype(q.dtype)
        part = forward_pair(q.to(cd), k.to(cd), v.to(cd), q_tiles, k_tiles, scale, vis)
        if part is None:
            part = (q.new_zeros(q.shape, dtype=cd), q.new_full(q.shape[:3], float("-inf"), dtype=cd))
        out, lse = part[0].to(q.dtype), part[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.vis, ctx.scale = (q_tiles, k_tiles), vis, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cd = compute_dtype(q.dtype)
        dout = dout.to(cd)
        delta = (dout * out.to(cd)).sum(-1) - dlse.to(cd)
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)
        dk = torch.zeros(k.shape, dtype=cd, device=k.device)
        dv = torch.zeros(v.shape, dtype=cd, device=v.device)
        backward_pair(q.to(cd), k.to(cd), v.to(cd), dout, lse, delta, *ctx.tiles, ctx.scale, ctx.vis,
                      dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_positions: Optional[torch.Tensor] = None,
                        k_positions: Optional[torch.Tensor] = None,
                        causal: bool = True, scale: Optional[float] = None,
                        block_size: int = 256, window: Optional[int] = None,
                        softcap: Optional[float] = None, q_documents: Optional[torch.Tensor] = None,
                        k_documents: Optional[torch.Tensor] = None, chunk: Optional[int] = None,
                        sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale q k^T + mask) v`` without the ``sq x sk`` matrix; returns ``(out, lse)``.

    ``q [b, heads, sq, d]``, ``k, v [b, groups, sk, d]``; ``out`` has ``q``'s shape and dtype, ``lse
    [b, heads, sq]`` is float64 for float64 inputs and float32 otherwise. Positions (1-D int, default
    ``arange``) define the causal mask: query ``i`` sees key ``j`` when ``k_positions[j] <=
    q_positions[i]`` (and, with ``window``, ``q_positions[i] - k_positions[j] <= window``).
    ``scale`` defaults to ``1 / sqrt(d)``; ``softcap`` caps the scaled scores at ``cap tanh(s / cap)``.
    ``q_documents [b, sq]``, ``k_documents [b, sk]``: document ids (packed documents); a query then sees
    keys of its own document only.  ``chunk``: a query sees keys of its own chunk of positions only
    (``k_pos // chunk == q_pos // chunk``, Llama 4).  ``sinks [heads]``: one more logit per head in every
    softmax (attention sinks, :func:`add_sinks`; ``lse`` then includes it).  Both outputs are
    differentiable."""
    check_shapes(q, k, v)
    if q_positions is None:
        q_positions = torch.arange(q.shape[2])
    if k_positions is None:
        k_positions = torch.arange(k.shape[2])
    if q_positions.numel() != q.shape[2] or k_positions.numel() != k.shape[2]:
        raise ValueError(f"{q_positions.numel()} query and {k_positions.numel()} key positions for "
                         f"{q.shape[2]} queries and {k.shape[2]} keys")
    check_variants(causal, window, chunk)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q_tiles = Tiles(q_positions, block_size, q.device, q_documents)
    k_tiles = Tiles(k_positions, block_size, q.device, k_documents)
    vis = Visibility(causal, window, softcap, chunk)
    out, lse = _BlockwiseAttention.apply(q, k, v, q_tiles, k_tiles, vis, scale)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def check_variants(causal: bool, window: Optional[int], chunk: Optional[int]) -> None:
    if window is not None and not causal:
        raise ValueError("a sliding window needs causal attention")
    if chunk is not None and (not causal or chunk < 1):
        raise ValueError(f"chunked attention needs causal attention and a positive chunk size, got {chunk}")
