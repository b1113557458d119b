#!/usr/bin/env python
"""Estimate per-rank memory for each ZeRO stage: params, grads, optimizer state, activations.

Takes the same flags as pretrain_gpt.py (e.g. --model gpt2-xl --tensor-model-parallel-size 2
--bf16 --micro-batch-size 4) plus --world-size; prints a table, or JSON with --json.
Installed as the console script ``megazero-estimate-memory``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.cli import estimate_memory_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(estimate_memory_main())
