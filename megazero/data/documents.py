"""Documents packed into one sequence: Megatron-LM's ``--reset-attention-mask``, ``--reset-position-ids``
and ``--eod-mask-loss``, built from the token ids on their device.

Megatron-LM's rule (``get_ltor_masks_and_position_ids``): the end-of-document (EOD) token belongs to the
document it ends, and the token after it starts a new one.  So a token's document is the number of EOD
tokens *before* it (an exclusive cumulative sum), its position is its distance from its document's first
token, and a query sees a key of its own document only (and, as always, none after it).  Everything here
is a handful of elementwise ops and scans over ``[b, s]``: no per-sample loop, nothing read back to the
host.  A document longer than the sequence simply fills it (no EOD: one document).
"""
from __future__ import annotations

from typing import Optional

import torch

RESET_FLAGS = ("reset_attention_mask", "reset_position_ids")


def document_eod(cfg) -> Optional[int]:
    """The end-of-document id the model needs (the tokenizer's), or None when neither
    ``--reset-attention-mask`` nor ``--reset-position-ids`` is set."""
    if not any(getattr(cfg.data, f, False) for f in RESET_FLAGS):
        return None
    from megazero.data.tokenizer import tokenizer_from_config
    tokenizer = tokenizer_from_config(cfg)
    if tokenizer is None:
        raise ValueError("--reset-attention-mask / --reset-position-ids need an end-of-document id: give "
                         "--tokenizer-model (its EOS id) or --tokenizer-type NullTokenizer --vocab-size N")
    return int(tokenizer.eod)


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, s]`` int64: each token's document within its row (0 for the first), the EOD token counted
    in the document it ends."""
    ends = (tokens == eod).long()
    return ends.cumsum(dim=1) - ends


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, s]`` int64: positions that restart at 0 after each EOD token."""
    s = tokens.shape[1]
    index = torch.arange(s, device=tokens.device).expand_as(tokens)
    after_end = torch.zeros_like(tokens, dtype=torch.bool)
    after_end[:, 1:] = tokens[:, :-1] == eod
    starts = torch.where(after_end, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts


def document_mask(docs: torch.Tensor, window: Optional[int], dtype) -> torch.Tensor:
    """Additive ``[b, 1, s, s]`` mask (0 seen, -inf hidden) of causal attention within each document
    (``docs``: :func:`document_ids`), and within ``window`` keys before the query when given.  In the
    attention's dtype, so that SDPA keeps this tensor for backward rather than a converted copy."""
    s = docs.shape[1]
    i = torch.arange(s, device=docs.device)
    hidden = i[None, :] > i[:, None]
    if window is not None:
        hidden = hidden | (i[:, None] - i[None, :] > window)
    hidden = hidden[None] | (docs[:, :, None] != docs[:, None, :])
    zeros = torch.zeros(hidden.shape, dtype=dtype, device=docs.device)
    return zeros.masked_fill(hidden, float("-inf")).unsqueeze(1)
