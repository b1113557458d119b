#!/usr/bin/env python
"""Alias of ``scripts/bench/pipeline.py`` (the benchmark package :mod:`bench.pipeline`); same flags."""
import sys

from bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
