"""Text generation with a KV cache: greedy, temperature, top-k and top-p sampling.

``generate(model, ids, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0, seed=None,
eos_id=None)`` continues token ids ``[b, s]`` and returns ``[b, s + n]``.  ``temperature == 0``
is greedy (argmax, ties to the lowest id, as ``torch.argmax`` and Hugging Face's greedy search);
otherwise the next token is drawn from ``softmax(logits / temperature)`` restricted to the
``top_k`` most likely tokens (0: all) and to the smallest set whose probability reaches
``top_p`` (1.0: all), from a generator seeded by ``seed``.  The model runs once over the prompt,
then one position per step (:meth:`models.gpt.GPTModel.decode`, keys and values of earlier
positions kept in a :class:`models.layers.KVCache`).  Under tensor parallelism every TP rank calls
it with the same arguments; the logits are gathered, so every rank draws the same tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

from .layers import KVCache


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits [b, vocab]`` (see the module docstring)."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # the mass before this token already suffices
        drop = cumulative - sorted_scores.softmax(dim=-1) >= top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming the setting for values that make no sense."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: no limit), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1] (1: no limit), got {top_p}")


@torch.no_grad()
def generate(model, ids: torch.Tensor, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: Optional[int] = None, eos_id: Optional[int] = None) -> torch.Tensor:
    """``ids [b, s]`` followed by up to ``max_new_tokens`` generated tokens (fewer when every row
    has produced ``eos_id``; rows that finished early are padded with it)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    m = model.cfg.model
    if (m.position_embedding_type == "learned_absolute"
            and ids.shape[1] + max_new_tokens > m.max_position_embeddings):
        raise ValueError(f"{ids.shape[1]} prompt tokens + --max-new-tokens {max_new_tokens} exceed the "
                         f"model's {m.max_position_embeddings} learned positions; shorten the prompt or "
                         "generate fewer")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = ids.to(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(0 if seed is None else int(seed))
    cache, out = KVCache(), [ids]
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    try:
        logits = model.decode(ids, cache)
        for step in range(max_new_tokens):
            token = next_token(logits[:, -1], temperature, top_k, top_p, generator)
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done |= token == eos_id
            out.append(token[:, None])
            if step == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
                break
            logits = model.decode(token[:, None], cache)
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)
