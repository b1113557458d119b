#!/usr/bin/env python
"""Alias of ``scripts/bench/documents.py`` (the benchmark package :mod:`bench.documents`); same flags."""
import sys

from bench.documents import main

if __name__ == "__main__":
    sys.exit(main())
