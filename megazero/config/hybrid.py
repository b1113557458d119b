"""Hybrid layer stacks (``--hybrid-layer-pattern``): which kind of layer each global layer index is,
and the rules of the settings, each a one-line :class:`ConfigError` naming the flag and the fix.

One symbol per layer, Megatron-LM's: ``M`` a Mamba-2 layer, ``*`` an attention layer, ``-`` an MLP
layer, ``E`` a mixture-of-experts layer, ``G`` a Gated DeltaNet layer (Qwen3-Next's linear
attention).  Without ``--num-layers`` the pattern's length sets it (Megatron-LM's rule,
:func:`megazero.config.megatron.translate`).  Each layer is one pre-norm residual block around its one mixer
(``x + f(norm(x))``), as in Megatron-core's hybrid stack.
"""
from __future__ import annotations

from typing import List, Optional

from megazero.errors import ConfigError

MAMBA, ATTENTION, MLP, MOE, DELTANET = "M", "*", "-", "E", "G"
SYMBOLS = {MAMBA: "Mamba-2", ATTENTION: "attention", MLP: "MLP", MOE: "mixture of experts",
           DELTANET: "Gated DeltaNet"}
RECURRENT = (MAMBA, DELTANET)  # layers whose state runs along the sequence
MAMBA_CONV_KERNEL = 4  # Mamba-2's causal conv width (Megatron-core's d_conv; no flag)


def allocate_pattern(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """The pattern older Megatron-LM scripts ask for with ``--hybrid-attention-ratio`` and
    ``--hybrid-mlp-ratio`` (since replaced by the pattern itself), by Megatron-LM's rule:
    ``round(layers x attention_ratio)`` attention layers spread evenly between ``attention + 1``
    equal runs of Mamba layers, then ``round(layers x mlp_ratio)`` of those Mamba layers turned into
    MLP layers, spread evenly with the last run ending in one (right-justified).  Each placement walks
    the layers with a budget: a layer takes the symbol when less than half a slot remains, which
    refills the budget by one run length; any other layer spends one."""
    kinds = [MAMBA] * num_layers
    attention = round(num_layers * attention_ratio)
    run = (num_layers - attention) / (attention + 1)
    budget = run
    for i in range(num_layers):
        if budget < 0.5:
            kinds[i], budget = ATTENTION, budget + run
        else:
            budget -= 1
    mlps = round(num_layers * mlp_ratio)
    if mlps:
        run = (num_layers - attention - mlps) / mlps
        budget = run
        for i in range(num_layers):
            if kinds[i] != MAMBA:
                continue
            if budget < 0.5:
                kinds[i], budget = MLP, budget + run
            else:
                budget -= 1
    return "".join(kinds)


def layer_kinds(mod) -> Optional[List[str]]:
    """The kind symbol of every layer of ``mod`` (a ModelConfig), or None for a plain transformer."""
    pattern = getattr(mod, "hybrid_layer_pattern", None)
    return list(pattern) if pattern else None


def layer_kind(mod, layer_idx: int) -> Optional[str]:
    kinds = layer_kinds(mod)
    return None if kinds is None else kinds[layer_idx]


def linear_attention_layers(mod) -> Optional[List[bool]]:
    """Megatron-LM's Gated DeltaNet inside transformer layers (``--experimental-attention-variant
    gated_delta_net``): which layers' attention is Gated DeltaNet, by ``--linear-attention-freq``
    (``N``: every layer but each N-th, counting from 1; a list: 1 for Gated DeltaNet, 0 for
    attention); None without the variant."""
    if getattr(mod, "experimental_attention_variant", None) != "gated_delta_net":
        return None
    from megazero.config.patterns import layer_flags
    freq = mod.linear_attention_freq
    if isinstance(freq, int):
        return [not full for full in layer_flags(freq, mod.num_layers)]
    return layer_flags(freq, mod.num_layers)


def has_recurrent_layers(mod) -> bool:
    return any(k in RECURRENT for k in layer_kinds(mod) or ())


def mamba_num_heads(mod) -> int:
    """``--mamba-num-heads``, or Megatron-LM's default: ``2 x --hidden-size / --mamba-head-dim``."""
    return mod.mamba_num_heads or max(1, 2 * mod.hidden_size // mod.mamba_head_dim)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_hybrid(cfg) -> None:
    """The hybrid settings of a resolved config (nothing to check without a pattern), and Qwen3-Next's
    attention output gate."""
    mod, par = cfg.model, cfg.parallel
    _check(not (getattr(mod, "attention_output_gate", False) and mod.multi_latent_attention),
           "--attention-output-gate with --multi-latent-attention is not implemented; drop one of them")
    _check_linear_attention(cfg)
    pattern = getattr(mod, "hybrid_layer_pattern", None)
    if not pattern:
        return
    _check(not getattr(mod, "mtp_num_layers", None), "--mtp-num-layers with --hybrid-layer-pattern: "
           "multi-token prediction in hybrid stacks is not implemented; drop --mtp-num-layers")
    _check("/" not in pattern, f"--hybrid-layer-pattern {pattern!r}: multi-token prediction layers (after "
           "'/') are not implemented; drop the part from '/'")
    _check("|" not in pattern, f"--hybrid-layer-pattern {pattern!r}: pipeline stage marks '|' are not read; "
           "drop them and split stages with --decoder-first-pipeline-num-layers / "
           "--decoder-last-pipeline-num-layers")
    bad = sorted(set(pattern) - set(SYMBOLS))
    _check(not bad, f"--hybrid-layer-pattern {pattern!r}: {(bad or [''])[0]!r} is not a layer symbol; use "
           + ", ".join(f"{s} ({name})" for s, name in SYMBOLS.items()))
    _check(len(pattern) == mod.num_layers, f"--hybrid-layer-pattern {pattern!r} has {len(pattern)} layers "
           f"but --num-layers is {mod.num_layers}; set --num-layers {len(pattern)}")
    _check(mod.norm_position == "pre", f"--norm-position {mod.norm_position} with --hybrid-layer-pattern: "
           "hybrid layers are pre-norm blocks; drop --norm-position")
    tp, kinds = par.tensor_model_parallel_size, set(pattern)
    experts = bool(getattr(cfg.moe, "num_experts", None))
    _check(experts or MOE not in kinds, f"--hybrid-layer-pattern {pattern!r} has E (mixture-of-experts) "
           "layers: add --num-experts")
    _check(not experts or MOE in kinds, "--num-experts with --hybrid-layer-pattern: the pattern's E layers "
           "are the MoE layers, and it has none; add E to the pattern or drop --num-experts")
    _check(not experts or cfg.moe.moe_layer_freq in ("1", 1), "--moe-layer-freq with --hybrid-layer-pattern: "
           "the pattern's E layers are the MoE layers; drop --moe-layer-freq")
    recurrent = sorted(SYMBOLS[k] for k in kinds & set(RECURRENT))
    _check(not (recurrent and cfg.data.reset_attention_mask), f"--reset-attention-mask with "
           f"{' and '.join(recurrent)} layers: restarting their conv and recurrent state at each document "
           "is not implemented; drop --reset-attention-mask (or use attention-only patterns)")
    cp = par.context_parallel_size
    for kind, width in ((MAMBA, MAMBA_CONV_KERNEL), (DELTANET, mod.linear_conv_kernel_dim)):
        _check(cp == 1 or kind not in kinds or mod.seq_length // (2 * cp) >= width - 1,
               f"--context-parallel-size {cp} cuts --seq-length {mod.seq_length} into chunks of "
               f"{mod.seq_length // (2 * cp)} tokens, fewer than the {width - 1} past inputs of the "
               f"{SYMBOLS[kind]} conv; use a smaller --context-parallel-size")
    if MAMBA in kinds:
        heads = mamba_num_heads(mod)
        for flag, v in (("--mamba-num-heads", heads), ("--mamba-head-dim", mod.mamba_head_dim),
                        ("--mamba-state-dim", mod.mamba_state_dim),
                        ("--mamba-num-groups", mod.mamba_num_groups),
                        ("--mamba-chunk-size", mod.mamba_chunk_size)):
            _check(isinstance(v, int) and v >= 1, f"{flag} must be a positive integer, got {v}")
        _check(heads % mod.mamba_num_groups == 0, f"--mamba-num-heads {heads} is not divisible by "
               f"--mamba-num-groups {mod.mamba_num_groups}; each group must serve a whole number of heads")
        _check(mod.mamba_num_groups % tp == 0, f"--mamba-num-groups {mod.mamba_num_groups} is not divisible "
               f"by --tensor-model-parallel-size {tp}; tensor parallelism splits whole groups")
    if DELTANET in kinds:
        _check_deltanet_sizes(mod, tp)


def _check_deltanet_sizes(mod, tp: int) -> None:
    for flag, v in (("--linear-num-key-heads", mod.linear_num_key_heads),
                    ("--linear-num-value-heads", mod.linear_num_value_heads),
                    ("--linear-key-head-dim", mod.linear_key_head_dim),
                    ("--linear-value-head-dim", mod.linear_value_head_dim),
                    ("--linear-conv-kernel-dim", mod.linear_conv_kernel_dim),
                    ("--linear-chunk-size", mod.linear_chunk_size)):
        _check(isinstance(v, int) and v >= 1, f"{flag} must be a positive integer, got {v}")
    _check(mod.linear_num_value_heads % mod.linear_num_key_heads == 0,
           f"--linear-num-value-heads {mod.linear_num_value_heads} is not divisible by "
           f"--linear-num-key-heads {mod.linear_num_key_heads}")
    _check(mod.linear_num_key_heads % tp == 0, f"--linear-num-key-heads {mod.linear_num_key_heads} is "
           f"not divisible by --tensor-model-parallel-size {tp}; tensor parallelism splits whole key "
           "heads")


def _check_linear_attention(cfg) -> None:
    """``--experimental-attention-variant gated_delta_net`` with ``--linear-attention-freq``."""
    mod, par = cfg.model, cfg.parallel
    variant = getattr(mod, "experimental_attention_variant", None)
    freq = getattr(mod, "linear_attention_freq", None)
    _check(variant is None or freq is not None, "--experimental-attention-variant gated_delta_net needs "
           "--linear-attention-freq (N: every N-th layer keeps attention, or a list of 1s for Gated DeltaNet "
           "and 0s for attention)")
    _check(freq is None or variant is not None, "--linear-attention-freq needs "
           "--experimental-attention-variant gated_delta_net")
    if variant is None:
        return
    _check(not getattr(mod, "hybrid_layer_pattern", None), "--experimental-attention-variant with "
           "--hybrid-layer-pattern: give Gated DeltaNet layers as G in the pattern instead")
    _check(not mod.multi_latent_attention, "--experimental-attention-variant gated_delta_net with "
           "--multi-latent-attention is not implemented; drop one of them")
    _check(not cfg.data.reset_attention_mask, "--reset-attention-mask with Gated DeltaNet layers: restarting "
           "their conv and recurrent state at each document is not implemented; drop --reset-attention-mask")
    try:
        linear_attention_layers(mod)
    except ValueError as err:
        raise ConfigError(f"--linear-attention-freq {freq}: {err}") from None
    _check_deltanet_sizes(mod, par.tensor_model_parallel_size)
    cp = par.context_parallel_size
    _check(cp == 1 or mod.seq_length // (2 * cp) >= mod.linear_conv_kernel_dim - 1,
           f"--context-parallel-size {cp} cuts --seq-length {mod.seq_length} into chunks of "
           f"{mod.seq_length // (2 * cp)} tokens, fewer than the {mod.linear_conv_kernel_dim - 1} past "
           "inputs of the Gated DeltaNet conv; use a smaller --context-parallel-size")
