"""Hugging Face ``transformers`` interop: GPT-2, LLaMA (RoPE scaling of the llama3, linear, yarn and dynamic
types), Mistral and Qwen2 (with their sliding windows), Qwen3, Gemma, Gemma 2, Phi-3, OLMo 2 and SmolLM3,
Gemma 3, Llama 4 (its MoE layers: :mod:`models.hf_llama4`), and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, GLM-4.5 and DeepSeek-V3 (multi-latent attention:
:mod:`models.hf_deepseek`; their experts: :mod:`models.hf_sigmoid_moe`); Qwen3-Next (Gated DeltaNet and
gated attention in transformer layers: :mod:`models.hf_qwen3next`).

- :func:`config_from_hf` (:mod:`models.hf_config`) maps a ``transformers`` config to ModelConfig field
  overrides and rejects what megazero cannot reproduce exactly (naming the field and the feature);
  :func:`hf_config_from` (:mod:`models.hf_export`) is the other direction.
- :func:`from_hf` builds a megazero model (pp = 1) holding this rank's TP shard of the weights.
- :func:`to_hf` writes ``config.json`` + ``model.safetensors`` that ``AutoModelForCausalLM``
  loads. With TP > 1 it gathers the shards first: every TP rank must call it (collective) and
  TP rank 0 of data-parallel rank 0 writes.
- :func:`megazero_tensor` (import) and :func:`export_groups` (export) map tensors one at a time, so
  ``scripts/convert_hf.py`` streams them (:mod:`models.hf_convert`).

Layout differences handled here: GPT-2's ``Conv1D`` weights are ``[in, out]`` (transposed) and
its ``c_attn`` stacks ``[q; k; v]``, as Phi-3's ``qkv_proj`` (untransposed) does, whose ``gate_up_proj``
stacks ``[gate; up]``; the others have separate ``q/k/v_proj`` and ``gate/up/down_proj``.
megazero's fused QKV (and Qwen2's QKV bias) is grouped per key/value head (see :mod:`models.layers`).
Gemma's norms scale by ``1 + weight``: megazero stores ``1 + weight`` (in fp32, the very factor
transformers computes), and exports the stored scale minus one.  Per-layer norms are named by
``--norm-position`` (:data:`NORMS`).  The q/k rows are already in the half-split ``rotate_half``
layout megazero uses, so they are copied as is.

Experts: megazero stacks a layer's experts (``mlp.experts.fc1_weight [E, F, hidden]``; the checkpoint
and :func:`~models.gpt.full_state_dict` name them one by one, ``mlp.experts.<e>.fc1_weight``).
transformers 5 holds them fused in memory (``mlp.experts.gate_up_proj [E, 2F, hidden]`` = ``[gate; up]``
per expert, ``mlp.experts.down_proj``) and writes them one by one, as the published checkpoints are
(Mixtral's ``block_sparse_moe.experts.<e>.w1`` = gate, ``w3`` = up, ``w2`` = down; the others'
``mlp.experts.<e>.gate_proj`` ...).  Import reads either; export writes the published names, expert
by expert.  The router is ``mlp.gate`` (``block_sparse_moe.gate`` on Mixtral's disk), Qwen2-MoE's shared
expert ``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate``.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.names import expert_name
from megazero.config import config_from_dict, validate
from megazero.mesh import ParallelMesh
from .gpt import GPTModel, full_state_dict, load_full_state_dict
from .hf_config import GPT2_ACTIVATIONS, config_from_hf  # noqa: F401 - public names
from .hf_deepseek import MLA_NAMES, MTP_NAMES, pairs_getter
from .hf_export import arch_of, hf_config_from  # noqa: F401 - public names
from . import hf_llama4
from . import hf_mamba, hf_qwen3next

GPT2_LAYER = [  # (megazero name, HF name, "T" where HF stores it transposed)
    ("input_norm.weight", "ln_1.weight", ""), ("input_norm.bias", "ln_1.bias", ""),
    ("attention.proj.weight", "attn.c_proj.weight", "T"), ("attention.proj.bias", "attn.c_proj.bias", ""),
    ("post_attention_norm.weight", "ln_2.weight", ""), ("post_attention_norm.bias", "ln_2.bias", ""),
    ("mlp.fc1.weight", "mlp.c_fc.weight", "T"), ("mlp.fc1.bias", "mlp.c_fc.bias", ""),
    ("mlp.fc2.weight", "mlp.c_proj.weight", "T"), ("mlp.fc2.bias", "mlp.c_proj.bias", "")]
GPT2_GLOBAL = [("word_embeddings.weight", "transformer.wte.weight"),
               ("position_embeddings.weight", "transformer.wpe.weight"),
               ("final_norm.weight", "transformer.ln_f.weight"), ("final_norm.bias", "transformer.ln_f.bias"),
               ("output_layer.weight", "lm_head.weight")]
LLAMA_GLOBAL = [("word_embeddings.weight", "model.embed_tokens.weight"),
                ("final_norm.weight", "model.norm.weight"),
                ("output_layer.weight", "lm_head.weight")]
NORMS = {  # megazero's norms of a layer by --norm-position, and their transformers names
    "pre": [("input_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm")],
    "post": [("attention_output_norm", "post_attention_layernorm"),
             ("mlp_output_norm", "post_feedforward_layernorm")],
    "sandwich": [("input_norm", "input_layernorm"), ("attention_output_norm", "post_attention_layernorm"),
                 ("post_attention_norm", "pre_feedforward_layernorm"),
                 ("mlp_output_norm", "post_feedforward_layernorm")]}
EMBEDDINGS = {"gpt2": GPT2_GLOBAL[0][1], "llama": LLAMA_GLOBAL[0][1],  # the token embeddings' HF names
              **{a: hf_mamba.global_names(a)["word_embeddings.weight"] for a in hf_mamba.HYBRID_ARCHS}}
# buffers some exports carry that megazero recomputes: RoPE's inverse frequencies, GPT-2's causal masks
UNNEEDED_BUFFERS = {"gpt2": re.compile(r"transformer\.h\.\d+\.attn\.(?:masked_)?bias"),
                    "llama": re.compile(r"model\.(?:layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")}
# norms scaling by 1 + weight: megazero stores 1 + weight
OFFSET_NORMS = ("gemma", "gemma2", "gemma3_text", "qwen3_next")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe", "deepseek_v3", "qwen3_next")
EXPERT = re.compile(r"mlp\.experts\.(?:(\d+)\.)?(fc1|gate|fc2)_(weight|bias)")  # stacked or one expert
EXPERT_FILES = {"mixtral": {"gate": "w1", "fc1": "w3", "fc2": "w2"},  # the published per-expert names
                "qwen": {"gate": "gate_proj", "fc1": "up_proj", "fc2": "down_proj"}}
SHARED_EXPERT = [("mlp.shared_experts.gate.weight", "mlp.shared_expert.gate_proj.weight", ""),
                 ("mlp.shared_experts.fc1.weight", "mlp.shared_expert.up_proj.weight", ""),
                 ("mlp.shared_experts.fc2.weight", "mlp.shared_expert.down_proj.weight", ""),
                 ("mlp.shared_gate_weight", "mlp.shared_expert_gate.weight", "")]
SHARED_EXPERTS = [("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", ""),  # GLM-4.5, DeepSeek-V3
                  ("mlp.shared_experts.gate.weight", "mlp.shared_experts.gate_proj.weight", ""),
                  ("mlp.shared_experts.fc1.weight", "mlp.shared_experts.up_proj.weight", ""),
                  ("mlp.shared_experts.fc2.weight", "mlp.shared_experts.down_proj.weight", "")]


def _fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv, heads: int, groups: int, head_dim: int):
    per = qkv.reshape(groups, -1, *qkv.shape[1:])
    nq = heads // groups * head_dim
    q, k, v = per[:, :nq], per[:, nq:nq + head_dim], per[:, nq + head_dim:]
    return [t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v)]


def layer_map(cfg, arch: str) -> List[Tuple[str, str, str]]:
    """``(megazero name, HF name, how)`` of one layer's one-to-one tensors: how is ``""`` (as is),
    ``"T"`` (HF stores it transposed) or ``"1p"`` (HF stores the norm scale minus one)."""
    if arch == "gpt2":
        return list(GPT2_LAYER)
    offset = "1p" if arch in OFFSET_NORMS else ""
    out = [(f"{mz}.weight", f"{hf}.weight", offset) for mz, hf in NORMS[cfg.model.norm_position]]
    mlp = "feed_forward" if arch == "llama4_text" else "mlp"
    out += [("attention.proj.weight", "self_attn.o_proj.weight", ""),
            ("mlp.fc2.weight", f"{mlp}.down_proj.weight", "")]
    if arch != "phi3":
        out += [("mlp.gate.weight", f"{mlp}.gate_proj.weight", ""),
                ("mlp.fc1.weight", f"{mlp}.up_proj.weight", "")]
    if arch == "deepseek_v3":  # multi-latent attention (its latent norms are q_norm and kv_norm)
        out += [(mz, hf, "") for mz, hf in MLA_NAMES]
    elif cfg.model.qk_layernorm:
        out += [("attention.q_norm.weight", "self_attn.q_norm.weight", offset),
                ("attention.k_norm.weight", "self_attn.k_norm.weight", offset)]
    if arch == "gpt_oss":  # biased attention and router, attention sinks (docs/attention.md)
        out += [("attention.proj.bias", "self_attn.o_proj.bias", ""),
                ("attention.sinks", "self_attn.sinks", ""),
                ("mlp.router.weight", "mlp.router.weight", ""), ("mlp.router.bias", "mlp.router.bias", "")]
    elif arch in MOE_ARCHS:
        router = ("block_sparse_moe" if arch == "mixtral" else "mlp") + ".gate.weight"
        out.append(("mlp.router.weight", router, ""))
    if arch in ("qwen2_moe", "qwen3_next"):
        out += SHARED_EXPERT
    if arch == "qwen3_next":  # its Gated DeltaNet layers' one-to-one tensors
        out += hf_qwen3next.DELTANET_NAMES
    if arch in ("glm4_moe", "deepseek_v3"):
        out += SHARED_EXPERTS
    if arch == "llama4_text":  # its MoE layers' router and shared expert (models.hf_llama4)
        out += hf_llama4.LAYER_NAMES
    return out


def _expert_file_name(arch: str, e: int, leaf: str) -> str:
    """Expert ``e``'s ``leaf`` (fc1, gate, fc2) under its published name, within a layer."""
    if arch == "mixtral":
        return f"block_sparse_moe.experts.{e}.{EXPERT_FILES['mixtral'][leaf]}.weight"
    return f"mlp.experts.{e}.{EXPERT_FILES['qwen'][leaf]}.weight"


def _gpt_oss_expert(get, src: str, e: Optional[int], leaf: str, kind: str) -> torch.Tensor:
    """gpt-oss's experts, stacked: ``gate_up_proj [E, h, 2F]`` (gate and up interleaved, ``x @ W``),
    ``down_proj [E, F, h]`` and their biases ``[E, 2F]``, ``[E, h]``."""
    bias = "_bias" if kind == "bias" else ""
    if leaf == "fc2":
        t = get(src + "mlp.experts.down_proj" + bias)
    else:
        start = 0 if leaf == "gate" else 1
        t = get(src + "mlp.experts.gate_up_proj" + bias)[..., start::2]
    t = t if e is None else t[e]
    return t if bias else t.transpose(-1, -2)


def _expert_tensor(get, src: str, arch: str, e: Optional[int], leaf: str, experts: int,
                   kind: str = "weight") -> torch.Tensor:
    """One expert's weight (``e``), or all stacked (``e`` None), from the published per-expert tensors
    or, where those are absent, transformers' fused in-memory ones (gpt-oss: its stacked tensors)."""
    if arch == "gpt_oss":
        return _gpt_oss_expert(get, src, e, leaf, kind)
    try:
        if e is not None:
            return get(src + _expert_file_name(arch, e, leaf))
        return torch.stack([get(src + _expert_file_name(arch, j, leaf)) for j in range(experts)])
    except KeyError:
        pass
    if leaf == "fc2":
        down = get(src + "mlp.experts.down_proj")
        return down if e is None else down[e]
    fused = get(src + "mlp.experts.gate_up_proj")
    fused = fused if e is None else fused[e]
    gate, up = fused.chunk(2, dim=-2)
    return gate if leaf == "gate" else up


def _moe_get(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get`` that also finds Mixtral's ``block_sparse_moe`` tensors under transformers' ``mlp``."""
    def found(name: str) -> torch.Tensor:
        try:
            return get(name)
        except KeyError:
            if ".block_sparse_moe." not in name:
                raise
            return get(name.replace(".block_sparse_moe.", ".mlp."))
    return found


def unneeded_buffer(hf_name: str, arch: str) -> bool:
    """Whether ``hf_name`` is a buffer that some exports of ``arch`` carry and megazero recomputes
    (:data:`UNNEEDED_BUFFERS`), so an import need not use it."""
    return bool(UNNEEDED_BUFFERS["gpt2" if arch == "gpt2" else "llama"].fullmatch(hf_name))


def layers_present(hf_names, arch: str) -> set:
    """The indices of the layers that have at least one tensor among ``hf_names`` (of ``arch``)."""
    pattern = re.compile(re.escape(_prefix(arch)) + r"(\d+)\.")
    return {int(m.group(1)) for m in map(pattern.match, hf_names) if m}


def _global_map(arch: str) -> Dict[str, str]:
    if arch in hf_mamba.HYBRID_ARCHS:
        return hf_mamba.global_names(arch)
    return dict(GPT2_GLOBAL if arch == "gpt2" else LLAMA_GLOBAL)


def _prefix(arch: str) -> str:
    if arch in hf_mamba.HYBRID_ARCHS:
        return hf_mamba.layer_prefix(arch)
    return "transformer.h." if arch == "gpt2" else "model.layers."


def megazero_tensor(name: str, cfg, get: Callable[[str], torch.Tensor],
                    arch: Optional[str] = None) -> torch.Tensor:
    """The full (unsharded, unpadded) megazero tensor ``name`` from a Hugging Face model's tensors of
    architecture ``arch`` (default: the one an export of ``cfg`` writes), fetched one by one with
    ``get(hf_name)``."""
    m, arch = cfg.model, arch or arch_of(cfg.model, cfg.moe)
    if arch in hf_mamba.HYBRID_ARCHS:  # Mamba-2 and Nemotron-H: models.hf_mamba
        return hf_mamba.megazero_tensor(name, cfg, get, arch)
    if name.startswith("mtp."):  # DeepSeek-V3's multi-token prediction: model.layers.<i> after the decoder's
        _, i, rest = name.split(".", 2)
        if rest.startswith("layer."):
            return megazero_tensor(f"decoder.{i}.{rest[len('layer.'):]}", cfg, get, arch)
        return get(f"{_prefix(arch)}{i}.{MTP_NAMES[rest]}")
    if not name.startswith("decoder."):
        t = get(_global_map(arch)[name])
        return t.float() + 1 if name == "final_norm.weight" and arch in OFFSET_NORMS else t
    _, i, rest = name.split(".", 2)
    src = f"{_prefix(arch)}{i}."
    if arch == "llama4_text" and EXPERT.fullmatch(rest):  # its fused experts (models.hf_llama4)
        e, leaf = EXPERT.fullmatch(rest).group(1, 2)
        return hf_llama4.expert_tensor(get, src, None if e is None else int(e), leaf)
    if arch in MOE_ARCHS:
        get = _moe_get(get)
        expert = EXPERT.fullmatch(rest)
        if expert:
            e = None if expert.group(1) is None else int(expert.group(1))
            return _expert_tensor(get, src, arch, e, expert.group(2), cfg.moe.num_experts, expert.group(3))
    for mz, hf, how in layer_map(cfg, arch):
        if rest == mz:
            t = get(src + hf)
            return t.t() if how == "T" else (t.float() + 1 if how == "1p" else t)
    if arch == "qwen3_next" and rest in hf_qwen3next.REGROUPED:  # gated query, DeltaNet in-projection, conv
        return hf_qwen3next.layer_tensor(rest, cfg, get, src)
    if arch == "phi3" and rest in ("mlp.gate.weight", "mlp.fc1.weight"):
        gate, up = get(src + "mlp.gate_up_proj.weight").chunk(2)
        return gate if rest == "mlp.gate.weight" else up
    kind = rest.rsplit(".", 1)[1]  # attention.qkv.weight / .bias
    if arch in ("gpt2", "phi3"):
        w = get(src + (f"attn.c_attn.{kind}" if arch == "gpt2" else f"self_attn.qkv_proj.{kind}"))
        w = w.t() if arch == "gpt2" and kind == "weight" else w
        q_rows, kv_rows = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
        return _fuse_qkv(*w.split([q_rows, kv_rows, kv_rows]), m.num_query_groups)
    q, k, v = (get(f"{src}self_attn.{n}_proj.{kind}") for n in "qkv")
    if arch == "llama4_text":  # interleaved RoPE pairs (2i, 2i + 1) -> megazero's halves (i, i + d/2)
        q, k = (_reorder_heads(t, m.kv_channels, _halves(m.kv_channels)) for t in (q, k))
    return _fuse_qkv(q, k, v, m.num_query_groups)


def _halves(d: int) -> torch.Tensor:
    """Channel order of a head taking interleaved RoPE pairs to halves: even channels, then odd."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _reorder_heads(t, d: int, order: torch.Tensor):
    """Rows of ``t [heads * d, ...]`` reordered within each head by ``order``."""
    return t.reshape(-1, d, *t.shape[1:])[:, order].reshape(t.shape)


ExportGroup = Tuple[List[str], List[str], Callable[..., List[torch.Tensor]]]


def export_groups(cfg) -> List[ExportGroup]:
    """How to write a model in transformers' names: ``(megazero names, HF names, f)`` where
    ``f(*megazero tensors)`` returns the HF tensors (views where possible), in order.  One group
    per HF tensor, except the q/k/v projections split from one fused tensor.  Experts go one by one
    (``decoder.L.mlp.experts.<e>.fc1_weight``, the checkpoint's names) to their published names."""
    arch = arch_of(cfg.model, cfg.moe)
    if arch in hf_mamba.HYBRID_ARCHS:
        return hf_mamba.export_groups(cfg, arch, megazero_names(cfg, per_expert=True))
    glob, groups = _global_map(arch), []
    for name in megazero_names(cfg, per_expert=True):
        if name.startswith("mtp."):
            groups += _mtp_groups(name, cfg, arch)
        elif not name.startswith("decoder."):
            offset = name == "final_norm.weight" and arch in OFFSET_NORMS
            fix = (lambda t: [t - 1]) if offset else (lambda t: [t])
            groups.append(([name], [glob[name]], fix))
        else:
            groups += _decoder_groups(name, cfg, arch)
    return groups


def _decoder_groups(name: str, cfg, arch: str) -> List[ExportGroup]:
    """The export groups of decoder parameter ``name`` (``decoder.<i>.<rest>``)."""
    m = cfg.model
    _, i, rest = name.split(".", 2)
    dst = f"{_prefix(arch)}{i}."
    one = {mz: (hf, how) for mz, hf, how in layer_map(cfg, arch)}
    expert = EXPERT.fullmatch(rest)
    if expert and arch == "gpt_oss":  # one stacked tensor per kind: written with the layer's first
        first = rest == "mlp.experts.0.fc1_weight"
        return _gpt_oss_expert_groups(i, dst, cfg.moe.num_experts) if first else []
    if expert and arch == "llama4_text":  # likewise: its fused gate_up_proj and down_proj
        first = rest == "mlp.experts.0.fc1_weight"
        return hf_llama4.expert_groups(i, dst, cfg.moe.num_experts) if first else []
    if expert:
        hf = _expert_file_name(arch, int(expert.group(1)), expert.group(2))
        return [([name], [dst + hf], lambda t: [t])]
    if arch == "qwen3_next" and rest in hf_qwen3next.REGROUPED:
        return hf_qwen3next.export_groups(name, rest, dst, cfg)
    if rest in one:
        hf, how = one[rest]
        fn = {"T": lambda t: [t.t()], "1p": lambda t: [t - 1], "": lambda t: [t]}[how]
        return [([name], [dst + hf], fn)]
    if rest == "mlp.gate.weight":  # phi3: with fc1, one gate_up_proj
        return [([name, f"decoder.{i}.mlp.fc1.weight"], [dst + "mlp.gate_up_proj.weight"],
                 lambda g, u: [torch.cat([g, u])])]
    return [_qkv_group(name, dst, rest.rsplit(".", 1)[1], m, arch)] if rest != "mlp.fc1.weight" else []


def _mtp_groups(name: str, cfg, arch: str) -> List[ExportGroup]:
    """Multi-token prediction depth ``i``'s parameter ``name`` (``mtp.<i>.<rest>``) where DeepSeek-V3's
    files put it, ``model.layers.<i>.*`` (:data:`models.hf_deepseek.MTP_NAMES`; its transformer layer as
    a decoder layer's); with its ``enorm`` also the copies of the embedding and the head those files
    carry (``embed_tokens``, ``shared_head.head``)."""
    _, i, rest = name.split(".", 2)
    dst = f"{_prefix(arch)}{i}."
    if rest.startswith("layer."):  # every group of a DeepSeek-V3 layer's parameter is one-to-one
        alias = f"decoder.{i}.{rest[len('layer.'):]}"
        return [([name], hf, fn) for _, hf, fn in _decoder_groups(alias, cfg, arch)]
    out = [([name], [dst + MTP_NAMES[rest]], lambda t: [t])]
    if rest == "enorm.weight":
        untied = cfg.model.untie_embeddings_and_output_weights
        head = "output_layer.weight" if untied else "word_embeddings.weight"
        out += [(["word_embeddings.weight"], [dst + "embed_tokens.weight"], lambda t: [t.clone()]),
                ([head], [dst + "shared_head.head.weight"], lambda t: [t.clone()])]
    return out


def _qkv_group(name: str, dst: str, kind: str, m, arch: str) -> ExportGroup:
    def split(t):
        return _split_qkv(t, m.num_attention_heads, m.num_query_groups, m.kv_channels)
    if arch == "gpt2":
        def c_attn(t):
            joined = torch.cat(split(t))
            return [joined.t() if kind == "weight" else joined]
        return [name], [dst + f"attn.c_attn.{kind}"], c_attn
    if arch == "phi3":
        return [name], [dst + f"self_attn.qkv_proj.{kind}"], lambda t: [torch.cat(split(t))]
    if arch == "llama4_text":  # megazero's halves back to interleaved RoPE pairs
        back = torch.argsort(_halves(m.kv_channels))
        return [name], [f"{dst}self_attn.{n}_proj.{kind}" for n in "qkv"], \
            lambda t: [_reorder_heads(x, m.kv_channels, back) if j < 2 else x for j, x in enumerate(split(t))]
    return [name], [f"{dst}self_attn.{n}_proj.{kind}" for n in "qkv"], split


def _gpt_oss_expert_groups(i: str, dst: str, experts: int) -> List[ExportGroup]:
    """Layer ``i``'s experts as gpt-oss stores them (:func:`_gpt_oss_expert`'s inverse)."""
    def names(leaf, kind):
        return [f"decoder.{i}.mlp.experts.{e}.{leaf}_{kind}" for e in range(experts)]

    def gate_up(*t):  # gates then ups, one per expert: [F, h] weights (or [F] biases)
        gates, ups = t[:experts], t[experts:]
        if gates[0].dim() == 1:
            return [torch.stack([torch.stack([g, u], -1).flatten() for g, u in zip(gates, ups)])]
        return [torch.stack([torch.stack([g.t(), u.t()], -1).flatten(-2) for g, u in zip(gates, ups)])]
    return [(names("gate", "weight") + names("fc1", "weight"), [dst + "mlp.experts.gate_up_proj"], gate_up),
            (names("gate", "bias") + names("fc1", "bias"), [dst + "mlp.experts.gate_up_proj_bias"], gate_up),
            (names("fc2", "weight"), [dst + "mlp.experts.down_proj"],
             lambda *t: [torch.stack([w.t() for w in t])]),
            (names("fc2", "bias"), [dst + "mlp.experts.down_proj_bias"], lambda *t: [torch.stack(t)])]


def megazero_names(cfg, per_expert: bool = False) -> List[str]:
    """Every parameter name of a whole model of ``cfg`` in the model's order (embeddings first, layers
    in order): the names of a model built on the meta device; with ``per_expert``, a stacked expert
    parameter as one name per expert (``...experts.<e>.fc1_weight``, the checkpoint's)."""
    from . import build_model
    from .checkpoint import model_settings
    whole = validate(config_from_dict(model_settings(cfg.to_dict())), 1, check_data=False)  # the model alone
    with torch.device("meta"):
        model = build_model(whole, ParallelMesh.single(torch.device("meta")))
    out = []
    for n, p in model.named_parameters():
        expert = per_expert and getattr(p, "expert_parallel", False)
        out += [expert_name(n, e) for e in range(p.shape[0])] if expert else [n]
    return out


def megazero_state_from_hf(hf_state: Dict[str, torch.Tensor], cfg,
                           arch: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Full megazero tensors (unsharded, unpadded) from a transformers ``state_dict`` of architecture
    ``arch`` (default: the one an export of ``cfg`` writes)."""
    return {n: megazero_tensor(n, cfg, hf_state.__getitem__, arch).detach().float()
            for n in megazero_names(cfg, per_expert=True)}


def hf_state_from_megazero(state: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`megazero_state_from_hf` (HF parameter names; tied head omitted)."""
    out = {}
    for mz, hf, fn in export_groups(cfg):
        out.update({n: t.contiguous() for n, t in zip(hf, fn(*[state[k] for k in mz]))})
    return out


def from_hf(model_or_dir, mesh: Optional[ParallelMesh] = None,
            cfg_overrides: Optional[Dict[str, Any]] = None) -> GPTModel:
    """A megazero model (pp = 1) with the weights of a ``transformers`` causal LM of a family megazero
    imports (GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3, OLMo 2, SmolLM3, Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE and the others of docs/usage.md).

    ``model_or_dir``: such a model (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) or a directory
    ``from_pretrained`` reads. ``mesh``: this process's mesh (one process when None); the model holds
    this rank's TP shard. ``cfg_overrides``: extra settings by field name (``seq_length``, dropout,
    ``recompute_granularity``, ...). The returned model keeps its config as ``model.cfg``.
    """
    from . import build_model
    hf = model_or_dir
    if isinstance(model_or_dir, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    mesh = mesh or ParallelMesh.single()
    if mesh.size("pp") != 1:
        raise ValueError("from_hf builds the whole model; use a mesh with pipeline-model-parallel size 1")
    settings = dict(config_from_hf(hf.config), tensor_model_parallel_size=mesh.size("tp"),
                    pipeline_model_parallel_size=1)
    if settings.get("num_experts"):  # the mesh's expert layout (MoE under TP needs --sequence-parallel)
        settings.update(expert_model_parallel_size=mesh.size("ep"),
                        expert_tensor_parallel_size=mesh.size("etp"), sequence_parallel=mesh.size("tp") > 1)
    settings.update(cfg_overrides or {})
    cfg = validate(config_from_dict(settings), mesh.world_size, check_data=False)  # no data of its own
    model = build_model(cfg, mesh)
    state = hf.state_dict()
    get = pairs_getter(state.__getitem__, hf.config)  # DeepSeek-V3's RoPE halves as pairs
    load_full_state_dict(model, {n: megazero_tensor(n, cfg, get, hf.config.model_type).detach().float()
                                 for n in megazero_names(cfg, per_expert=True)})
    return model


def to_hf(model: GPTModel, out_dir: str) -> Optional[str]:
    """Write ``model`` as a ``transformers`` directory (``config.json``, ``model.safetensors``).

    Needs the whole model (one chunk with embedding and head). Collective over the TP group:
    every TP rank calls it; TP rank 0 of data-parallel rank 0 writes and returns ``out_dir``
    (the others return None). Weights keep the model's dtype.
    """
    from safetensors.torch import save_file
    if not (model.pre_process and model.post_process):
        raise ValueError("to_hf needs the whole model (pp = 1); gather pipeline stages first")
    state = full_state_dict(model)
    if model.mesh.coord("tp") != 0 or model.mesh.coord("dp", "cp") != 0:
        return None
    hf_config = hf_config_from(model.cfg)
    hf_config.dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    tensors = hf_state_from_megazero({k: v.cpu() for k, v in state.items()}, model.cfg)
    os.makedirs(out_dir, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


TOKENIZER_CHECK = ["Hello world, this is a tokenizer check: 12345.",
                   "ROMEO:\nBut, soft! what light\n\n  breaks?"]


def export_tokenizer(path: str, out_dir: str) -> str:
    """Write the tokenizer ``path`` (a sentencepiece ``.model`` file or a Hugging Face tokenizer
    directory) into ``out_dir`` so that ``transformers.AutoTokenizer`` (and ``pipeline``) load it.

    A sentencepiece model is converted by ``transformers`` into a ``tokenizers`` tokenizer and
    checked: it must encode sample texts to the same ids as sentencepiece (ValueError otherwise).
    Returns the Hugging Face tokenizer written."""
    import json
    import shutil
    import tempfile
    from transformers import AutoTokenizer
    if os.path.isdir(path):
        tok = AutoTokenizer.from_pretrained(path)
        tok.save_pretrained(out_dir)
        return tok
    from megazero.data.tokenizer import SentencePieceTokenizer
    sp = SentencePieceTokenizer(path)
    piece = sp.sp.IdToPiece
    special = {name: piece(i) for name, i in (("unk_token", sp.unk_id), ("bos_token", sp.bos_id),
                                              ("eos_token", sp.eos_id), ("pad_token", sp.pad_id)) if i >= 0}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(path, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as fh:
            json.dump(dict(special, tokenizer_class="TokenizersBackend"), fh)
        tok = AutoTokenizer.from_pretrained(tmp)
    for text in TOKENIZER_CHECK:
        got, want = tok.encode(text, add_special_tokens=False), sp.encode(text)
        if got != want:
            raise ValueError(f"{path}: the converted Hugging Face tokenizer encodes {text!r} to {got[:12]}, "
                             f"sentencepiece to {want[:12]}; this tokenizer cannot be exported")
    tok.save_pretrained(out_dir)
    return tok
