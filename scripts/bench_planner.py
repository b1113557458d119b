#!/usr/bin/env python
"""Alias of ``scripts/bench/planner.py`` (the benchmark package :mod:`bench.planner`); same flags."""
import os
import sys

# this checkout's megazero, as scripts/plan.py imports it (not another installed copy)
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.planner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
