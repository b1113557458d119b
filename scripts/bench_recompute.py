#!/usr/bin/env python
"""Alias of ``scripts/bench/recompute.py`` (the benchmark package :mod:`bench.recompute`); same flags."""
import sys

from bench.recompute import main

if __name__ == "__main__":
    sys.exit(main())
