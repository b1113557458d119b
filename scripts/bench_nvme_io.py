#!/usr/bin/env python
"""Alias of ``scripts/bench/nvme_io.py`` (the benchmark package :mod:`bench.nvme_io`); same flags."""
import sys

from bench.nvme_io import main

if __name__ == "__main__":
    sys.exit(main())
