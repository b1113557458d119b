#!/usr/bin/env python
"""Alias of ``scripts/bench/moe.py`` (the benchmark package :mod:`bench.moe`); same flags."""
import sys

from bench.moe import main

if __name__ == "__main__":
    sys.exit(main())
