"""Public Megatron-style launch scripts of 2025-2026, their flags kept (names and values) and their sizes
scaled down, through pretrain_gpt.py: each trains, or is refused by name only for a feature megazero
names as not implemented (FP8, Megatron-FSDP, DeepSpeed, per-document attention masks); never a
bare "unrecognized arguments" for a Megatron-LM flag.

Where a script builds its command from shell conditions, the branch is named; flags of the project a
script belongs to that Megatron-LM does not have are listed per script (left out, or kept where
megazero answers them by name)."""
import json

import pytest

from megazero.config import ConfigError, parse_args
from megazero.process.local_ranks import run_ranks
from test_megatron import gpt2_bpe, gpt3_175b_flags, llama3_8b_flags  # noqa: F401 - fixture and flag lists

DECOUPLED = ["--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
       "--fp8-param-gather"]


def qwen3_8b_flags(tmp, tokenizer_dir):
    """NVIDIA/Megatron-LM examples/post_training/modelopt/conf/Qwen/Qwen3-8B.sh (d98e8a6): its MODEL_ARGS,
    every flag kept, sizes scaled down (36 layers of 4096 with 32 heads of 128 channels and 8 key/value
    groups -> 2 layers of 64 with 8 heads of 16 channels: heads of other than hidden / heads channels,
    as Qwen3-0.6B has), TOKENIZER_MODEL a local Hugging Face tokenizer, and the training flags the
    recipe leaves to its caller (mock data, SGD-free defaults, 2 iterations)."""
    model = ["--save-interval", "100000", "--micro-batch-size", "1", "--bf16", "--no-masked-softmax-fusion",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type",
             "rope", "--no-rope-fusion", "--normalization", "RMSNorm", "--swiglu", "--num-layers", "2",
             "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "8",
             "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
             "--seq-length", "32", "--max-position-embeddings", "64", "--tokenizer-type",
             "HuggingFaceTokenizer", "--make-vocab-size-divisible-by", "1187", "--use-mcore-models",
             "--rotary-percent", "1.0", "--rotary-base", "1000000", "--no-bias-swiglu-fusion"]
    return model + ["--tokenizer-model", tokenizer_dir, "--mock-data", "--global-batch-size", "4",
                    "--lr", "1e-4", "--train-iters", "2", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--save", f"{tmp}/ckpt", "--log-interval", "1"]


def mixtral_8x7b_flags(tmp):
    """NVIDIA/Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh (d98e8a6), WANDB unset."""
    model = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "32",
             "--max-position-embeddings", "64",
             "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224", "--num-attention-heads",
             "8",
             "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
             "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000"]
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
           "--overlap-param-gather", "--overlap-grad-reduce"]
    rest = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--split", "99990,8,2",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "2",
            "--lr-decay-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay",
            "0.1",
            "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters",
            "10",
            "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt", "--tensorboard-dir", f"{tmp}/ckpt/tensorboard",
            "--no-load-optim", "--no-load-rng"]
    return model + moe + rest


def megatron_fsdp_llama3_flags(tmp):
    """NVIDIA/Megatron-LM examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (d98e8a6) with
    USE_MEGATRON_FSDP=1, SHARDING_STRATEGY=optim_grads_params, DTYPE=bf16, mock data."""
    base = llama3_8b_flags(tmp)
    base.remove("--grad-reduce-in-bf16")
    base.remove("--calculate-per-token-loss")
    base += ["--no-check-for-nan-in-loss-and-grad", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr",
             "4.5e-5"]
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--no-gradient-accumulation-fusion", "--calculate-per-token-loss",
            "--init-model-with-meta-device",
            "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub", "--fsdp-double-buffer",
            "--fsdp-manual-registration"]
    return base + fsdp


def megatron_deepspeed_llama2_flags(tmp, sp_model):
    """deepspeedai/Megatron-DeepSpeed examples_deepspeed/pretrain_llama2_distributed.sh (TP 2, PP 2,
    ZERO_STAGE=0, activation_checkpoint=false, LOG_TO_WANDB=0); its tokenizer is a sentencepiece model.
    The DeepSpeed flags (--deepspeed, --deepspeed_config, --zero-stage) come last."""
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--train-iters", "2", "--save", f"{tmp}/ckpt", "--load",
            f"{tmp}/ckpt",
            "--mock-data", "--data-impl", "mmap", "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", sp_model, "--split", "949,50,1", "--distributed-backend", "nccl", "--lr",
            "3e-4",
            "--lr-decay-style", "cosine", "--min-lr", "3e-5", "--weight-decay", "0.1", "--clip-grad", "1",
            "--lr-warmup-iters", "1", "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters",
            "10",
            "--bf16", "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu",
            "--normalization", "rmsnorm", "--disable-bias-linear", "--num-key-value-heads", "2",
            "--zero-stage=0", "--deepspeed_config=ds_config.json", "--deepspeed"]


def mindspeed_llama2_13b_flags(tmp):
    """Ascend/MindSpeed-LLM examples/mcore/llama2/pretrain_llama2_13b_ptd.sh (TP 8 there, 2 here). Its
    own flags that megazero answers are kept (the fused-kernel switches, ignored; --tokenizer-name-or-path,
    refused with Megatron-LM's spelling); --tokenizer-type PretrainedFromHF, --handler-name,
    --enable-hf2mg-convert and --model-type-hf are left out. Its --load names converted weights, a
    directory of its own; here that directory has no checkpoint: a warning and a fresh start, as in
    Megatron-LM."""
    return ["--use-mcore-models", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
            "--sequence-parallel", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
            "--num-attention-heads", "4", "--tokenizer-name-or-path", f"{tmp}/tokenizer",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--make-vocab-size-divisible-by", "1", "--lr", "1e-6",
            "--train-iters", "2",
            "--lr-decay-style", "cosine", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--attention-dropout", "0.0", "--init-method-std", "0.01", "--hidden-dropout", "0.0",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--use-fused-rmsnorm",
            "--swiglu",
            "--use-flash-attn", "--no-masked-softmax-fusion", "--attention-softmax-in-fp32", "--min-lr",
            "1e-8",
            "--weight-decay", "1e-1", "--lr-warmup-fraction", "0.01", "--clip-grad", "1.0", "--adam-beta1",
            "0.9",
            "--initial-loss-scale", "4096", "--adam-beta2", "0.95", "--no-gradient-accumulation-fusion",
            "--load", f"{tmp}/converted", "--no-load-optim", "--no-load-rng", "--use-fused-swiglu",
            "--use-fused-rotary-pos-emb", "--bf16",
            "--ckpt-format", "torch", "--mock-data", "--split", "949,50,1", "--log-interval", "1",
            "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
            "--distributed-backend", "nccl", "--save", f"{tmp}/save", "--transformer-impl", "local"]


def swallow_llama31_8b_flags(tmp):
    """okoge-kaz/Megatron-LM (Swallow, Tokyo Tech) scripts/abci/Llama-3.1-8B-ablation/
    llama-3.1-8b-tp4-pp2-exp7.sh, first training (no checkpoint of its own yet). Its fork's flags
    (--tokenizer-type Llama3Tokenizer, --rope-factor and its three companions, --use-mpi, --use-z-loss,
    --wandb-name) are left out; Megatron-LM's LLaMA-3.1 RoPE scaling is --use-rope-scaling
    --rope-scaling-factor 8. It trains on documents packed with per-document attention masks."""
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--context-parallel-size", "1", "--sequence-parallel", "--use-distributed-optimizer",
            "--overlap-grad-reduce", "--overlap-param-gather", "--num-layers", "4", "--hidden-size", "64",
            "--ffn-hidden-size", "224", "--num-attention-heads", "8", "--group-query-attention",
            "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
            "--reset-position-ids", "--reset-attention-mask", "--save", f"{tmp}/save", "--split", "990,10,0",
            "--distributed-backend", "nccl", "--lr", "2.5E-5", "--min-lr", "2.5E-6", "--lr-decay-style",
            "cosine",
            "--lr-decay-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1", "--lr-warmup-iters", "1",
            "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
            "--save-interval", "500", "--no-initialization", "--eval-interval", "500", "--eval-iters", "10",
            "--bf16", "--untie-embeddings-and-output-weights", "--no-position-embedding",
            "--position-embedding-type", "rope", "--rotary-base", "500000.0", "--use-rope-scaling",
            "--rope-scaling-factor", "8", "--disable-bias-linear", "--use-mcore-models", "--normalization",
            "RMSNorm", "--norm-epsilon", "1e-5", "--no-masked-softmax-fusion", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--swiglu", "--use-flash-attn", "--attention-softmax-in-fp32",
            "--accumulate-allreduce-grads-in-fp32", "--transformer-impl", "transformer_engine",
            "--log-throughput", "--log-straggler", "--disable-straggler-on-startup",
            "--wandb-project", "Llama-3.1-8B-ablation", "--wandb-entity", "prj-jalm", "--wandb-mode",
            "disabled"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("sp")
    (d / "text.txt").write_text("\n".join(["the quick brown fox jumps over the lazy dog"] * 40))
    spm.SentencePieceTrainer.Train(input=str(d / "text.txt"), model_prefix=str(d / "tok"), vocab_size=40,
                                   model_type="bpe", minloglevel=2)
    return str(d / "tok.model")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A Hugging Face tokenizer directory (save_pretrained) of a small byte-level BPE."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["To be, or not to be, that is the question."] * 50, vocab_size=300,
                            special_tokens=["<|endoftext|>"])
    d = str(tmp_path_factory.mktemp("hf_tokenizer"))
    PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>").save_pretrained(d)
    return d


def _without(argv, *flags_and_values):
    """``argv`` less the given flags, each with the values that follow it (until the next flag)."""
    out, skip = [], False
    for word in argv:
        if word.split("=")[0] in flags_and_values:
            skip = True
            continue
        if skip and not word.startswith("--"):
            continue
        skip = False
        out.append(word)
    return out


# name -> (flags, world size, refused for (ConfigError needle) or None, the flags of that feature)
def _scripts(tmp, bpe, sp):
    fsdp = megatron_fsdp_llama3_flags(tmp)
    deepspeed = megatron_deepspeed_llama2_flags(tmp, sp)
    return {
        "megatron-lm gpt3 175b": (gpt3_175b_flags(tmp, *bpe), 4, None, ()),
        "megatron-lm llama3 8b bf16": (llama3_8b_flags(tmp) + DECOUPLED, 2, None, ()),
        "megatron-lm llama3 8b fp8": (llama3_8b_flags(tmp) + FP8, 2, "--fp8-format: FP8/FP4 training is not "
                                      "implemented", tuple(f for f in FP8 if f.startswith("--"))),
        # PP 2 x EP 2 needs 4 ranks (the original's PP 4 x EP 8 needs 32)
        "megatron-lm mixtral 8x7b": (mixtral_8x7b_flags(tmp), 4, None, ()),
        "megatron-lm megatron-fsdp llama3 8b": (fsdp, 2, "--use-megatron-fsdp: Megatron-FSDP",
                                                ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                 "--fsdp-double-buffer", "--fsdp-manual-registration")),
        "megatron-deepspeed llama2": (deepspeed, 4, "--deepspeed: DeepSpeed is not used",
                                      ("--deepspeed", "--deepspeed_config", "--num-key-value-heads")),
        "mindspeed-llm llama2 13b": (mindspeed_llama2_13b_flags(tmp), 2,
                                     "--tokenizer-name-or-path: MindSpeed-LLM's "
                                     "flag: use --tokenizer-type HuggingFaceTokenizer",
                                     ("--tokenizer-name-or-path",)),
        "swallow llama3.1 8b": (swallow_llama31_8b_flags(tmp), 4, None, ()),
    }


FIXES = {  # what the refusal says to do instead, where a feature has a megazero spelling
    "megatron-deepspeed llama2": ["--group-query-attention", "--num-query-groups", "2"],
    "mindspeed-llm llama2 13b": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127"],
}
NAMES = ["megatron-lm gpt3 175b", "megatron-lm llama3 8b bf16", "megatron-lm llama3 8b fp8",
         "megatron-lm mixtral 8x7b", "megatron-lm megatron-fsdp llama3 8b", "megatron-deepspeed llama2",
         "mindspeed-llm llama2 13b", "swallow llama3.1 8b"]


@pytest.mark.parametrize("name", NAMES)
def test_script_parses_or_is_refused_by_name(name, tmp_path, gpt2_bpe, sp_model):  # noqa: F811
    argv, world, refused, feature = _scripts(tmp_path, gpt2_bpe, sp_model)[name]
    if refused:
        with pytest.raises(ConfigError, match=refused):
            parse_args(argv, world_size=world)
        argv = _without(argv, *feature) + FIXES.get(name, [])
    cfg = parse_args(argv, world_size=world)  # without the refused feature: every other flag has an answer
    assert cfg.training.train_iters >= 2 and not [n for n in cfg.notes if "unrecognized" in n]


def test_scripts_train_the_models_their_authors_meant(tmp_path, gpt2_bpe, sp_model):  # noqa: F811
    s = _scripts(tmp_path, gpt2_bpe, sp_model)
    gpt3 = parse_args(s["megatron-lm gpt3 175b"][0], world_size=4)  # no dropout flags: Megatron-LM's 0.1
    assert (gpt3.model.hidden_dropout, gpt3.model.activation, gpt3.optimizer.lr_decay_style) == \
        (0.1, "gelu_exact", "cosine")
    llama = parse_args(s["megatron-lm llama3 8b bf16"][0], world_size=2)
    assert (llama.optimizer.decoupled_lr, llama.optimizer.decoupled_min_lr) == (5e-4, 4.5e-5)
    ds = parse_args(_without(s["megatron-deepspeed llama2"][0], "--deepspeed", "--deepspeed_config",
                             "--num-key-value-heads") + FIXES["megatron-deepspeed llama2"], world_size=4)
    assert (ds.model.normalization, ds.model.num_query_groups, ds.parallel.zero_stage) == ("RMSNorm", 2, 0)
    swallow = parse_args(s["swallow llama3.1 8b"][0], world_size=4)  # packed documents, as Swallow trains
    assert swallow.data.reset_position_ids and swallow.data.reset_attention_mask
    assert swallow.model.use_rope_scaling and swallow.model.rope_scaling_factor == 8.0
    assert swallow.model.rotary_base == 500000.0
    mixtral = parse_args(s["megatron-lm mixtral 8x7b"][0], world_size=4).moe
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_aux_loss_coeff) == (8, 2, 1e-2)
    assert (mixtral.moe_token_dispatcher_type, mixtral.expert_model_parallel_size) == ("alltoall", 2)


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron-lm llama3 8b bf16", "megatron-deepspeed llama2",
                                  "mindspeed-llm llama2 13b",
                                  "swallow llama3.1 8b", "megatron-lm mixtral 8x7b"])
def test_script_trains_scaled_down(name, tmp_path, gpt2_bpe, sp_model):  # noqa: F811
    """Each script trains (without the flags of a refused feature) for its first iterations."""
    argv, world, refused, feature = _scripts(tmp_path, gpt2_bpe, sp_model)[name]
    argv = _without(argv, *feature) + FIXES.get(name, []) + ["--metrics-file", str(tmp_path / "m.jsonl")]
    assert run_ranks(_pretrain, world, argv, timeout=300) == [0] * world
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert len(rows) >= 2 and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.slow
def test_qwen3_recipe_trains_unmodified(tmp_path, hf_tokenizer):
    """Megatron-LM's Qwen3-8B flags, scaled down, train on 4 ranks (TP 2 x PP 2) as they are:
    --qk-layernorm (per-head RMSNorm of queries and keys) and --kv-channels 16 with 64 / 8 heads."""
    argv = qwen3_8b_flags(tmp_path, hf_tokenizer)
    cfg = parse_args(argv, world_size=4)
    m = cfg.model
    assert (m.qk_layernorm, m.qk_layernorm_scope, m.kv_channels, m.num_query_groups) == (True, "head", 16, 2)
    assert m.padded_vocab_size % (1187 * 2) == 0 and cfg.precision.bf16
    argv += ["--metrics-file", str(tmp_path / "m.jsonl")]
    assert run_ranks(_pretrain, 4, argv, timeout=300) == [0] * 4
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)
