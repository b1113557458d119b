#!/usr/bin/env python
"""DeepSpeed's launcher conventions (``deepspeed --hostfile F --include ... train.py``) over
megazero's launcher; docs/operations.md ("DeepSpeed-style hostfiles")::

    python scripts/deepspeed_launch.py --hostfile hostfile --num_gpus 8 train.py --deepspeed_config ds.json

The logic is models.cli.ds_launch.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.cli.ds_launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
