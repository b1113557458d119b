#!/usr/bin/env python
"""Alias of ``scripts/bench/moe_deepspeed.py`` (:mod:`bench.moe_deepspeed`); same flags."""
import sys

from bench.moe_deepspeed import main

if __name__ == "__main__":
    sys.exit(main())
