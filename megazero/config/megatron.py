"""Megatron-LM's flags under Megatron-LM's names, so its launch scripts run unchanged.

Three kinds, each a table below:

- :data:`SWITCHES`: aliases of megazero settings with Megatron-LM's meaning (``--swiglu`` is
  ``--activation swiglu``); a few more with a rule of their own are handled in :func:`translate`
  (``--group-query-attention``, ``--grad-reduce-in-bf16``, ``--context-parallel-size``, ...);
- :data:`IGNORED`: flags that only tune speed, memory or logging on Megatron-LM; accepted, and
  named with the reason on one start-up line (rank 0);
- :data:`REFUSED`: Megatron-LM flags that would change the math and that megazero does not
  implement; refused by name, with what to do instead.

Settings that megazero shares with Megatron-LM under the same name (``--train-samples``,
``--lr-warmup-fraction``, ``--tokenizer-type`` ...) are ordinary fields of
:mod:`megazero.config.sections`.  Everything here works on the parsed flags before the config is
built (:func:`translate`), and returns the remarks instead of printing them.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Set, Tuple

from megazero.errors import ConfigError

PREFIX = "megatron__"  # argparse dest prefix of the flags defined here

SWITCHES: Dict[str, Tuple[str, Any]] = {  # flag -> (setting, value)
    "--swiglu": ("activation", "swiglu"),
    "--use-rotary-position-embeddings": ("position_embedding_type", "rope"),
    "--recompute-activations": ("recompute_granularity", "selective"),
    "--overlap-grad-reduce": ("overlap_grad_reduce", True),
}

_FUSION = "kernel fusion only: the same numbers either way"
_LOGGING = "logging detail only"
_SDPA = "attention is torch's scaled_dot_product_attention, which picks its fastest kernel"
IGNORED: Dict[str, str] = {  # flag -> why it does not matter here
    "--use-mcore-models": "megazero has one GPT implementation",
    "--use-legacy-models": "megazero has one GPT implementation",
    "--transformer-impl": "megazero has one GPT implementation (no Transformer Engine)",
    "--use-flash-attn": _SDPA,
    "--attention-backend": _SDPA,
    "--overlap-param-gather": "when ZeRO's parameter all-gather runs is a speed matter",
    "--cross-entropy-loss-fusion": _FUSION,
    "--no-gradient-accumulation-fusion": _FUSION,
    "--no-masked-softmax-fusion": _FUSION,
    "--no-bias-gelu-fusion": _FUSION,
    "--no-bias-swiglu-fusion": _FUSION,
    "--no-bias-dropout-fusion": _FUSION,
    "--no-rope-fusion": _FUSION,
    "--no-persist-layer-norm": _FUSION,
    "--manual-gc": "Python garbage-collection timing only",
    "--manual-gc-interval": "Python garbage-collection timing only",
    "--empty-unused-memory-level": "CUDA cache management only",
    "--log-throughput": "tokens/s and TFLOP/s are always logged",
    "--data-cache-path": "dataset indices are built in memory, not cached on disk",
    "--no-mmap-bin-files": "how the .bin files are read only",
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated and reduced in fp32 already "
                                            "(--grad-reduce-dtype fp32)",
    "--attention-softmax-in-fp32": "the attention softmax runs in fp32 already",
    "--distributed-backend": "the backend follows the device: NCCL on GPUs, gloo on CPUs",
    "--profile": "profiling only", "--profile-step-start": "profiling only",
    "--profile-step-end": "profiling only", "--profile-ranks": "profiling only",
    "--ckpt-format": "megazero writes its own format, which loads under any layout",
    "--tiktoken-pattern": "used by TikTokenizer only",
    "--no-create-attention-mask-in-dataloader": "attention is causal by construction: no mask is built",
    "--use-cpu-initialization": "initialisation does not depend on the device here",
    "--timing-log-level": _LOGGING, "--timing-log-option": _LOGGING,
    "--log-timers-to-tensorboard": _LOGGING, "--log-memory-to-tensorboard": _LOGGING,
    "--log-validation-ppl-to-tensorboard": _LOGGING, "--log-params-norm": _LOGGING,
    "--log-num-zeros-in-grad": _LOGGING, "--tensorboard-log-interval": _LOGGING,
    "--tensorboard-queue-size": _LOGGING, "--log-loss-scale-to-tensorboard": _LOGGING,
    "--log-world-size-to-tensorboard": _LOGGING,
}

_FP8 = "FP8 training is not implemented; use --bf16"
REFUSED: Dict[str, str] = {  # flag -> why and what to do
    "--rampup-batch-size": "batch-size ramp-up is not implemented: megazero trains with --global-batch-size "
                           "from the first step; drop the flag",
    "--decoupled-lr": "a separate learning rate for the embedding and output layer is not implemented; drop "
                      "it (those parameters then follow --lr)",
    "--decoupled-min-lr": "a separate learning rate for the embedding and output layer is not implemented; "
                          "drop it (those parameters then follow --min-lr)",
    "--fp8-format": _FP8, "--fp8-recipe": _FP8, "--fp8-amax-history-len": _FP8,
    "--fp8-amax-compute-algo": _FP8, "--fp8-param-gather": _FP8, "--fp8-margin": _FP8,
    "--num-experts": "mixture of experts is not implemented",
    "--expert-model-parallel-size": "mixture of experts is not implemented",
    "--qk-layernorm": "normalising queries and keys is not implemented",
    "--add-qkv-bias": "a QKV bias without the other linear biases is not implemented",
    "--apply-query-key-layer-scaling": "query-key layer scaling is not implemented",
    "--rotary-interleaved": "interleaved rotary pairs are not implemented (megazero rotates halves, as "
                            "Hugging Face LLaMA does)",
    "--use-rope-scaling": "RoPE scaling is not implemented",
    "--squared-relu": "the squared-ReLU MLP is not implemented (gelu or --swiglu)",
    "--fp32-residual-connection": "fp32 residuals are not implemented",
    "--apply-residual-connection-post-layernorm": "post-norm residuals are not implemented",
}

# flags with a rule of their own (see translate); value kinds for argparse
SPECIAL: Dict[str, Dict[str, Any]] = {
    "--use-distributed-optimizer": dict(action="store_true", help="Shard the optimizer state over "
                                        "the data-parallel ranks (= --zero-stage 1, or the stage given)."),
    "--group-query-attention": dict(action="store_true", help="Grouped-query attention: "
                                    "--num-query-groups applies only with this flag (Megatron-LM's rule)."),
    "--grad-reduce-in-bf16": dict(action="store_true", help="Reduce gradients in bf16 "
                                  "(= --grad-reduce-dtype param with --bf16)."),
    "--context-parallel-size": dict(type=int, help="Only 1 (no context parallelism)."),
    "--rotary-percent": dict(type=float, help="Only 1.0 (rotary embeddings on the whole head)."),
    "--calculate-per-token-loss": dict(action="store_true", help="Average the loss over tokens: the "
                                       "same number here unless --eod-mask-loss, which it is refused with."),
    "--apply-layernorm-1p": dict(action="store_true", help="Megatron-LM stores norm scales minus one; "
                                 "the same model in exact arithmetic here, where norm scales get no weight "
                                 "decay."),
    "--no-position-embedding": dict(action="store_true", help="Only with rotary embeddings (which have "
                                    "no learned table)."),
}


def _dest(flag: str) -> str:
    return PREFIX + flag[2:].replace("-", "_")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the Megatron-LM flags of this module to ``parser`` (its own group in ``--help``)."""
    group = parser.add_argument_group(
        "Megatron-LM", "Megatron-LM flags: aliases of the settings above, and flags that only tune speed or "
        "logging there (accepted, ignored, named at start-up). Flags that would change the math and are "
        "not implemented are refused by name.")
    for flag, (name, value) in SWITCHES.items():
        shown = "" if value is True else f" {value}"
        group.add_argument(flag, dest=_dest(flag), action="store_true",
                           help=f"= --{name.replace('_', '-')}{shown}.")
    for flag, kw in SPECIAL.items():
        group.add_argument(flag, dest=_dest(flag), **kw)
    for flag, why in IGNORED.items():
        group.add_argument(flag, dest=_dest(flag), nargs="*", metavar="VALUE", help=f"Ignored: {why}.")
    for flag in REFUSED:
        group.add_argument(flag, dest=_dest(flag), nargs="*", help=argparse.SUPPRESS)


def translate(settings: Dict[str, Any], command_line: Set[str]) -> Tuple[Dict[str, Any], List[str]]:
    """Megatron-LM flags in ``settings`` (parsed flags over a ``--config`` file) to megazero settings.

    ``command_line``: the setting names given as flags (Megatron-LM's ``--num-query-groups`` rule
    applies to them).  Returns the settings and the start-up remarks; raises :class:`ConfigError`
    for a refused flag or a value megazero cannot honour."""
    given = {"--" + k[len(PREFIX):].replace("_", "-"): v for k, v in settings.items() if k.startswith(PREFIX)}
    out = {k: v for k, v in settings.items() if not k.startswith(PREFIX)}
    refused = [f for f in REFUSED if f in given]
    if refused:
        raise ConfigError("; ".join(f"{f}: {REFUSED[f]}" for f in refused))
    for flag, (name, value) in SWITCHES.items():
        if given.get(flag):
            if name in out and out[name] != value:
                raise ConfigError(f"{flag} means --{name.replace('_', '-')} {value}, but "
                                  f"{out[name]!r} is given too; drop one")
            out[name] = value
    ignored = [f"{f} ({IGNORED[f]})" for f in IGNORED if f in given]
    notes = _special(given, out, command_line, ignored)
    if ignored:
        notes.insert(0, "ignored Megatron-LM flags that only tune speed or logging here: "
                     + "; ".join(ignored))
    return out, notes


def _special(given: Dict[str, Any], out: Dict[str, Any], command_line: Set[str],
             ignored: List[str]) -> List[str]:
    """The flags of :data:`SPECIAL` and the sequence-parallel rule; returns remarks (and adds the
    flags accepted without effect to ``ignored``)."""
    notes: List[str] = []
    if given.get("--use-distributed-optimizer"):
        out["zero_stage"] = max(1, out.get("zero_stage", 1))
    if "num_query_groups" in command_line and not given.get("--group-query-attention"):
        notes.append(f"--num-query-groups {out.pop('num_query_groups')} ignored: it applies only with "
                     "--group-query-attention (Megatron-LM's rule); add that flag for grouped-query "
                     "attention")
    if given.get("--grad-reduce-in-bf16"):
        if not out.get("bf16"):
            raise ConfigError("--grad-reduce-in-bf16 needs --bf16 (gradients are reduced in the bf16 "
                              "parameter dtype); add --bf16 or drop the flag")
        out["grad_reduce_dtype"] = "param"
    cp = given.get("--context-parallel-size")
    if cp is not None and cp != 1:
        raise ConfigError(f"--context-parallel-size {cp}: context parallelism is not implemented; use 1 "
                          "(or drop the flag)")
    if cp == 1:
        ignored.append("--context-parallel-size 1 (no context parallelism is the only kind here)")
    rp = given.get("--rotary-percent")
    if rp is not None and rp != 1.0:
        raise ConfigError(f"--rotary-percent {rp}: partial rotary embeddings are not implemented; use 1.0")
    if rp == 1.0:
        ignored.append("--rotary-percent 1.0 (rotary embeddings always cover the whole head)")
    if given.get("--calculate-per-token-loss") and out.get("eod_mask_loss"):
        raise ConfigError("--calculate-per-token-loss with --eod-mask-loss is not implemented "
                          "(micro-batches then hold different token counts); drop one of them")
    if given.get("--calculate-per-token-loss"):
        ignored.append("--calculate-per-token-loss (every micro-batch holds the same number of tokens, "
                       "so the per-token mean is the mean of the micro-batch means)")
    if given.get("--apply-layernorm-1p"):
        ignored.append("--apply-layernorm-1p (the same model in exact arithmetic: norm scales are stored "
                       "as is and, as in Megatron-LM, get no weight decay; in bf16 the compute copy of a "
                       "scale near 1 is coarser than Megatron-LM's zero-centred one, the fp32 master is not)")
    if given.get("--no-position-embedding") and out.get("position_embedding_type") != "rope":
        raise ConfigError("--no-position-embedding: a model without any position embedding is not "
                          "implemented; use it with --position-embedding-type rope or drop it")
    if given.get("--no-position-embedding"):
        ignored.append("--no-position-embedding (rotary embeddings have no learned table)")
    if out.get("sequence_parallel") and out.get("tensor_model_parallel_size", 1) == 1:
        out["sequence_parallel"] = False
        notes.append("--sequence-parallel turned off: it needs --tensor-model-parallel-size > 1 "
                     "(as Megatron-LM does)")
    return notes
