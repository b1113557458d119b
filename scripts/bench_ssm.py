#!/usr/bin/env python
"""Alias of ``scripts/bench/ssm.py`` (the benchmark package :mod:`bench.ssm`); same flags."""
import sys

from bench.ssm import main

if __name__ == "__main__":
    sys.exit(main())
