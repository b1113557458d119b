"""Megatron-core's names and arguments in megazero's terms.

Names (dense GPT, pre-norm; the local and the Transformer Engine layer specs)::

    embedding.word_embeddings.weight                     word_embeddings.weight (vocabulary padding cut)
    embedding.position_embeddings.weight                 position_embeddings.weight
    decoder.layers.<i>.input_layernorm.*                 decoder.<i>.input_norm.*
      (TE: self_attention.linear_qkv.layer_norm_*)
    decoder.layers.<i>.self_attention.linear_qkv.*       decoder.<i>.attention.qkv.* (the same per-group
                                                         [q ... q, k, v] row order)
    decoder.layers.<i>.self_attention.linear_proj.*      decoder.<i>.attention.proj.*
    decoder.layers.<i>.self_attention.{q,k}_layernorm.weight   decoder.<i>.attention.{q,k}_norm.weight
    decoder.layers.<i>.pre_mlp_layernorm.*               decoder.<i>.post_attention_norm.*
      (TE: mlp.linear_fc1.layer_norm_*)
    decoder.layers.<i>.mlp.linear_fc1.*                  decoder.<i>.mlp.fc1.* ([gate; up] with a gated
                                                         activation: mlp.gate.* and mlp.fc1.*)
    decoder.layers.<i>.mlp.linear_fc2.*                  decoder.<i>.mlp.fc2.*
    decoder.final_layernorm.*                            final_norm.*
    output_layer.weight                                  output_layer.weight (untied only)

Mixture of experts (torch_dist only): ``mlp.router.weight`` is megazero's router; the experts'
``mlp.experts.experts.linear_fc1.weight [L, E, 2F, h]`` (``mlp.experts.linear_fc1.weight`` with grouped
GEMM) give ``mlp.experts.gate_weight`` and ``mlp.experts.fc1_weight [E, F, h]`` (its halves),
``linear_fc2`` gives ``mlp.experts.fc2_weight``; ``mlp.shared_experts.linear_fc1/2`` the shared expert.

In ``torch_dist`` a layer's tensor is stored once for all layers, stacked on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight [L, 3h, h]``).  ``--apply-layernorm-1p`` models
store each norm scale minus one; megazero stores the scale, so one is added.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, Optional

import torch

from megazero.checkpoint.errors import CheckpointError

# Megatron-LM argument -> megazero setting of the same meaning (the same name unless mapped)
PLAIN_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
              "seq_length", "max_position_embeddings", "position_embedding_type", "rotary_base",
              "rotary_percent", "normalization", "norm_epsilon", "qk_layernorm", "add_bias_linear",
              "add_qkv_bias", "untie_embeddings_and_output_weights", "hidden_dropout", "attention_dropout",
              "make_vocab_size_divisible_by", "rotary_seq_len_interpolation_factor", "init_method_std",
              "use_rope_scaling", "rope_scaling_factor")
MOE_ARGS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
            "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_load_balancing_type",
            "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_intermediate_size",
            "moe_apply_probs_on_input")
REFUSED_ARGS = {"multi_latent_attention": "multi-latent attention",
                "rotary_interleaved": "interleaved rotary embeddings",
                "apply_residual_connection_post_layernorm": "residuals taken after the norm",
                "moe_router_enable_expert_bias": "a router expert bias",
                "moe_shared_expert_gate": "a gated shared expert",
                "hybrid_override_pattern": "hybrid (Mamba) stacks",
                "mtp_num_layers": "multi-token prediction"}
LAYER = {  # megazero leaf -> Megatron-core leaves (local spec, TE spec)
    "input_norm": ("input_layernorm.{}", "self_attention.linear_qkv.layer_norm_{}"),
    "attention.qkv": ("self_attention.linear_qkv.{}",),
    "attention.proj": ("self_attention.linear_proj.{}",),
    "attention.q_norm": ("self_attention.q_layernorm.{}",),
    "attention.k_norm": ("self_attention.k_layernorm.{}",),
    "post_attention_norm": ("pre_mlp_layernorm.{}", "mlp.linear_fc1.layer_norm_{}"),
    "mlp.fc2": ("mlp.linear_fc2.{}",),
}
GLOBAL = {"word_embeddings.weight": "embedding.word_embeddings.weight",
          "position_embeddings.weight": "embedding.position_embeddings.weight",
          "final_norm.weight": "decoder.final_layernorm.weight",
          "final_norm.bias": "decoder.final_layernorm.bias",
          "output_layer.weight": "output_layer.weight"}
GATED = ("swiglu", "geglu", "quick_geglu")
EXPERT = re.compile(r"mlp\.experts\.(fc1|gate|fc2)_weight$")  # megazero's stacked expert weights
DENSE_GLU = re.compile(r"mlp\.(shared_experts\.)?(gate|fc1)\.")  # halves of Megatron's linear_fc1


def settings_from_args(args) -> Dict[str, object]:
    """megazero's model settings from Megatron-LM's stored arguments (``--use-checkpoint-args``)."""
    a = vars(args)
    for key, what in REFUSED_ARGS.items():
        if a.get(key):
            raise CheckpointError(f"--load: the Megatron-LM checkpoint has {what} (--{key.replace('_', '-')} "
                                  f"{a[key]}), which megazero's Megatron-LM reader does not map yet")
    out = {k: a[k] for k in PLAIN_ARGS if a.get(k) is not None}
    if a.get("group_query_attention") and a.get("num_query_groups"):
        out["num_query_groups"] = a["num_query_groups"]
    if a.get("swiglu"):
        out["activation"] = "swiglu"
    elif a.get("squared_relu"):
        out["activation"] = "squared_relu"
    elif a.get("openai_gelu"):
        out["activation"] = "gelu"
    vocab = a.get("vocab_size") or a.get("padded_vocab_size")
    if vocab:
        out["vocab_size"] = int(vocab)
    return out


def moe_settings_from_args(args) -> Dict[str, object]:
    """megazero's MoE settings from Megatron-LM's stored arguments (none for a dense model)."""
    a = vars(args)
    if not a.get("num_experts"):
        return {}
    freq = a.get("moe_layer_freq", 1)
    if freq not in (1, None) and not (isinstance(freq, list) and all(freq)):
        raise CheckpointError(f"--load: the Megatron-LM checkpoint mixes dense and MoE layers "
                              f"(--moe-layer-freq {freq}), which megazero's Megatron-LM reader does not "
                              "map yet")
    return {k: a[k] for k in MOE_ARGS if a.get(k) is not None}


def _layer_source(rest: str, has: Callable[[str], bool], prefix: str) -> Optional[str]:
    leaf, kind = rest.rsplit(".", 1)
    for pattern in LAYER.get(leaf, ()):
        name = prefix + pattern.format(kind)
        if has(name):
            return name
    return None


class NameMap:
    """megazero's full tensors from a :class:`~megazero.checkpoint.megatron.files.MegatronCheckpoint`
    for a model of ``cfg`` (whole: unsharded, vocabulary unpadded)."""

    def __init__(self, ckpt, cfg, layernorm_1p: bool = False):
        self.ck, self.cfg, self.one_p = ckpt, cfg, layernorm_1p
        self.stacked = ckpt.format == "torch_dist"

    def _prefix(self, i: int) -> str:
        return "decoder.layers." if self.stacked else f"decoder.layers.{i}."

    def _get(self, name: str, i: Optional[int]) -> torch.Tensor:
        if not self.stacked:
            return self.ck.tensor(name, glu=self.cfg.model.activation in GATED)
        return self.ck.tensor(name, layer=i)  # one layer of the stack read, not the stack

    def source(self, name: str) -> Optional[str]:
        """The Megatron-core tensor megazero's ``name`` comes from (None: not in the checkpoint)."""
        if not name.startswith("decoder."):
            return GLOBAL[name] if self.ck.has(GLOBAL.get(name, "")) else None
        _, i, rest = name.split(".", 2)
        if rest == "mlp.router.weight":
            src = self._prefix(int(i)) + "mlp.router.weight"
            return src if self.ck.has(src) else None
        expert = EXPERT.fullmatch(rest)
        if expert:
            return self._expert_source(int(i), expert.group(1))
        if rest.startswith("mlp.shared_experts."):
            leaf, kind = rest[len("mlp.shared_experts."):].rsplit(".", 1)
            fc = "fc2" if leaf == "fc2" else "fc1"
            src = f"{self._prefix(int(i))}mlp.shared_experts.linear_{fc}.{kind}"
            return src if self.ck.has(src) else None
        if rest.startswith(("mlp.gate.", "mlp.fc1.")):
            src = self._prefix(int(i)) + "mlp.linear_fc1." + rest.rsplit(".", 1)[1]
            return src if self.ck.has(src) else None
        return _layer_source(rest, self.ck.has, self._prefix(int(i)))

    def _expert_source(self, i: int, leaf: str) -> Optional[str]:
        if not self.stacked:
            raise CheckpointError(f"--load {self.ck.directory}: mixture-of-experts weights are read from "
                                  "torch_dist checkpoints only (the legacy per-rank files split experts by "
                                  "expert-parallel rank)")
        fc = "linear_fc2" if leaf == "fc2" else "linear_fc1"
        for src in (f"decoder.layers.mlp.experts.experts.{fc}.weight",  # SequentialMLP
                    f"decoder.layers.mlp.experts.{fc}.weight"):  # grouped GEMM
            if self.ck.has(src):
                return src
        return None

    def tensor(self, name: str) -> torch.Tensor:
        src = self.source(name)
        if src is None:
            raise CheckpointError(f"--load {self.ck.directory}: the Megatron-LM checkpoint has no tensor for "
                                  f"megazero's {name}; is --use-checkpoint-args or the model's shape "
                                  "(--num-layers, --swiglu, --add-bias-linear, ...) different?")
        layer = int(name.split(".")[1]) if name.startswith("decoder.") else None
        t = self._get(src, layer if self.stacked else None)
        if name in ("word_embeddings.weight", "output_layer.weight"):
            t = t[:self.cfg.model.vocab_size]
        gated = self.cfg.model.activation in GATED
        expert = EXPERT.search(name)
        if expert and expert.group(1) != "fc2" and gated:  # [E, 2F, h]: [gate; up] per expert
            gate, up = t.chunk(2, dim=1)
            t = gate if expert.group(1) == "gate" else up
        elif gated and name.startswith("decoder.") and DENSE_GLU.search(name):
            gate, up = t.chunk(2, dim=0)
            t = gate if re.search(r"\.gate\.", name) else up
        if self.one_p and re.search(r"norm\.weight$", name):
            t = t + 1
        return t
