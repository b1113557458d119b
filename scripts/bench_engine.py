#!/usr/bin/env python
"""Alias of ``scripts/bench/engine.py`` (the benchmark package :mod:`bench.engine`); same flags."""
import sys

from bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
