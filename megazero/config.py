"""Every setting as a documented dataclass field, parsed from Megatron-LM-named flags.

Layering, lowest to highest priority: dataclass defaults < ``--model PRESET`` < ``--config FILE``
(YAML or JSON, flat ``flag-name: value`` keys or nested by section) < command-line flags.
:func:`validate` checks the whole configuration once and raises :class:`ConfigError` whose
message names the flag and the fix; derived values (data-parallel size, micro-batches per
step, padded vocabulary) are computed there, once.

The field's flag is ``--`` + the field name with ``_`` replaced by ``-`` unless its metadata
names another one; the help text is the field's ``help`` metadata.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields, asdict, replace
from typing import Any, Dict, List, Optional, Sequence


class ConfigError(ValueError):
    """An inconsistent or invalid setting; the message names the flag and how to fix it."""


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
    decoder_first_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the first pipeline stage (uneven split); the rest are spread evenly.")
    decoder_last_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the last pipeline stage (uneven split); the rest are spread evenly.")
    pipeline_schedule: str = _f("1f1b", "Pipeline schedule: gpipe, 1f1b or interleaved "
                                "(interleaved is chosen when virtual stages are set).",
                                choices=["gpipe", "1f1b", "interleaved"])
    sequence_parallel: bool = _f(False, "Split activations along the sequence in the non-tensor-parallel "
                                 "regions (needs --tensor-model-parallel-size > 1).")
    zero_stage: int = _f(0, "ZeRO stage on the data-parallel axis: 0 plain DP, 1 optimizer state, "
                         "2 + gradients, 3 + parameters.", type=int)
    offload_optimizer: bool = _f(False, "Keep fp32 master weights and optimizer state on the CPU (ZeRO 1-3).")
    ddp_bucket_size: Optional[int] = _f(
        None, "Gradient bucket size in elements (default: a quarter of the model, within 1M-40M; "
        "never more than the model).")
    overlap_grad_reduce: bool = _f(True, "Start each bucket's gradient reduction as soon as it is complete.",
                                   flag="--no-overlap-grad-reduce", action="store_false")
    rank_order: str = _f("tp-dp-pp", "Order of the axes in the rank number, fastest first (Megatron: tp-dp-pp).")
    # derived by validate()
    world_size: int = _f(1, "Number of processes (taken from WORLD_SIZE; not a flag).", derived=True)
    data_parallel_size: int = _f(1, "world size / (tp x pp) (derived).", derived=True)
    virtual_pipeline_model_parallel_size: int = _f(1, "Model chunks per pipeline stage (derived).", derived=True)


@dataclass
class ModelConfig:
    """The GPT architecture (GPT-2 and LLaMA styles)."""
    num_layers: int = _f(2, "Transformer layers.")
    hidden_size: int = _f(64, "Hidden size.")
    ffn_hidden_size: Optional[int] = _f(None, "MLP hidden size (default 4 x hidden, or LLaMA's 8/3 rule for swiglu).")
    num_attention_heads: int = _f(4, "Attention heads.")
    num_query_groups: Optional[int] = _f(None, "Key/value heads for grouped-query attention (default: heads).")
    kv_channels: Optional[int] = _f(None, "Channels per head (default hidden / heads).")
    seq_length: int = _f(64, "Training sequence length.")
    max_position_embeddings: Optional[int] = _f(None, "Learned position table size (default seq length).")
    vocab_size: int = _f(512, "Vocabulary size before padding (the tokenizer's, when one is given).")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this x TP size.")
    position_embedding_type: str = _f("learned_absolute", "learned_absolute (GPT-2) or rope (LLaMA).",
                                      choices=["learned_absolute", "rope"])
    rotary_base: float = _f(10000.0, "RoPE base.", type=float)
    normalization: str = _f("LayerNorm", "LayerNorm or RMSNorm.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the norms.", type=float)
    activation: str = _f("gelu", "MLP activation: gelu (tanh approximation, GPT-2) or swiglu (LLaMA).",
                         choices=["gelu", "swiglu"])
    add_bias_linear: bool = _f(True, "Biases in the linear layers (GPT-2); off for LLaMA.",
                               flag="--disable-bias-linear", action="store_false")
    untie_embeddings_and_output_weights: bool = _f(False, "Give the output head its own weight.")
    hidden_dropout: float = _f(0.0, "Dropout after attention and MLP.", type=float)
    attention_dropout: float = _f(0.0, "Dropout on attention probabilities.", type=float)
    init_method_std: float = _f(0.02, "Std of the normal initialisation.", type=float)
    recompute_granularity: Optional[str] = _f(None, "Activation recomputation: full or selective.",
                                              choices=["full", "selective"])
    recompute_method: Optional[str] = _f(None, "With full: uniform or block.", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = _f(None, "With full: layers per recomputed group (uniform) "
                                             "or layers recomputed per stage (block).")
    # derived by validate()
    padded_vocab_size: int = _f(0, "Vocabulary padded for TP (derived).", derived=True)


@dataclass
class TrainingConfig:
    """Batch sizes, length of training, evaluation."""
    micro_batch_size: int = _f(2, "Sequences per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = _f(None, "Sequences per optimizer step (default micro x DP).")
    train_iters: int = _f(10, "Optimizer steps.")
    seed: int = _f(1234, "Random seed (same weights and data at every layout).")
    eval_interval: int = _f(0, "Evaluate every this many steps (0: never).")
    eval_iters: int = _f(2, "Batches per evaluation.")
    # derived by validate()
    num_micro_batches: int = _f(1, "global batch / (micro batch x DP) (derived).", derived=True)


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule and clipping."""
    optimizer: str = _f("adam", "adam (AdamW) or sgd.", choices=["adam", "sgd"])
    lr: float = _f(1e-3, "Peak learning rate.", type=float)
    min_lr: float = _f(0.0, "Learning rate at the end of decay.", type=float)
    lr_decay_style: str = _f("cosine", "constant, linear or cosine.", choices=["constant", "linear", "cosine"])
    lr_warmup_iters: int = _f(0, "Linear warm-up steps.")
    lr_decay_iters: Optional[int] = _f(None, "Steps over which to decay (default --train-iters).")
    weight_decay: float = _f(0.01, "Decoupled weight decay (not applied to biases and norms).", type=float)
    adam_beta1: float = _f(0.9, "Adam beta1.", type=float)
    adam_beta2: float = _f(0.999, "Adam beta2.", type=float)
    adam_eps: float = _f(1e-8, "Adam epsilon.", type=float)
    sgd_momentum: float = _f(0.0, "SGD momentum.", type=float)
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).", type=float)


@dataclass
class PrecisionConfig:
    """Mixed precision and loss scaling."""
    bf16: bool = _f(False, "Parameters and activations in bfloat16, fp32 master weights.")
    fp16: bool = _f(False, "Parameters and activations in float16, fp32 master weights, loss scaling.")
    loss_scale: Optional[float] = _f(None, "Constant loss scale for fp16 (default: dynamic).", type=float)
    initial_loss_scale: float = _f(2.0 ** 32, "Starting dynamic loss scale.", type=float)
    min_loss_scale: float = _f(1.0, "Training stops if the dynamic scale would fall below this.", type=float)
    loss_scale_window: int = _f(1000, "Clean steps before the dynamic scale doubles.")
    hysteresis: int = _f(2, "Overflows tolerated before the dynamic scale halves.")
    grad_reduce_dtype: str = _f("fp32", "dtype gradients are accumulated and reduced in: fp32 or param.",
                                choices=["fp32", "param"])


@dataclass
class DataConfig:
    """Where the tokens come from."""
    data_path: List[str] = _f([], "Megatron-format dataset prefix(es) (PREFIX.bin/.idx, written by "
                              "scripts/preprocess_data.py or Megatron-LM), optionally weighted: [w1] p1 [w2] p2.",
                              nargs="+")
    split: str = _f("969,30,1", "Train,valid,test split of the documents (with --data-path).")
    mock_data: bool = _f(False, "Deterministic synthetic tokens (same global sample at every layout).")
    tokenizer_model: Optional[str] = _f(None, "sentencepiece .model file or Hugging Face tokenizer directory; "
                                        "its vocabulary size replaces --vocab-size.")
    num_workers: int = _f(0, "Data-loader worker processes (reserved; mock data needs none).")
    eod_mask_loss: bool = _f(False, "Leave the prediction after each end-of-document token out of the loss "
                             "(the EOD id comes from --tokenizer-model).")


@dataclass
class CheckpointConfig:
    """Saving and loading."""
    save: Optional[str] = _f(None, "Directory to save checkpoints to (iter_XXXXXXX/ per save and "
                             "latest_checkpointed_iteration.txt), every --save-interval steps and at the end.")
    load: Optional[str] = _f(None, "Directory to resume from: its latest checkpoint, written under any "
                             "TP/PP/DP/ZeRO layout (iteration, LR schedule, data position, loss scale "
                             "continue); the same directory as --save may be empty (first job starts fresh).")
    save_interval: int = _f(0, "Save every this many steps (0: only at the end of training; needs --save).")
    override_opt_param_scheduler: bool = _f(False, "On --load, use this run's --lr, --min-lr, --lr-warmup-iters, "
                                            "--lr-decay-iters and --lr-decay-style even where they differ "
                                            "from the checkpoint's (otherwise such a difference is an error).")


@dataclass
class LoggingConfig:
    """Console, metrics file and wandb."""
    log_interval: int = _f(1, "Print a progress line every this many steps.")
    metrics_file: Optional[str] = _f(None, "Write one JSON object per step to this file (rank 0).")
    wandb_project: Optional[str] = _f(None, "Log to this wandb project.")
    wandb_mode: Optional[str] = _f(None, "online, offline or disabled (default: offline without an API key).",
                                   choices=["online", "offline", "disabled"])
    wandb_exp_name: Optional[str] = _f(None, "wandb run name.")
    wandb_save_dir: Optional[str] = _f(None, "Directory for wandb files.")


SECTIONS = {"parallel": ParallelConfig, "model": ModelConfig, "training": TrainingConfig,
            "optimizer": OptimizerConfig, "precision": PrecisionConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig}


@dataclass
class MegazeroConfig:
    """The whole configuration, one dataclass per concern."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model_preset: Optional[str] = None
    # fields that validate() filled in from others (recomputed on every validate, never stale)
    defaulted: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def replace(self, **sections) -> "MegazeroConfig":
        """A copy with some fields changed: ``cfg.replace(parallel={"zero_stage": 2})``."""
        out = {name: getattr(self, name) for name in SECTIONS}
        for name, changes in sections.items():
            out[name] = replace(out[name], **changes)
        return MegazeroConfig(**out, model_preset=self.model_preset, defaulted=list(self.defaulted))


def flag_of(f) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _field_index() -> Dict[str, tuple]:
    """field name -> (section name, dataclass field); names are unique across sections."""
    index = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = (section, f)
    return index


def build_parser(presets: Optional[Dict[str, dict]] = None) -> argparse.ArgumentParser:
    """The argparse parser for every flag (defaults suppressed so given flags can be told apart)."""
    p = argparse.ArgumentParser(
        description="Pretrain a GPT model with tensor, pipeline and data parallelism and ZeRO.",
        argument_default=argparse.SUPPRESS, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML or JSON file of settings; flags override it.")
    p.add_argument("--model", dest="model_preset", choices=sorted(presets) if presets else None,
                   help="Named model preset" + (f" ({', '.join(sorted(presets))})" if presets else ""))
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard the optimizer state across data-parallel ranks (= --zero-stage 1).")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section, cls.__doc__)
        for f in fields(cls):
            if f.metadata.get("derived"):
                continue
            kw: Dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
            if "action" in f.metadata:
                kw["action"] = f.metadata["action"]
            elif f.type in ("bool", bool):
                kw["action"] = "store_true"
            else:
                kw["type"] = f.metadata.get("type", _scalar_type(f))
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                if "nargs" in f.metadata:
                    kw["nargs"] = f.metadata["nargs"]
            group.add_argument(flag_of(f), **kw)
    return p


def _scalar_type(f):
    t = str(f.type)
    if "float" in t:
        return float
    if "int" in t:
        return int
    return str


def _load_file(path: str) -> Dict[str, Any]:
    with open(path) as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        import yaml
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_").lstrip("_")] = value
    return flat


def config_from_dict(settings: Dict[str, Any], presets: Optional[Dict[str, dict]] = None) -> MegazeroConfig:
    """Build a config from ``{field_name: value}`` (a preset named by ``model_preset`` first)."""
    index = _field_index()
    per_section: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
    preset = settings.get("model_preset") or settings.get("model")
    if isinstance(preset, str):
        if not presets or preset not in presets:
            known = ", ".join(sorted(presets or {})) or "none registered"
            raise ConfigError(f"--model {preset}: unknown model preset; choose one of: {known}")
        for k, v in presets[preset].items():
            per_section[index[k][0]][k] = v
    for key, value in settings.items():
        if key in ("model_preset", "model", "config"):
            continue
        if key == "use_distributed_optimizer":
            if value:
                per_section["parallel"]["zero_stage"] = max(1, settings.get("zero_stage", 1))
            continue
        if key not in index:
            raise ConfigError(f"unknown setting {key!r} (flag --{key.replace('_', '-')}); see --help for the list")
        per_section[index[key][0]][key] = value
    cfg = MegazeroConfig(**{s: cls(**per_section[s]) for s, cls in SECTIONS.items()},
                         model_preset=preset if isinstance(preset, str) else None)
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None, presets: Optional[Dict[str, dict]] = None,
               world_size: Optional[int] = None, validate_now: bool = True) -> MegazeroConfig:
    """Parse Megatron-style flags (after an optional --config file and --model preset) and validate."""
    ns = vars(build_parser(presets).parse_args(argv))
    settings: Dict[str, Any] = {}
    if "config" in ns:
        settings.update(_load_file(ns.pop("config")))
    settings.update(ns)
    cfg = config_from_dict(settings, presets)
    if validate_now:
        validate(cfg, world_size)
    return cfg


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: MegazeroConfig, world_size: Optional[int] = None) -> MegazeroConfig:
    """Check every setting against the others; fill in derived values. Raises ConfigError."""
    par, mod, tr, opt, pre = cfg.parallel, cfg.model, cfg.training, cfg.optimizer, cfg.precision
    index = _field_index()
    for name in cfg.defaulted:  # a value derived last time is derived again from today's settings
        setattr(getattr(cfg, index[name][0]), name, None)
    cfg.defaulted = []

    def default(section, name: str, value) -> None:
        setattr(section, name, value)
        cfg.defaulted.append(name)

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--num-layers", mod.num_layers), ("--hidden-size", mod.hidden_size),
                    ("--num-attention-heads", mod.num_attention_heads), ("--seq-length", mod.seq_length),
                    ("--vocab-size", mod.vocab_size), ("--micro-batch-size", tr.micro_batch_size),
                    ("--make-vocab-size-divisible-by", mod.make_vocab_size_divisible_by)):
        _check(isinstance(v, int) and v >= 1, f"{flag} must be a positive integer, got {v!r}")
    for flag, v in (("--global-batch-size", tr.global_batch_size), ("--kv-channels", mod.kv_channels),
                    ("--ffn-hidden-size", mod.ffn_hidden_size), ("--num-query-groups", mod.num_query_groups),
                    ("--max-position-embeddings", mod.max_position_embeddings),
                    ("--lr-decay-iters", opt.lr_decay_iters), ("--recompute-num-layers", mod.recompute_num_layers)):
        _check(v is None or (isinstance(v, int) and v >= 1), f"{flag} must be a positive integer, got {v!r}")
    _check(tr.train_iters >= 0, f"--train-iters must be >= 0, got {tr.train_iters}")
    _check(tr.seed >= 0, f"--seed must be >= 0, got {tr.seed}")
    _check(tr.eval_interval >= 0, f"--eval-interval must be >= 0 (0: never), got {tr.eval_interval}")
    _check(tr.eval_interval == 0 or tr.eval_iters >= 1,
           f"--eval-iters must be >= 1 when --eval-interval is set, got {tr.eval_iters}")
    _check(cfg.logging.log_interval >= 1, f"--log-interval must be >= 1, got {cfg.logging.log_interval}")
    try:
        from megazero.mesh import _parse_order
        _parse_order(par.rank_order)
    except ValueError as err:
        raise ConfigError(f"--rank-order: {err}") from None
    _check(world_size % (tp * pp) == 0,
           f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
           f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
           "or change the sizes")
    dp = world_size // (tp * pp)
    par.world_size, par.data_parallel_size = world_size, dp

    # ---- model shape vs tensor parallel
    _check(mod.hidden_size % mod.num_attention_heads == 0 or mod.kv_channels is not None,
           f"--hidden-size {mod.hidden_size} is not divisible by --num-attention-heads "
           f"{mod.num_attention_heads}; change one or set --kv-channels")
    _check(mod.num_attention_heads % tp == 0,
           f"--num-attention-heads {mod.num_attention_heads} is not divisible by --tensor-model-parallel-size "
           f"{tp}; use a tensor-parallel size that divides the number of heads")
    if mod.num_query_groups is None:
        default(mod, "num_query_groups", mod.num_attention_heads)
    _check(mod.num_query_groups >= 1 and mod.num_attention_heads % mod.num_query_groups == 0,
           f"--num-attention-heads {mod.num_attention_heads} is not divisible by --num-query-groups "
           f"{mod.num_query_groups}; each key/value head must serve a whole number of query heads")
    _check(mod.num_query_groups % tp == 0,
           f"--num-query-groups {mod.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}; "
           "use a tensor-parallel size that divides the number of key/value heads")
    _check(mod.hidden_size % tp == 0,
           f"hidden size {mod.hidden_size} is not divisible by tensor-model-parallel size {tp} "
           "(--hidden-size, --tensor-model-parallel-size); choose a hidden size that TP divides")
    if mod.kv_channels is None:
        default(mod, "kv_channels", mod.hidden_size // mod.num_attention_heads)
    if mod.ffn_hidden_size is None:
        if mod.activation == "swiglu":
            raw = int(8 * mod.hidden_size / 3)
            default(mod, "ffn_hidden_size", ((raw + 63) // 64) * 64)
        else:
            default(mod, "ffn_hidden_size", 4 * mod.hidden_size)
    _check(mod.ffn_hidden_size % tp == 0,
           f"--ffn-hidden-size {mod.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if mod.max_position_embeddings is None:
        default(mod, "max_position_embeddings", mod.seq_length)
    _check(mod.position_embedding_type == "rope" or mod.seq_length <= mod.max_position_embeddings,
           f"--seq-length {mod.seq_length} exceeds --max-position-embeddings {mod.max_position_embeddings}; "
           "raise --max-position-embeddings or shorten the sequence")
    if mod.position_embedding_type == "rope":
        _check(mod.kv_channels % 2 == 0, f"rope needs an even head dimension, got {mod.kv_channels}")
    for flag, v in (("--hidden-dropout", mod.hidden_dropout), ("--attention-dropout", mod.attention_dropout)):
        _check(0.0 <= v < 1.0, f"{flag} must be in [0, 1), got {v}")
    multiple = mod.make_vocab_size_divisible_by * tp
    mod.padded_vocab_size = ((mod.vocab_size + multiple - 1) // multiple) * multiple

    # ---- sequence parallel
    _check(not par.sequence_parallel or tp > 1,
           "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations across the "
           "tensor-parallel ranks); drop the flag or raise the tensor-parallel size")
    _check(not par.sequence_parallel or mod.seq_length % tp == 0,
           f"--sequence-parallel: --seq-length {mod.seq_length} is not divisible by "
           f"--tensor-model-parallel-size {tp}")

    # ---- pipeline
    _check(pp <= mod.num_layers,
           f"--pipeline-model-parallel-size {pp} is larger than --num-layers {mod.num_layers}; every stage "
           "needs at least one layer")
    vpl = par.num_layers_per_virtual_pipeline_stage
    uneven = par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None
    if vpl is not None:
        _check(vpl >= 1, f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {vpl}")
        _check(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        _check(not uneven, "--num-layers-per-virtual-pipeline-stage cannot be combined with "
               "--decoder-first/last-pipeline-num-layers; use one or the other")
        _check(mod.num_layers % (pp * vpl) == 0,
               f"--num-layers {mod.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
               f"--num-layers-per-virtual-pipeline-stage {vpl} = {pp * vpl}")
        par.virtual_pipeline_model_parallel_size = mod.num_layers // (pp * vpl)
        par.pipeline_schedule = "interleaved"
    else:
        par.virtual_pipeline_model_parallel_size = 1
        _check(par.pipeline_schedule != "interleaved",
               "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage")
    if uneven:
        first = par.decoder_first_pipeline_num_layers or 0
        last = par.decoder_last_pipeline_num_layers or 0
        _check(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        middle_stages = pp - (par.decoder_first_pipeline_num_layers is not None) \
            - (par.decoder_last_pipeline_num_layers is not None)
        rest = mod.num_layers - first - last
        _check(first >= 0 and last >= 0 and rest >= 0,
               f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers {last} "
               f"exceed --num-layers {mod.num_layers}")
        if middle_stages > 0:
            _check(rest % middle_stages == 0 and rest // middle_stages >= 1,
                   f"the {rest} layers left after --decoder-first/last-pipeline-num-layers cannot be split "
                   f"evenly over the other {middle_stages} pipeline stages")
        else:
            _check(rest == 0, f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers "
                   f"{last} must add up to --num-layers {mod.num_layers} when pp is 2")
    elif vpl is None:
        _check(mod.num_layers % pp == 0,
               f"--num-layers {mod.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
               "choose a divisor or give an uneven split with --decoder-first-pipeline-num-layers / "
               "--decoder-last-pipeline-num-layers")

    # ---- batch
    if tr.global_batch_size is None:
        default(tr, "global_batch_size", tr.micro_batch_size * dp)
    _check(tr.global_batch_size % (tr.micro_batch_size * dp) == 0,
           f"--global-batch-size {tr.global_batch_size} is not divisible by --micro-batch-size "
           f"{tr.micro_batch_size} x data-parallel size {dp} = {tr.micro_batch_size * dp}")
    tr.num_micro_batches = tr.global_batch_size // (tr.micro_batch_size * dp)
    if par.pipeline_schedule == "interleaved":
        _check(tr.num_micro_batches % pp == 0,
               f"the interleaved schedule needs the number of micro-batches ({tr.num_micro_batches} = "
               f"--global-batch-size / (--micro-batch-size x DP)) to be a multiple of "
               f"--pipeline-model-parallel-size {pp}; allowed counts: {pp}, {2 * pp}, {3 * pp}, ...")

    # ---- ZeRO
    _check(par.zero_stage in (0, 1, 2, 3), f"--zero-stage must be 0, 1, 2 or 3, got {par.zero_stage}")
    _check(not par.offload_optimizer or par.zero_stage >= 1,
           "--offload-optimizer needs --zero-stage 1, 2 or 3 (stage 0 keeps no sharded optimizer state)")
    _check(par.ddp_bucket_size is None or par.ddp_bucket_size >= 1,
           f"--ddp-bucket-size must be positive, got {par.ddp_bucket_size}")

    # ---- precision
    _check(not (pre.fp16 and pre.bf16), "--fp16 and --bf16 cannot be used together; choose one")
    _check(pre.loss_scale is None or pre.loss_scale > 0, f"--loss-scale must be > 0, got {pre.loss_scale}")
    _check(pre.min_loss_scale > 0, f"--min-loss-scale must be > 0, got {pre.min_loss_scale}")
    _check(pre.initial_loss_scale >= pre.min_loss_scale,
           f"--initial-loss-scale {pre.initial_loss_scale} is below --min-loss-scale {pre.min_loss_scale}")
    _check(pre.hysteresis >= 1, f"--hysteresis must be >= 1, got {pre.hysteresis}")
    _check(pre.loss_scale_window >= 1, f"--loss-scale-window must be >= 1, got {pre.loss_scale_window}")

    # ---- recompute
    if mod.recompute_granularity == "full":
        if mod.recompute_method is None:
            default(mod, "recompute_method", "uniform")
        if mod.recompute_num_layers is None:
            default(mod, "recompute_num_layers", 1)
        _check(mod.recompute_num_layers >= 1,
               f"--recompute-num-layers must be >= 1, got {mod.recompute_num_layers}")
    else:
        _check(mod.recompute_method is None,
               "--recompute-method is only used with --recompute-granularity full")

    # ---- optimizer
    _check(opt.lr >= 0 and opt.min_lr >= 0, "--lr and --min-lr must be >= 0")
    _check(opt.min_lr <= opt.lr, f"--min-lr {opt.min_lr} is above --lr {opt.lr}")
    _check(opt.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {opt.clip_grad}")
    _check(opt.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {opt.lr_warmup_iters}")
    _check(0.0 <= opt.adam_beta1 < 1.0 and 0.0 <= opt.adam_beta2 < 1.0,
           f"--adam-beta1/--adam-beta2 must be in [0, 1), got {opt.adam_beta1}, {opt.adam_beta2}")
    _check(opt.adam_eps > 0, f"--adam-eps must be > 0, got {opt.adam_eps}")
    _check(opt.sgd_momentum >= 0, f"--sgd-momentum must be >= 0, got {opt.sgd_momentum}")
    _check(opt.weight_decay >= 0, f"--weight-decay must be >= 0, got {opt.weight_decay}")
    if opt.lr_decay_iters is None:
        default(opt, "lr_decay_iters", tr.train_iters)
    else:
        _check(opt.lr_decay_style == "constant" or opt.lr_decay_iters > opt.lr_warmup_iters,
               f"--lr-decay-iters {opt.lr_decay_iters} must be greater than --lr-warmup-iters "
               f"{opt.lr_warmup_iters} (decay runs after warm-up); raise it or use --lr-decay-style constant")

    # ---- checkpoints
    ck = cfg.checkpoint
    _check(isinstance(ck.save_interval, int) and ck.save_interval >= 0,
           f"--save-interval must be >= 0 (0: save only at the end), got {ck.save_interval!r}")
    _check(not ck.save_interval or ck.save,
           f"--save-interval {ck.save_interval} needs --save DIR (the directory to write checkpoints to)")
    for flag, v in (("--save", ck.save), ("--load", ck.load)):
        _check(v is None or (isinstance(v, str) and v.strip() != ""),
               f"{flag} needs a directory, got {v!r}")

    # ---- data
    _check(cfg.data.mock_data or cfg.data.data_path,
           "no training data: pass --mock-data for synthetic tokens or --data-path PREFIX for a "
           "Megatron-format dataset (see scripts/preprocess_data.py)")
    _check(not (cfg.data.mock_data and cfg.data.data_path),
           "--mock-data and --data-path are exclusive; choose one")
    if cfg.data.tokenizer_model:  # as in Megatron-LM, the tokenizer's vocabulary sets the model's
        try:
            from megazero.data.tokenizer import load_tokenizer
            mod.vocab_size = load_tokenizer(cfg.data.tokenizer_model).vocab_size
        except (OSError, ValueError) as err:
            raise ConfigError(f"--tokenizer-model: {err}") from None
        mod.padded_vocab_size = ((mod.vocab_size + multiple - 1) // multiple) * multiple
    _check(not cfg.data.eod_mask_loss or cfg.data.tokenizer_model,
           "--eod-mask-loss needs --tokenizer-model (the end-of-document id comes from the tokenizer)")
    _check(not cfg.data.mock_data or mod.vocab_size >= 2,
           f"--vocab-size must be at least 2 for --mock-data, got {mod.vocab_size}")
    return cfg
