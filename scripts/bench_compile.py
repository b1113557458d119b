#!/usr/bin/env python
"""Alias of ``scripts/bench/compile.py`` (the benchmark package :mod:`bench.compile`); same flags."""
import sys

from bench.compile import main

if __name__ == "__main__":
    sys.exit(main())
