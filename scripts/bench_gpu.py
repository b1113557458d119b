#!/usr/bin/env python
"""Alias of ``scripts/bench/gpu.py`` (the benchmark package :mod:`bench.gpu`); same flags."""
import sys

from bench.gpu import main

if __name__ == "__main__":
    sys.exit(main())
