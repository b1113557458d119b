"""--compile: each transformer layer through torch.compile (Inductor's C++ kernels on the CPU) computes
what eager computes, under recomputation, TP + SP, PP and ZeRO-3.

Compiling is slow (tens of seconds a graph on a busy core), so the layouts share one 8-rank run.
"""
import pytest
import torch

from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from tolerance import R_TRAIN


def _cfg(**extra):
    settings = dict(mock_data=True, num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, micro_batch_size=1, global_batch_size=4, train_iters=3, eval_interval=0,
                    log_interval=100, optimizer="sgd", lr=0.1, hidden_dropout=0.0, attention_dropout=0.0)
    return config_from_dict(dict(settings, **extra))


def _train(cfg):
    """Losses and gradient norms, and how many graphs Dynamo compiled in this process."""
    import models
    from megazero.training import train
    counters = torch._dynamo.utils.counters
    counters.clear()
    rows = train(cfg, models.build_chunks)
    return [(m["loss"], m["grad_norm"]) for m in rows], counters["stats"]["unique_graphs"]


def _close(got, ref):
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=R_TRAIN) and norm == pytest.approx(ref_norm, rel=R_TRAIN)
    assert len(got) == len(ref)


@pytest.mark.slow
def test_compiled_layers_match_eager_under_tp_sp_pp_zero3_and_recompute():
    ref, graphs = _train(_cfg())  # the oracle: one process, eager
    assert graphs == 0
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, zero_stage=3,
                  sequence_parallel=True, recompute_granularity="full", compile=True)
    out = run_ranks(_train, 8, _cfg(**layout), timeout=900)
    for got, graphs in out:
        assert graphs >= 1  # the layers did run compiled
        _close(got, ref)


@pytest.mark.slow
def test_compiled_dropout_under_recomputation_replays_eager():
    """With dropout on, the compiled layers draw eager's masks (fallback_random), and recomputation
    replays them: the same run, compiled or not."""
    cfg = dict(hidden_dropout=0.1, attention_dropout=0.1, recompute_granularity="full")
    ref, _ = _train(_cfg(**cfg))
    got, graphs = _train(_cfg(compile=True, **cfg))
    assert graphs >= 1
    _close(got, ref)
    no_dropout, _ = _train(_cfg(recompute_granularity="full"))
    assert abs(no_dropout[-1][0] - ref[-1][0]) > 10 * R_TRAIN * abs(ref[-1][0])  # dropout did act


def test_compile_without_a_cpp_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match=r"--compile needs a C\+\+ compiler .*\$CXX=/nonexistent/g\+\+"):
        validate(_cfg(compile=True), 1)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="no g\\+\\+, c\\+\\+ or clang\\+\\+ on PATH"):
        validate(_cfg(compile=True), 1)
    validate(_cfg(), 1)  # without --compile nothing is needed


def test_compile_is_a_flag(monkeypatch, capsys):
    from megazero.config import parse_args
    assert parse_args(["--mock-data", "--compile"], {}, 1).precision.compile is True
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from models.cli.pretrain import main
    assert main(["--mock-data", "--compile", "--train-iters", "1"], None, {}) == 2
    assert "--compile needs a C++ compiler" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_layers_with_onednn_products_match_eager(monkeypatch):
    """--cpu-matmul onednn (what auto picks where oneDNN is faster) with --compile: the compiled layers
    leave the product to Inductor (its lowering rejects the direct oneDNN call), the rest stays on
    oneDNN; the same numbers as eager on oneDNN."""
    import megazero.tensor_parallel.layers as tp_layers
    if not tp_layers.onednn_linear_available():
        pytest.skip("no oneDNN linear in this torch build")
    monkeypatch.setattr(tp_layers, "ONEDNN_MIN_MACS", 0)  # every product of the tiny GPT through oneDNN
    calls, onednn = [], tp_layers._onednn
    monkeypatch.setattr(tp_layers, "_onednn", lambda *args: (calls.append(1), onednn(*args))[1])
    ref, _ = _train(_cfg(cpu_matmul="onednn"))
    assert calls  # eager did use oneDNN
    got, graphs = _train(_cfg(cpu_matmul="onednn", compile=True))
    assert graphs >= 1
    _close(got, ref)
