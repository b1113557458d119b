"""Benchmarks: megazero beside its peers, printed as ratios measured in the same run (never asserted
by tests).  Run them as ``python scripts/bench_<name>.py`` (an alias of ``scripts/bench/<name>.py``)
or ``python -m bench.<name>`` from ``scripts/``, with the venv's python (megazero installed)."""
