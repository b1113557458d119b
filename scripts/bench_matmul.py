#!/usr/bin/env python
"""Alias of ``scripts/bench/matmul.py`` (the benchmark package :mod:`bench.matmul`); same flags."""
import sys

from bench.matmul import main

if __name__ == "__main__":
    sys.exit(main())
