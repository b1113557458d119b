#!/usr/bin/env python
"""Alias of ``scripts/bench/planner.py`` (the benchmark package :mod:`bench.planner`); same flags."""
import sys

from bench.planner import main

if __name__ == "__main__":
    sys.exit(main())
