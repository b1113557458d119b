#!/usr/bin/env python
"""Plan a run: the TP x PP x DP + ZeRO layouts that fit a cluster, fastest first.

    python scripts/plan.py --model llama3-8b --gpus 64 --gpus-per-node 8 --gpu-memory-gb 80 \
        --seq-length 4096 --global-batch-size 512 [--json] [--gpu H100|H200|A100|L4]
    python scripts/plan.py --calibrate          # fit link and compute constants on this machine

Installed as the console script ``megazero-plan``; the logic is megazero.planning.planner.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.cli import plan_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(plan_main())
