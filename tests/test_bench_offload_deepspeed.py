"""scripts/bench_offload_deepspeed.py without DeepSpeed (not a dependency of megazero): its arguments,
the one-line refusal when the DeepSpeed interpreter cannot import deepspeed, and its summary."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_offload_deepspeed.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/bin/python"])
def test_missing_deepspeed_is_refused_in_one_line(python, tmp_path):
    proc = _run("--ds-python", python, "--modes", "ds-cpu", "mz-cpu", "--dir", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"offload_deepspeed: --ds-python {python}")
    assert "install deepspeed into a venv" in lines[0] and "docs/offload.md" in lines[0]
    assert os.listdir(tmp_path) == []  # refused before any mode ran


def test_arguments_and_summary():
    proc = _run("--modes", "bogus")
    assert proc.returncode == 2 and "invalid choice: 'bogus'" in proc.stderr
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench import offload_deepspeed as bench
    a = bench._parser().parse_args([])
    assert a.modes == ["ds-nvme", "ds-cpu", "mz-nvme", "mz-cpu"] and a.ds_python == "/tmp/dsvenv/bin/python"
    assert (a.batch, a.iters, a.weight_decay, a.io_threads, a.block_mib) == (2, 4, 0.01, 4, 1)
    io = bench._proc_io()
    assert set(io) == {"read", "write"} and all(v >= 0 for v in io.values())
    rows = [dict(step_s=s, read_bytes=r, write_bytes=w, swap_bytes=b, loss=9.0)
            for s, r, w, b in [(9.0, 0, 0, 5), (2.0, 10, 20, 7), (3.0, 30, 40, 6), (4.0, 50, 60, 6)]]
    res = dict(rows=rows, peak_rss_bytes=1, params=3, optimizer="x", threads=1, config={}, wall_s=1.0)
    s = bench._summary(res)  # the first iteration is left out of the medians
    assert (s["step_s"], s["read_bytes"], s["write_bytes"], s["swap_bytes"]) == (3.0, 30, 40, 7)
