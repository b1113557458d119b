#!/usr/bin/env python
"""Pretrain a GPT model with tensor, pipeline and data parallelism and ZeRO.

Run under torchrun for several processes, or with plain python for one::

    torchrun --nproc-per-node 8 scripts/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --zero-stage 2 --mock-data --model tiny
    python scripts/pretrain_gpt.py --mock-data --train-iters 20

Flags use Megatron-LM's names (``--help`` lists them all).  Invalid combinations are reported,
naming the flag, before any process group is created; the exit status is then 2.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from models.cli import pretrain_entry  # noqa: E402

if __name__ == "__main__":
    pretrain_entry()
