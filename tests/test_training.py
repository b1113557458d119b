"""The trainer: LR schedule, FLOPs, start-up errors, and every layout against one process."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megazero.config import MegazeroConfig, validate
from megazero.flops import (device_peak_flops, hardware_flops_per_iteration, model_flops_per_iteration,
                            peak_flops)
from megazero.lr import learning_rate
from megazero.training import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")


# ---- learning-rate schedule ----------------------------------------------------------------
def test_lr_warmup_then_cosine_to_min():
    lr = [learning_rate(i, 1.0, 0.1, warmup_iters=4, decay_iters=12, style="cosine") for i in range(1, 15)]
    assert lr[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lr[7] == pytest.approx(0.55)  # half-way through decay: (max + min) / 2
    assert all(a >= b for a, b in zip(lr[3:], lr[4:]))
    assert lr[11:] == [0.1, 0.1, 0.1]


def test_lr_linear_and_constant():
    assert learning_rate(6, 1.0, 0.0, 2, 10, "linear") == pytest.approx(0.5)
    assert learning_rate(1, 1.0, 0.0, 0, 10, "linear") == pytest.approx(0.9)
    assert learning_rate(50, 1.0, 0.0, 2, 10, "constant") == 1.0
    assert learning_rate(1, 2.0, 0.0, 4, 10, "constant") == 0.5


# ---- FLOPs ---------------------------------------------------------------------------------
def _model_cfg(**model):
    cfg = MegazeroConfig()
    cfg.data.mock_data = True
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 8, 1
    return validate(cfg, world_size=1)


def test_model_flops_match_megatron_formula():
    cfg = _model_cfg(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257)
    b, s, L, h, V = 8, 1024, 12, 768, cfg.model.padded_vocab_size
    megatron = 12 * b * s * L * h * h * ((1 + 1 + s / h) + 4 + V / (2 * L * h))
    assert model_flops_per_iteration(cfg) == pytest.approx(megatron, rel=1e-12)
    gqa = _model_cfg(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, seq_length=128,
                     activation="swiglu", ffn_hidden_size=512)
    b, s, L, h, V = 8, 128, 2, 256, gqa.model.padded_vocab_size
    megatron = 12 * b * s * L * h * h * ((1 + 2 / 8 + s / h) + 512 / h * 1.5 + V / (2 * L * h))
    assert model_flops_per_iteration(gqa) == pytest.approx(megatron, rel=1e-12)


def test_recompute_adds_a_forward_of_the_layers():
    plain = _model_cfg(num_layers=4, hidden_size=64, vocab_size=4)
    full = _model_cfg(num_layers=4, hidden_size=64, vocab_size=4, recompute_granularity="full")
    assert hardware_flops_per_iteration(plain) == model_flops_per_iteration(plain)
    # layers dominate with a tiny vocabulary: close to 4/3 of the model FLOPs
    assert hardware_flops_per_iteration(full) / model_flops_per_iteration(full) == pytest.approx(4 / 3, rel=2e-2)
    sel = _model_cfg(num_layers=4, hidden_size=64, vocab_size=4, recompute_granularity="selective")
    assert model_flops_per_iteration(sel) < hardware_flops_per_iteration(sel) < hardware_flops_per_iteration(full)


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("Tesla V100-SXM2-32GB") == 125e12
    assert peak_flops("Some Unknown Accelerator") is None and peak_flops(None) is None
    assert device_peak_flops(torch.device("cpu")) is None


# ---- start-up errors -----------------------------------------------------------------------
BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--train-iters", "2"]


def _never_called(cfg, mesh):
    raise AssertionError("the model must not be built when the flags are invalid")


@pytest.mark.parametrize("world,flags,needle", [
    (6, ["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size"),
    (2, ["--tensor-model-parallel-size", "8"], "world size 2"),
    (2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "48"],
     "--num-attention-heads 3"),
    (4, ["--global-batch-size", "6", "--micro-batch-size", "1"], "--global-batch-size 6"),
    (1, ["--fp16", "--bf16"], "--fp16"),
    (1, ["--sequence-parallel"], "--sequence-parallel"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], "--num-layers 3"),
    (1, ["--recompute-method", "block"], "--recompute-method"),
    (1, ["--min-lr", "1.0", "--lr", "0.1"], "--min-lr"),
])
def test_startup_errors_name_the_flag(world, flags, needle, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main(BASE + flags, _never_called, {"tiny": {}}) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("pretrain_gpt.py: error:")


def test_unknown_preset_is_an_argparse_error(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exc:
        main(BASE + ["--model", "no-such-model"], _never_called, {"tiny": {}})
    assert exc.value.code == 2 and "--model" in capsys.readouterr().err


def test_startup_error_for_missing_or_unsupported_data(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([a for a in BASE if a != "--mock-data"], _never_called) == 2
    assert "--mock-data" in capsys.readouterr().err
    assert main([a for a in BASE if a != "--mock-data"] + ["--data-path", "x"], _never_called) == 2
    assert "--data-path" in capsys.readouterr().err


def test_cli_reports_errors_before_any_process_group():
    """Under a torchrun environment without a rendezvous, a bad flag must fail fast with status 2."""
    env = dict(os.environ, WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, SCRIPT, *BASE, "--tensor-model-parallel-size", "3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--tensor-model-parallel-size 3" in proc.stderr
