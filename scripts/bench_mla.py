#!/usr/bin/env python
"""Alias of ``scripts/bench/mla.py`` (the benchmark package :mod:`bench.mla`); same flags."""
import sys

from bench.mla import main

if __name__ == "__main__":
    sys.exit(main())
