import ast
import json
import os
import sys

import pytest

from megazero.config import ConfigError, config_from_dict, parse_args, validate

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]


def parse(*extra, world=1, presets=None):
    return parse_args(BASE + list(extra), world_size=world, presets=presets)


def test_defaults_and_derived_values():
    cfg = parse("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "1000", world=8)
    assert cfg.parallel.data_parallel_size == 2
    assert cfg.training.num_micro_batches == 4
    assert cfg.model.padded_vocab_size == 1024  # multiple of 128 x tp 2 = 256
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.kv_channels == 16
    assert cfg.optimizer.lr_decay_iters == cfg.training.train_iters


def test_make_vocab_size_divisible_by():
    cfg = parse(
        "--vocab-size", "50257", "--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size",
        "4", world=4)
    assert cfg.model.padded_vocab_size == 50432  # next multiple of 256


def test_delay_wgrad_compute_is_on_by_default_and_megatrons_switch_agrees():
    assert parse().parallel.delay_wgrad_compute is True
    assert parse("--delay-wgrad-compute").parallel.delay_wgrad_compute is True
    assert parse("--no-delay-wgrad-compute").parallel.delay_wgrad_compute is False


def test_host_malloc_choices(capsys):
    assert parse().precision.host_malloc == "auto"
    assert parse("--host-malloc", "release").precision.host_malloc == "release"
    with pytest.raises(SystemExit) as e:
        parse("--host-malloc", "never")
    assert e.value.code == 2 and "--host-malloc" in capsys.readouterr().err


def test_use_distributed_optimizer_is_stage_1():
    assert parse("--use-distributed-optimizer").parallel.zero_stage == 1
    assert parse("--zero-stage", "3").parallel.zero_stage == 3


def test_file_then_flags_override(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"parallel": {"zero_stage": 2}, "lr": 0.5, "hidden-size": 128}))
    cfg = parse("--config", str(path), "--lr", "0.25")
    assert cfg.parallel.zero_stage == 2 and cfg.optimizer.lr == 0.25
    assert cfg.model.hidden_size == 64  # the flag in BASE wins over the file
    yml = tmp_path / "c.yaml"
    yml.write_text("train-iters: 7\nmodel:\n  num_query_groups: 2\n")
    cfg = parse("--config", str(yml))
    assert cfg.training.train_iters == 7 and cfg.model.num_query_groups == 2


def test_preset_then_flags():
    presets = {"small": {"num_layers": 6, "hidden_size": 96, "num_attention_heads": 6}}
    cfg = parse_args(["--mock-data", "--model", "small", "--num-layers", "3"], presets=presets, world_size=1)
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 96 and cfg.model_preset == "small"
    with pytest.raises(ConfigError, match="unknown model preset; choose one of: small"):
        config_from_dict({"model_preset": "huge"}, presets)


def test_unknown_setting_in_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hiden_size": 3}))
    with pytest.raises(ConfigError, match="unknown setting 'hiden_size'"):
        parse("--config", str(path))


@pytest.mark.parametrize("extra,world,msg", [
    (["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"], 4,
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--pipeline-model-parallel-size", "3"], 3,
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (["--pipeline-model-parallel-size", "8"], 8,
     "--pipeline-model-parallel-size 8 is larger than --num-layers 4"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 2 x --num-layers-per-virtual"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     r"--pipeline-model-parallel-size 2 stages: .*multiple of the pipeline-parallel size 2, got 3; "
     r"allowed counts: 2, 4, 6"),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "1"], 3, None),  # 1 + 2 + 1: valid
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "3"], 3,
     "cannot be split evenly over the other 2 pipeline stages"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1,
     "--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 1"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--sequence-parallel", "--sequence-parallel"], 1, None),  # turned off with TP 1, as in Megatron-LM
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16 cannot be used together"),
    (["--tensor-model-parallel-size", "3"], 8,
     "world size 8 is not divisible by --tensor-model-parallel-size 3"),
    (["--offload-optimizer"], 1, "--offload-optimizer needs --zero-stage 1, 2 or 3"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1,
     "--hidden-size 100 is not divisible by --num-attention-heads 3"),
    (["--seq-length", "128", "--max-position-embeddings", "64"], 1, "--seq-length 128 exceeds"),
    (["--recompute-method", "block"], 1, "--recompute-method is only used with --recompute-granularity full"),
    (["--min-lr", "1", "--lr", "0.1"], 1, "--min-lr 1.0 is above --lr 0.1"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout must be in"),
    (["--hysteresis", "0"], 1, "--hysteresis must be >= 1"),
    (["--save-interval", "5", "--no-load-optim", "--no-load-rng"], 1, None),  # accepted, as in Megatron-LM
    (["--save", "/tmp/ckpt", "--save-interval", "-1"], 1, "--save-interval must be >= 0"),
    (["--load", ""], 1, "--load needs a directory"),
    (["--global-batch-size", "0"], 1, "--global-batch-size must be a positive integer, got 0"),
    (["--kv-channels", "0"], 1, "--kv-channels must be a positive integer, got 0"),
    (["--ffn-hidden-size", "0"], 1, "--ffn-hidden-size must be a positive integer, got 0"),
    (["--lr-decay-iters", "0"], 1, "--lr-decay-iters must be a positive integer, got 0"),
    (["--lr-decay-iters", "5", "--lr-warmup-iters", "5"], 1,
     "--lr-decay-iters 5 must be greater than --lr-warmup-iters 5"),
    (["--adam-beta1", "1.0"], 1, "--adam-beta1/--adam-beta2 must be in"),
    (["--seed", "-5"], 1, "--seed must be >= 0, got -5"),
    (["--eval-interval", "2", "--eval-iters", "0"], 1, None),  # no validation, as in Megatron-LM
    (["--eval-iters", "-1"], 1, "--eval-iters must be >= 0"),
    (["--rank-order", "foo"], 1, "--rank-order: unknown axis 'foo'"),
    (["--vocab-size", "1"], 1, "--vocab-size must be at least 2 for --mock-data"),
])
def test_validation_errors_name_the_flag(extra, world, msg):
    if msg is None:
        parse(*extra, world=world)
        return
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)") if "allowed" not in msg
                       else msg):
        parse(*extra, world=world)


def test_zero_stage_out_of_range():
    with pytest.raises(ConfigError, match="--zero-stage must be 0, 1, 2 or 3, got 4"):
        parse("--zero-stage", "4")


def test_no_data_source():
    with pytest.raises(ConfigError, match="--mock-data"):
        parse_args(["--num-layers", "2"], world_size=1)


def test_a_layout_check_needs_no_data():
    """check_data=False (a model to load weights into, a planned layout) skips the data settings only."""
    layout = config_from_dict({"num_layers": 2, "tensor_model_parallel_size": 2})
    assert not validate(layout, world_size=2, check_data=False).data.mock_data
    with pytest.raises(ConfigError, match="no training data: pass --mock-data"):
        validate(layout, world_size=2)
    with pytest.raises(ConfigError, match="--num-attention-heads 4 is not divisible by "
                                          "--tensor-model-parallel-size 3"):
        validate(config_from_dict({"tensor_model_parallel_size": 3}), world_size=3, check_data=False)
    with pytest.raises(ConfigError, match="--mock-data and --data-path are exclusive"):
        validate(config_from_dict({"mock_data": True, "data_path": ["x"], "vocab_size": 512}), world_size=1)
    assert not parse_args(["--num-layers", "2"], world_size=1, check_data=False).data.mock_data


def test_hidden_not_divisible_by_tp():
    cfg = config_from_dict({"mock_data": True, "hidden_size": 98, "num_attention_heads": 4,
                            "kv_channels": 32, "tensor_model_parallel_size": 4})
    with pytest.raises(ConfigError, match="hidden size 98 is not divisible by tensor-model-parallel size 4"):
        validate(cfg, world_size=4)


def test_cli_help_lists_megatron_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--zero-stage",
                 "--num-layers-per-virtual-pipeline-stage", "--recompute-granularity", "--loss-scale-window",
                 "--use-distributed-optimizer", "--untie-embeddings-and-output-weights", "--metrics-file"):
        assert flag in out


def test_revalidation_recomputes_derived_defaults():
    """Values validate() derived (global batch, ffn size, decay iters) follow later changes."""
    cfg = parse()  # world 1: global batch = micro batch 2
    assert cfg.training.global_batch_size == 2 and cfg.model.ffn_hidden_size == 256
    cfg.model.hidden_size, cfg.training.train_iters = 128, 30
    cfg = validate(cfg, world_size=4)
    assert cfg.training.global_batch_size == 8 and cfg.model.ffn_hidden_size == 512
    assert cfg.optimizer.lr_decay_iters == 30 and cfg.parallel.data_parallel_size == 4
    explicit = parse("--global-batch-size", "16", "--ffn-hidden-size", "100")
    explicit = validate(explicit, world_size=2)  # values the user gave are kept
    assert explicit.training.global_batch_size == 16 and explicit.model.ffn_hidden_size == 100


def test_validate_leaves_its_argument_unchanged_and_reads_no_files(tmp_path):
    cfg = config_from_dict({"mock_data": True, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4})
    before = cfg.to_dict()
    resolved = validate(cfg, world_size=2)
    assert cfg.to_dict() == before and cfg.derived is None
    assert resolved.model.ffn_hidden_size == 256 and resolved.parallel.data_parallel_size == 2
    assert resolved.is_filled("ffn_hidden_size") and not resolved.is_filled("hidden_size")
    assert resolved.derived.padded_vocab_size == resolved.model.padded_vocab_size


def test_store_false_flags_say_what_the_flag_does(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--disable-bias-linear Linear layers without biases" in out
    assert "--no-overlap-grad-reduce Do not overlap" in out


def test_schedule_must_fit_virtual_stages():
    with pytest.raises(ConfigError, match="the 1f1b schedule runs one model chunk per stage, got 2; use the "
                                          "interleaved schedule"):
        parse("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
              "--pipeline-schedule", "1f1b", world=2)
    assert parse("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                 "--global-batch-size", "4", world=2).parallel.pipeline_schedule == "interleaved"
    assert parse("--pipeline-model-parallel-size", "2", world=2).parallel.pipeline_schedule == "1f1b"


def test_config_is_a_schema_that_imports_no_other_subsystem():
    """``megazero.config`` (the settings, flags and checks) imports no other part of megazero, nor torch,
    when it is imported: the subsystems it asks are imported where a check runs."""
    import subprocess
    code = ("import sys, megazero.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('megazero', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    loaded = ast.literal_eval(out)
    assert loaded and all(m in ("megazero", "megazero.errors") or m.startswith("megazero.config")
                          for m in loaded), loaded


def test_dry_run_prints_the_start_up_notes_about_the_flags(monkeypatch, capsys):
    from models.cli import pretrain_main
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain_main(["--dry-run", "--mock-data", "--model", "tiny", "--log-progress"]) == 0
    out = capsys.readouterr().out
    assert "megazero: ignored Megatron-LM flags (no effect here): --log-progress" in out
    assert "dry run: the flags are valid for 2 ranks" in out
