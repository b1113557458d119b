"""Deterministic synthetic tokens with structure a model can learn (``--mock-data``).

Every sample is a walk on a fixed random Markov chain over the vocabulary: token ``v`` is
followed by one of a few successors chosen for ``v`` once (from the seed), with skewed
probabilities, and now and then by a uniformly random token.  A bigram model drives the loss
from ``ln(vocab)`` towards the chain's entropy (about 1.5 nats), so training visibly works.

Sample ``i`` of split ``s`` depends only on ``(seed, s, i)``: its random draws come from a
generator keyed by those three numbers.  It is therefore the same whatever the parallel
layout, the batch split or the order in which samples are asked for.  The train and eval
splits use different keys, so held-out samples never repeat training samples.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

SPLITS = {"train": 0, "valid": 1, "test": 2}


class MockGPTData:
    """A token source: ``get_tokens(indices, split)`` returns ``[n, seq_length + 1]`` int64 ids.

    Args:
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seq_length: tokens per training sequence (one more is generated for the labels).
        seed: the only source of randomness.
        successors: how many tokens may follow each token.
        noise: probability that a step jumps to a uniformly random token.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234, successors: int = 4,
                 noise: float = 0.05):
        if vocab_size < 2:
            raise ValueError(f"--vocab-size must be at least 2 for mock data, got {vocab_size}")
        self.vocab_size, self.seq_length, self.seed, self.noise = vocab_size, seq_length, seed, noise
        table_rng = np.random.default_rng([seed, 0x6D6F636B])  # "mock"
        self.table = table_rng.integers(0, vocab_size, size=(vocab_size, successors))
        weights = 0.5 ** np.arange(successors)  # 1/2, 1/4, ... : skewed but not deterministic
        self.cum_probs = np.cumsum(weights / weights.sum())

    def get_tokens(self, indices: Sequence[int], split: str = "train") -> torch.Tensor:
        """Token ids ``[len(indices), seq_length + 1]`` of the given global samples."""
        n, steps = len(indices), self.seq_length
        uniform = np.empty((n, steps))
        jumps = np.empty((n, steps), dtype=np.int64)
        out = np.empty((n, steps + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            rng = np.random.default_rng([self.seed, SPLITS[split], int(index)])
            out[row, 0] = rng.integers(0, self.vocab_size)
            uniform[row] = rng.random(steps)
            jumps[row] = rng.integers(0, self.vocab_size, size=steps)
        # a step jumps with probability `noise`; otherwise uniform/(1-noise) picks the successor
        jump = uniform >= 1 - self.noise
        choice = np.minimum(np.searchsorted(self.cum_probs, uniform / (1 - self.noise), side="right"),
                            self.table.shape[1] - 1)
        for t in range(steps):  # the walk is sequential; vectorised over samples
            nxt = self.table[out[:, t], choice[:, t]]
            out[:, t + 1] = np.where(jump[:, t], jumps[:, t], nxt)
        return torch.from_numpy(out)
