#!/usr/bin/env python
"""Alias of ``scripts/bench/host_malloc.py`` (the benchmark package :mod:`bench.host_malloc`); same flags."""
import sys

from bench.host_malloc import main

if __name__ == "__main__":
    sys.exit(main())
