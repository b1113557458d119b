#!/usr/bin/env python
"""Alias of ``scripts/bench/offload.py`` (the benchmark package :mod:`bench.offload`); same flags."""
import sys

from bench.offload import main

if __name__ == "__main__":
    sys.exit(main())
