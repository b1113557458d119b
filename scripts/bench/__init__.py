"""Benchmarks: megazero beside its peers, printed as ratios measured in the same run (never asserted
by tests).  Run them as ``python scripts/bench_<name>.py`` (an alias of ``scripts/bench/<name>.py``)
or ``python -m bench.<name>`` from ``scripts/``, with the venv's python (megazero installed)."""


def write_json(data, path: str) -> None:
    """``--json PATH``: ``data`` as indented JSON to ``path`` ('-': stdout)."""
    import json
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text)
