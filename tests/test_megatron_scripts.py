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


def mindspeed_llama2_13b_flags(tmp, tokenizer_dir):
    """Ascend/MindSpeed-LLM examples/mcore/llama2/pretrain_llama2_13b_ptd.sh (a9547f6; TP 8 there, 2 here),
    every flag kept, its own included: --tokenizer-type PretrainedFormHF (sic) with --tokenizer-name-or-path
    (a Hugging Face tokenizer directory), the fused-kernel switches (ignored), --handler-name (its
    preprocessing handler) and --enable-hf2mg-convert --model-type-hf llama2 (its start-up conversion of
    Hugging Face weights in --load). Its --load names weights to convert; here that directory is empty:
    nothing to convert, a warning and a fresh start, as in Megatron-LM. Its data path is mock data."""
    return ["--use-mcore-models", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
            "--sequence-parallel", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
            "--num-attention-heads", "4", "--tokenizer-type", "PretrainedFormHF", "--tokenizer-name-or-path",
            tokenizer_dir, "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
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
            "--use-fused-rotary-pos-emb", "--bf16", "--ckpt-format", "torch",
            "--mock-data", "--handler-name", "GeneralPretrainHandler", "--split", "949,50,1",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters",
            "10", "--enable-hf2mg-convert", "--model-type-hf", "llama2",
            "--distributed-backend", "nccl", "--save", f"{tmp}/save", "--transformer-impl", "local"]


def swallow_llama31_8b_flags(tmp, tokenizer_dir):
    """okoge-kaz/Megatron-LM (Swallow, Tokyo Tech) scripts/abci/Llama-3.1-8B-ablation/
    llama-3.1-8b-tp4-pp2-exp7.sh, first training (no checkpoint of its own yet), every flag kept, its fork's
    own included: --tokenizer-type Llama3Tokenizer (its --tokenizer-model, a tiktoken file there, is the
    Hugging Face directory of a tokenizer here), --rope-factor 8.0 with its three companions (LLaMA-3.1
    RoPE scaling), --use-mpi (under torchrun here), --use-z-loss (a 1e-4 z-loss on the logits) and
    --wandb-name. It trains on documents packed with per-document attention masks; its data path is mock
    data (--wandb-mode disabled added: no wandb run in a test)."""
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--context-parallel-size", "1", "--sequence-parallel", "--use-distributed-optimizer",
            "--overlap-grad-reduce", "--overlap-param-gather", "--num-layers", "4", "--hidden-size", "64",
            "--ffn-hidden-size", "224", "--num-attention-heads", "8", "--group-query-attention",
            "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
            "--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", tokenizer_dir,
            "--reset-position-ids", "--reset-attention-mask", "--save", f"{tmp}/save", "--mock-data",
            "--split", "990,10,0",
            "--distributed-backend", "nccl", "--lr", "2.5E-5", "--min-lr", "2.5E-6", "--lr-decay-style",
            "cosine",
            "--lr-decay-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1", "--lr-warmup-iters", "1",
            "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
            "--save-interval", "500", "--no-initialization", "--eval-interval", "500", "--eval-iters", "10",
            "--bf16", "--untie-embeddings-and-output-weights", "--no-position-embedding",
            "--position-embedding-type", "rope", "--rotary-base", "500000.0", "--rope-factor", "8.0",
            "--rope-low-freq-factor", "1.0", "--rope-high-freq-factor", "4.0",
            "--rope-original-max-positional-embeddings", "8192", "--disable-bias-linear",
            "--use-mcore-models",
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--no-masked-softmax-fusion",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--use-flash-attn",
            "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--transformer-impl",
            "transformer_engine", "--use-mpi", "--use-z-loss", "--log-throughput", "--log-straggler",
            "--disable-straggler-on-startup", "--wandb-name", "exp7", "--wandb-project",
            "Llama-3.1-8B-ablation", "--wandb-entity", "prj-jalm", "--wandb-mode", "disabled"]


def deepseek_v3_flags(tmp, tokenizer_dir):
    """NVIDIA/Megatron-LM examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh (d98e8a6), the
    DeepSeek-V3 architecture: its MODEL_ARGS, every flag kept, sizes scaled down (61 layers of 7168 with
    128 heads, 256 experts of 2048, 8 groups choosing 4 -> 4 layers of 64 with 4 heads, 8 experts of 32,
    4 groups choosing 2, top-2; MLA ranks 1536 / 512 -> 32 / 16, head dims 128 / 64 -> 16 / 8; the first
    3 dense layers -> 1: --moe-layer-freq [0]*1+[1]*3), TOKENIZER_MODEL a local Hugging Face tokenizer,
    and the training flags the recipe leaves to its caller (mock data, 2 iterations)."""
    model = ["--save-interval", "100000", "--micro-batch-size", "1", "--bf16", "--no-masked-softmax-fusion",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type",
             "rope", "--no-rope-fusion", "--normalization", "RMSNorm", "--swiglu", "--num-layers", "4",
             "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
             "--kv-channels", "16", "--multi-latent-attention", "--kv-lora-rank", "16", "--v-head-dim", "16",
             "--q-lora-rank", "32", "--qk-head-dim", "16", "--qk-layernorm", "--qk-pos-emb-head-dim", "8",
             "--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*3", "--moe-ffn-hidden-size", "32",
             "--moe-router-dtype", "fp32", "--moe-router-score-function", "sigmoid",
             "--moe-router-bias-update-rate", "1e-3", "--moe-router-enable-expert-bias", "--moe-router-topk",
             "2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-pre-softmax",
             "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-overlap",
             "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "1e-4",
             "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
             "--moe-token-drop-policy", "probs", "--seq-length", "32", "--max-position-embeddings", "1280",
             "--tokenizer-type", "HuggingFaceTokenizer", "--make-vocab-size-divisible-by", "1280",
             "--use-mcore-models", "--rotary-base", "10000", "--rotary-percent", "1.0",
             "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0",
             "--recompute-activations", "--moe-layer-recompute", "--sequence-parallel"]
    return model + ["--tokenizer-model", tokenizer_dir, "--mock-data", "--global-batch-size", "4",
                    "--lr", "1e-4", "--train-iters", "2", "--tensor-model-parallel-size", "2",
                    "--expert-model-parallel-size", "2", "--save", f"{tmp}/ckpt", "--log-interval", "1"]


def deepseek_v3_mfsdp_flags(tmp, tokenizer_dir):
    """NVIDIA/Megatron-LM examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (d98e8a6), its PRETRAIN_ARGS
    with USE_MEGATRON_FSDP=0 (the branch without Megatron-FSDP), PROFILE=0, WANDB=0, every flag kept, sizes
    scaled down (61 layers of 7168 with 128 heads, 256 experts of 2048 top-8 in 8 groups choosing 4, the
    first 3 dense -> 4 layers of 64 with 4 heads, 8 experts of 32 top-2 in 4 groups choosing 2, the first
    dense; MLA ranks 1536 / 512 -> 32 / 16, head dims 128 / 64 -> 16 / 8; 4096 tokens -> 32; EP 8 -> 2,
    MBS 4 -> 1, GBS 2048 -> 4, 585937500 samples -> 8: 2 iterations), TOKENIZER a local Hugging Face
    directory, its data path mock data. MTP depth 1 as written."""
    return ["--distributed-timeout-minutes", "60", "--tensor-model-parallel-size", "1",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
            "--context-parallel-size", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--use-mcore-models", "--sequence-parallel", "--use-flash-attn",
            "--disable-bias-linear", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-samples", "8", "--exit-duration-in-mins", "220", "--no-check-for-nan-in-loss-and-grad",
            "--manual-gc", "--manual-gc-interval", "10", "--recompute-granularity", "selective",
            "--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm", "--transformer-impl",
            "transformer_engine", "--seq-length", "32", "--data-cache-path", f"{tmp}/cache",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir, "--mock-data",
            "--split", "99,1,0", "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader",
            "--num-workers", "6", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--kv-channels", "16", "--max-position-embeddings", "32",
            "--position-embedding-type", "rope", "--rotary-base", "10000", "--make-vocab-size-divisible-by",
            "3232", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
            "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--clip-grad", "1.0", "--weight-decay", "0.1", "--qk-layernorm",
            "--lr-decay-samples", "6", "--lr-warmup-samples", "2", "--lr-warmup-init", "3.9e-7", "--lr",
            "3.9e-6", "--min-lr", "3.9e-7", "--lr-decay-style", "cosine", "--adam-beta1", "0.9",
            "--adam-beta2", "0.95", "--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*3",
            "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk", "2",
            "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
            "--moe-router-pre-softmax", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-4",
            "--moe-router-group-topk", "2", "--moe-router-num-groups", "4",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
            "--moe-router-force-load-balancing", "--q-lora-rank", "32", "--kv-lora-rank", "16",
            "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
            "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0",
            "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1", "--eval-iters", "32",
            "--eval-interval", "100", "--auto-detect-ckpt-format", "--load", f"{tmp}/checkpoints", "--save",
            f"{tmp}/checkpoints", "--save-interval", "100", "--dist-ckpt-strictness", "log_all",
            "--init-method-std", "0.02", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
            "--log-num-zeros-in-grad", "--log-params-norm", "--log-validation-ppl-to-tensorboard",
            "--log-throughput", "--log-interval", "1", "--logging-level", "40", "--tensorboard-dir",
            f"{tmp}/tensorboard", "--bf16", "--enable-experimental"]


def deepseek_v2_lite_flags(tmp, tokenizer_dir):
    """NVIDIA/Megatron-LM examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh (d98e8a6): its
    MODEL_ARGS, every flag kept, sizes scaled down (27 layers of 2048 with 16 heads, 64 experts of 1408,
    top-6 -> 3 layers of 64 with 4 heads, 8 experts of 32, top-2; --kv-lora-rank 512 -> 16, head dims
    128 / 64 -> 16 / 8; no query LoRA, as V2-Lite has none), TOKENIZER_MODEL a local Hugging Face
    tokenizer, and the caller's training flags (mock data, 2 iterations)."""
    model = ["--save-interval", "100000", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--micro-batch-size", "1", "--bf16", "--no-masked-softmax-fusion", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-rope-fusion",
             "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--num-layers", "4",
             "--hidden-size", "64", "--ffn-hidden-size", "160", "--num-attention-heads", "4",
             "--kv-channels", "16", "--multi-latent-attention", "--kv-lora-rank", "16", "--v-head-dim", "16",
             "--qk-head-dim", "16", "--qk-layernorm", "--qk-pos-emb-head-dim", "8", "--num-experts", "8",
             "--moe-layer-freq", "([0]+[1]*3)", "--moe-ffn-hidden-size", "32", "--moe-grouped-gemm",
             "--moe-router-score-function", "softmax", "--moe-router-topk", "2",
             "--moe-router-topk-scaling-factor", "1.0", "--moe-router-pre-softmax",
             "--moe-shared-expert-intermediate-size", "64", "--moe-aux-loss-coeff", "1e-3",
             "--moe-token-dispatcher-type", "alltoall", "--moe-token-drop-policy", "probs",
             "--moe-router-load-balancing-type", "seq_aux_loss", "--seq-length", "32",
             "--max-position-embeddings", "32", "--tokenizer-type", "HuggingFaceTokenizer",
             "--make-vocab-size-divisible-by", "3200", "--attention-softmax-in-fp32", "--use-mcore-models",
             "--rotary-percent", "1.0", "--rotary-base", "10000", "--rotary-scaling-factor", "40",
             "--mscale", "0.707", "--mscale-all-dim", "0.707", "--sequence-parallel"]
    return model + ["--tokenizer-model", tokenizer_dir, "--mock-data", "--global-batch-size", "4",
                    "--lr", "1e-4", "--train-iters", "2", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--save", f"{tmp}/ckpt", "--log-interval", "1"]


def gpt_oss_train_flags(tmp):
    """NVIDIA/Megatron-LM examples/gptoss/02_train.sh (d98e8a6), its mock branch (TOKENIZER_ARG=MOCK),
    DTYPE=fp8 as written (its FP8 flags are refused by name), every flag kept; sizes scaled down (12 layers
    of 512 with 64 heads of 8 query groups, 4 experts of 2048 -> 2 layers of 64 with 8 heads of 2 groups,
    4 experts of 64; --window-size 127,0 -> 7,0 below 32 tokens; 128256 vocabulary -> 127), PP = the 2
    ranks as the script sets it, 2 iterations of 4 samples (--train-samples 8) instead of 1953125000."""
    model = ["--no-masked-softmax-fusion", "--transformer-impl", "transformer_engine",
             "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--no-rope-fusion", "--normalization", "RMSNorm",
             "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "64", "--num-attention-heads",
             "8", "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
             "--max-position-embeddings", "32", "--use-mcore-models", "--rotary-percent", "1.0",
             "--rope-type", "rope", "--position-embedding-type", "rope", "--rotary-base", "10000",
             "--no-bias-gelu-fusion", "--export-force-local-attention", "--no-bias-dropout-fusion",
             "--quick-geglu", "--glu-linear-offset", "1.0", "--softmax-type", "learnable",
             "--window-attn-skip-freq", "2", "--activation-func-clamp-value", "7.0", "--window-size", "7,0",
             "--enable-gpt-oss"]
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
           "--overlap-param-gather", "--overlap-grad-reduce", "--moe-ffn-hidden-size", "64",
           "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3", "--moe-permute-fusion"]
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--data-cache-path",
            f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1.0e-5", "--train-samples",
                "8", "--lr-decay-samples", "6", "--lr-decay-style", "cosine", "--min-lr", "1.0e-6",
                "--weight-decay", "0.1", "--lr-warmup-fraction", "0.05", "--clip-grad", "1.0", "--bf16",
                "--use-flash-attn", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
                "--disable-bf16-reduced-precision-matmul", "--recompute-activations"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                "--expert-model-parallel-size", "1", "--sequence-parallel", "--context-parallel-size", "1",
                "--use-distributed-optimizer", *FP8]
    logging = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "50000000",
               "--eval-iters", "0", "--save", f"{tmp}/ckpt", "--tensorboard-dir", f"{tmp}/ckpt/tensorboard",
               "--moe-per-layer-logging", "--no-load-optim", "--no-load-rng", "--log-throughput"]
    return model + moe + data + training + parallel + logging


def mamba_train_flags(tmp, sp_model):
    """NVIDIA/Megatron-LM examples/mamba/train.sh (d98e8a6), MODEL_SCALE=800M, every flag kept, sizes scaled
    down (the 800M pattern's first 10 layers M-M-M--M-* of width 1024 with 16 heads -> width 64 with 8
    heads of 8 query groups; 4096 tokens -> 32; 73242188 samples -> 8 (2 iterations of 4), warm-up 50000
    -> 2, decay 73192188 -> 6); its tokenizer a sentencepiece model, its data mock (no data path)."""
    return ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
            "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
            "--untie-embeddings-and-output-weights", "--init-method-std", "0.02", "--position-embedding-type",
            "none", "--hybrid-layer-pattern", "M-M-M--M-*", "--hidden-size", "256", "--num-attention-heads",
            "8", "--group-query-attention", "--num-query-groups", "8", "--seq-length", "32",
            "--max-position-embeddings", "32", "--train-samples", "8", "--lr-warmup-samples", "2",
            "--lr-decay-samples", "6", "--save", f"{tmp}/checkpoints", "--load", f"{tmp}/checkpoints",
            "--mock-data", "--data-cache-path", f"{tmp}/data-cache", "--split", "99,1,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
            "--distributed-backend", "nccl", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "2.5e-4", "--min-lr", "2.5e-5", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--disable-bias-linear", "--normalization", "RMSNorm", "--adam-beta1", "0.9", "--adam-beta2",
            "0.95", "--log-interval", "1", "--save-interval", "2000", "--eval-interval", "2000",
            "--eval-iters", "32", "--bf16", "--use-mcore-models", "--spec",
            "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
            "--no-create-attention-mask-in-dataloader", "--tensorboard-dir", f"{tmp}/tensorboard"]


def nemotronh_flags(tmp):
    """NVIDIA-NeMo/Megatron-Bridge tests/functional_tests/ckpts/nemotronh_4b/test_nemotronh_4b_mcore.sh
    (efbe2d5), through Megatron-LM's pretrain_mamba.py: every flag kept, sizes scaled down (26 layers
    M-M-M-M*-M-M-M-M*-M-M-M-M* of width 3072 with 32 heads of 128 channels, 112 Mamba heads -> the first
    9 layers M-M-M-M*- of width 64 with 8 heads of 16 channels and 8 Mamba heads; 8192 tokens -> 32;
    151936 vocabulary -> 127; 10 iterations -> 2, saving every 5 -> 1).  Its --load names the Bridge's
    converted checkpoint; here that directory is empty: a warning and a fresh start, as in Megatron-LM."""
    return ["--init-method-std", "0.014", "--disable-bias-linear", "--use-rope-scaling", "--squared-relu",
            "--qk-layernorm", "--rotary-percent", "1.0", "--rotary-base", "1000000",
            "--use-rotary-position-embeddings", "--hybrid-override-pattern", "M-M-M-M*-",
            "--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec", "--num-layers", "9",
            "--hidden-size", "64", "--num-attention-heads", "8", "--mamba-num-heads", "8",
            "--ffn-hidden-size", "128", "--kv-channels", "16", "--group-query-attention",
            "--position-embedding-type", "none", "--attention-backend", "fused", "--num-query-groups", "8",
            "--normalization", "RMSNorm", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
            "--save-interval", "1", "--eval-interval", "1", "--eval-iters", "1", "--load", f"{tmp}/mbridge",
            "--save", f"{tmp}/mcore", "--ckpt-format", "torch_dist", "--log-progress", "--bf16", "--lr",
            "4.5e-4", "--min-lr", "4.5e-5", "--num-workers", "2", "--tensorboard-dir", f"{tmp}/tb",
            "--log-interval", "1", "--log-throughput", "--no-load-optim", "--no-load-rng"]


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
def _scripts(tmp, bpe, sp, hf):
    fsdp = megatron_fsdp_llama3_flags(tmp)
    deepspeed = megatron_deepspeed_llama2_flags(tmp, sp)
    fp8 = ("FP8/FP4 training is not implemented", tuple(f for f in FP8 if f.startswith("--")))
    random = "--moe-router-force-load-balancing"
    return {
        "megatron-lm gpt3 175b": (gpt3_175b_flags(tmp, *bpe), 4, None, ()),
        "megatron-lm llama3 8b bf16": (llama3_8b_flags(tmp) + DECOUPLED, 2, None, ()),
        "megatron-lm llama3 8b fp8": (llama3_8b_flags(tmp) + FP8, 2, "--fp8-format: " + fp8[0], fp8[1]),
        # PP 2 x EP 2 needs 4 ranks (the original's PP 4 x EP 8 needs 32)
        "megatron-lm mixtral 8x7b": (mixtral_8x7b_flags(tmp), 4, None, ()),
        "megatron-lm megatron-fsdp llama3 8b": (fsdp, 2, "--use-megatron-fsdp: Megatron-FSDP",
                                                ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                 "--fsdp-double-buffer", "--fsdp-manual-registration")),
        "megatron-deepspeed llama2": (deepspeed, 4, "--deepspeed: DeepSpeed is not used",
                                      ("--deepspeed", "--deepspeed_config", "--num-key-value-heads")),
        "mindspeed-llm llama2 13b": (mindspeed_llama2_13b_flags(tmp, hf), 2, None, ()),
        "swallow llama3.1 8b": (swallow_llama31_8b_flags(tmp, hf), 4, None, ()),
        # TP 2 (SP) x EP 2 on 4 ranks; V2-Lite: TP 2 (SP) x PP 2
        "megatron-lm deepseek-v3": (deepseek_v3_flags(tmp, hf), 4, None, ()),
        "megatron-lm deepseek-v2-lite": (deepseek_v2_lite_flags(tmp, hf), 4, None, ()),
        # EP 2 x DP 2 on 2 ranks; its benchmark-only random routing is refused by name
        "megatron-lm deepseek-v3 pretrain": (deepseek_v3_mfsdp_flags(tmp, hf), 2, random + ": Megatron-LM's "
                                             "benchmark-only", (random,)),
        # its DTYPE=fp8 as written: the four FP8 flags are named in one refusal
        "megatron-lm gpt-oss 02_train": (gpt_oss_train_flags(tmp), 2,
                                         "4 flags refused: --fp8-format: " + fp8[0], fp8[1]),
        "megatron-lm mamba 800m": (mamba_train_flags(tmp, sp), 2, None, ()),
        "megatron-bridge nemotronh 4b": (nemotronh_flags(tmp), 2, None, ()),
    }


FIXES = {  # what the refusal says to do instead, where a feature has a megazero spelling
    "megatron-deepspeed llama2": ["--group-query-attention", "--num-query-groups", "2"],
}
NAMES = ["megatron-lm gpt3 175b", "megatron-lm llama3 8b bf16", "megatron-lm llama3 8b fp8",
         "megatron-lm mixtral 8x7b", "megatron-lm megatron-fsdp llama3 8b", "megatron-deepspeed llama2",
         "mindspeed-llm llama2 13b", "swallow llama3.1 8b", "megatron-lm deepseek-v3",
         "megatron-lm deepseek-v2-lite", "megatron-lm deepseek-v3 pretrain",
         "megatron-lm gpt-oss 02_train", "megatron-lm mamba 800m",
         "megatron-bridge nemotronh 4b"]


@pytest.mark.parametrize("name", NAMES)
def test_script_parses_or_is_refused_by_name(name, tmp_path, gpt2_bpe, sp_model, hf_tokenizer):  # noqa: F811
    argv, world, refused, feature = _scripts(tmp_path, gpt2_bpe, sp_model, hf_tokenizer)[name]
    if refused:
        with pytest.raises(ConfigError, match=refused):
            parse_args(argv, world_size=world)
        argv = _without(argv, *feature) + FIXES.get(name, [])
    cfg = parse_args(argv, world_size=world)  # without the refused feature: every other flag has an answer
    assert cfg.training.train_iters >= 2 and not [n for n in cfg.notes if "unrecognized" in n]


def test_scripts_train_the_models_their_authors_meant(tmp_path, gpt2_bpe, sp_model,  # noqa: F811
                                                      hf_tokenizer):
    s = _scripts(tmp_path, gpt2_bpe, sp_model, hf_tokenizer)
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
    m = swallow.model  # --rope-factor and its companions: LLaMA-3.1 RoPE scaling
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rope_scaling_low_freq_factor,
            m.rope_scaling_high_freq_factor, m.rope_scaling_original_max_position_embeddings) == \
        (True, 8.0, 1.0, 4.0, 8192)
    assert m.rotary_base == 500000.0 and swallow.training.z_loss_coeff == 1e-4
    assert swallow.data.tokenizer_type == "HuggingFaceTokenizer" and swallow.logging.wandb_exp_name == "exp7"
    mind = parse_args(s["mindspeed-llm llama2 13b"][0], world_size=2)
    assert (mind.data.tokenizer_type, mind.data.tokenizer_model) == ("HuggingFaceTokenizer", hf_tokenizer)
    assert any("--handler-name GeneralPretrainHandler" in n for n in mind.notes)
    v3 = parse_args(s["megatron-lm deepseek-v3"][0], world_size=4)  # MLA, group-limited sigmoid routing
    assert (v3.model.multi_latent_attention, v3.model.q_lora_rank, v3.model.kv_lora_rank) == (True, 32, 16)
    assert (v3.model.rotary_scaling_factor, v3.model.mscale, v3.model.mscale_all_dim) == (40.0, 1.0, 1.0)
    assert (v3.moe.moe_router_num_groups, v3.moe.moe_router_group_topk, v3.moe.moe_router_score_function,
            v3.moe.moe_router_enable_expert_bias, v3.moe.moe_router_load_balancing_type) == \
        (4, 2, "sigmoid", True, "seq_aux_loss")
    lite = parse_args(s["megatron-lm deepseek-v2-lite"][0], world_size=4).model  # no query LoRA
    argv, _, _, feature = s["megatron-lm deepseek-v3 pretrain"]
    pre = parse_args(_without(argv, *feature), world_size=2)  # MTP depth 1; flex = alltoall's routing
    assert (pre.model.mtp_num_layers, pre.moe.moe_token_dispatcher_type, pre.training.train_iters) == \
        (1, "alltoall", 2)
    assert any("--recompute-modules mlp moe mla_up_proj layernorm (memory only" in n for n in pre.notes)
    assert (lite.multi_latent_attention, lite.q_lora_rank, lite.mscale) == (True, None, 0.707)
    oss = parse_args(_without(s["megatron-lm gpt-oss 02_train"][0], *s["megatron-lm gpt-oss 02_train"][3]),
                     world_size=2)
    m = oss.model  # --enable-gpt-oss: YaRN; sinks, alternating windows, clamped GEGLU
    assert (m.position_embedding_type, m.softmax_type, m.window_size, m.window_attn_skip_freq,
            m.activation) == ("yarn", "learnable", [7, 0], 2, "quick_geglu")
    assert oss.training.train_iters == 2 and oss.moe.moe_z_loss_coeff == 1e-3
    mamba = parse_args(s["megatron-lm mamba 800m"][0], world_size=2).model
    assert (mamba.hybrid_layer_pattern, mamba.position_embedding_type) == ("M-M-M--M-*", "none")
    nemo = parse_args(s["megatron-bridge nemotronh 4b"][0], world_size=2)
    # Megatron-LM: the legacy RoPE flag wins over --position-embedding-type none; its hybrid model
    # builds RoPE without the LLaMA-3.1 scaling that --use-rope-scaling asks for
    assert (nemo.model.position_embedding_type, nemo.model.use_rope_scaling) == ("rope", False)
    assert any("--use-rope-scaling: no effect in a hybrid stack" in n for n in nemo.notes)
    mixtral = parse_args(s["megatron-lm mixtral 8x7b"][0], world_size=4).moe
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_aux_loss_coeff) == (8, 2, 1e-2)
    assert (mixtral.moe_token_dispatcher_type, mixtral.expert_model_parallel_size) == ("alltoall", 2)


def test_fork_flags_refuse_what_they_cannot_mean(tmp_path, hf_tokenizer, monkeypatch):
    """MindSpeed-LLM's start-up conversion with Hugging Face weights in --load, Swallow's tiktoken file
    and --use-mpi under mpirun without torchrun's variables: each refused by name with the fix."""
    argv = mindspeed_llama2_13b_flags(tmp_path, hf_tokenizer)
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted" / "config.json").write_text("{}")
    (tmp_path / "converted" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="--enable-hf2mg-convert: .* holds Hugging Face weights"):
        parse_args(argv, world_size=2)
    argv = swallow_llama31_8b_flags(tmp_path, hf_tokenizer)
    tiktoken = tmp_path / "tokenizer.model"
    tiktoken.write_text("IQ== 0\n")
    argv[argv.index(hf_tokenizer)] = str(tiktoken)
    with pytest.raises(ConfigError, match="Llama3Tokenizer --tokenizer-model .*Hugging Face directory"):
        parse_args(argv, world_size=4)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="--use-mpi: under mpirun set RANK"):
        parse_args(swallow_llama31_8b_flags(tmp_path, hf_tokenizer), world_size=4)


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron-lm llama3 8b bf16", "megatron-deepspeed llama2",
                                  "mindspeed-llm llama2 13b", "swallow llama3.1 8b",
                                  "megatron-lm mixtral 8x7b",
                                  "megatron-lm deepseek-v3", "megatron-lm deepseek-v2-lite",
                                  "megatron-lm deepseek-v3 pretrain",
                                  "megatron-lm gpt-oss 02_train", "megatron-lm mamba 800m",
                                  "megatron-bridge nemotronh 4b"])
def test_script_trains_scaled_down(name, tmp_path, gpt2_bpe, sp_model, hf_tokenizer):  # noqa: F811
    """Each script trains (without the flags of a refused feature) for its first iterations."""
    argv, world, refused, feature = _scripts(tmp_path, gpt2_bpe, sp_model, hf_tokenizer)[name]
    argv = _without(argv, *feature) + FIXES.get(name, []) + ["--metrics-file", str(tmp_path / "m.jsonl")]
    iters = parse_args(argv, world_size=world).training.train_iters
    assert run_ranks(_pretrain, world, argv, timeout=300) == [0] * world
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["iteration"] for r in rows] == list(range(1, iters + 1)) and iters >= 2
    assert all(r["loss"] == r["loss"] for r in rows)


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
