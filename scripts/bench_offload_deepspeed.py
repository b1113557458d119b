#!/usr/bin/env python
"""Alias of ``scripts/bench/offload_deepspeed.py`` (the benchmark package :mod:`bench.offload_deepspeed`);
same flags."""
import sys

from bench.offload_deepspeed import main

if __name__ == "__main__":
    sys.exit(main())
