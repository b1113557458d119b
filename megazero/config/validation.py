"""Checking a configuration and deriving what follows from it.

:func:`validate` never changes its argument: it checks the settings, computes the derived values
with the pure function :func:`derive`, and returns a resolved copy.  Each section has one small
check; a rule that belongs to another module (the pipeline split, the schedule's micro-batch rule,
the ZeRO stages, the rank order) is checked by that module and its ValueError becomes a
:class:`ConfigError` that names the flag.  The data settings are checked only for a run that
reads data (``check_data``): a model built to load weights into, or a layout the planner weighs,
needs no dataset.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import fields
from typing import Any, Dict, Optional, Sequence

from megazero.config.attention_variants import check_attention_variants
from megazero.config.mla import check_mla
from megazero.config.patterns import GATED, layer_flags, uses_rope
from megazero.config.sections import SECTIONS, Derived, MegazeroConfig, field_index, flag_of
from megazero.errors import ConfigError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@contextlib.contextmanager
def _owned_rule(prefix: str = ""):
    """Turn the ValueError of a rule checked by its owning module into a ConfigError."""
    try:
        yield
    except ValueError as err:
        raise ConfigError(f"{prefix}{err}") from None


def validate(cfg: MegazeroConfig, world_size: Optional[int] = None,
             check_data: bool = True) -> MegazeroConfig:
    """Check every setting against the others and return the resolved config (derived values
    filled in); ``cfg`` is not changed.  ``world_size`` defaults to ``$WORLD_SIZE`` or 1.
    ``check_data=False`` leaves out the data settings (a training run needs ``--mock-data`` or
    ``--data-path``; building a model to load weights into, or planning a layout, needs neither).
    Validating a resolved config again derives its defaults afresh.  Raises ConfigError."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    given = cfg.given()
    _check_finite(given)
    _check_numbers(given)
    _check_batch_schedule(given)
    _check_world(given, world_size)
    resolved = given._fill(derive(given, world_size))  # given is this call's own copy
    data = (_check_data,) if check_data else ()
    for check in (_check_model, _check_hybrid, _check_moe, _check_context_parallel, _check_sequence_parallel,
                  _check_pipeline,
                  _check_batch, _check_zero, _check_precision, _check_recompute, _check_optimizer,
                  _check_checkpoint, *data, _check_resilience, _check_profile):
        check(resolved)
    return resolved


def _check_hybrid(cfg: MegazeroConfig) -> None:
    from megazero.config.hybrid import check_hybrid  # the hybrid stack's rules live with its symbols
    check_hybrid(cfg)


def derive(cfg: MegazeroConfig, world_size: int) -> Derived:
    """The derived values of settings ``cfg`` (as given) on ``world_size`` ranks; pure."""
    par, mod, tr = cfg.parallel, cfg.model, cfg.training
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    from megazero.mesh import axis_sizes  # the mesh owns the world's decomposition
    sizes = axis_sizes(world_size, tp, pp, par.context_parallel_size, cfg.moe.expert_model_parallel_size,
                       cfg.moe.expert_tensor_parallel_size or None)
    dp = sizes["dp"]
    index = field_index()
    filled = {name: value for name, value in _default_rules(cfg, dp).items()
              if getattr(getattr(cfg, index[name][0]), name) is None}
    vpl = par.num_layers_per_virtual_pipeline_stage or filled.get("num_layers_per_virtual_pipeline_stage")
    multiple = mod.make_vocab_size_divisible_by * tp
    global_batch = tr.global_batch_size or filled["global_batch_size"]
    return Derived(world_size=world_size, data_parallel_size=dp,
                   virtual_pipeline_model_parallel_size=mod.num_layers // (pp * vpl) if vpl else 1,
                   padded_vocab_size=-(-mod.vocab_size // multiple) * multiple,
                   num_micro_batches=global_batch // (tr.micro_batch_size * dp),
                   expert_data_parallel_size=sizes["edp"], filled=tuple(filled.items()))


def _default_rules(cfg: MegazeroConfig, dp: int) -> Dict[str, Any]:
    """The value each defaultable setting takes when left unset."""
    from megazero.config.batch_schedule import iterations_for_samples, schedule_of
    mod, tr = cfg.model, cfg.training
    heads, hidden = mod.num_attention_heads, mod.hidden_size
    swiglu_ffn = max(64, int((4 * hidden * 2 / 3) / 64) * 64)  # Megatron-LM's: 8/3 x hidden, down to 64s
    default_batch = tr.micro_batch_size * dp
    if tr.step_batch_size_schedule:  # the schedule's last batch size
        default_batch = schedule_of(tr, mod.seq_length, None)[-1][1]
    global_batch = tr.global_batch_size or default_batch
    if tr.train_samples and (tr.step_batch_size_schedule or tr.rampup_batch_size):
        train_iters = iterations_for_samples(schedule_of(tr, mod.seq_length, global_batch), tr.train_samples)
    else:
        train_iters = tr.train_samples // global_batch if tr.train_samples else 10
    ffn = swiglu_ffn if mod.activation in GATED else 4 * hidden
    rules = {"num_query_groups": heads, "kv_channels": hidden // heads, "ffn_hidden_size": ffn,
             "moe_ffn_hidden_size": mod.ffn_hidden_size or ffn,
             "expert_tensor_parallel_size": cfg.parallel.tensor_model_parallel_size,
             "max_position_embeddings": mod.seq_length, "global_batch_size": default_batch,
             "train_iters": train_iters,
             "pipeline_schedule": "1f1b"}
    chunks, pp = cfg.parallel.num_virtual_stages_per_pipeline_rank, cfg.parallel.pipeline_model_parallel_size
    if chunks and chunks > 1:  # Megatron-LM's other way to ask for the interleaved schedule
        rules["num_layers_per_virtual_pipeline_stage"] = max(1, mod.num_layers // (pp * chunks))
    if cfg.parallel.num_layers_per_virtual_pipeline_stage or (chunks and chunks > 1):
        rules["pipeline_schedule"] = "interleaved"
    if tr.train_samples:  # Megatron-LM's sample-based schedule: lengths in samples
        rules["lr_decay_samples"] = tr.train_samples
    else:
        rules["lr_decay_iters"] = tr.train_iters if tr.train_iters is not None else rules["train_iters"]
    if mod.recompute_granularity == "full":
        rules.update(recompute_method="uniform", recompute_num_layers=1)
    return rules


# ---- one check per section -------------------------------------------------------------------
def _number_fields():
    """(section, name, flag, type) of every setting, read once from the dataclasses."""
    return tuple((section, f.name, flag_of(f), str(f.type)) for section, cls in SECTIONS.items()
                 for f in fields(cls))


_FIELDS = _number_fields()  # a tuple: the sections are fixed


def _check_finite(cfg: MegazeroConfig) -> None:
    """Every numeric setting of every section: a float field holds a number (None where optional), and no
    setting holds NaN or an infinity (``v < 0`` is false for NaN, so the range checks below would let it
    through)."""
    for section, name, flag, kind in _FIELDS:
        v = getattr(getattr(cfg, section), name)
        if isinstance(v, float):
            _check(math.isfinite(v), f"{flag} must be a finite number, got {v}")
        elif kind in ("float", "Optional[float]"):
            _check(isinstance(v, int) and not isinstance(v, bool) or (v is None and kind != "float"),
                   f"{flag} must be a number, got {v!r}")
        elif isinstance(v, (list, tuple)):
            for item in v:
                _check(not isinstance(item, float) or math.isfinite(item),
                       f"{flag} must be a finite number, got {item}")


def _check_numbers(cfg: MegazeroConfig) -> None:
    par, mod, tr, opt = cfg.parallel, cfg.model, cfg.training, cfg.optimizer
    for flag, v in (("--tensor-model-parallel-size", par.tensor_model_parallel_size),
                    ("--pipeline-model-parallel-size", par.pipeline_model_parallel_size),
                    ("--num-layers", mod.num_layers), ("--hidden-size", mod.hidden_size),
                    ("--num-attention-heads", mod.num_attention_heads), ("--seq-length", mod.seq_length),
                    ("--vocab-size", mod.vocab_size), ("--micro-batch-size", tr.micro_batch_size),
                    ("--make-vocab-size-divisible-by", mod.make_vocab_size_divisible_by)):
        _check(isinstance(v, int) and v >= 1, f"{flag} must be a positive integer, got {v!r}")
    for flag, v in (("--global-batch-size", tr.global_batch_size), ("--kv-channels", mod.kv_channels),
                    ("--ffn-hidden-size", mod.ffn_hidden_size), ("--num-query-groups", mod.num_query_groups),
                    ("--max-position-embeddings", mod.max_position_embeddings),
                    ("--lr-decay-iters", opt.lr_decay_iters),
                    ("--recompute-num-layers", mod.recompute_num_layers)):
        _check(v is None or (isinstance(v, int) and v >= 1), f"{flag} must be a positive integer, got {v!r}")
    _check(tr.train_iters is None or tr.train_iters >= 0, f"--train-iters must be >= 0, got {tr.train_iters}")
    for flag, v in (("--train-samples", tr.train_samples), ("--lr-decay-samples", opt.lr_decay_samples),
                    ("--ckpt-step", cfg.checkpoint.ckpt_step)):
        _check(v is None or (isinstance(v, int) and v >= 0), f"{flag} must be an integer >= 0, got {v!r}")
    _check(tr.seed >= 0, f"--seed must be >= 0, got {tr.seed}")
    _check(tr.eval_interval >= 0, f"--eval-interval must be >= 0 (0: never), got {tr.eval_interval}")
    _check(isinstance(tr.eval_iters, int) and tr.eval_iters >= 0,
           f"--eval-iters must be >= 0 (0: no validation, as in Megatron-LM), got {tr.eval_iters!r}")
    _check(cfg.logging.log_interval >= 1, f"--log-interval must be >= 1, got {cfg.logging.log_interval}")


def _check_batch_schedule(cfg: MegazeroConfig) -> None:
    """``--step-batch-size-schedule`` / ``--rampup-batch-size`` well formed (before anything is derived)."""
    from megazero.config.batch_schedule import schedule_of
    tr = cfg.training
    _check(not (tr.step_batch_size_schedule and tr.rampup_batch_size),
           "--step-batch-size-schedule and --rampup-batch-size both set the batch size; give one")
    _check(not tr.rampup_batch_size or tr.global_batch_size,
           "--rampup-batch-size needs --global-batch-size (the batch size it ramps up to)")
    if not (tr.step_batch_size_schedule or tr.rampup_batch_size):
        return
    with _owned_rule():
        schedule = schedule_of(tr, cfg.model.seq_length, tr.global_batch_size)
    last = schedule[-1][1]
    _check(not tr.step_batch_size_schedule or tr.global_batch_size in (None, last),
           f"--global-batch-size {tr.global_batch_size} differs from the last batch size {last} of "
           "--step-batch-size-schedule; drop --global-batch-size (Megatron-LM refuses the two together) or "
           "make "
           "them equal")


def _check_world(cfg: MegazeroConfig, world: int) -> None:
    par = cfg.parallel
    from megazero.mesh import axis_sizes, parse_rank_order
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    _check(isinstance(cp, int) and cp >= 1, f"--context-parallel-size must be a positive integer, got {cp}")
    _check(world % (tp * pp) == 0,
           f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
           f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
           "or change the sizes")
    _check(world % (tp * cp * pp) == 0,
           f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
           f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp} = {tp * cp * pp}; launch a "
           f"multiple of {tp * cp * pp} processes or change the sizes")
    with _owned_rule("--rank-order: "):
        dp = axis_sizes(world, tp, pp, cp)["dp"]
        parse_rank_order(par.rank_order, {"tp": tp, "cp": cp, "pp": pp, "dp": dp})
    moe = cfg.moe
    if moe.num_experts:  # the expert decomposition of the same world (megazero.mesh)
        from megazero.mesh import expert_layouts
        with _owned_rule():
            expert_layouts(world, tp, pp, par.rank_order, cp, moe.expert_model_parallel_size,
                           moe.expert_tensor_parallel_size)


def _check_moe(cfg: MegazeroConfig) -> None:
    from megazero.config.mtp_rules import check_mtp
    from megazero.moe.settings import check_moe
    with _owned_rule():
        check_moe(cfg)
        check_mtp(cfg)  # multi-token prediction (not MoE, but a DeepSeek-V3 piece too)


def _check_context_parallel(cfg: MegazeroConfig) -> None:
    """The sequence must cut into 2 x CP chunks (and each into TP pieces under sequence parallelism);
    Ulysses needs the heads on a rank to divide by CP; attention dropout is not implemented under CP."""
    from megazero.context_parallel import check_comm_type, check_cp_seq_length
    par, mod = cfg.parallel, cfg.model
    cp, tp = par.context_parallel_size, par.tensor_model_parallel_size
    with _owned_rule(""):
        check_comm_type(par.cp_comm_type)
    if cp == 1:
        return
    with _owned_rule(""):
        check_cp_seq_length(mod.seq_length, cp)
    local = mod.seq_length // cp
    _check(not par.sequence_parallel or local % tp == 0,
           f"--sequence-parallel with --context-parallel-size {cp}: each CP rank's {local} tokens "
           f"(--seq-length {mod.seq_length} / {cp}) must divide by --tensor-model-parallel-size {tp}; "
           f"use a --seq-length divisible by {2 * cp * tp}")
    heads = mod.num_attention_heads // tp
    _check(par.cp_comm_type != "a2a" or heads % cp == 0,
           f"--cp-comm-type a2a splits the {heads} attention heads of a rank (--num-attention-heads "
           f"{mod.num_attention_heads} / --tensor-model-parallel-size {tp}) over --context-parallel-size "
           f"{cp}, which must divide them; use --cp-comm-type p2p or change the sizes")
    _check(mod.attention_dropout == 0.0,
           f"--attention-dropout {mod.attention_dropout} with --context-parallel-size {cp}: dropout inside "
           "ring/Ulysses attention is not implemented; use --attention-dropout 0")


def _check_model(cfg: MegazeroConfig) -> None:
    mod, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    _check(mod.hidden_size % mod.num_attention_heads == 0 or not cfg.is_filled("kv_channels"),
           f"--hidden-size {mod.hidden_size} is not divisible by --num-attention-heads "
           f"{mod.num_attention_heads}; change one or set --kv-channels")
    _check(mod.num_attention_heads % tp == 0,
           f"--num-attention-heads {mod.num_attention_heads} is not divisible by "
           f"--tensor-model-parallel-size {tp}; use a tensor-parallel size that divides the number of heads")
    _check(mod.num_attention_heads % mod.num_query_groups == 0,
           f"--num-attention-heads {mod.num_attention_heads} is not divisible by --num-query-groups "
           f"{mod.num_query_groups}; each key/value head must serve a whole number of query heads")
    _check(mod.num_query_groups % tp == 0,
           f"--num-query-groups {mod.num_query_groups} is not divisible by --tensor-model-parallel-size "
           f"{tp}; use a tensor-parallel size that divides the number of key/value heads")
    _check(mod.hidden_size % tp == 0,
           f"hidden size {mod.hidden_size} is not divisible by tensor-model-parallel size {tp} "
           "(--hidden-size, --tensor-model-parallel-size); choose a hidden size that TP divides")
    _check(mod.ffn_hidden_size % tp == 0,
           f"--ffn-hidden-size {mod.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    _check(mod.position_embedding_type != "learned_absolute" or mod.seq_length <= mod.max_position_embeddings,
           f"--seq-length {mod.seq_length} exceeds --max-position-embeddings {mod.max_position_embeddings}; "
           "raise --max-position-embeddings or shorten the sequence")
    _check(not uses_rope(mod) or mod.kv_channels % 2 == 0,
           f"--position-embedding-type {mod.position_embedding_type} needs an even head dimension "
           f"(--kv-channels), got {mod.kv_channels}")
    for flag, v in (("--hidden-dropout", mod.hidden_dropout), ("--attention-dropout", mod.attention_dropout)):
        _check(0.0 <= v < 1.0, f"{flag} must be in [0, 1), got {v}")
    for flag, v in (("--init-method-std", mod.init_method_std), ("--norm-epsilon", mod.norm_epsilon),
                    ("--rotary-base", mod.rotary_base)):
        _check(v > 0, f"{flag} must be > 0, got {v}")
    _check_rope_scaling(mod)
    _check_attention(mod)
    check_mla(mod)
    check_attention_variants(mod)


def _check_pattern(flag: str, value, num_layers: int, counts: bool = True) -> None:
    _check(value is None or isinstance(value, (int, list)),
           f"{flag} {value!r}: expected an integer N or a list expression such as [1,1,0]*4")
    if value is not None:
        with _owned_rule(f"{flag} {value}: "):
            layer_flags(value, num_layers)
        _check(not counts or not isinstance(value, int) or num_layers % value == 0,
               f"{flag} {value} must divide --num-layers {num_layers} (Megatron-LM's rule); give a per-layer "
               "list instead")


def _check_attention(mod) -> None:
    """Windows, soft-caps, the q/k norm and the attention scale."""
    w = mod.window_size
    _check(w is None or (isinstance(w, list) and len(w) == 2 and all(isinstance(v, int) for v in w)),
           f"--window-size {w!r}: expected two integers LEFT,RIGHT such as 4095,0")
    if w is not None:
        _check(w[1] == 0, f"--window-size {w[0]},{w[1]}: attention is causal, so RIGHT must be 0 (a query "
               f"sees no later key); use --window-size {w[0]},0")
        _check(w[0] >= -1, f"--window-size {w[0]},0: LEFT must be >= 0 (or -1: no window)")
    _check(mod.window_attn_skip_freq is None or (w is not None and w[0] >= 0),
           "--window-attn-skip-freq chooses the layers that attend within --window-size; give --window-size "
           "LEFT,0 too or drop it")
    _check_pattern("--window-attn-skip-freq", mod.window_attn_skip_freq, mod.num_layers, counts=False)
    _check_pattern("--no-rope-freq", mod.no_rope_freq, mod.num_layers)
    _check(mod.no_rope_freq is None or uses_rope(mod),
           "--no-rope-freq picks layers that skip RoPE: it needs --position-embedding-type rope or yarn")
    for flag, v in (("--attn-logit-softcapping", mod.attn_logit_softcapping),
                    ("--final-logit-softcapping", mod.final_logit_softcapping),
                    ("--softmax-scale", mod.softmax_scale)):
        _check(v is None or v > 0, f"{flag} must be > 0, got {v}")
    _check(not mod.attn_logit_softcapping or mod.attention_dropout == 0.0,
           f"--attn-logit-softcapping with --attention-dropout {mod.attention_dropout}: soft-capped "
           "attention runs in megazero's blockwise kernel, which has no dropout; use --attention-dropout 0")
    _check(not (mod.qk_layernorm and mod.qk_layernorm_scope == "all") or mod.normalization == "RMSNorm",
           "--qk-layernorm-scope all (one norm over all heads of a token, OLMo 2's) is implemented for "
           "--normalization RMSNorm only")


def _check_rope_scaling(mod) -> None:
    linear, dynamic = mod.rotary_seq_len_interpolation_factor, mod.dynamic_rope_scaling_factor
    for flag, on in (("--use-rope-scaling", mod.use_rope_scaling),
                     ("--rotary-seq-len-interpolation-factor", linear is not None),
                     ("--dynamic-rope-scaling-factor", dynamic is not None)):
        _check(not on or uses_rope(mod),
               f"{flag} scales rotary embeddings: it needs --position-embedding-type rope")
    scalings = [f for f, on in (("--use-rope-scaling", mod.use_rope_scaling),
                                ("--dynamic-rope-scaling-factor", dynamic is not None),
                                ("--position-embedding-type yarn", mod.position_embedding_type == "yarn"))
                if on]
    _check(len(scalings) <= 1, f"{' and '.join(scalings)} are two RoPE scalings; choose one")
    _check(dynamic is None or dynamic > 0, f"--dynamic-rope-scaling-factor must be > 0, got {dynamic}")
    if mod.position_embedding_type == "yarn":
        _check(mod.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be > 0, got "
                                              f"{mod.rotary_scaling_factor}")
        _check(mod.yarn_beta_fast > 0 and mod.yarn_beta_slow > 0,
               f"--yarn-beta-fast {mod.yarn_beta_fast} and --yarn-beta-slow {mod.yarn_beta_slow} must be > 0")
        _check(isinstance(mod.yarn_original_max_position_embeddings, int)
               and mod.yarn_original_max_position_embeddings >= 1,
               "--yarn-original-max-position-embeddings must be a positive integer")
    _check(linear is None or linear > 0, f"--rotary-seq-len-interpolation-factor must be > 0, got {linear}")
    if mod.use_rope_scaling:
        low, high = mod.rope_scaling_low_freq_factor, mod.rope_scaling_high_freq_factor
        _check(mod.rope_scaling_factor > 0, "--rope-scaling-factor must be > 0, got "
                                            f"{mod.rope_scaling_factor}")
        _check(0 < low < high, f"--rope-scaling-low-freq-factor {low} must be positive and below "
               f"--rope-scaling-high-freq-factor {high}")
        _check(mod.rope_scaling_original_max_position_embeddings >= 1,
               "--rope-scaling-original-max-position-embeddings must be a positive integer")


def _check_sequence_parallel(cfg: MegazeroConfig) -> None:
    par, tp = cfg.parallel, cfg.parallel.tensor_model_parallel_size
    if par.sequence_parallel:
        _check(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations "
               "across the tensor-parallel ranks); drop the flag or raise the tensor-parallel size")
        _check(cfg.model.seq_length % tp == 0, f"--sequence-parallel: --seq-length {cfg.model.seq_length} is "
               f"not divisible by --tensor-model-parallel-size {tp}")


def _check_pipeline(cfg: MegazeroConfig) -> None:
    from megazero.pipeline.partition import check_layout
    par = cfg.parallel
    chunks, pp = par.num_virtual_stages_per_pipeline_rank, par.pipeline_model_parallel_size
    if chunks is not None:
        _check(chunks >= 1, f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {chunks}")
        _check(chunks == 1 or cfg.is_filled("num_layers_per_virtual_pipeline_stage"),
               "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage both set "
               "the "
               "virtual stages; give one")
        _check(cfg.model.num_layers % (pp * chunks) == 0, f"--num-layers {cfg.model.num_layers} is not "
                                                          "divisible "
               f"by --pipeline-model-parallel-size {pp} x --num-virtual-stages-per-pipeline-rank {chunks}")
    split = (par.num_layers_per_virtual_pipeline_stage, par.decoder_first_pipeline_num_layers,
             par.decoder_last_pipeline_num_layers)
    _check(par.pipeline_model_parallel_size > 1 or split == (None, None, None),
           "--num-layers-per-virtual-pipeline-stage and --decoder-first/last-pipeline-num-layers need "
           "--pipeline-model-parallel-size > 1")
    with _owned_rule():
        check_layout(cfg.model.num_layers, par.pipeline_model_parallel_size,
                     par.num_layers_per_virtual_pipeline_stage, par.decoder_first_pipeline_num_layers,
                     par.decoder_last_pipeline_num_layers)
    _check(par.pipeline_schedule != "interleaved" or par.num_layers_per_virtual_pipeline_stage is not None,
           "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage")


def _check_batch(cfg: MegazeroConfig) -> None:
    from megazero.config.batch_schedule import schedule_of, sizes
    from megazero.pipeline.schedules import check_schedule
    par, tr = cfg.parallel, cfg.training
    dp, mbs = par.data_parallel_size, tr.micro_batch_size
    flag = "--global-batch-size"
    if tr.step_batch_size_schedule or tr.rampup_batch_size:
        flag = "--step-batch-size-schedule" if tr.step_batch_size_schedule else "--rampup-batch-size"
    for gbs in sizes(schedule_of(tr, cfg.model.seq_length, tr.global_batch_size)):
        what = f"{flag} batch size {gbs}" if flag != "--global-batch-size" else f"{flag} {gbs}"
        _check(gbs % (mbs * dp) == 0, f"{what} is not divisible by --micro-batch-size {mbs} x data-parallel "
               f"size {dp} = {mbs * dp}")
        with _owned_rule(f"{what} / (--micro-batch-size {mbs} x DP {dp}) = {gbs // (mbs * dp)} "
                         "micro-batches on "
                         f"--pipeline-model-parallel-size {par.pipeline_model_parallel_size} stages: "):
            check_schedule(par.pipeline_schedule, par.pipeline_model_parallel_size, gbs // (mbs * dp),
                           par.virtual_pipeline_model_parallel_size)


def _check_zero(cfg: MegazeroConfig) -> None:
    from megazero.offload.settings import check_offload
    from megazero.zero.stages import check_stage
    par = cfg.parallel
    with _owned_rule():
        check_stage(par.zero_stage)
        check_offload(par)
    _check(par.ddp_bucket_size is None or par.ddp_bucket_size >= 1,
           f"--ddp-bucket-size must be positive, got {par.ddp_bucket_size}")
    _check(par.max_reductions_in_flight >= 1,
           f"--max-reductions-in-flight must be at least 1, got {par.max_reductions_in_flight}")


def _check_precision(cfg: MegazeroConfig) -> None:
    pre = cfg.precision
    _check(not (pre.fp16 and pre.bf16), "--fp16 and --bf16 cannot be used together; choose one")
    _check(pre.loss_scale is None or pre.loss_scale > 0, f"--loss-scale must be > 0, got {pre.loss_scale}")
    _check(pre.min_loss_scale > 0, f"--min-loss-scale must be > 0, got {pre.min_loss_scale}")
    _check(pre.initial_loss_scale >= pre.min_loss_scale,
           f"--initial-loss-scale {pre.initial_loss_scale} is below --min-loss-scale {pre.min_loss_scale}")
    _check(pre.hysteresis >= 1, f"--hysteresis must be >= 1, got {pre.hysteresis}")
    _check(pre.loss_scale_window >= 1, f"--loss-scale-window must be >= 1, got {pre.loss_scale_window}")
    from megazero.tensor_parallel.cpu_matmul import resolve_cpu_matmul
    with _owned_rule():
        resolve_cpu_matmul(pre.cpu_matmul)
    if pre.compile:
        from megazero.tensor_parallel.compiling import check_compile
        with _owned_rule():
            import torch
            check_compile("cuda" if torch.cuda.is_available() else "cpu")


def _check_recompute(cfg: MegazeroConfig) -> None:
    mod = cfg.model
    _check(mod.recompute_granularity == "full" or mod.recompute_method is None,
           "--recompute-method is only used with --recompute-granularity full")


def _check_schedule_units(cfg: MegazeroConfig) -> None:
    """Megatron-LM's rule: iteration-based or sample-based lengths, never a mix."""
    opt, tr = cfg.optimizer, cfg.training
    if tr.train_samples:
        for flag, ok in (("--train-iters", cfg.is_filled("train_iters")),
                         ("--lr-decay-iters", cfg.is_filled("lr_decay_iters") or opt.lr_decay_iters is None),
                         ("--lr-warmup-iters", opt.lr_warmup_iters == 0)):
            _check(ok, f"{flag} cannot be used with --train-samples (sample-based training); give the "
                   f"length in samples ({flag.replace('iters', 'samples')}) or train by iterations")
    else:
        for flag, ok in (("--lr-decay-samples", opt.lr_decay_samples is None),
                         ("--lr-warmup-samples", opt.lr_warmup_samples == 0)):
            _check(ok, f"{flag} needs --train-samples (sample-based training); use "
                   f"{flag.replace('samples', 'iters')} with --train-iters")
    warmups = [f for f, v in (("--lr-warmup-iters", opt.lr_warmup_iters),
                              ("--lr-warmup-samples", opt.lr_warmup_samples)) if v]
    _check(opt.lr_warmup_fraction is None or not warmups,
           f"--lr-warmup-fraction and {' '.join(warmups)} both set the warm-up; give one")
    _check(opt.lr_warmup_fraction is None or 0.0 <= opt.lr_warmup_fraction <= 1.0,
           f"--lr-warmup-fraction must be in [0, 1], got {opt.lr_warmup_fraction}")
    _check(opt.lr_warmup_samples >= 0, f"--lr-warmup-samples must be >= 0, got {opt.lr_warmup_samples}")
    wsd_iters, wsd_samples = opt.lr_wsd_decay_iters, opt.lr_wsd_decay_samples
    if tr.train_samples:
        _check(wsd_iters is None, "--lr-wsd-decay-iters cannot be used with --train-samples; give "
               "--lr-wsd-decay-samples")
    else:
        _check(wsd_samples is None, "--lr-wsd-decay-samples needs --train-samples; use --lr-wsd-decay-iters")
    if opt.lr_decay_style == "WSD":
        wsd, flag = (wsd_samples, "--lr-wsd-decay-samples") if tr.train_samples else (wsd_iters,
                                                                                      "--lr-wsd-decay-iters")
        _check(wsd is not None, f"--lr-decay-style WSD needs {flag} (the length of the final decay)")
        _check(wsd >= 1, f"{flag} must be a positive integer, got {wsd}")
    _check(opt.lr_warmup_init >= 0, f"--lr-warmup-init must be >= 0, got {opt.lr_warmup_init}")


def _check_optimizer(cfg: MegazeroConfig) -> None:
    opt = cfg.optimizer
    _check_schedule_units(cfg)
    _check(opt.lr >= 0 and opt.min_lr >= 0, "--lr and --min-lr must be >= 0")
    _check(opt.min_lr <= opt.lr, f"--min-lr {opt.min_lr} is above --lr {opt.lr}")
    _check(opt.decoupled_min_lr is None or opt.decoupled_lr is not None,
           "--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak rate)")
    if opt.decoupled_lr is not None:
        floor = opt.decoupled_min_lr if opt.decoupled_min_lr is not None else opt.min_lr
        _check(opt.decoupled_lr >= 0 and floor >= 0, "--decoupled-lr and --decoupled-min-lr must be >= 0")
        _check(floor <= opt.decoupled_lr, f"the decoupled minimum {floor} (--decoupled-min-lr, default "
                                          "--min-lr) "
               f"is above --decoupled-lr {opt.decoupled_lr}")
        _check(opt.lr_warmup_init <= opt.decoupled_lr, f"--lr-warmup-init {opt.lr_warmup_init} is above "
               f"--decoupled-lr {opt.decoupled_lr} (warm-up rises from it to each peak)")
    _check(opt.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {opt.clip_grad}")
    _check(opt.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {opt.lr_warmup_iters}")
    _check(0.0 <= opt.adam_beta1 < 1.0 and 0.0 <= opt.adam_beta2 < 1.0,
           f"--adam-beta1/--adam-beta2 must be in [0, 1), got {opt.adam_beta1}, {opt.adam_beta2}")
    _check(opt.adam_eps > 0, f"--adam-eps must be > 0, got {opt.adam_eps}")
    _check(opt.sgd_momentum >= 0, f"--sgd-momentum must be >= 0, got {opt.sgd_momentum}")
    _check(opt.weight_decay >= 0, f"--weight-decay must be >= 0, got {opt.weight_decay}")
    _check(cfg.is_filled("lr_decay_iters") or opt.lr_decay_iters is None or opt.lr_decay_style == "constant"
           or opt.lr_decay_iters > opt.lr_warmup_iters,
           f"--lr-decay-iters {opt.lr_decay_iters} must be greater than --lr-warmup-iters "
           f"{opt.lr_warmup_iters} (decay runs after warm-up); raise it or use --lr-decay-style constant")


def _check_checkpoint(cfg: MegazeroConfig) -> None:
    ck = cfg.checkpoint
    _check(isinstance(ck.save_interval, int) and ck.save_interval >= 0,
           f"--save-interval must be >= 0 (0: save only at the end), got {ck.save_interval!r}")
    for flag, v in (("--save", ck.save), ("--load", ck.load)):
        _check(v is None or (isinstance(v, str) and v.strip() != ""), f"{flag} needs a directory, got {v!r}")
    for flag, on in (("--finetune", ck.finetune), ("--use-checkpoint-args", ck.use_checkpoint_args),
                     ("--ckpt-step", ck.ckpt_step is not None),
                     ("--exit-on-missing-checkpoint", ck.exit_on_missing_checkpoint)):
        _check(not on or ck.load, f"{flag} needs --load DIR (the checkpoint to start from)")
    _check(ck.ckpt_keep is None or (isinstance(ck.ckpt_keep, int) and ck.ckpt_keep >= 1),
           f"--ckpt-keep must be a positive integer (checkpoints to keep), got {ck.ckpt_keep!r}")
    _check(ck.ckpt_keep is None or ck.save, "--ckpt-keep needs --save DIR (the directory to prune)")
    _check(not ck.async_save or ck.save, "--async-save needs --save DIR")
    from megazero.offload.settings import optimizer_device
    _check(not ck.async_save or optimizer_device(cfg.parallel) != "nvme",
           "--async-save copies this rank's optimizer state to memory, which --offload-optimizer-device nvme "
           "keeps out of it; drop --async-save (NVMe saves stream one sub-group at a time)")
    _check(not (ck.pretrained_checkpoint and ck.finetune),
           "--pretrained-checkpoint already loads weights only; drop --finetune (with --load it would "
           "discard the fine-tune's own progress on every restart)")
    _check(not ck.pretrained_checkpoint or ck.pretrained_checkpoint.strip() != "",
           "--pretrained-checkpoint needs a directory")


def _check_data(cfg: MegazeroConfig) -> None:
    data = cfg.data
    real = [f for f, v in (("--data-path", data.data_path), ("--train-data-path", data.train_data_path)) if v]
    _check(data.mock_data or real, "no training data: pass --mock-data for synthetic tokens or "
           "--data-path PREFIX for a Megatron-format dataset (see scripts/preprocess_data.py)")
    _check(not (data.mock_data and real),
           f"--mock-data and {real[0] if real else ''} are exclusive; choose one")
    _check(len(real) < 2, "--data-path and --train-data-path are exclusive: --split cuts one set, the other "
           "names separate sets; choose one")
    _check(not data.valid_data_path or data.train_data_path,
           "--valid-data-path goes with --train-data-path (with --data-path, --split makes the validation "
           "set)")
    from megazero.data.eval_sets import check as check_sets, evaluates
    _check(not (data.train_data_path and evaluates(cfg) and not data.valid_data_path),
           "--eval-interval with --train-data-path needs --valid-data-path (the set to evaluate on)")
    for flag, items in (("--data-path", data.data_path), ("--train-data-path", data.train_data_path),
                        ("--valid-data-path", data.valid_data_path),
                        ("--test-data-path", data.test_data_path)):
        _check_blend(flag, items)
    with _owned_rule():
        check_sets(cfg)
    parts = [p for p in str(data.split).replace("/", ",").split(",") if p.strip()]
    _check(all(_number(p) is not None and math.isfinite(_number(p)) and _number(p) >= 0 for p in parts),
           f"--split {data.split!r}: expected up to three finite non-negative numbers such as 969,30,1")
    has_tokenizer = data.tokenizer_model or data.vocab_file or data.tokenizer_type
    _check(not data.eod_mask_loss or has_tokenizer,
           "--eod-mask-loss needs --tokenizer-model (the end-of-document id comes from the tokenizer)")
    for flag, on in (("--reset-attention-mask", data.reset_attention_mask),
                     ("--reset-position-ids", data.reset_position_ids)):
        _check(not on or has_tokenizer, f"{flag} needs an end-of-document id: give --tokenizer-model (its "
               "EOS id), or --tokenizer-type NullTokenizer --vocab-size N (id N)")
    _check(not data.mock_data or cfg.model.vocab_size >= 2,
           f"--vocab-size must be at least 2 for --mock-data, got {cfg.model.vocab_size}")
    from megazero.config.sft import check_sft
    check_sft(cfg)


def _number(text) -> Optional[float]:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _check_blend(flag: str, items: Sequence[str]) -> None:
    """A weighted blend ``W1 P1 W2 P2 ...`` (the first item a number): every weight finite and > 0."""
    items = list(items or [])
    if len(items) < 2 or _number(items[0]) is None:
        return
    for w, prefix in zip(items[0::2], items[1::2]):
        v = _number(w)
        _check(v is not None and math.isfinite(v) and v > 0,
               f"{flag}: the weight {w!r} before {prefix!r} must be a finite number > 0 (a blend is "
               "'WEIGHT PREFIX' pairs; leave out a prefix to give it no share)")


def _check_resilience(cfg: MegazeroConfig) -> None:
    import signal
    res = cfg.resilience
    minutes = res.distributed_timeout_minutes
    _check(isinstance(minutes, (int, float)) and minutes > 0,
           f"--distributed-timeout-minutes must be > 0 (fractions allowed, e.g. 0.5), got {minutes!r}")
    _check(res.exit_duration_in_mins is None or res.exit_duration_in_mins > 0,
           f"--exit-duration-in-mins must be > 0, got {res.exit_duration_in_mins!r}")
    _check(res.exit_interval is None or (isinstance(res.exit_interval, int) and res.exit_interval >= 1),
           f"--exit-interval must be a positive integer, got {res.exit_interval!r}")
    _check(isinstance(res.skip_nan_steps, int) and res.skip_nan_steps >= 0,
           f"--skip-nan-steps must be >= 0, got {res.skip_nan_steps!r}")
    _check(res.loss_spike_factor is None or res.loss_spike_factor == 0 or res.loss_spike_factor > 1,
           f"--loss-spike-factor must be > 1 (a multiple of the median loss) or 0 (off), got "
           f"{res.loss_spike_factor!r}")
    _check(isinstance(res.loss_spike_window, int) and res.loss_spike_window >= 1,
           f"--loss-spike-window must be a positive integer, got {res.loss_spike_window!r}")
    _check(res.loss_spike_action in ("stop", "skip"),
           f"--loss-spike-action must be stop or skip, got {res.loss_spike_action!r}")
    _check(isinstance(res.loss_spike_max_skips, int) and res.loss_spike_max_skips >= 1,
           f"--loss-spike-max-skips must be a positive integer, got {res.loss_spike_max_skips!r}")
    _check(res.loss_spike_action == "stop" or bool(res.loss_spike_factor),
           "--loss-spike-action skip needs --loss-spike-factor K > 1 (the spike threshold), not 0 (off)")
    _check(res.exit_signal_grace_secs >= 0,
           f"--exit-signal-grace-secs must be >= 0, got {res.exit_signal_grace_secs!r}")
    signals = list(res.exit_signal or [])
    _check(bool(signals), "--exit-signal needs at least one signal name, e.g. SIGTERM")
    for name in signals:
        _check(isinstance(getattr(signal, str(name), None), signal.Signals),
               f"--exit-signal {name}: not a signal on this platform; use SIGTERM or SIGUSR1")
    _check(res.exit_signal_handler or signals == ["SIGTERM"],
           f"--exit-signal {' '.join(signals)} needs --exit-signal-handler (which turns the signal into a "
           "save and a clean exit)")


def _check_profile(cfg: MegazeroConfig) -> None:
    """--profile's window and ranks (megazero/training/profiling.py)."""
    lg, world = cfg.logging, cfg.parallel.world_size
    if not lg.profile:
        return
    _check(0 <= lg.profile_step_start < lg.profile_step_end,
           f"--profile-step-start {lg.profile_step_start} --profile-step-end {lg.profile_step_end}: need "
           "0 <= start < end (the iterations done when profiling starts and when it stops)")
    ranks = list(lg.profile_ranks or [])
    _check(bool(ranks) and all(isinstance(r, int) and 0 <= r < world for r in ranks),
           f"--profile-ranks {' '.join(map(str, ranks))}: give global ranks from 0 to {world - 1}")
