#!/usr/bin/env python
"""Alias of ``scripts/bench/checkpoint.py`` (the benchmark package :mod:`bench.checkpoint`); same flags."""
import sys

from bench.checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
