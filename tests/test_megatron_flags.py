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
    (["--moe-router-num-groups", "2"], "--moe-router-num-groups: this mixture-of-experts option"),
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
    with pytest.raises(ConfigError, match=r"^--enable-gpt-oss: GPT-OSS mode \(ModelOpt: fills in GPT-OSS's "
                                          r"YaRN RoPE constants\) is not implemented"):
        parse_args(["--mock-data", "--enable-gpt-oss"], world_size=1)
    with pytest.raises(ConfigError, match="--export-kv-cache-quant fp8: quantization"):
        parse_args(["--mock-data", "--export-kv-cache-quant", "fp8"], world_size=1)


@pytest.mark.parametrize("flags,needle", [
    (["--no-async-tensor-model-parallel-allreduce"],
     "--no-async-tensor-model-parallel-allreduce: removed from Megatron-LM (last in its parser 2026-01); it "
     "only tuned speed, memory or communication, which changes no numbers, here as there: drop it"),
    (["--layernorm-epsilon", "1e-5"], "--layernorm-epsilon: removed from Megatron-LM (last in its parser "
                                      "2023-09); renamed: use --norm-epsilon"),
    (["--DDP-impl", "local", "--use-contiguous-buffers-in-ddp"], "--DDP-impl: removed .*; "
                                                                 "--use-contiguous-buffers-in-ddp: removed"),
    (["--local_rank=3"], "--local_rank: removed .* launch with torchrun"),
])
def test_flags_megatron_lm_removed_say_what_became_of_them(flags, needle):
    from megazero.config.megatron_removed import REMOVED
    assert not set(REMOVED) & (set(pinned_flags()) | implemented_flags())  # gone, answered nowhere else
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["--mock-data"] + flags, world_size=1)


def test_named_no_ops_of_the_issue_parse_with_a_note():
    cfg = parse_args(["--mock-data", "--log-progress", "--logging-level", "20",
                      "--no-log-loss-scale-to-tensorboard", "--num-dataset-builder-threads", "4",
                      "--dataloader-type", "single", "--main-grads-dtype", "fp32",
                      "--use-precision-aware-optimizer", "--persistent-save-interval", "7", "--save", "/x"],
                     world_size=1)
    (note,) = [n for n in cfg.notes if n.startswith("ignored Megatron-LM flags")]
    for flag in ("--log-progress", "--logging-level", "--no-log-loss-scale-to-tensorboard",
                 "--num-dataset-builder-threads", "--dataloader-type single", "--main-grads-dtype fp32",
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
