#!/usr/bin/env python
"""Alias of ``scripts/bench/zero.py`` (the benchmark package :mod:`bench.zero`); same flags."""
import sys

from bench.zero import main

if __name__ == "__main__":
    sys.exit(main())
