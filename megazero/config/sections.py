"""The settings: one documented dataclass per concern, and the values derived from them.

Each field's flag is ``--`` + its name with ``_`` replaced by ``-`` unless its metadata names
another (``flag``); ``help`` describes the setting, ``flag_help`` the flag where the two differ
(a ``store_false`` flag such as ``--disable-bias-linear``).  Fields marked ``derived`` are not
flags: :func:`megazero.config.validate` fills them in from :class:`Derived`.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple

from megazero.config.patterns import GATED, parse_pattern, parse_pattern_arg, parse_window

HF_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "smollm3",
                  "gemma3_text")
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "SFTTokenizer")


def _f(default, help: str, **meta):  # noqa: A002 - mirrors argparse
    """A dataclass field with its help text (and optional flag metadata)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ParallelConfig:
    """How the world is split: tensor, pipeline and data parallel, and ZeRO on the data axis."""
    tensor_model_parallel_size: int = _f(1, "Ranks that split every layer's weights (tensor parallel).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline stages the layers are cut into.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(
        None, "Layers per virtual stage; enables the interleaved 1F1B schedule.")
    num_virtual_stages_per_pipeline_rank: Optional[int] = _f(
        None, "Model chunks per pipeline stage, instead of --num-layers-per-virtual-pipeline-stage (which is "
        "then --num-layers / (pipeline size x this)).")
    decoder_first_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the first pipeline stage (uneven split); the rest are spread evenly.")
    decoder_last_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the last pipeline stage (uneven split); the rest are spread evenly.")
    pipeline_schedule: Optional[str] = _f(None, "Pipeline schedule: gpipe, 1f1b or interleaved (default: "
                                          "interleaved with virtual stages, else 1f1b).",
                                          choices=["gpipe", "1f1b", "interleaved"])
    delay_wgrad_compute: bool = _f(
        True, "Pipeline stages after the first compute each backward's linear weight gradients after its "
        "input gradient is sent back, so the previous stage starts its backward that much earlier; the "
        "same numbers.", flag="--no-delay-wgrad-compute", action="store_false",
        flag_help="Compute each backward's weight gradients before its input gradient is sent back "
        "(Megatron-LM's default order).")
    context_parallel_size: int = _f(
        1, "Ranks that split every sequence (context parallel): 2N chunks, rank i holds chunks i and "
        "2N-1-i; attention runs as ring attention (or Ulysses) over the CP group.", type=int)
    cp_comm_type: str = _f("p2p", "Context-parallel attention: p2p (ring attention, K/V blocks passed "
                           "around the CP group) or a2a (Ulysses all-to-all between sequence and heads).",
                           choices=["p2p", "a2a"])
    sequence_parallel: bool = _f(False, "Split activations along the sequence in the non-tensor-parallel "
                                 "regions (needs --tensor-model-parallel-size > 1).")
    zero_stage: int = _f(0, "ZeRO stage on the data-parallel axis: 0 plain DP, 1 optimizer state, "
                         "2 + gradients, 3 + parameters.", type=int)
    offload_optimizer: bool = _f(False, "Keep fp32 master weights and optimizer state on the CPU (ZeRO 1-3); "
                                 "the same as --offload-optimizer-device cpu.")
    offload_optimizer_device: Optional[str] = _f(
        None, "Where the fp32 master weights and optimizer moments of this rank's shard live (ZeRO 1-3): "
        "none (the device), cpu (host memory) or nvme (swap files under --nvme-path, streamed through "
        "--nvme-buffer-count host buffers in every step). Default: cpu with --offload-optimizer, else none.",
        choices=["none", "cpu", "nvme"])
    optimizer_offload_fraction: float = _f(
        1.0, "Share of the optimizer state (by elements, whole buckets in bucket order, Megatron-LM's "
        "meaning) that goes to the offload device; the rest stays in memory.", type=float)
    offload_param_device: Optional[str] = _f(
        None, "ZeRO-3 only: where the parameter shards live while their unit is not computed: none or "
        "nvme (read ahead one unit in forward, backward and recompute order).",
        choices=["none", "cpu", "nvme"])
    nvme_path: Optional[str] = _f(None, "Directory on a local disk for the rank<r>.swap files of the nvme "
                                  "tier (scratch: recreated at start, removed at a clean exit).")
    nvme_block_size: int = _f(1 << 20, "Bytes per NVMe I/O request, a multiple of 4096.")
    nvme_io_threads: int = _f(4, "NVMe I/O threads per rank, which is also the number of requests in "
                              "flight (the queue depth).")
    nvme_buffer_count: int = _f(3, "Host buffers streaming optimizer sub-groups: 2 overlaps the read of "
                                "the next sub-group with the update, 3 also the write-back of the previous.")
    nvme_buffer_size: int = _f(64 << 20, "Bytes per streaming buffer; the optimizer shard is cut into "
                               "sub-groups (master weights and moments together) that fit in one.")
    ddp_bucket_size: Optional[int] = _f(
        None, "Gradient bucket size in elements (default: a quarter of the model, within 1M-40M; "
        "never more than the model).")
    overlap_grad_reduce: bool = _f(True, "Start each bucket's gradient reduction as soon as it is complete.",
                                   flag="--no-overlap-grad-reduce", action="store_false",
                                   flag_help="Do not overlap: reduce the gradients after backward (stages "
                                   "0/1), or wait for each bucket's reduction as it completes (stages 2/3).")
    max_reductions_in_flight: int = _f(
        2, "Gradient reductions (stages 1-3: each holds a bucket-sized buffer) that may run at once while "
        "backward goes on; before another starts, the oldest is waited for.")
    overlap_param_gather: bool = _f(
        True, "Stages 1/2: the all-gather of the updated parameters runs during the "
        "next forward, each layer waiting only for its own bucket.",
        flag="--no-overlap-param-gather", action="store_false",
        flag_help="Stages 1/2: wait for the parameter all-gather inside the "
        "optimizer step.")
    rank_order: str = _f(
        "tp-cp-ep-dp-pp", "Order of the mesh axes in the rank number, fastest first (Megatron-core's "
        "default tp-cp-ep-dp-pp; axes of size 1 may be left out, e.g. tp-dp-pp).")
    # derived (see Derived)
    world_size: int = _f(1, "Number of processes (taken from WORLD_SIZE; not a flag).", derived=True)
    data_parallel_size: int = _f(1, "world size / (tp x cp x pp) (derived).", derived=True)
    virtual_pipeline_model_parallel_size: int = _f(
        1, "Model chunks per pipeline stage (derived).", derived=True)


@dataclass
class ModelConfig:
    """The GPT architecture (GPT-2 and LLaMA styles)."""
    num_layers: int = _f(2, "Transformer layers.")
    hidden_size: int = _f(64, "Hidden size.")
    ffn_hidden_size: Optional[int] = _f(
        None, "MLP hidden size (default 4 x hidden, or with swiglu 8/3 x hidden rounded down to a "
        "multiple of 64, Megatron-LM's rule).")
    num_attention_heads: int = _f(4, "Attention heads.")
    num_query_groups: Optional[int] = _f(
        None, "Key/value heads for grouped-query attention (default: heads).")
    kv_channels: Optional[int] = _f(None, "Channels per head (default hidden / heads).")
    seq_length: int = _f(64, "Training sequence length.")
    max_position_embeddings: Optional[int] = _f(None, "Learned position table size (default seq length).")
    vocab_size: int = _f(512, "Vocabulary size before padding (the tokenizer's, when one is given).")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this x TP size.")
    position_embedding_type: str = _f(
        "learned_absolute", "learned_absolute (GPT-2), rope (LLaMA), yarn (RoPE with YaRN's frequencies and "
        "attention factor: --rotary-scaling-factor and the --yarn-* flags) or none (no position embedding: "
        "NoPE).", choices=["learned_absolute", "rope", "yarn", "none"])
    rotary_base: float = _f(10000.0, "RoPE base.", type=float)
    rotary_percent: float = _f(1.0, "Fraction of each head's channels that RoPE rotates (the first ones; "
                               "GLM-4.5: 0.5), the rest pass through.", type=float)
    rotary_base_local: Optional[float] = _f(
        None, "Gemma 3: the RoPE base of the sliding-window layers (10000), which take no RoPE scaling; "
        "the full-attention layers keep --rotary-base and its scaling.", type=float)
    no_rope_freq: Optional[Any] = _f(
        None, "Layers without RoPE (NoPE layers, SmolLM3): N skips it on every N-th layer (counting from 1), "
        "or a per-layer list expression such as '([0]*3+[1])*2' (1: no RoPE).", type=parse_pattern_arg)
    rotary_scaling_factor: float = _f(1.0, "YaRN: how much longer than "
                                      "--yarn-original-max-position-embeddings the context is made (HF "
                                      "rope_scaling 'factor').", type=float)
    yarn_original_max_position_embeddings: int = _f(4096, "YaRN: the context length the model was trained "
                                                    "for.")
    yarn_beta_fast: float = _f(32.0, "YaRN: rotations above which a frequency is kept (extrapolated).",
                               type=float)
    yarn_beta_slow: float = _f(1.0, "YaRN: rotations below which a frequency is divided by the factor.",
                               type=float)
    yarn_correction_range_round_to_int: bool = _f(
        True, "YaRN: round the ramp's ends to whole dimensions (HF 'truncate'); "
        "--no-yarn-correction-range-round-to-int keeps them fractional.")
    mscale: float = _f(1.0, "YaRN attention factor: (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim "
                       "ln(factor) + 1) multiplies cos and sin.", type=float)
    mscale_all_dim: float = _f(0.0, "YaRN attention factor's denominator (see --mscale).", type=float)
    dynamic_rope_scaling_factor: Optional[float] = _f(
        None, "Dynamic NTK RoPE scaling (Hugging Face's rope_scaling type 'dynamic'): a forward over L > "
        "--max-position-embeddings positions uses base x (factor L / max - factor + 1)^(d / (d - 2)).",
        type=float)
    use_rope_scaling: bool = _f(
        False, "LLaMA-3.x RoPE scaling (Megatron-LM's --use-rope-scaling): rotary frequencies whose "
        "wavelength exceeds --rope-scaling-original-max-position-embeddings / --rope-scaling-low-freq-factor "
        "are divided by --rope-scaling-factor, those below ... / --rope-scaling-high-freq-factor are kept, "
        "and those between are interpolated.")
    rope_scaling_factor: float = _f(8.0, "LLaMA-3.x RoPE scaling factor (with --use-rope-scaling).",
                                    type=float)
    rope_scaling_low_freq_factor: float = _f(1.0, "LLaMA-3.x RoPE scaling: low-frequency factor.",
                                             type=float)
    rope_scaling_high_freq_factor: float = _f(4.0, "LLaMA-3.x RoPE scaling: high-frequency factor.",
                                              type=float)
    rope_scaling_original_max_position_embeddings: int = _f(
        8192, "LLaMA-3.x RoPE scaling: the context length the model was first trained for.")
    rotary_seq_len_interpolation_factor: Optional[float] = _f(
        None, "Linear RoPE scaling (position interpolation): positions are divided by this factor "
        "(Hugging Face's rope_scaling type 'linear').", type=float)
    normalization: str = _f("LayerNorm", "LayerNorm or RMSNorm.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the norms.", type=float)
    norm_position: str = _f(
        "pre", "Where each layer's norms are: pre (the input of attention and of the MLP), post (their "
        "outputs, before the residual add: OLMo 2) or sandwich (both: Gemma 2).",
        choices=["pre", "post", "sandwich"])
    qk_layernorm: bool = _f(False, "Normalise queries and keys (with --normalization) before RoPE (Qwen3, "
                            "OLMo 2); with --multi-latent-attention the query and key/value latents.")
    qk_layernorm_scope: str = _f("head", "With --qk-layernorm: over each head's channels (head: Qwen3, "
                                 "Megatron-LM's) or over all heads of a token (all: OLMo 2).",
                                 choices=["head", "all"])
    multi_latent_attention: bool = _f(
        False, "Multi-latent attention (DeepSeek-V2/V3, Megatron-LM's MLA): queries and keys/values through "
        "low-rank latents (--q-lora-rank, --kv-lora-rank) and a rotary key part shared by the heads "
        "(--qk-pos-emb-head-dim); with --qk-layernorm the latents are normalised (docs/mla.md).")
    q_lora_rank: Optional[int] = _f(None, "MLA: rank of the query latent (default: none, one query "
                                    "projection).", type=int)
    kv_lora_rank: int = _f(32, "MLA: rank of the key/value latent (what generation caches, with the "
                           "rotary part).")
    qk_head_dim: int = _f(128, "MLA: query/key channels per head without position (a head's query is this "
                          "+ --qk-pos-emb-head-dim).")
    qk_pos_emb_head_dim: int = _f(64, "MLA: rotary query/key channels per head (one rotary key part shared "
                                  "by the heads).")
    v_head_dim: int = _f(128, "MLA: value channels per head.")
    rope_type: Optional[str] = _f(
        None, "RoPE of multi-latent attention: yarn (its default: --rotary-scaling-factor, --mscale, "
        "--mscale-all-dim and the --yarn-* settings) or rope (plain, --rotary-base). Ordinary attention "
        "takes rope only (Megatron-LM's rule; YaRN there: --position-embedding-type yarn).",
        choices=["rope", "yarn"])
    window_size: Optional[List[int]] = _f(
        None, "Sliding-window attention, Megatron-LM's LEFT,RIGHT: a query sees itself and the LEFT keys "
        "before it (RIGHT must be 0: attention is causal; LEFT -1: no window). A Hugging Face sliding_window "
        "W is W-1,0.", type=parse_window)
    window_attn_skip_freq: Optional[Any] = _f(
        None, "With --window-size: N makes every N-th layer (counting from 1) attend to everything and the "
        "others within the window (Gemma 2: 2), or a per-layer list expression such as '[1,1,1,0]*3' (1: "
        "windowed, 0: full).", type=parse_pattern_arg)
    attn_logit_softcapping: Optional[float] = _f(
        None, "Soft-cap the attention scores: cap x tanh(score / cap) before the softmax (Gemma 2).",
        type=float)
    final_logit_softcapping: Optional[float] = _f(
        None, "Soft-cap the output logits: cap x tanh(logit / cap) (Gemma 2).", type=float)
    softmax_scale: Optional[float] = _f(
        None, "Scale of the attention scores (default 1 / sqrt(--kv-channels); Gemma 2: "
        "query_pre_attn_scalar^-0.5).", type=float)
    softmax_type: str = _f(
        "vanilla", "Attention softmax: vanilla, off-by-one (a zero logit joins every softmax denominator) or "
        "learnable (attention sinks, gpt-oss: one learned logit per head, TP-split with the heads).",
        choices=["vanilla", "off-by-one", "learnable"])
    attention_chunk_size: Optional[int] = _f(
        None, "Chunked local attention (Llama 4's attention_chunk_size): on the layers that use RoPE a query "
        "sees only the keys of its own chunk of this many positions.", type=int)
    qk_l2_norm: bool = _f(False, "Llama 4's q/k norm: each head's query and key divided by its RMS (no "
                          "scale; epsilon --norm-epsilon).")
    qk_l2_norm_scope: str = _f("all", "With --qk-l2-norm: the layers it acts on, all (Megatron-LM's) or rope "
                               "(those that use RoPE: Llama 4).", choices=["all", "rope"])
    attn_temperature_tuning: bool = _f(
        False, "Llama 4's attention temperature on the layers without RoPE (--no-rope-freq): queries at "
        "position p are multiplied by 1 + --attn-temperature-scale x log(1 + floor((p + 1) / "
        "--attn-temperature-floor-scale)).")
    attn_temperature_floor_scale: float = _f(8192.0, "Llama 4's floor_scale (see --attn-temperature-tuning).",
                                             type=float)
    attn_temperature_scale: float = _f(0.1, "Llama 4's attn_scale (see --attn-temperature-tuning).",
                                       type=float)
    mtp_num_layers: Optional[int] = _f(
        None, "Multi-token prediction (DeepSeek-V3, Megatron-core's MTP block): this many extra depths "
        "on the last pipeline stage, depth k predicting token t+k+1 from the previous depth's hidden state "
        "and the embedding of token t+k, each its own norms, 2h->h projection and transformer layer, "
        "sharing the embedding and output head (docs/moe.md).", type=int)
    mtp_loss_scaling_factor: float = _f(
        0.1, "Multi-token prediction: the depths' losses, averaged over the depths, times this are added to "
        "the objective (reported apart as mtp loss).", type=float)
    scale_embedding: bool = _f(False, "Multiply the word embeddings by sqrt(--hidden-size) (Gemma).")
    activation: str = _f("gelu_exact", "MLP activation: gelu_exact (the erf GELU, Megatron-LM's default), "
                         "gelu (tanh approximation: GPT-2, Megatron-LM's --openai-gelu), swiglu (LLaMA), "
                         "geglu (gated, tanh-approximated GELU: Gemma) or quick_geglu (gated x sigmoid(1.702 "
                         "x): gpt-oss, Megatron-LM's --quick-geglu), or squared_relu (relu(x)^2: "
                         "Nemotron-H, Megatron-LM's --squared-relu).",
                         choices=["gelu_exact", "gelu", "swiglu", "geglu", "quick_geglu", "squared_relu"])
    glu_linear_offset: float = _f(0.0, "Gated activations: act(gate) x (linear + this) (gpt-oss: 1.0).",
                                  type=float)
    activation_func_clamp_value: Optional[float] = _f(
        None, "Gated activations: the gate clamped to at most this and the linear part to [-this, this] "
        "before the activation (gpt-oss: 7.0).", type=float)
    add_bias_linear: bool = _f(True, "Biases in the linear layers (GPT-2); off for LLaMA.",
                               flag="--disable-bias-linear", action="store_false",
                               flag_help="Linear layers without biases (LLaMA style).")
    add_qkv_bias: bool = _f(False, "Biases on the query, key and value projections, even without "
                            "--add-bias-linear's other biases (Qwen2; Megatron-LM's --add-qkv-bias).")
    untie_embeddings_and_output_weights: bool = _f(False, "Give the output head its own weight.")
    hf_model_type: Optional[str] = _f(
        None, "The transformers architecture an export writes (scripts/convert_hf.py --direction to-hf): "
        "set by an import; default the first of gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, olmo2, "
        "smollm3 that holds the model.", choices=list(HF_MODEL_TYPES))
    hidden_dropout: float = _f(0.1, "Dropout after attention and MLP.", type=float)
    attention_dropout: float = _f(0.1, "Dropout on attention probabilities.", type=float)
    init_method_std: float = _f(0.02, "Std of the normal initialisation.", type=float)
    recompute_granularity: Optional[str] = _f(None, "Activation recomputation: full or selective.",
                                              choices=["full", "selective"])
    recompute_method: Optional[str] = _f(None, "With full: uniform or block.", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = _f(None, "With full: layers per recomputed group (uniform) "
                                             "or layers recomputed per stage (block).")
    hybrid_layer_pattern: Optional[str] = _f(
        None, "A hybrid layer stack (Megatron-LM's; also --hybrid-override-pattern): one symbol per layer, M "
        "Mamba-2, * attention, - MLP, E mixture of experts, G Gated DeltaNet, e.g. M*M-M*M-; its length is "
        "--num-layers, which it sets when not given (docs/hybrid.md).")
    mamba_num_heads: Optional[int] = _f(None, "Mamba-2 heads (default 2 x --hidden-size / --mamba-head-dim).",
                                        type=int)
    mamba_head_dim: int = _f(64, "Mamba-2 channels per head.")
    mamba_state_dim: int = _f(128, "Mamba-2 state size per head.")
    mamba_num_groups: int = _f(8, "Mamba-2 groups: the heads of a group share B and C; tensor parallelism "
                               "splits whole groups.")
    mamba_chunk_size: int = _f(128, "Positions per chunk of Mamba-2's chunked (SSD) scan: the same numbers "
                               "at any size, up to rounding.")
    linear_num_key_heads: int = _f(16, "Gated DeltaNet query/key heads; tensor parallelism splits them.")
    linear_num_value_heads: int = _f(32, "Gated DeltaNet value heads (a multiple of the key heads).")
    linear_key_head_dim: int = _f(128, "Gated DeltaNet channels per query/key head.")
    linear_value_head_dim: int = _f(128, "Gated DeltaNet channels per value head.")
    linear_conv_kernel_dim: int = _f(4, "Width of the short causal convolutions of Gated DeltaNet.")
    linear_chunk_size: int = _f(64, "Positions per chunk of Gated DeltaNet's chunked delta rule.")
    attention_output_gate: bool = _f(False, "Gated attention (Qwen3-Next): each attention output channel "
                                     "times sigmoid(x W_gate), a gate projection of its own.")
    experimental_attention_variant: Optional[str] = _f(
        None, "gated_delta_net: Gated DeltaNet in place of attention in the transformer layers "
        "--linear-attention-freq names (Megatron-LM's Qwen3-Next form; docs/hybrid.md).",
        choices=["gated_delta_net"])
    linear_attention_freq: Optional[Any] = _f(
        None, "With --experimental-attention-variant: N keeps attention in every N-th layer (counting from "
        "1) and Gated DeltaNet in the others, or a per-layer list expression such as '[1,1,1,0]*2' (1: "
        "Gated DeltaNet, 0: attention).", type=parse_pattern_arg)
    # derived (see Derived)
    padded_vocab_size: int = _f(0, "Vocabulary padded for TP (derived).", derived=True)

    @property
    def gated_mlp(self) -> bool:
        """The MLP has a third weight, the gate (a :data:`~megazero.config.patterns.GATED` activation)."""
        return self.activation in GATED

    def __post_init__(self):
        """Patterns and windows given as text (a config file, a saved config) in their parsed form;
        text that does not parse is left for validation to name."""
        for name, parse in (("window_size", parse_window), ("window_attn_skip_freq", parse_pattern),
                            ("no_rope_freq", parse_pattern), ("linear_attention_freq", parse_pattern)):
            try:
                setattr(self, name, parse(getattr(self, name)))
            except (TypeError, ValueError):
                pass


@dataclass
class TrainingConfig:
    """Batch sizes, length of training, evaluation."""
    micro_batch_size: int = _f(2, "Sequences per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = _f(None, "Sequences per optimizer step (default micro x DP).")
    train_iters: Optional[int] = _f(
        None, "Optimizer steps (default 10, or --train-samples / --global-batch-size).")
    train_samples: Optional[int] = _f(None, "Train on this many samples instead of a number of iterations "
                                      "(Megatron-LM's sample-based training; exclusive with --train-iters).")
    step_batch_size_schedule: Optional[str] = _f(
        None, "Global batch size by tokens consumed, Megatron-LM's format: 'THRESHOLD:BATCH ...' with K, M, "
        "B, T suffixes, e.g. '0:16 2.4B:320 4.8B:624' (16 sequences until 2.4 billion tokens, then 320 ...); "
        "the first threshold is 0. --global-batch-size, if given, must equal the last batch size.")
    rampup_batch_size: Optional[List[int]] = _f(
        None, "Batch-size ramp-up (older Megatron-LM's): START INCREMENT SAMPLES: start with START "
        "sequences and grow by INCREMENT in equal steps over SAMPLES samples up to --global-batch-size.",
        nargs=3, type=int)
    z_loss_coeff: Optional[float] = _f(
        None, "A z-loss on the output logits: this times log(sum exp(logits))^2 per token is added to the "
        "loss (and to the loss reported), as Swallow's --use-z-loss does with 1e-4; not with MTP.",
        type=float)
    seed: int = _f(1234, "Random seed (same weights and data at every layout).")
    eval_interval: int = _f(0, "Evaluate every this many steps (0: never).")
    eval_iters: int = _f(100, "Batches per evaluation (0: no validation, as in Megatron-LM).")
    full_validation: bool = _f(
        False, "Each evaluation reads the whole validation set once (its whole global batches) instead of "
        "--eval-iters batches (Megatron-LM's; docs/data.md).")
    multiple_validation_sets: bool = _f(
        False, "Evaluate each prefix of --valid-data-path on its own (no weights) and report each loss under "
        "its name: eval_loss-NAME (Megatron-LM's; docs/data.md).")
    validation_set_names: List[str] = _f(
        [], "With --multiple-validation-sets: a name per validation set, in order (default: 0, 1, ...).",
        nargs="+")
    # derived (see Derived)
    num_micro_batches: int = _f(1, "global batch / (micro batch x DP) (derived).", derived=True)


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule and clipping."""
    optimizer: str = _f("adam", "adam (AdamW) or sgd.", choices=["adam", "sgd"])
    lr: float = _f(1e-3, "Peak learning rate.", type=float)
    min_lr: float = _f(0.0, "Learning rate at the end of decay.", type=float)
    lr_decay_style: str = _f("linear", "Decay after warm-up: constant, linear, cosine, inverse-square-root "
                             "(lr x sqrt(warm-up / steps)) or WSD (warm-up, stable at --lr, then a final "
                             "decay of --lr-wsd-decay-iters steps in --lr-wsd-decay-style).",
                             choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_wsd_decay_style: str = _f("exponential", "Shape of WSD's final decay: exponential, linear, cosine or "
                                 "minus_sqrt.", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: Optional[int] = _f(None, "WSD: steps of the final decay, which ends where decay "
                                           "ends (--lr-decay-iters).")
    lr_wsd_decay_samples: Optional[int] = _f(None, "WSD with --train-samples: samples of the final decay.")
    decoupled_lr: Optional[float] = _f(None, "Peak learning rate of the input embedding and the output layer "
                                       "(default: --lr); the same schedule.", type=float)
    decoupled_min_lr: Optional[float] = _f(None, "Final learning rate of the input embedding and the output "
                                           "layer (default: --min-lr); needs --decoupled-lr.", type=float)
    lr_warmup_iters: int = _f(0, "Linear warm-up steps.")
    lr_decay_iters: Optional[int] = _f(None, "Steps over which to decay (default --train-iters).")
    lr_warmup_init: float = _f(0.0, "Learning rate at the first warm-up step (Megatron-LM's: warm-up rises "
                               "from it, linearly, to --lr).", type=float)
    lr_warmup_fraction: Optional[float] = _f(None, "Warm-up as a fraction of the decay steps (instead of "
                                             "--lr-warmup-iters / --lr-warmup-samples).", type=float)
    lr_warmup_samples: int = _f(0, "Warm-up length in samples (with --train-samples).")
    lr_decay_samples: Optional[int] = _f(None, "Decay length in samples (with --train-samples; default "
                                         "--train-samples).")
    weight_decay: float = _f(0.01, "Decoupled weight decay (not applied to biases and norms).", type=float)
    adam_beta1: float = _f(0.9, "Adam beta1.", type=float)
    adam_beta2: float = _f(0.999, "Adam beta2.", type=float)
    adam_eps: float = _f(1e-8, "Adam epsilon.", type=float)
    sgd_momentum: float = _f(0.9, "SGD momentum.", type=float)
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).", type=float)


@dataclass
class PrecisionConfig:
    """Mixed precision and loss scaling."""
    bf16: bool = _f(False, "Parameters and activations in bfloat16, fp32 master weights.")
    fp16: bool = _f(False, "Parameters and activations in float16, fp32 master weights, loss scaling.")
    tf32: bool = _f(False, "On CUDA, fp32 matrix products and convolutions in TF32 (tensor cores; about "
                    "10 mantissa bits per product). Default: PyTorch's (fp32 products stay fp32 unless "
                    "the environment says otherwise, as NGC containers do).")
    loss_scale: Optional[float] = _f(None, "Constant loss scale for fp16 (default: dynamic).", type=float)
    initial_loss_scale: float = _f(2.0 ** 32, "Starting dynamic loss scale.", type=float)
    min_loss_scale: float = _f(1.0, "Training stops if the dynamic scale would fall below this.", type=float)
    loss_scale_window: int = _f(1000, "Clean steps before the dynamic scale doubles.")
    hysteresis: int = _f(2, "Overflows tolerated before the dynamic scale halves.")
    grad_reduce_dtype: str = _f("fp32", "dtype gradients are accumulated and reduced in: fp32 or param.",
                                choices=["fp32", "param"])
    cpu_matmul: str = _f("auto", "fp32 linear layers on the CPU: onednn (oneDNN's matrix product), torch "
                         "(PyTorch's BLAS, MKL on x86) or auto (whichever runs the model's products faster "
                         "on this machine: measured at start-up, cached in ~/.cache/megazero).",
                         choices=["auto", "onednn", "torch"])
    host_malloc: str = _f("auto", "Host memory that tensors free (glibc): keep (reused by the next step: no "
                          "page faults for its activations, more resident memory), release (blocks of 1 MiB "
                          "or more go back to the system when freed and are faulted in again at every "
                          "step), system (the C library's own settings) or auto: keep on CPUs with ZeRO "
                          "0-2 and nothing offloaded, release otherwise.",
                          choices=["auto", "keep", "release", "system"])  # host_memory.HOST_MALLOC
    compile: bool = _f(False, "Compile each transformer layer with torch.compile (Inductor: C++ kernels on "
                       "the CPU, which need a C++ compiler; Triton on a GPU); the same numbers as eager "
                       "within fp32 rounding, at a one-time compile cost at start-up.")


@dataclass
class DataConfig:
    """Where the tokens come from."""
    data_path: List[str] = _f(
        [], "Megatron-format dataset prefix(es) (PREFIX.bin/.idx, written by "
        "scripts/preprocess_data.py or Megatron-LM), optionally weighted: [w1] p1 [w2] p2.",
        nargs="+")
    train_data_path: List[str] = _f(
        [], "Megatron-format prefix(es) of the training set alone (weights as "
        "--data-path); no --split. Evaluation then reads --valid-data-path.", nargs="+")
    valid_data_path: List[str] = _f([], "Megatron-format prefix(es) of the validation set (with "
                                    "--train-data-path).", nargs="+")
    split: str = _f("969,30,1", "Train,valid,test split of the documents (with --data-path).")
    test_data_path: List[str] = _f(
        [], "Megatron-format prefix(es) of the test set (with --train-data-path), evaluated once at the end "
        "of training (test_loss), as in Megatron-LM.", nargs="+")
    data_args_path: Optional[str] = _f(
        None, "A file holding the --data-path items (whitespace-separated: prefixes, or WEIGHT PREFIX "
        "pairs), for blends too long for a command line (Megatron-LM's).")
    per_split_data_args_path: Optional[str] = _f(
        None, "A JSON file {\"train\": [...], \"valid\": [...], \"test\": [...]} of the "
        "--train/--valid/--test-data-path items (lists, or whitespace-separated strings), as in Megatron-LM.")
    mmap_bin_files: bool = _f(
        True, "Read the .bin files through memory maps; off: plain file reads (the same tokens).",
        flag="--no-mmap-bin-files", action="store_false",
        flag_help="Read the .bin files with plain file reads instead of memory maps (the same tokens).")
    num_dataset_builder_threads: int = _f(
        1, "Threads that open and index the datasets of a blend (the same samples whatever the number).")
    data_cache_path: Optional[str] = _f(
        None, "Megatron-LM's directory for cached dataset indices; megazero builds them in memory, an epoch "
        "at a time, and writes nothing there (named at start-up).")
    create_attention_mask_in_dataloader: bool = _f(
        True, "Megatron-LM's data loader builds a dense attention mask; megazero never does (causal "
        "attention, and --reset-attention-mask's document mask, are built on the device from the tokens): "
        "the same model either way, named at start-up.", flag="--no-create-attention-mask-in-dataloader",
        action="store_false", flag_help="Megatron-LM's switch; megazero builds no mask in the data loader "
        "either way (named at start-up).")
    mock_data: bool = _f(False, "Deterministic synthetic tokens (same global sample at every layout).")
    tokenizer_model: Optional[str] = _f(
        None, "sentencepiece .model file or Hugging Face tokenizer directory; "
        "its vocabulary size replaces --vocab-size.")
    tokenizer_type: Optional[str] = _f(
        None, "Megatron-LM's tokenizer types that megazero has: a sentencepiece model "
        "(SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer) or a "
        "Hugging Face directory (HuggingFaceTokenizer, or SFTTokenizer: the same with --sft) in "
        "--tokenizer-model; "
        "GPT2BPETokenizer from --vocab-file and --merge-file; NullTokenizer (no "
        "tokenizer: ids below --vocab-size, plus one end-of-document id). Default: "
        "from the files given.",
        choices=list(TOKENIZER_TYPES))
    vocab_file: Optional[str] = _f(None, "GPT-2 BPE vocabulary (vocab.json) for GPT2BPETokenizer.")
    merge_file: Optional[str] = _f(None, "GPT-2 BPE merges (merges.txt) for GPT2BPETokenizer.")
    num_workers: int = _f(0, "Data-loader worker processes (reserved; mock data needs none).")
    eod_mask_loss: bool = _f(False, "Leave the prediction after each end-of-document token out of the loss "
                             "(the EOD id comes from the tokenizer: --tokenizer-model, or "
                             "--tokenizer-type NullTokenizer's id --vocab-size).")
    reset_attention_mask: bool = _f(
        False, "Packed documents attend within themselves only: a token sees the earlier tokens of its own "
        "document (the end-of-document token belongs to the document it ends), as in Megatron-LM.")
    reset_position_ids: bool = _f(
        False, "Positions (RoPE or learned) restart at 0 after each end-of-document token, as in "
        "Megatron-LM.")
    sft: bool = _f(
        False, "Supervised fine-tuning (Megatron-LM's --sft): --data-path (or --train-data-path / "
        "--valid-data-path) names JSON-lines files of conversations ({\"messages\": [{\"role\", "
        "\"content\"}]} or {\"prompt\", \"response\"}), the loss is on the assistant's tokens only, and with "
        "--reset-attention-mask several conversations are packed to a sequence (docs/sft.md).")
    sft_tokenizer_prompt_format: Optional[str] = _f(
        None, "With --sft: how turns become tokens: default (the Hugging Face tokenizer's chat template) or "
        "identity (each turn's text as it is). Default: the chat template when the tokenizer has one, else "
        "identity.")


@dataclass
class CheckpointConfig:
    """Saving and loading."""
    save: Optional[str] = _f(
        None, "Directory to save checkpoints to (iter_XXXXXXX/ per save and "
        "latest_checkpointed_iteration.txt), every --save-interval steps and at the end.")
    load: Optional[str] = _f(None, "Directory to resume from: its latest checkpoint, written under any "
                             "TP/PP/DP/ZeRO layout (iteration, LR schedule, data position, loss scale "
                             "continue). Without a checkpoint there the run starts from scratch (a warning "
                             "unless it is also --save), as in Megatron-LM.")
    save_interval: int = _f(0, "Save every this many steps (0: only at the end of training; needs --save).")
    finetune: bool = _f(
        False, "With --load: take the model weights only and start at iteration 0 with a fresh "
        "optimizer, learning-rate schedule, data position and RNG (Megatron-LM's --finetune).")
    no_load_optim: bool = _f(
        False, "With --load: do not load the optimizer state (moments, step, loss scaler); "
        "the iteration, data position and schedule still continue.")
    no_load_rng: bool = _f(False, "With --load: do not restore the generators; reseed them from "
                           "(--seed, iteration) instead.")
    use_checkpoint_args: bool = _f(False, "Take the model's architecture (layers, sizes, heads, vocabulary, "
                                   "norms, ...), its dropout and its tokenizer from the --load checkpoint, "
                                   "as Megatron-LM does; flags given on the command line still win.")
    no_use_tokenizer_model_from_checkpoint_args: bool = _f(
        False, "With --use-checkpoint-args: keep the tokenizer flags of this command line (or none) instead "
        "of the checkpoint's tokenizer.")
    ckpt_step: Optional[int] = _f(None, "With --load: load this iteration instead of the latest.")
    ckpt_format: Optional[str] = _f(
        None, "Megatron-LM's checkpoint format: with --load of a Megatron-LM directory, torch_dist or torch "
        "(legacy mp_rank_*) names the format expected (unset: detected); megazero's own checkpoints load "
        "whatever this says. With --save, torch_dist also writes each save in Megatron-LM's layout "
        "(iter_*/ and its tracker; megazero's own files in DIR/megazero_state/), other values megazero's "
        "format only (docs/migration.md).",
        choices=["torch_dist", "torch", "zarr", "torch_dcp", "fsdp_dtensor"])
    exit_on_missing_checkpoint: bool = _f(
        False, "With --load: stop with an error when the directory holds no checkpoint, instead of "
        "starting from scratch (also when it is --save).")
    override_opt_param_scheduler: bool = _f(
        False, "On --load, use this run's --lr, --min-lr, --lr-warmup-iters, "
        "--lr-decay-iters and --lr-decay-style even where they differ "
        "from the checkpoint's (otherwise such a difference is an error).")
    # ---- operations II (issue 21): fine-tune resume, asynchronous saves, pruning ----
    pretrained_checkpoint: Optional[str] = _f(
        None, "Fine-tune from this directory's model weights (Megatron-LM's --pretrained-checkpoint): used "
        "when --load holds no checkpoint of its own yet (a fresh optimizer, schedule and data position from "
        "iteration 0); once the fine-tune has saved, --load resumes its own progress instead.")
    async_save: bool = _f(
        False, "Write checkpoints in a background thread while training goes on: each rank snapshots its "
        "state to memory at the save iteration, the files are written and published as with a synchronous "
        "save (same bytes, checksums and atomic rename); a second save waits for the first.")
    ckpt_keep: Optional[int] = _f(
        None, "Keep only the newest N published checkpoints in --save (older iter_* directories are removed "
        "after each save; the one the tracker names is never removed).")


@dataclass
class LoggingConfig:
    """Console, metrics file and wandb."""
    log_interval: int = _f(100, "Print a progress line every this many steps.")
    metrics_file: Optional[str] = _f(None, "Append one JSON object per step to this file (rank 0); a resumed "
                                     "run drops the rows after its checkpoint's iteration first.")
    tensorboard_dir: Optional[str] = _f(None, "Write the same values as the metrics file as TensorBoard "
                                        "scalars to this directory (needs the tensorboard package).")
    wandb_project: Optional[str] = _f(None, "Log to this wandb project.")
    wandb_mode: Optional[str] = _f(None, "online, offline or disabled (default: offline without an API key).",
                                   choices=["online", "offline", "disabled"])
    wandb_exp_name: Optional[str] = _f(None, "wandb run name.")
    wandb_entity: Optional[str] = _f(None, "wandb entity (team or user) that owns the project.")
    wandb_save_dir: Optional[str] = _f(None, "Directory for wandb files.")
    profile: bool = _f(False, "Profile the iterations from --profile-step-start + 1 to --profile-step-end on "
                       "--profile-ranks (megazero/training/profiling.py): a torch.profiler Chrome/Perfetto "
                       "trace per rank in --profile-dir (on a GPU without --use-pytorch-profiler: a CUDA "
                       "profiler capture range for nsys).")
    use_pytorch_profiler: bool = _f(False, "With --profile: torch.profiler's trace also on a GPU (on the CPU "
                                    "it is the only profiler).")
    profile_step_start: int = _f(10, "With --profile: iterations done when profiling starts.")
    profile_step_end: int = _f(12, "With --profile: iterations done when profiling stops.")
    profile_ranks: List[int] = _f([0], "With --profile: the global ranks that profile.", nargs="+", type=int)
    profile_dir: Optional[str] = _f(None, "With --profile: directory of the trace_rank<R>_iters<A>-<B>.json "
                                    "files (default --tensorboard-dir, else ./profile).")
    dry_run: bool = _f(False, "Validate the flags for a job of $WORLD_SIZE ranks (default 1), print the "
                       "layout and exit 0 without training (--nvme-path, a directory of the training "
                       "machine, is not checked).", action="store_true")


@dataclass
class ResilienceConfig:
    """Operations at scale: bounded waits, preemption and time limits, numerical faults."""
    distributed_timeout_minutes: float = _f(
        10.0, "Timeout of every collective and point-to-point operation on every process group, in minutes "
        "(fractions allowed): a rank that stops answering makes the others fail with a message naming the "
        "operation, the group and the silent ranks.", type=float)
    exit_signal_handler: bool = _f(
        False, "On a signal named by --exit-signal, every rank finishes the current "
        "iteration, saves a checkpoint (with --save) and exits 0.")
    exit_signal: List[str] = _f(
        ["SIGTERM"], "Signals that --exit-signal-handler turns into a save and a clean "
        "exit (SLURM's #SBATCH --signal sends SIGUSR1 in launch/slurm.sbatch).",
        nargs="+", choices=["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"])
    exit_duration_in_mins: Optional[float] = _f(
        None, "Save (with --save) and exit 0 after the iteration during which this many minutes have passed "
        "since start-up.", type=float)
    exit_interval: Optional[int] = _f(
        None, "Save (with --save) and exit 0 after the iteration whose number is a "
        "multiple of this.")
    check_for_nan_in_loss_and_grad: bool = _f(
        True, "Stop with an error naming the iteration when the loss or the gradient norm is NaN or inf "
        "(fp32, bf16 and a constant --loss-scale; fp16's dynamic loss scaler handles its own overflows).",
        flag="--no-check-for-nan-in-loss-and-grad", action="store_false",
        flag_help="Do not stop on a NaN or inf loss or gradient norm (such steps are still skipped).")
    skip_nan_steps: int = _f(0, "Skip up to this many steps with a NaN or inf loss or gradient norm (in all) "
                             "before stopping.")
    # ---- operations II (issue 21): divergence guard and preemption grace ----
    loss_spike_factor: float = _f(
        10.0, "A loss over this many times the median of the last --loss-spike-window losses is a spike (a "
        "finite divergence): an error, nothing saved from that iteration (or see --loss-spike-action). "
        "On by default at 10 (a pretraining loss never grows tenfold over its recent median unless it "
        "diverges; Megatron-LM's --check-for-spiky-loss, off by default there, uses 10 times the largest "
        "loss seen); 0 turns the check off.",
        type=float)
    loss_spike_window: int = _f(100, "How many recent losses --loss-spike-factor takes the median of.")
    loss_spike_action: str = _f(
        "stop", "What a loss over --loss-spike-factor does: stop (an error; nothing is saved from that "
        "iteration) or skip (that batch's update is not applied, as an overflow: weights, optimizer state "
        "and the learning-rate schedule unchanged; counted in skipped iterations; its loss stays out of the "
        "median).",
        choices=["stop", "skip"])
    loss_spike_max_skips: int = _f(
        10, "With --loss-spike-action skip: stop as with stop at a spike that follows this many skipped "
        "spiking batches in a row.")
    exit_signal_grace_secs: float = _f(
        30.0, "With --exit-signal-handler: further termination signals are one request (SLURM signals every "
        "process and torchrun forwards it again) until this many seconds after the save started (after the "
        "first signal while no save has started); a signal after that ends the process at once.",
        type=float)


@dataclass
class MoEConfig:
    """Mixture of experts (Megatron-LM's flags): which layers route their tokens to experts, the router,
    the token dispatcher, the experts and how they are split over the expert-parallel axes."""
    num_experts: Optional[int] = _f(None, "Routed experts per MoE layer (none: a dense model).")
    moe_ffn_hidden_size: Optional[int] = _f(None, "Hidden size of each routed expert's MLP (default "
                                            "--ffn-hidden-size).")
    moe_layer_freq: str = _f(
        "1", "Which layers are MoE layers: an integer N (layers 0, N, 2N, ... are MoE, the others dense) or "
        "Megatron-LM's list expression of 0s and 1s, one per layer, e.g. '([0]*1+[1]*1)*2' (1: MoE).")
    moe_router_topk: int = _f(2, "Experts each token is routed to.")
    moe_router_score_function: str = _f("softmax", "Score of the router's logits: softmax or sigmoid.",
                                        choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = _f(False, "Take the score (softmax or sigmoid) of all experts before the "
                                      "top-k (default: softmax over the top-k logits only).")
    moe_router_topk_scaling_factor: Optional[float] = _f(
        None, "Multiply the top-k routing weights by this.", type=float)
    moe_router_num_groups: Optional[int] = _f(
        None, "Group-limited routing (DeepSeek-V3): the experts split into this many equal groups of "
        "consecutive experts; each token chooses its top-k among the experts of its best "
        "--moe-router-group-topk groups. Groups = expert-parallel size: device-limited routing.", type=int)
    moe_router_group_topk: Optional[int] = _f(
        None, "Groups each token may route to (with --moe-router-num-groups); a group's score is the sum of "
        "its best top-k / group-topk expert scores.", type=int)
    moe_router_group_score_topk: Optional[int] = _f(
        None, "megazero: experts whose scores add up to a group's score (default --moe-router-topk / "
        "--moe-router-group-topk, Megatron-core's rule; Hugging Face's DeepSeek-V3 always takes 2).",
        type=int)
    moe_router_bias: bool = _f(
        False, "A learned bias on the router's logits (gpt-oss), zero-initialised; megazero's switch "
        "(Megatron-LM adds one whenever --add-bias-linear, which here gives the experts their biases only).")
    moe_router_enable_expert_bias: bool = _f(
        False, "Aux-loss-free balancing: a per-expert bias, added to the scores for the top-k choice only, "
        "moved by --moe-router-bias-update-rate after every step towards balance (no gradient; sigmoid "
        "scores).")
    moe_router_bias_update_rate: float = _f(
        1e-3, "Step of the expert bias update: + rate for experts below the mean token count, - rate above.",
        type=float)
    moe_router_load_balancing_type: str = _f(
        "aux_loss", "Load-balancing loss: aux_loss (Switch/GShard, per micro-batch), seq_aux_loss (per "
        "sequence, DeepSeek-V2) or none.",
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"])
    moe_aux_loss_coeff: float = _f(0.0, "Coefficient of the load-balancing loss (1e-2 is a usual start).",
                                   type=float)
    moe_z_loss_coeff: Optional[float] = _f(None, "Coefficient of the router z-loss (mean squared "
                                           "log-sum-exp of the logits; 1e-3 is a usual start).", type=float)
    moe_token_dispatcher_type: str = _f(
        "allgather", "How tokens reach their experts: allgather (every rank of the expert-TP x EP group sees "
        "all tokens and computes its experts' share) or alltoall (tokens travel by all-to-all over the EP "
        "group, then gathered over expert TP).", choices=["allgather", "alltoall", "flex"])
    moe_expert_capacity_factor: Optional[float] = _f(
        None, "Expert capacity as a multiple of the even share: each expert takes at most ceil(factor x "
        "top-k x T / experts) of the T tokens of a micro-batch (the sequences of one data-parallel rank's "
        "micro-batch, whatever the TP, CP and EP split); the rest are dropped. None: dropless.", type=float)
    moe_token_drop_policy: str = _f("probs", "Which tokens an expert over capacity keeps: probs (the highest "
                                    "routing weights) or position (the earliest tokens).",
                                    choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = _f(
        False, "Give every expert exactly its capacity of tokens (tokens not routed to it fill the free "
        "places with routing weight 0); needs --moe-expert-capacity-factor.")
    moe_grouped_gemm: bool = _f(
        False, "Run a rank's experts as one grouped product (torch's grouped_mm on a GPU; elsewhere one "
        "batched matrix product over the experts' tokens padded to the busiest expert's) instead of one "
        "product per expert (Megatron-LM's default; on CPUs the faster of the two).", action="store_true")
    moe_shared_expert_intermediate_size: Optional[int] = _f(
        None, "Hidden size of the shared expert, a dense MLP every token goes through beside its routed "
        "experts (Qwen2-MoE, DeepSeek); none: no shared expert.")
    moe_shared_expert_gate: bool = _f(
        False, "Scale the shared expert's output by sigmoid(x . w) with a learned w (Qwen2-MoE).")
    moe_apply_probs_on_input: bool = _f(
        False, "Multiply each token's routing weight into the expert's input instead of its output; the "
        "expert outputs then add up unweighted (Llama 4). Needs --moe-router-topk 1 (Megatron-LM's rule).")
    expert_model_parallel_size: int = _f(
        1, "Ranks the experts are split over (expert parallel, EP): each holds --num-experts / EP experts.")
    expert_tensor_parallel_size: Optional[int] = _f(
        None, "Ranks each expert's weights are split over (expert tensor parallel; default "
        "--tensor-model-parallel-size).")
    # derived (see Derived)
    expert_data_parallel_size: int = _f(1, "world size / (expert TP x EP x PP): the ranks that hold the same "
                                        "experts and reduce their gradients (derived).", derived=True)


SECTIONS = {"parallel": ParallelConfig, "model": ModelConfig, "moe": MoEConfig, "training": TrainingConfig,
            "optimizer": OptimizerConfig, "precision": PrecisionConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig, "resilience": ResilienceConfig}


def _index_fields() -> Mapping[str, Tuple[str, Any]]:
    index = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = (section, f)
    return MappingProxyType(index)


_FIELD_INDEX = _index_fields()  # read-only: built once, since the sections are fixed


def field_index() -> Mapping[str, Tuple[str, Any]]:
    """field name -> (section name, dataclass field), read-only; names are unique across sections."""
    return _FIELD_INDEX


def flag_of(f) -> str:
    """The command-line flag of a dataclass field."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


@dataclass(frozen=True)
class Derived:
    """What :func:`megazero.config.validate` computes from the settings and the world size.

    ``filled`` holds the settings left unset that took their default rule's value (e.g.
    ``ffn_hidden_size`` = 4 x hidden); the others are never given on the command line."""
    world_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    padded_vocab_size: int
    num_micro_batches: int
    expert_data_parallel_size: int = 1
    filled: Tuple[Tuple[str, Any], ...] = ()

    def values(self) -> Dict[str, Any]:
        """Every derived field and filled setting by name."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "filled"}
        out.update(self.filled)
        return out


@dataclass
class MegazeroConfig:
    """The whole configuration, one dataclass per concern.

    ``derived`` is None for settings as given; :func:`megazero.config.validate` returns a resolved
    copy whose sections hold the derived values too and whose ``derived`` says which they are."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    model_preset: Optional[str] = None
    notes: Tuple[str, ...] = ()  # start-up remarks (ignored Megatron-LM flags ...), printed by rank 0
    derived: Optional[Derived] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def is_filled(self, name: str) -> bool:
        """Whether setting ``name`` was left unset and took its default rule's value."""
        return self.derived is not None and name in dict(self.derived.filled)

    def _copy(self) -> "MegazeroConfig":
        """A copy sharing nothing mutable with this one: new section objects, and a deep copy of the
        values that are containers (a full ``deepcopy`` costs more than validation itself)."""
        out = copy.copy(self)
        for f in fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "__dataclass_fields__") and not isinstance(section, Derived):
                section = copy.copy(section)
                for k, v in vars(section).items():
                    if isinstance(v, (list, dict, set)):
                        setattr(section, k, copy.deepcopy(v))
                setattr(out, f.name, section)
        return out

    def resolved(self, derived: Derived) -> "MegazeroConfig":
        """A copy with ``derived``'s values written into the sections."""
        return self._copy()._fill(derived)

    def _fill(self, derived: Derived) -> "MegazeroConfig":
        """Write ``derived``'s values into this config's own sections (a copy no one else holds)."""
        for name, value in derived.values().items():
            setattr(getattr(self, _FIELD_INDEX[name][0]), name, value)
        self.derived = derived
        return self

    def given(self) -> "MegazeroConfig":
        """The settings as given: a resolved config's filled-in defaults unset again (a value
        changed since validation counts as given), so validating again derives them afresh."""
        out = self._copy()
        out.derived = None
        if self.derived is not None:
            index = field_index()
            for name, value in self.derived.filled:
                section = getattr(out, index[name][0])
                if getattr(section, name) == value:
                    setattr(section, name, index[name][1].default)
        return out

    def replace(self, **sections) -> "MegazeroConfig":
        """A copy of the given settings with some changed: ``cfg.replace(parallel={"zero_stage": 2})``."""
        out = self.given()
        for name, changes in sections.items():
            setattr(out, name, replace(getattr(out, name), **changes))
        return out
