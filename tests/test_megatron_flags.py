"""Every current Megatron-LM flag has an answer: the pinned list of Megatron-LM's flag names, the script
that regenerates it, and the four kinds (implemented, ignored or default-only, refused, unknown)."""
import importlib.util
import os
import textwrap

import pytest

from megazero.config import ConfigError, build_parser, parse_args
from megazero.config.megatron import implemented_flags
from megazero.config.megatron_table import DEFAULT_ONLY, classify, pinned_flags, pinned_origin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("megatron_flags",
                                                  os.path.join(ROOT, "scripts", "megatron_flags.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pinned_list_is_a_generated_list_of_names():
    flags = pinned_flags()
    assert len(flags) > 800 and flags == sorted(set(flags)) and all(f.startswith("--") for f in flags)
    assert "Megatron-LM git" in pinned_origin()
    for flag in ("--num-layers", "--step-batch-size-schedule", "--moe-router-topk",
                 "--exit-on-missing-checkpoint", "--no-check-for-nan-in-loss-and-grad",
                 "--lr-wsd-decay-style", "--log-progress"):
        assert flag in flags, flag  # literal add_argument calls and dataclass fields alike
    assert "--rampup-batch-size" in flags and "--decoupled-lr" in flags


FAKE_ARGUMENTS = '''
import argparse
from megatron.training.argument_utils import ArgumentGroupFactory

def _add_training_args(parser):
    group = parser.add_argument_group(title='training')
    group.add_argument('--micro-batch-size', type=int)
    group.add_argument('--lr', '--learning-rate', type=float)
    group.add_argument('--wandb-logging', action=argparse.BooleanOptionalAction)
    exclude = ["internal_field"]
    ArgumentGroupFactory(TrainConfig, exclude=exclude).build_group(parser, "train")
    ArgumentGroupFactory(OtherConfig, exclude=["skipped"]).build_group(parser, "other")
    return parser
'''
FAKE_CONFIG = '''
from dataclasses import dataclass, field

@dataclass
class BaseConfig:
    seq_length: int = 1024

@dataclass(kw_only=True)
class TrainConfig(BaseConfig):
    train_iters: int | None = None
    check_for_nan: bool = True
    use_thing: bool = False
    internal_field: int = 3
    derived: int = field(init=False, default=0)
    save_interval: int = field(default=0, metadata={"argparse_meta": {
        "arg_names": ["--save-interval", "--persistent-save-interval"]}})

@dataclass
class OtherConfig:
    skipped: bool = True
    kept: str = "x"
'''


FAKE_MODELOPT = '''
def add_modelopt_args(parser):
    group = parser.add_argument_group(title="modelopt-generic")
    group.add_argument("--export-force-local-attention", action="store_true")
    return parser
'''


def test_extractor_reads_literal_flags_and_dataclass_fields(tmp_path):
    for path, text in (("megatron/training/arguments.py", FAKE_ARGUMENTS),
                       ("megatron/training/config/train.py", FAKE_CONFIG),
                       ("megatron/post_training/arguments.py", FAKE_MODELOPT)):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    mod = _script()
    got = mod.megatron_flags(mod.Source(str(tmp_path)))
    assert got == sorted(["--micro-batch-size", "--lr", "--learning-rate",
                          "--wandb-logging", "--no-wandb-logging", "--seq-length", "--train-iters",
                          "--no-check-for-nan", "--disable-check-for-nan",
                          "--use-thing", "--save-interval", "--persistent-save-interval", "--kept",
                          "--export-force-local-attention"])  # pretrain_gpt.py's ModelOpt flags too
    out = tmp_path / "flags.txt"
    assert mod.main(["--source", str(tmp_path), "--output", str(out)]) == 0
    assert mod.read_list(str(out)) == got and mod.main(["--source", str(tmp_path), "--output", str(out),
                                                        "--check"]) == 0
    out.write_text(out.read_text().replace("--kept\n", ""))
    assert mod.main(["--source", str(tmp_path), "--output", str(out), "--check"]) == 1


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM"), reason="set MEGATRON_LM to a Megatron-LM checkout")
def test_pinned_list_matches_a_megatron_checkout():
    mod = _script()
    assert mod.main(["--source", os.environ["MEGATRON_LM"], "--check"]) == 0


def test_every_pinned_flag_is_classified():
    implemented = implemented_flags()
    kinds = {flag: classify(flag, implemented) for flag in pinned_flags()}
    unknown = [f for f, (kind, _) in kinds.items() if kind == "unknown"]
    assert not unknown, f"Megatron-LM flags without an answer: {unknown}"
    assert all(why for kind, why in kinds.values() if kind != "implemented")  # every other kind says why
    counts = {k: sum(1 for kind, _ in kinds.values() if kind == k) for k in
              ("implemented", "ignored", "default-only", "refused")}
    assert counts["implemented"] > 100 and counts["refused"] > 100 and counts["ignored"] > 200, counts
    assert classify("--not-a-flag")[0] == "unknown"


def test_no_megatron_flag_is_an_unrecognized_argument():
    """Each flag alone on a command line: it parses (with a note if ignored) or is refused by name;
    argparse never says 'unrecognized arguments'."""
    parser = build_parser()
    options = set(parser._option_string_actions)
    implemented = implemented_flags()
    for flag in pinned_flags():
        assert flag in options, f"{flag}: not a megazero flag"
        if flag in implemented:
            continue
        value = list(DEFAULT_ONLY[flag][0][:1]) if flag in DEFAULT_ONLY else []
        try:
            cfg = parse_args(["--mock-data", flag] + value, world_size=1, parser=parser)
        except ConfigError as err:
            assert str(err).startswith(f"{flag}"), (flag, str(err))
            assert classify(flag)[0] == "refused"
        else:
            assert any(flag in n for n in cfg.notes), flag


@pytest.mark.parametrize("flags,needle", [
    (["--moe-input-jitter-eps", "0.1"], "--moe-input-jitter-eps: this mixture-of-experts option is not "
                                        "implemented"),
    # newer than the pinned list
    (["--moe-a-future-flag", "3"], "--moe-a-future-flag: this mixture-of-experts option"),
    (["--fp8-format", "hybrid"], "--fp8-format: FP8/FP4 training is not implemented; use --bf16"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp: Megatron-FSDP"),
    (["--dataloader-type", "cyclic"], "--dataloader-type cyclic: samples are read in order"),
    (["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16: main gradients are fp32; use fp32"),
    (["--batch-size", "4"], "--batch-size: no longer a Megatron-LM flag either: use --micro-batch-size"),
    (["--num-key-value-heads", "2"], "use --group-query-attention --num-query-groups N"),
])
def test_refused_flags_say_why_and_what_to_do(flags, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["--mock-data"] + flags, world_size=1)


def test_flags_megatron_does_not_have_are_unrecognized(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--mock-data", "--not-a-megatron-flag", "3"], world_size=1)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --not-a-megatron-flag 3" in err and "not among Megatron-LM's flags" in err
    with pytest.raises(SystemExit):  # spelled out, never guessed from a prefix (Megatron-LM's allow_abbrev)
        parse_args(["--mock-data", "--micro-batch", "2"], world_size=1)


def test_megatron_lms_own_modelopt_flags_get_true_reasons():
    """pretrain_gpt.py adds the ModelOpt flags when nvidia-modelopt is installed (Megatron-LM's GPT-OSS
    example passes two): each is answered as a Megatron-LM flag, never as one Megatron-LM lacks."""
    assert {"--export-force-local-attention", "--enable-gpt-oss"} <= set(pinned_flags())
    cfg = parse_args(["--mock-data", "--export-force-local-attention", "--export-model-type", "GPTModel"],
                     world_size=1)
    (note,) = [n for n in cfg.notes if n.startswith("ignored Megatron-LM flags")]
    assert "--export-force-local-attention (ModelOpt's choice of layer implementation" in note
    m = parse_args(["--mock-data", "--enable-gpt-oss"], world_size=1).model  # gpt-oss's YaRN, as ModelOpt
    assert (m.position_embedding_type, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings,
            m.yarn_correction_range_round_to_int) == ("yarn", 32.0, 131072, False)
    with pytest.raises(ConfigError, match=r"^--modelopt-enabled: ModelOpt"):
        parse_args(["--mock-data", "--modelopt-enabled"], world_size=1)
    with pytest.raises(ConfigError, match="--export-kv-cache-quant fp8: quantization"):
        parse_args(["--mock-data", "--export-kv-cache-quant", "fp8"], world_size=1)


@pytest.mark.parametrize("flags,needle", [
    (["--no-async-tensor-model-parallel-allreduce"],
     "--no-async-tensor-model-parallel-allreduce: removed from Megatron-LM (last in its parser 2026-01); it "
     "only tuned speed, memory or communication, which changes no numbers, here as there: drop it"),
    (["--layernorm-epsilon", "1e-5"], "--layernorm-epsilon: removed from Megatron-LM (last in its parser "
                                      "2023-09); renamed: use --norm-epsilon"),
    (["--DDP-impl", "local", "--use-contiguous-buffers-in-ddp"],
     "^2 flags refused: --DDP-impl: removed .* \\| --use-contiguous-buffers-in-ddp: removed"),
    (["--local_rank=3"], "--local_rank: removed .* launch with torchrun"),
])
def test_flags_megatron_lm_removed_say_what_became_of_them(flags, needle):
    from megazero.config.megatron_removed import REMOVED
    assert not set(REMOVED) & (set(pinned_flags()) | implemented_flags())  # gone, answered nowhere else
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["--mock-data"] + flags, world_size=1)


def test_named_no_ops_of_the_issue_parse_with_a_note():
    cfg = parse_args(["--mock-data", "--log-progress", "--logging-level", "20",
                      "--no-log-loss-scale-to-tensorboard",
                      "--dataloader-type", "single", "--main-grads-dtype", "fp32",
                      "--use-precision-aware-optimizer", "--persistent-save-interval", "7", "--save", "/x"],
                     world_size=1)
    (note,) = [n for n in cfg.notes if n.startswith("ignored Megatron-LM flags")]
    for flag in ("--log-progress", "--logging-level", "--no-log-loss-scale-to-tensorboard",
                 "--dataloader-type single", "--main-grads-dtype fp32",
                 "--use-precision-aware-optimizer"):
        assert flag in note, flag
    assert cfg.checkpoint.save_interval == 7  # --persistent-save-interval is --save-interval


def test_aliases_keep_megatrons_meaning():
    cfg = parse_args(["--mock-data", "--optimizer-cpu-offload", "--use-distributed-optimizer",
                      "--openai-gelu", "--use-tp-pp-dp-mapping", "--override-opt_param-scheduler"],
                     world_size=1)
    assert cfg.parallel.offload_optimizer and cfg.model.activation == "gelu"
    assert cfg.parallel.rank_order == "tp-pp-dp" and cfg.checkpoint.override_opt_param_scheduler
    cfg = parse_args(["--mock-data", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                      "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4"],
                     world_size=2)
    assert cfg.parallel.num_layers_per_virtual_pipeline_stage == 2
    assert cfg.parallel.pipeline_schedule == "interleaved"
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError, match="--num-virtual-stages-per-pipeline-rank and "
                                          "--num-layers-per-virtual-pipeline-stage"):
        parse_args(["--mock-data", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                    "--num-virtual-stages-per-pipeline-rank", "2",
                    "--num-layers-per-virtual-pipeline-stage", "2"],
                   world_size=2)


def test_what_megatron_accepts_is_accepted_and_named():
    """--eval-iters 0 with --eval-interval (no validation), --no-load-optim / --no-load-rng without --load
    and --save-interval without --save: Megatron-LM accepts them (gpt-oss's 02_train.sh passes them),
    so does megazero, each named at start-up as having no effect."""
    cfg = parse_args(["--mock-data", "--eval-iters", "0", "--eval-interval", "5", "--no-load-optim",
                      "--no-load-rng", "--save-interval", "100"], world_size=1)
    notes = " ".join(cfg.notes)
    assert cfg.training.eval_iters == 0 and cfg.checkpoint.save_interval == 100
    for needle in ("--eval-iters 0: no validation", "--save-interval 100 without --save: nothing is saved",
                   "--no-load-optim without --load", "--no-load-rng without --load"):
        assert needle in notes, needle
    with pytest.raises(ConfigError, match="--eval-iters must be >= 0"):
        parse_args(["--mock-data", "--eval-iters", "-1"], world_size=1)


def test_eval_iters_0_trains_without_evaluating():
    import models
    from megazero.training import train
    cfg = parse_args(["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                      "--seq-length", "8", "--vocab-size", "32", "--micro-batch-size", "1",
                      "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "0",
                      "--log-interval", "100"], world_size=1)
    history = train(cfg, models.build_chunks)
    assert len(history) == 2 and not any("eval_loss" in m for m in history)
    cfg = parse_args(["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                      "--seq-length", "8", "--vocab-size", "32", "--micro-batch-size", "1",
                      "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1",
                      "--log-interval", "100"], world_size=1)
    assert all("eval_loss" in m for m in train(cfg, models.build_chunks))  # the same run evaluates with 1


def test_every_refused_flag_is_named_in_one_message(capsys):
    """Three refused flags of three kinds (a refused table entry, a value other than Megatron-LM's
    default, a rule of their own) and a removed one: one error names them all (a script needs one rerun,
    not four); an unknown word on the same line is named in that error too."""
    argv = ["--mock-data", "--fp8-format", "hybrid", "--dataloader-type", "cyclic", "--grad-reduce-in-bf16",
            "--layernorm-epsilon", "1e-5"]
    with pytest.raises(ConfigError) as err:
        parse_args(argv, world_size=1)
    text = str(err.value)
    assert text.startswith("4 flags refused: ") and "\n" not in text
    parts = text[len("4 flags refused: "):].split(" | ")
    assert [p.split(" ")[0].rstrip(":") for p in parts] == ["--fp8-format", "--dataloader-type",
                                                            "--grad-reduce-in-bf16", "--layernorm-epsilon"]
    assert "use --bf16" in parts[0] and "cyclic" in parts[1] and "needs --bf16" in parts[2]
    assert "renamed: use --norm-epsilon" in parts[3]
    with pytest.raises(ConfigError) as err:
        parse_args(argv + ["--not-a-megatron-flag", "3", "--moe-a-future-flag", "2"], world_size=1)
    text = str(err.value)
    assert text.startswith("5 flags refused: --moe-a-future-flag: ") and "--layernorm-epsilon" in text
    assert text.endswith("; see --help)") and "unrecognized arguments: --not-a-megatron-flag 3 (" in text
    assert "--moe-a-future-flag 2" not in text  # its value went with it
    # a lone refusal reads as before: the flag first
    with pytest.raises(ConfigError, match=r"^--fp8-format: FP8"):
        parse_args(["--mock-data", "--fp8-format", "hybrid"], world_size=1)


def test_refusals_from_the_cli_exit_2_with_one_line(monkeypatch, capsys):
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = main(["--mock-data", "--fp8-format", "hybrid", "--dataloader-type", "cyclic",
                 "--grad-reduce-in-bf16"], lambda cfg, mesh: None)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("pretrain_gpt.py: error: 3 flags refused: --fp8")


def test_modelopt_qwen3_config_parses_as_megatron_lm_takes_it():
    """Megatron-LM's examples/post_training/modelopt/conf/Qwen/Qwen3-0.6B.sh (d98e8a6) MODEL_ARGS as
    written (its --save-interval without --save was refused before), the tokenizer a NullTokenizer."""
    model_args = ("--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion "
                  "--disable-bias-linear --position-embedding-type rope --no-rope-fusion "
                  "--normalization RMSNorm --swiglu --num-layers 28 --hidden-size 1024 "
                  "--ffn-hidden-size 3072 --num-attention-heads 16 "
                  "--group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm "
                  "--seq-length 4096 --max-position-embeddings 40960 --tokenizer-type NullTokenizer "
                  "--vocab-size 1000 --make-vocab-size-divisible-by 1187 --use-mcore-models "
                  "--rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion").split()
    cfg = parse_args(["--mock-data"] + model_args, world_size=1)
    assert cfg.checkpoint.save_interval == 100000 and cfg.checkpoint.save is None
    assert cfg.model.num_query_groups == 8 and cfg.model.padded_vocab_size == 1187
    assert any(n == "--save-interval 100000 without --save: nothing is saved" for n in cfg.notes)
