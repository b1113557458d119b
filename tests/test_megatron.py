"""Megatron-LM launch scripts: their flags (sizes scaled down, every flag name kept) parse and run;
aliases keep Megatron-LM's meaning; speed-only flags are named once; math-changing ones are refused;
the learning rate of the first iterations follows Megatron-LM's scheduler."""
import json
import os

import pytest

from megazero.config import ConfigError, parse_args
from megazero.config.megatron import IGNORED, REFUSED
from megazero.training.lr import lr_from_config
from megazero.process.local_ranks import run_ranks


def gpt3_175b_flags(tmp, vocab_file, merge_file):
    """NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh as of d98e8a6 (2026-08): its flags
    with the sizes scaled down, the batch-size schedule's thresholds too (tokens, as there: 4 sequences
    until 128 tokens, then 8); --mock-data stands in for --data-path (exclusive here)."""
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--step-batch-size-schedule", "0:4 128:8",
            "--train-iters", "4",
            "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
            "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
            "--lr-warmup-fraction", ".001", "--lr-decay-iters", "4",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--mock-data", "--vocab-file", vocab_file, "--merge-file", merge_file, "--split", "949,50,1",
            "--log-interval", "1", "--save-interval", "2", "--eval-interval", "2",
            "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt", "--eval-iters", "1",
            "--tensorboard-dir", f"{tmp}/tb", "--metrics-file", f"{tmp}/gpt3.jsonl"]


def llama3_8b_flags(tmp):
    """examples/llama/train_llama3_8b_h100_fp8.sh with DTYPE=bf16 (its FP8 block is conditional; FP8
    and the decoupled learning rate are refused below), sizes scaled down, mock data."""
    return ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
            "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
            "--kv-channels", "8", "--seq-length", "32", "--max-position-embeddings", "32",
            "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
            "--init-method-std", "0.0134",
            "--attention-backend", "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "32",
            "--lr-decay-samples", "24", "--lr-warmup-samples", "16", "--lr", "0.00015", "--min-lr", "0.00001",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
            "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
            "--exit-duration-in-mins", "235",
            "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
            "--data-cache-path", f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
            "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "2", "--save-interval", "1000",
            "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
            "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
            "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt", "--tensorboard-dir", f"{tmp}/tb",
            "--metrics-file", f"{tmp}/llama3.jsonl"]


@pytest.fixture(scope="module")
def gpt2_bpe(tmp_path_factory):
    """A small GPT-2 byte-level BPE (vocab.json + merges.txt) with <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer
    d = tmp_path_factory.mktemp("bpe")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["To be, or not to be, that is the question."] * 50, vocab_size=300,
                            special_tokens=["<|endoftext|>"])
    tok.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_gpt3_flags_parse(tmp_path, gpt2_bpe):
    cfg = parse_args(gpt3_175b_flags(tmp_path, *gpt2_bpe), world_size=4)
    with open(gpt2_bpe[0]) as fh:  # GPT2BPETokenizer (from the files): the vocabulary is theirs
        assert cfg.model.vocab_size == len(json.load(fh)) and cfg.data.tokenizer_type is None
    assert cfg.precision.fp16 and cfg.optimizer.lr_warmup_fraction == 0.001
    assert any("--attention-backend" in n for n in cfg.notes)
    # the model its authors meant: Megatron-LM's dropout and (erf) GELU, the batch-size schedule
    m = cfg.model
    assert (m.hidden_dropout, m.attention_dropout, m.activation) == (0.1, 0.1, "gelu_exact")
    assert cfg.training.step_batch_size_schedule == "0:4 128:8" and cfg.training.global_batch_size == 8
    older = gpt3_175b_flags(tmp_path, *gpt2_bpe)
    older[older.index("--step-batch-size-schedule"):older.index("--step-batch-size-schedule") + 2] = \
        ["--rampup-batch-size", "2", "2", "16"]  # the example before April 2026
    assert parse_args(older, world_size=4).training.rampup_batch_size == [2, 2, 16]


def test_llama3_flags_parse_with_megatrons_meaning(tmp_path):
    cfg = parse_args(llama3_8b_flags(tmp_path), world_size=2)
    m = cfg.model
    assert ((m.activation, m.position_embedding_type, m.num_query_groups, m.vocab_size)
            == ("swiglu", "rope", 2, 128))
    assert cfg.parallel.zero_stage == 1 and cfg.precision.grad_reduce_dtype == "param"
    assert not cfg.parallel.sequence_parallel  # TP 1: turned off, as Megatron-LM does
    assert cfg.training.train_iters == 4  # --train-samples 32 / --global-batch-size 8
    ignored = [n for n in cfg.notes if n.startswith("ignored Megatron-LM flags")]
    assert len(ignored) == 1
    assert cfg.parallel.context_parallel_size == 1  # a megazero setting now, not an ignored flag
    for flag in ("--use-mcore-models", "--overlap-param-gather", "--manual-gc",
                 "--apply-layernorm-1p", "--calculate-per-token-loss"):
        assert flag in ignored[0], flag
    assert any(n.startswith("--data-cache-path ") and "no effect" in n for n in cfg.notes)  # a setting now
    assert any(n.startswith("--sequence-parallel turned off") for n in cfg.notes)
    fp8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
           "--fp8-param-gather"]
    decoupled = ["--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5"]
    with pytest.raises(ConfigError) as err:
        parse_args(llama3_8b_flags(tmp_path) + fp8 + decoupled, world_size=2)
    for flag in ("--fp8-format", "--fp8-param-gather"):
        assert f"{flag}:" in str(err.value)
    assert "--decoupled-lr" not in str(err.value)  # implemented
    cfg = parse_args(llama3_8b_flags(tmp_path) + decoupled, world_size=2)
    assert (cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr) == (5e-4, 4.5e-5)


def megatron_lr(num_steps, max_lr, min_lr, warmup_steps, decay_steps, init_lr=0.0, style="cosine"):
    """Megatron-LM's OptimizerParamScheduler.get_lr (cosine or linear), written out independently."""
    import math
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warmup_steps)
    if num_steps > decay_steps:
        return min_lr
    ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def test_first_iterations_follow_megatrons_scheduler(tmp_path):
    # the scheduler is stepped by the global batch after each iteration, from 0 (sample-based)
    cfg = parse_args(llama3_8b_flags(tmp_path), world_size=2)
    want = [megatron_lr((it - 1) * 8, 1.5e-4, 1e-5, 16, 24) for it in range(1, 6)]
    assert [lr_from_config(cfg, it) for it in range(1, 6)] == pytest.approx(want, rel=1e-12)
    assert lr_from_config(cfg, 1) == 0.0  # warm-up starts from --lr-warmup-init (0)
    iters = parse_args(["--mock-data", "--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "3",
                        "--train-iters", "10", "--lr-warmup-init", "0.2"], world_size=1)
    # no --lr-decay-style: Megatron-LM's default, linear
    want = [megatron_lr(it - 1, 1.0, 0.1, 3, 10, init_lr=0.2, style="linear") for it in range(1, 12)]
    assert [lr_from_config(iters, it) for it in range(1, 12)] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("flags,needle", [
    (["--context-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 1 x "
     "--context-parallel-size 2"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5 rotates part of each head: it needs "
     "--position-embedding-type rope"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--train-samples", "64", "--train-iters", "4"], "--train-iters cannot be used with --train-samples"),
    (["--lr-decay-samples", "64"], "--lr-decay-samples needs --train-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    (["--swiglu", "--activation", "gelu"], "--swiglu means --activation swiglu"),
    (["--apply-wd-to-qk-layernorm"], "--apply-wd-to-qk-layernorm: weight decay on the --qk-layernorm scales"),
    (["--window-size", "7,1"], "--window-size 7,1: attention is causal, so RIGHT must be 0"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq chooses the layers that attend within"),
    (["--no-position-embedding"], "--no-position-embedding is deprecated.*--position-embedding-type none"),
    (["--rope-type", "yarn"], "--rope-type yarn: .*--position-embedding-type yarn"),
    (["--finetune"], "--finetune needs --load DIR"),
])
def test_refused_flags_name_the_flag_and_the_fix(flags, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        parse_args(["--mock-data"] + flags, world_size=1)


def test_num_query_groups_needs_group_query_attention():
    cfg = parse_args(["--mock-data", "--num-attention-heads", "4", "--num-query-groups", "2"], world_size=1)
    assert cfg.model.num_query_groups == 4 and "--num-query-groups 2 ignored" in cfg.notes[0]
    cfg = parse_args(["--mock-data", "--num-attention-heads", "4", "--num-query-groups", "2",
                      "--group-query-attention"], world_size=1)
    assert cfg.model.num_query_groups == 2 and not [n for n in cfg.notes if "--num-query-groups" in n]


def test_every_table_flag_is_in_help():
    import argparse
    from megazero.config import build_parser
    parser = build_parser()
    text = parser.format_help()
    assert all(flag in text for flag in IGNORED)
    shown = {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
    assert not shown & set(REFUSED)  # refused: not advertised


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_gpt3_175b_script_runs_scaled_down(tmp_path, gpt2_bpe, capfd):
    """TP 2 x PP 2, fp16, GPT-2 BPE vocabulary, saves and evaluates; run again with more iterations,
    it resumes from its own --save/--load directory (Megatron-LM's pattern) and continues the
    metrics file."""
    argv = gpt3_175b_flags(tmp_path, *gpt2_bpe)
    assert run_ranks(_pretrain, 4, argv, timeout=300) == [0] * 4
    rows = _rows(tmp_path / "gpt3.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4] and rows[0]["lr"] == 0.0
    assert [r["global_batch_size"] for r in rows] == [4, 8, 8, 8]  # 128 tokens = 4 sequences, then 8
    assert [r["consumed_samples"] for r in rows] == [4, 12, 20, 28]
    assert all(r["loss_scale"] > 1 for r in rows) and "eval_loss" in rows[1]
    assert os.listdir(tmp_path / "tb") and (tmp_path / "ckpt" / "iter_0000004").is_dir()
    out = capfd.readouterr().out
    assert out.count("ignored Megatron-LM flags") == 1 and "--attention-backend" in out
    assert run_ranks(_pretrain, 4, argv[:argv.index("--train-iters") + 1] + ["6"]
                     + argv[argv.index("--train-iters") + 2:], timeout=300) == [0] * 4
    again = _rows(tmp_path / "gpt3.jsonl")
    assert [r["iteration"] for r in again] == [1, 2, 3, 4, 5, 6] and again[:4] == rows
    assert again[-1]["consumed_samples"] == 44
    assert "loaded checkpoint" in capfd.readouterr().out


@pytest.mark.slow
def test_llama3_8b_script_runs_scaled_down(tmp_path):
    """DP 2 with ZeRO-1 (--use-distributed-optimizer), bf16, grouped-query attention,
    sample-based schedule."""
    argv = llama3_8b_flags(tmp_path)
    assert run_ranks(_pretrain, 2, argv, timeout=300) == [0, 0]
    rows = _rows(tmp_path / "llama3.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == pytest.approx(
        [megatron_lr(8 * i, 1.5e-4, 1e-5, 16, 24) for i in range(4)])
    assert all(r["loss"] == r["loss"] for r in rows)  # finite


def test_rope_type_rope_yarn_and_no_position_embedding():
    """Megatron-LM's --rope-type rope (ordinary attention's) is accepted and named; YaRN is
    --position-embedding-type yarn with Megatron-LM's flags; --position-embedding-type none is NoPE."""
    cfg = parse_args(["--mock-data", "--position-embedding-type", "rope", "--rope-type", "rope"],
                     world_size=1)
    assert cfg.model.position_embedding_type == "rope" and any("--rope-type rope" in n for n in cfg.notes)
    yarn = parse_args(["--mock-data", "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                       "--yarn-original-max-position-embeddings", "32", "--yarn-beta-fast", "16",
                       "--no-yarn-correction-range-round-to-int", "--mscale", "0.7", "--mscale-all-dim",
                       "0.7"], world_size=1).model
    assert (yarn.rotary_scaling_factor, yarn.yarn_original_max_position_embeddings, yarn.yarn_beta_fast,
            yarn.yarn_correction_range_round_to_int, yarn.mscale) == (4.0, 32, 16.0, False, 0.7)
    nope = parse_args(["--mock-data", "--position-embedding-type", "none", "--seq-length", "64",
                       "--max-position-embeddings", "16"], world_size=1)
    import torch
    import models
    model = models.build_model(nope)
    assert not any("position" in n for n, _ in model.named_parameters())
    assert model(torch.randint(0, 100, (2, 64))).shape == (2, 64, nope.model.vocab_size)
