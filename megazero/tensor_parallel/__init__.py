"""Tensor parallelism: collectives as autograd functions, parallel layers, vocab-parallel loss, RNG."""
