#!/usr/bin/env python
"""Packed documents: a training step with Megatron-LM's document masks against the same step without.

A batch of sequences, each holding ``--documents`` documents of equal length ended by the EOD id, runs
one forward and backward of a GPT twice per round: with ``--reset-attention-mask --reset-position-ids
--eod-mask-loss`` and without them, timed in interleaved rounds (the median is printed).  Two
attention kernels:

* ``sdpa``: torch's scaled_dot_product_attention, causal; masked, it takes the additive
  ``[b, 1, s, s]`` block-diagonal document mask;
* ``blockwise``: megazero's tiled kernel (what soft-capped scores and context parallelism run,
  selected here by ``--attn-logit-softcapping 50``), which skips the tile pairs across documents.

    python scripts/bench_documents.py [--seq-length 2048 --documents 8 --rounds 5]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from megazero.config import config_from_dict, validate
from megazero.errors import EXIT_OK
from megazero.process.threads import set_rank_threads

try:
    from bench.timing import interleaved_rounds
except ImportError:  # run as a module of the package
    from .timing import interleaved_rounds

KERNELS = {"sdpa": {}, "blockwise": {"attn_logit_softcapping": 50.0}}
MASKS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)


def packed_tokens(batch: int, seq: int, documents: int, vocab: int, eod: int, seed: int = 0) -> torch.Tensor:
    """``[batch, seq + 1]`` ids: ``documents`` documents of equal length per row, each ended by ``eod``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, eod, (batch, seq + 1), generator=g)
    length = seq // documents
    tokens[:, length - 1:seq:length] = eod
    return tokens


def step(model, tokens):
    def run():
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    set_rank_threads()
    import megazero_models as models
    vocab = 1000
    base = dict(mock_data=True, num_layers=a.num_layers, hidden_size=a.hidden_size,
                num_attention_heads=a.num_attention_heads, seq_length=a.seq_length,
                max_position_embeddings=a.seq_length, micro_batch_size=a.micro_batch_size,
                tokenizer_type="NullTokenizer", vocab_size=vocab - 1, hidden_dropout=0.0,
                attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm")
    tokens = packed_tokens(a.micro_batch_size, a.seq_length, a.documents, vocab - 1, vocab - 1)
    print(f"{a.micro_batch_size} x {a.seq_length} tokens, {a.documents} documents a sequence, "
          f"{a.num_layers} layers of {a.hidden_size}; forward + backward, median of {a.rounds} rounds")
    print(f"{'kernel':<10} {'unmasked s':>11} {'masked s':>9} {'masked / unmasked':>18}")
    for name, kernel in KERNELS.items():
        steps = {}
        for masked in (False, True):
            cfg = validate(config_from_dict(dict(base, **kernel, **(MASKS if masked else {}))), 1)
            torch.manual_seed(0)
            steps[masked] = step(models.build_model(cfg), tokens)
        for run in steps.values():  # warm-up
            run()
        times = {k: statistics.median(v) for k, v in interleaved_rounds(steps, a.rounds).items()}
        print(f"{name:<10} {times[False]:>11.3f} {times[True]:>9.3f} {times[True] / times[False]:>18.2f}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
