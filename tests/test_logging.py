"""Logging: console line, progress bar, metrics JSONL, and wandb offline holding the same values."""
import glob
import io
import json
import os
import struct
import time

import pytest

from megazero.config import MegazeroConfig
from megazero.training.log import TrainingLogger, format_line, progress_bar, wandb_mode


def _wandb_records(path):
    """Protobuf records of a ``.wandb`` transaction log (LevelDB log format: a 7-byte ``:W&B``
    header, then 32 KiB blocks of records ``crc32 | length | type`` that may span blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, block, pos = open(path, "rb").read(), 32768, 7
    assert data[:4] == b":W&B"
    records, buf = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # padding to the end of the block
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def read_wandb_offline(run_root, timeout=60.0):
    """(history, config) of the single offline run under ``run_root``: history maps step -> values.

    wandb's service process may still be writing the log when ``finish()`` returns, so this waits
    for the run's final ``exit`` record."""
    # "latest-run" links to the run directory: count each file once
    found = glob.glob(os.path.join(run_root, "**", "*.wandb"), recursive=True)
    (path,) = {os.path.realpath(p) for p in found}
    deadline = time.monotonic() + timeout
    records = _wandb_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout:.0f}s"
        time.sleep(0.2)
        records = _wandb_records(path)
    history, config = {}, {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":  # keys are in `key` or, in newer versions, `nested_key`
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[int(items["_step"])] = items
        elif kind in ("run", "config"):
            updates = rec.run.config.update if kind == "run" else rec.config.update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in updates})
    return history, config


def assert_same_values(records, history):
    """Every non-null value of every JSONL record equals wandb's value at that step."""
    assert sorted(history) == [r["iteration"] for r in records]
    for r in records:
        logged = history[r["iteration"]]
        for key, value in r.items():
            if key == "iteration" or value is None:
                continue
            assert logged[key] == pytest.approx(value, rel=1e-12, abs=0), key


def _metrics(it):
    return {"iteration": it, "loss": 6.0 / it, "lr": 1e-3 * it, "grad_norm": 0.5, "loss_scale": 1.0,
            "skipped": 0, "skipped_total": 0, "iteration_time": 0.1, "tokens_per_sec": 1234.5 + it,
            "tflops": 0.01, "param_bytes": 1000, "grad_bytes": 1000, "optim_bytes": 3000, "mfu": None}


def test_metrics_file_and_wandb_offline_agree(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = MegazeroConfig()
    cfg.training.train_iters = 3
    cfg.logging.metrics_file = str(tmp_path / "m" / "metrics.jsonl")
    cfg.logging.wandb_project, cfg.logging.wandb_mode = "megazero-test", "offline"
    cfg.logging.wandb_save_dir = str(tmp_path / "wandb")
    out = io.StringIO()
    log = TrainingLogger(cfg, rank=0, stream=out)
    for it in (1, 2, 3):
        log.log(_metrics(it))
    log.close()
    records = [json.loads(line) for line in open(cfg.logging.metrics_file)]
    assert records == [_metrics(it) for it in (1, 2, 3)]
    history, config = read_wandb_offline(cfg.logging.wandb_save_dir)
    assert_same_values(records, history)
    training = config["training"].get("value", config["training"])  # older versions wrap in "value"
    assert training["train_iters"] == 3 and "parallel" in config  # the full config is the run config
    assert "iteration 3/3" in out.getvalue()


def test_only_rank_zero_writes(tmp_path):
    cfg = MegazeroConfig()
    cfg.logging.metrics_file = str(tmp_path / "metrics.jsonl")
    out = io.StringIO()
    log = TrainingLogger(cfg, rank=1, stream=out)
    log.log(_metrics(1))
    log.close()
    assert not os.path.exists(cfg.logging.metrics_file) and out.getvalue() == ""


def test_metrics_file_is_strict_json_with_non_finite_values(tmp_path):
    cfg = MegazeroConfig()
    cfg.logging.metrics_file = str(tmp_path / "metrics.jsonl")
    log = TrainingLogger(cfg, rank=0, stream=io.StringIO())
    log.log(dict(_metrics(1), grad_norm=float("inf"), skipped=1))
    log.close()
    line = open(cfg.logging.metrics_file).read()
    assert "Infinity" not in line and json.loads(line)["grad_norm"] is None


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_console_interval_and_progress_bar():
    cfg = MegazeroConfig()
    cfg.training.train_iters, cfg.logging.log_interval = 4, 2
    out = _Tty()
    log = TrainingLogger(cfg, stream=out)
    for it in range(1, 5):
        log.log(_metrics(it))
    log.close()
    text = out.getvalue()
    lines = [ln.split("\r")[-1].replace("\033[K", "") for ln in text.split("\n") if "iteration" in ln]
    assert [ln.split(" | ")[0] for ln in lines] == ["iteration 1/4", "iteration 2/4", "iteration 4/4"]
    assert "[" + "#" * 30 + "] 4/4" in text and "\r" in text
    plain = io.StringIO()
    TrainingLogger(cfg, stream=plain).log(_metrics(3))
    assert plain.getvalue() == ""  # not a terminal and not a log iteration: nothing


def test_format_line_fields():
    m = dict(_metrics(10), mfu=0.25, eval_loss=2.5, eval_ppl=12.18, max_memory_allocated=3 * 2 ** 30)
    line = format_line(m, 100)
    for part in ("iteration  10/100", "loss 0.6000", "eval loss 2.5000", "lr 1.000e-02", "grad norm 0.500",
                 "loss scale 1", "skipped 0", "tok/s", "TFLOP/s/dev", "MFU 25.0%", "model state 4.9 KiB/rank",
                 "peak mem 3.0 GiB"):
        assert part in line, part
    assert "eta" in progress_bar(5, 10, 0.0, 1.0)
    assert "with recompute" not in line  # hardware FLOP/s shown only when recomputation adds work
    m.update(tflops=1.5, hw_tflops=2.0)
    assert "1.5 TFLOP/s/dev (hw 2 with recompute)" in format_line(m, 100)


def test_wandb_mode_default(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(None) == "offline" and wandb_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(None) == "disabled"


def _train_tiny(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def test_training_run_metrics_file_equals_wandb_offline_run(tmp_path, monkeypatch):
    """Two DP ranks train; rank 0 alone writes the metrics file and one offline wandb run, with the
    same values."""
    from megazero.process.local_ranks import run_ranks
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = MegazeroConfig()
    cfg.data.mock_data = True
    for section, values in {"model": dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                          vocab_size=100),
                            "training": dict(global_batch_size=4, micro_batch_size=1, train_iters=4,
                                             eval_interval=2, eval_iters=1),
                            "logging": dict(metrics_file=str(tmp_path / "metrics.jsonl"),
                                            wandb_project="megazero-test", wandb_mode="offline",
                                            wandb_save_dir=str(tmp_path / "wandb"),
                                            wandb_exp_name="tiny")}.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    hist = run_ranks(_train_tiny, 2, cfg)[0]
    records = [json.loads(line) for line in open(cfg.logging.metrics_file)]
    assert records == json.loads(json.dumps(hist))
    assert {"eval_loss", "eval_ppl"} <= set(records[1]) and "eval_loss" not in records[0]
    history, config = read_wandb_offline(cfg.logging.wandb_save_dir)  # exactly one run (rank 0's)
    assert_same_values(records, history)
    assert config["parallel"].get("value", config["parallel"])["data_parallel_size"] == 2


def test_metrics_file_appends_and_a_restart_drops_the_rows_after_its_start(tmp_path):
    cfg = MegazeroConfig()
    cfg.training.train_iters = 5
    cfg.logging.metrics_file = str(tmp_path / "metrics.jsonl")
    log = TrainingLogger(cfg, stream=io.StringIO())
    for it in (1, 2, 3, 4):  # this run died after iteration 4; its last checkpoint was iteration 2
        log.log(_metrics(it))
    log.close()
    resumed = TrainingLogger(cfg, stream=io.StringIO(), start_iteration=2)
    assert resumed.dropped_rows == 2
    for it in (3, 4, 5):
        resumed.log(_metrics(it))
    resumed.close()
    rows = [json.loads(line) for line in open(cfg.logging.metrics_file)]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]  # each iteration once


@pytest.mark.parametrize("tail,dropped", [
    ('{"iteration": 3, "loss": 4.1, "lo', 1),  # cut short without its newline (a full disk)
    ('{"iteration": 3, "loss": 4.1, "lo\n', 1),  # cut short, newline written
    ('{"iteration": 3, "loss": 4.1}', 0),  # whole but for its newline
    ('\x00' * 37, 0),  # what some file systems leave after a crash mid-write
    ('{"iteration": 3, "lo{"iteration": 3, "loss": 4.1}\n\n', 0),  # a row appended onto a cut one
    ('{"iteration": 3, "loss": 4.1}\n{"iteration": 4, "loss": 4.0}\n{"iter', 2),  # after the start, and cut
])
def test_a_resume_repairs_the_metrics_file_whatever_its_last_row(tmp_path, tail, dropped):
    """The file a full disk or a crash left: the resumed run (start 3) keeps whole rows up to 3,
    drops the rest, and its first row starts a line of its own."""
    cfg = MegazeroConfig()
    cfg.training.train_iters = 5
    cfg.logging.metrics_file = path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as fh:
        fh.write('{"iteration": 1, "loss": 4.3}\n{"iteration": 2, "loss": 4.2}\n' + tail)
    resumed = TrainingLogger(cfg, stream=io.StringIO(), start_iteration=3)
    assert resumed.dropped_rows == dropped
    resumed.log(_metrics(4))
    resumed.close()
    rows = [json.loads(line) for line in open(path)]  # every line is whole JSON
    whole_3 = "4.1}" in tail.split("\n")[0]
    assert [r["iteration"] for r in rows] == [1, 2] + ([3] if whole_3 else []) + [4]


def test_a_valid_metrics_file_is_left_alone_and_missed_rows_are_written(tmp_path):
    cfg = MegazeroConfig()
    cfg.logging.metrics_file = path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as fh:
        fh.write('{"iteration": 1, "loss": 4.3}\n{"iteration": 2, "loss": 4.2}\n')
    inode = os.stat(path).st_ino
    TrainingLogger(cfg, stream=io.StringIO(), start_iteration=2).close()
    assert os.stat(path).st_ino == inode  # not rewritten
    missed = [{"iteration": 3, "loss": 4.1}, {"iteration": 4, "loss": 4.0}]  # from a checkpoint at 3
    TrainingLogger(cfg, stream=io.StringIO(), start_iteration=3, missed_rows=missed).close()
    assert [json.loads(line)["iteration"] for line in open(path)] == [1, 2, 3]


def test_tensorboard_gets_the_metrics_file_values(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = MegazeroConfig()
    cfg.training.train_iters = 3
    cfg.logging.tensorboard_dir = str(tmp_path / "tb")
    log = TrainingLogger(cfg, stream=io.StringIO())
    for it in (1, 2, 3):
        log.log(dict(_metrics(it), grad_norm=float("inf") if it == 2 else 0.5))
    log.close()
    acc = EventAccumulator(cfg.logging.tensorboard_dir)
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == [(it, pytest.approx(_metrics(it)["loss"])) for it in (1, 2, 3)]
    assert [e.step for e in acc.Scalars("grad_norm")] == [1, 3]  # a non-finite value is left out


def test_tensorboard_missing_is_a_clear_error(monkeypatch, capsys):
    import builtins
    from models.cli.pretrain import main
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--mock-data", "--tensorboard-dir", "tb"], lambda cfg, mesh: None) == 2
    assert "--tensorboard-dir needs the tensorboard package" in capsys.readouterr().err


def test_wandb_resumes_the_run_of_the_checkpoint(monkeypatch, tmp_path):
    import sys
    import types
    calls = []

    class Run:
        id = "run-abc"

        def log(self, values, step):
            pass

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = MegazeroConfig()
    cfg.logging.wandb_project, cfg.logging.wandb_mode, cfg.logging.wandb_entity = "p", "offline", "team"
    log = TrainingLogger(cfg, stream=io.StringIO())
    assert log.wandb_id == "run-abc" and "id" not in calls[0] and calls[0]["entity"] == "team"
    log.close()
    TrainingLogger(cfg, stream=io.StringIO(), start_iteration=4, wandb_id="run-abc").close()
    assert calls[1]["id"] == "run-abc" and calls[1]["resume"] == "allow"
