"""scripts/bench_engine.py without DeepSpeed (not a dependency of megazero): the one-line refusal when
the DeepSpeed interpreter cannot import it, the merge of repeated runs, and a megazero mode on a tiny
BERT (two ranks under torch.distributed.run)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_engine.py")
TINY = ["--layers", "1", "--hidden", "64", "--vocab", "512", "--seq", "32", "--iters", "2", "--warmup", "1"]


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_missing_deepspeed_is_refused_in_one_line():
    proc = _run("--ds-python", "/nonexistent/bin/python", "--modes", "ds-z2", "mz-z2")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench engine: --ds-python /nonexistent/bin/python"), lines
    assert "docs/offload.md" in lines[0]


def test_repeated_runs_merge_into_medians():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench import engine as bench
    runs = [{"times": t, "params": 5, "ranks": [{"peak_rss": p, "rss_before_model": 1, "losses": [float(p)]}]}
            for t, p in (([1.0, 3.0], 10), ([5.0, 7.0], 30), ([2.0, 2.0], 20))]
    out = bench._merge(runs)
    assert out["run_step_s"] == [2.0, 6.0, 2.0] and out["step_s"] == 2.0
    assert out["ranks"][0]["peak_rss"] == 20 and out["ranks"][0]["losses"] == [10.0]


@pytest.mark.slow
def test_a_megazero_mode_runs():
    proc = _run("--modes", "mz-z3", *TINY, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["mz-z3"]]
    assert len(rows) == 1 and rows[0][6] == "FlatAdamW" and float(rows[0][1]) > 0, proc.stdout
