#!/usr/bin/env python
"""Alias of ``scripts/bench/peers.py`` (the benchmark package :mod:`bench.peers`); same flags."""
import sys

from bench.peers import main

if __name__ == "__main__":
    sys.exit(main())
