"""Megatron-LM's flags under Megatron-LM's names, so its launch scripts run unchanged.

Every flag of Megatron-LM's parser (the pinned list ``megatron_flags.txt``) has an answer:

- megazero settings of the same name (:mod:`megazero.config.sections`: ``--train-samples``,
  ``--lr-warmup-fraction``, ``--tokenizer-type`` ...);
- :data:`SWITCHES` and :data:`ALIASES`: aliases with Megatron-LM's meaning (``--swiglu`` is
  ``--activation swiglu``); :data:`SPECIAL`: flags with a rule of their own, applied in
  :func:`translate` (``--group-query-attention``, ``--grad-reduce-in-bf16``, ...);
- the tables of :mod:`megazero.config.megatron_table`: ignored flags (named with the reason on one
  start-up line, rank 0), flags accepted only at Megatron-LM's default, and refused flags (named,
  with what to do instead); and flags Megatron-LM has removed (:mod:`megazero.config.megatron_removed`),
  refused with what became of them.

Everything here works on the parsed flags before the config is built (:func:`translate`), and
returns the remarks instead of printing them; :func:`required_notes` names the settings Megatron-LM
requires that took megazero's defaults.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Set, Tuple

from megazero.config.megatron_removed import REMOVED
from megazero.config.megatron_forks import FORK_ALIASES, FORK_SPECIAL, HF_TOKENIZER_ALIASES, fork_rules
from megazero.config.megatron_table import DEFAULT_ONLY, IGNORED, REFUSED, classify, pinned_flags
from megazero.config.sections import field_index, flag_of
from megazero.errors import ConfigError

PREFIX = "megatron__"  # argparse dest prefix of the flags defined here

SWITCHES: Dict[str, Tuple[str, Any]] = {  # flag -> (setting, value)
    "--swiglu": ("activation", "swiglu"),
    "--use-rotary-position-embeddings": ("position_embedding_type", "rope"),
    "--recompute-activations": ("recompute_granularity", "selective"),
    "--overlap-grad-reduce": ("overlap_grad_reduce", True),
    "--delay-wgrad-compute": ("delay_wgrad_compute", True),
    "--optimizer-cpu-offload": ("offload_optimizer", True),
    "--override-opt_param-scheduler": ("override_opt_param_scheduler", True),
    "--use-tp-pp-dp-mapping": ("rank_order", "tp-pp-dp"),
    "--openai-gelu": ("activation", "gelu"),
    "--quick-geglu": ("activation", "quick_geglu"),
    "--export-qk-l2-norm": ("qk_l2_norm", True),  # ModelOpt's name of Llama 4's q/k norm
    "--export-moe-apply-probs-on-input": ("moe_apply_probs_on_input", True),  # ModelOpt's, Llama 4's experts
    "--squared-relu": ("activation", "squared_relu"),
    "--disable-use-tokenizer-model-from-checkpoint-args": ("no_use_tokenizer_model_from_checkpoint_args",
                                                           True),
    "--no-yarn-correction-range-round-to-int": ("yarn_correction_range_round_to_int", False),
    "--mmap-bin-files": ("mmap_bin_files", True),  # Megatron-LM's default, spelled out
    "--create-attention-mask-in-dataloader": ("create_attention_mask_in_dataloader", True),
}

# switches that win over their setting given too, as Megatron-LM's argument checks make them
# (Megatron-Bridge's Nemotron-H test passes --use-rotary-position-embeddings with
# --position-embedding-type none)
LEGACY_WINS = ("--use-rotary-position-embeddings",)

ALIASES: Dict[str, str] = {  # flag -> the setting it sets, with that setting's values
    "--persistent-save-interval": "save_interval",
    "--hybrid-override-pattern": "hybrid_layer_pattern",
}

# flags with a rule of their own (see translate); value kinds for argparse
SPECIAL: Dict[str, Dict[str, Any]] = {
    "--use-distributed-optimizer": dict(action="store_true", help="Shard the optimizer state over "
                                        "the data-parallel ranks (= --zero-stage 1, or the stage given)."),
    "--group-query-attention": dict(action="store_true", help="Grouped-query attention: "
                                    "--num-query-groups applies only with this flag (Megatron-LM's rule)."),
    "--grad-reduce-in-bf16": dict(action="store_true", help="Reduce gradients in bf16 "
                                  "(= --grad-reduce-dtype param with --bf16)."),
    "--calculate-per-token-loss": dict(action="store_true", help="Average the loss over tokens: the "
                                       "same number here unless --eod-mask-loss, which it is refused with."),
    "--apply-layernorm-1p": dict(action="store_true", help="Megatron-LM stores norm scales minus one; "
                                 "the same model in exact arithmetic here, where norm scales get no weight "
                                 "decay."),
    "--enable-gpt-oss": dict(action="store_true", help="ModelOpt's GPT-OSS mode: YaRN RoPE with gpt-oss's "
                             "constants (--rotary-scaling-factor 32, --yarn-original-max-position-embeddings "
                             "131072, --yarn-beta-fast 32, --yarn-beta-slow 1, --mscale 1, --mscale-all-dim "
                             "0, --no-yarn-correction-range-round-to-int), over the RoPE flags given."),
    "--no-position-embedding": dict(action="store_true", help="Only with rotary embeddings (which have "
                                    "no learned table); Megatron-LM's deprecated flag: for no position "
                                    "embedding at all use --position-embedding-type none."),
    "--spec": dict(nargs="*", help="Megatron-LM's layer spec: its Mamba and hybrid stack specs "
                   "(... mamba_stack_spec, ... hybrid_stack_spec) are accepted with --hybrid-layer-pattern, "
                   "which builds that stack; other specs are not implemented."),
}
HYBRID_SPECS = ("mamba_stack_spec", "hybrid_stack_spec")  # Megatron-core's hybrid stacks' spec names
SPECIAL.update(FORK_SPECIAL)  # Swallow's and MindSpeed-LLM's own flags (megatron_forks)
SPECIAL["--recompute-modules"] = dict(
    nargs="*", help="Megatron-LM's modules of selective recompute: accepted; megazero's "
    "--recompute-granularity selective recomputes core_attn, the others keep their activations (memory "
    "only: the same numbers), named at start-up.")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                     "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")  # Megatron-core's allowed names
ALIASES.update(FORK_ALIASES)
SPECIAL.update({  # older Megatron-LM hybrid scripts (replaced by --hybrid-layer-pattern in 2026-02)
    "--hybrid-attention-ratio": dict(type=float, help="Older Megatron-LM's share of attention layers in a "
                                     "hybrid stack, placed by its rule (docs/hybrid.md); now "
                                     "--hybrid-layer-pattern."),
    "--hybrid-mlp-ratio": dict(type=float, help="Older Megatron-LM's share of MLP layers in a hybrid stack "
                               "(docs/hybrid.md); now --hybrid-layer-pattern."),
})


# ModelOpt's --enable-gpt-oss (megatron/post_training/model_builder.py): gpt-oss's YaRN RoPE
GPT_OSS_YARN: Dict[str, Any] = dict(
    position_embedding_type="yarn", rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=131072,
    yarn_beta_fast=32.0, yarn_beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=False)


def _dest(flag: str) -> str:
    return PREFIX + flag[2:]  # the flag itself (argparse takes any string), so it maps back exactly


def implemented_flags() -> Set[str]:
    """Megatron-LM flag names that megazero implements: its settings' flags and this module's
    aliases and rules."""
    from megazero.config.sections import field_index, flag_of
    own = {flag_of(f) for _, f in field_index().values() if not f.metadata.get("derived")}
    return own | set(SWITCHES) | set(SPECIAL) | set(ALIASES)


# settings Megatron-LM has no default for (it requires them); megazero has small ones and says so
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")


def required_notes(settings: Dict[str, Any], presets: Optional[Dict[str, dict]] = None) -> List[str]:
    """The start-up remark naming the settings Megatron-LM requires that took megazero's defaults
    (neither given, nor set by the ``--model`` preset or the ``--use-checkpoint-args`` checkpoint)."""
    from megazero.config.sections import field_index
    preset = settings.get("model_preset") or settings.get("model")
    known = set(settings) | set((presets or {}).get(preset, {}) if isinstance(preset, str) else ())
    if settings.get("use_checkpoint_args"):
        known |= {"num_layers", "hidden_size", "num_attention_heads", "seq_length"}
    if settings.get("train_samples"):
        known.add("train_iters")
    index = field_index()
    missing = [n for n in REQUIRED + ("train_iters",) if n not in known]
    if not missing:
        return []
    shown = ", ".join(f"--{n.replace('_', '-')} {index[n][1].default if n != 'train_iters' else 10}"
                      for n in missing)
    return [f"Megatron-LM requires these settings, which took megazero's defaults: {shown}"]


def _taken(parser: argparse.ArgumentParser) -> Set[str]:
    return set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add Megatron-LM's flags that megazero has no setting of the same name for: the aliases and rules
    of this module, and every flag of :mod:`megazero.config.megatron_table` (those of the pinned list
    that its prefix rules cover included), each in its own group of ``--help``."""
    group = parser.add_argument_group(
        "Megatron-LM", "Megatron-LM flags: aliases of the settings above, and flags that only tune speed or "
        "logging there (accepted, ignored, named at start-up). Flags that would change the math and are "
        "not implemented are refused by name.")
    for flag, (name, value) in SWITCHES.items():
        field = field_index()[name][1]
        if value is True and field.default is True:  # a store_false setting: the switch is the default
            text = f"Megatron-LM's switch; on by default here ({flag_of(field)} turns it off)."
        else:
            text = f"= --{name.replace('_', '-')}{'' if value is True else f' {value}'}."
        group.add_argument(flag, dest=_dest(flag), action="store_true", help=text)
    for flag, kw in SPECIAL.items():
        group.add_argument(flag, dest=_dest(flag), **kw)
    kinds = next(a for a in parser._actions if a.dest == "tokenizer_type")  # noqa: SLF001
    kinds.choices = list(kinds.choices) + list(HF_TOKENIZER_ALIASES)  # translate() maps them
    for flag, name in ALIASES.items():
        original = next(a for a in parser._actions if a.dest == name)  # noqa: SLF001
        group.add_argument(flag, dest=name, type=original.type, help=f"= {original.option_strings[0]}.")
    for flag, (values, why) in DEFAULT_ONLY.items():
        group.add_argument(flag, dest=_dest(flag), nargs="*", metavar="VALUE",
                           help=f"Only {' or '.join(values)} (Megatron-LM's default): {why}.")
    taken = _taken(parser)
    for flag in dict.fromkeys([*IGNORED, *REFUSED, *pinned_flags(), *REMOVED]):
        if flag in taken:
            continue
        kind, why = classify(flag)
        if kind == "ignored":
            group.add_argument(flag, dest=_dest(flag), nargs="*", metavar="VALUE", help=f"Ignored: {why}.")
        elif kind in ("refused", "removed"):
            group.add_argument(flag, dest=_dest(flag), nargs="*", help=argparse.SUPPRESS)


def extra_words(extras: List[str]) -> Tuple[List[str], str]:
    """Command-line words no flag took: ``(refusals, unknown)``.  ``refusals``: ``"--flag: why"`` for each
    flag a prefix rule of :mod:`megazero.config.megatron_table` refuses (a Megatron-LM flag newer than
    the pinned list); ``unknown``: the argparse message for the other words ('' when none)."""
    from megazero.config.megatron_table import pinned_origin
    flags = [w.split("=", 1)[0] for w in extras if w.startswith("--")]
    refused = [f"{f}: {classify(f)[1]}" for f in flags if classify(f)[0] in ("refused", "removed")]
    refused_flags = {r.split(":", 1)[0] for r in refused}
    rest, skipping = [], False
    for w in extras:  # the words left once the refused flags and their values are taken out
        if w.startswith("--"):
            skipping = w.split("=", 1)[0] in refused_flags
        if not skipping:
            rest.append(w)
    if not rest:
        return refused, ""
    words = " ".join(rest)
    if not any(w.startswith("--") for w in rest):
        return refused, f"unrecognized arguments: {words} (values without a flag)"
    return refused, (f"unrecognized arguments: {words} (not megazero flags, and not among Megatron-LM's "
                     f"flags either, as of {pinned_origin()}; see --help)")


def refusal(problems: List[str]) -> ConfigError:
    """One error naming every refused flag of the command line (each ``"--flag ...: why"``): a user
    fixes them all in one round."""
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"{len(problems)} flags refused: " + " | ".join(problems))


def _default_only(given: Dict[str, Any], ignored: List[str], problems: List[str]) -> None:
    """:data:`DEFAULT_ONLY` flags: named as ignored with Megatron-LM's default, refused (added to
    ``problems``) with another value."""
    def same(value: str, accepted: str) -> bool:
        try:
            return float(value) == float(accepted)
        except ValueError:
            return value.lower() == accepted.lower()
    for flag, (accepted, why) in DEFAULT_ONLY.items():
        if flag not in given:
            continue
        values = given[flag] if isinstance(given[flag], list) else [given[flag]]
        if len(values) != 1 or not any(same(str(values[0]), a) for a in accepted):
            shown = " ".join(str(v) for v in values)
            problems.append(f"{flag} {shown}: {why}; use {' or '.join(accepted)} (Megatron-LM's default) or "
                            "drop the flag")
            continue
        ignored.append(f"{flag} {values[0]} ({why})")


def translate(settings: Dict[str, Any], command_line: Set[str],
              problems: Optional[List[str]] = None) -> Tuple[Dict[str, Any], List[str]]:
    """Megatron-LM flags in ``settings`` (parsed flags over a ``--config`` file) to megazero settings.

    ``command_line``: the setting names given as flags (Megatron-LM's ``--num-query-groups`` rule
    applies to them).  Returns the settings and the start-up remarks.  Every flag refused here (the
    tables, a value other than Megatron-LM's default, a rule of :data:`SPECIAL`), with ``problems``
    found before (words no flag took), is named in one :class:`ConfigError`."""
    problems = list(problems or [])
    given = {"--" + k[len(PREFIX):]: v for k, v in settings.items() if k.startswith(PREFIX)}
    out = {k: v for k, v in settings.items() if not k.startswith(PREFIX)}
    problems += [f"{f}: {classify(f)[1]}" for f in given if classify(f)[0] in ("refused", "removed")]
    overridden = []
    for flag, (name, value) in SWITCHES.items():
        if given.get(flag):
            if name in out and out[name] != value and flag in LEGACY_WINS:
                overridden.append(f"{flag} sets --{name.replace('_', '-')} {value} over the {out[name]!r} "
                                  "given (Megatron-LM's rule for this legacy flag)")
            elif name in out and out[name] != value:
                problems.append(f"{flag} means --{name.replace('_', '-')} {value}, but {out[name]!r} is "
                                "given too; drop one")
            out[name] = value
    if out.get("hybrid_layer_pattern") and "num_layers" not in out:  # Megatron-LM: the pattern's length
        out["num_layers"] = len(out["hybrid_layer_pattern"])
    ignored = [f"{f} ({classify(f)[1]})" for f in given if classify(f)[0] == "ignored"]
    _default_only(given, ignored, problems)
    notes = _special(given, out, command_line, ignored, problems) + _without_effect(out) + overridden
    if out.get("hybrid_layer_pattern") and out.get("use_rope_scaling"):  # as Megatron-core's HybridModel
        out["use_rope_scaling"] = False
        notes.append("--use-rope-scaling: no effect in a hybrid stack (Megatron-LM's hybrid model builds its "
                     "RoPE without the LLaMA-3.1 scaling), so none here either")
    if problems:  # in command-line order (a flag's refusal starts with the flag)
        order = {flag: i for i, flag in enumerate(given)}
        raise refusal(sorted(problems, key=lambda p: order.get(p.split(":")[0].split(" ")[0], -1)))
    if ignored:
        notes.insert(0, "ignored Megatron-LM flags (no effect here): " + "; ".join(ignored))
    return out, notes


def _without_effect(out: Dict[str, Any]) -> List[str]:
    """Settings Megatron-LM accepts where they do nothing (so its scripts run unchanged), named."""
    notes = []
    if out.get("eval_iters") == 0 and out.get("eval_interval"):
        notes.append(f"--eval-iters 0: no validation (Megatron-LM's meaning); --eval-interval "
                     f"{out['eval_interval']} has no effect")
    if out.get("save_interval") and not out.get("save"):
        notes.append(f"--save-interval {out['save_interval']} without --save: nothing is saved")
    for name in ("no_load_optim", "no_load_rng"):
        if out.get(name) and not out.get("load"):
            notes.append(f"--{name.replace('_', '-')} without --load: nothing is loaded, so it has no effect")
    sizes = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    mla = [f"--{k.replace('_', '-')}" for k in sizes if out.get(k, field_index()[k][1].default) !=
           field_index()[k][1].default]  # a saved settings file holds the defaults
    if mla and not out.get("multi_latent_attention"):
        notes.append(f"{', '.join(mla)} without --multi-latent-attention: no effect (multi-latent "
                     "attention's sizes; Megatron-LM ignores them too)")
    if out.get("data_cache_path"):
        notes.append(f"--data-cache-path {out['data_cache_path']}: no effect; dataset indices are built in "
                     "memory, an epoch at a time, and nothing is cached on disk")
    if out.get("create_attention_mask_in_dataloader") is False:
        kept = (" (--reset-attention-mask's document mask is built on the device from the tokens, and kept)"
                if out.get("reset_attention_mask") else "")
        notes.append("--no-create-attention-mask-in-dataloader: no effect; megazero builds no attention mask "
                     "in the data loader either way" + kept)
    return notes


def _hybrid_ratios(given: Dict[str, Any], out: Dict[str, Any], hybrid_spec: bool, notes: List[str],
                   problems: List[str]) -> None:
    """Older Megatron-LM hybrid scripts: ``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio`` (or a
    hybrid ``--spec`` alone: all Mamba-2) give the pattern by Megatron-LM's allocation; with a pattern
    given too, its counts must match theirs."""
    from megazero.config.hybrid import allocate_pattern
    ratios = (given.get("--hybrid-attention-ratio") or 0.0, given.get("--hybrid-mlp-ratio") or 0.0)
    if not (hybrid_spec or any(ratios)):
        return
    if min(ratios) < 0 or sum(ratios) > 1:
        problems.append(f"--hybrid-attention-ratio {ratios[0]} and --hybrid-mlp-ratio {ratios[1]} must be "
                        ">= 0 with a sum of at most 1")
        return
    pattern = out.get("hybrid_layer_pattern")
    layers = out.get("num_layers", field_index()["num_layers"][1].default)
    allocated = allocate_pattern(layers, *ratios)
    if pattern is None:
        out["hybrid_layer_pattern"] = allocated
        notes.append(f"--hybrid-layer-pattern {allocated}: the layers of --num-layers {layers} with "
                     f"attention ratio {ratios[0]} and MLP ratio {ratios[1]}, placed by Megatron-LM's rule")
    elif any(ratios) and sorted(pattern) != sorted(allocated):
        problems.append(f"--hybrid-layer-pattern {pattern} does not hold the layer counts of "
                        f"--hybrid-attention-ratio {ratios[0]} and --hybrid-mlp-ratio {ratios[1]} "
                        f"({allocated}); drop the ratios")


def _special(given: Dict[str, Any], out: Dict[str, Any], command_line: Set[str],
             ignored: List[str], problems: List[str]) -> List[str]:
    """The flags of :data:`SPECIAL` and the sequence-parallel rule; returns remarks (and adds the
    flags accepted without effect to ``ignored``, those refused to ``problems``)."""
    notes: List[str] = []
    fork_rules(given, out, notes, ignored, problems)
    if out.get("moe_token_dispatcher_type") == "flex":  # DeepEP / HybridEP: data movement only
        out["moe_token_dispatcher_type"] = "alltoall"
        notes.append("--moe-token-dispatcher-type flex: alltoall (the flex dispatcher moves the same tokens "
                     "to the same experts with DeepEP or HybridEP kernels: the same routing and numbers)")
    modules = given.get("--recompute-modules")
    if modules is not None and [m for m in modules if m not in RECOMPUTE_MODULES]:
        problems.append(f"--recompute-modules {' '.join(modules)}: Megatron-LM's modules are "
                        f"{', '.join(RECOMPUTE_MODULES)}")
    elif modules and modules != ["core_attn"]:
        ignored.append(f"--recompute-modules {' '.join(modules)} (memory only: --recompute-granularity "
                       "selective recomputes the attention core, core_attn, and keeps the others' "
                       "activations; the same numbers)")
    spec = " ".join(given.get("--spec") or [])
    _hybrid_ratios(given, out, bool(spec) and spec.split()[-1] in HYBRID_SPECS, notes, problems)
    if spec and spec.split()[-1] in HYBRID_SPECS:
        ignored.append(f"--spec {spec} (--hybrid-layer-pattern builds the hybrid stack)")
    elif spec:
        problems.append(f"--spec {spec}: custom layer specs are not implemented (megazero builds its "
                        "transformer layers, or with --hybrid-layer-pattern a hybrid stack); drop it")
    if given.get("--enable-gpt-oss"):  # as ModelOpt's model builder sets them, whatever was given
        out.update(GPT_OSS_YARN)
        notes.append("--enable-gpt-oss: --position-embedding-type yarn with gpt-oss's constants (ModelOpt's "
                     "GPT-OSS mode)")
    if given.get("--use-distributed-optimizer"):
        out["zero_stage"] = max(1, out.get("zero_stage", 1))
    if "num_query_groups" in command_line and not given.get("--group-query-attention"):
        notes.append(f"--num-query-groups {out.pop('num_query_groups')} ignored: it applies only with "
                     "--group-query-attention (Megatron-LM's rule); add that flag for grouped-query "
                     "attention")
    if given.get("--grad-reduce-in-bf16"):
        if not out.get("bf16"):
            problems.append("--grad-reduce-in-bf16 needs --bf16 (gradients are reduced in the bf16 "
                            "parameter dtype); add --bf16 or drop the flag")
        out["grad_reduce_dtype"] = "param"
    if given.get("--calculate-per-token-loss") and out.get("eod_mask_loss"):
        problems.append("--calculate-per-token-loss with --eod-mask-loss is not implemented "
                        "(micro-batches then hold different token counts); drop one of them")
    if given.get("--calculate-per-token-loss"):
        ignored.append("--calculate-per-token-loss (every micro-batch holds the same number of tokens, "
                       "so the per-token mean is the mean of the micro-batch means)")
    if given.get("--apply-layernorm-1p"):
        ignored.append("--apply-layernorm-1p (the same model in exact arithmetic: norm scales are stored "
                       "as is and, as in Megatron-LM, get no weight decay; in bf16 the compute copy of a "
                       "scale near 1 is coarser than Megatron-LM's zero-centred one, the fp32 master is not)")
    if given.get("--no-position-embedding") and out.get("position_embedding_type") not in ("rope", "yarn"):
        problems.append("--no-position-embedding is deprecated (Megatron-LM accepts it only with rotary "
                        "embeddings): for a model without position embeddings use "
                        "--position-embedding-type none")
    if given.get("--no-position-embedding"):
        ignored.append("--no-position-embedding (rotary embeddings have no learned table)")
    if out.get("rope_type") == "rope" and not out.get("multi_latent_attention"):
        ignored.append("--rope-type rope (ordinary attention's RoPE, which --position-embedding-type "
                       "chooses)")
    if out.get("sequence_parallel") and out.get("tensor_model_parallel_size", 1) == 1:
        out["sequence_parallel"] = False
        notes.append("--sequence-parallel turned off: it needs --tensor-model-parallel-size > 1 "
                     "(as Megatron-LM does)")
    return notes
