"""Hugging Face's Mamba-2 (``Mamba2ForCausalLM``, model_type ``mamba2``) and Nemotron-H
(``NemotronHForCausalLM``, ``nemotron_h``) as megazero hybrid stacks (``--hybrid-layer-pattern``,
docs/hybrid.md), both directions, tensor by tensor.

- ``mamba2``: every layer a Mamba-2 layer (pattern ``M...M``), tensors under ``backbone.``
  (``embeddings``, ``layers.<i>.norm``, ``layers.<i>.mixer.*``, ``norm_f``) and ``lm_head`` (tied to the
  embeddings with ``tie_word_embeddings``).
- ``nemotron_h``: ``layers_block_type`` (``hybrid_override_pattern``) gives one kind per layer:
  ``linear_attention`` = ``M``, ``full_attention`` = ``*`` (attention without position embeddings,
  grouped query heads of ``head_dim``), ``mlp`` = ``-`` (``up_proj``, squared ReLU, ``down_proj``: megazero's
  ``--squared-relu`` MLP); ``moe`` = ``E`` (:func:`moe_settings`).  Tensors under ``backbone.`` in its
  files (NVIDIA's names, which transformers renames ``model.`` in memory; an import reads either);
  each layer's one mixer is ``layers.<i>.mixer``.  transformers never ties its head (``lm_head`` is
  always its own tensor), so an import is untied and an export of a tied model writes the embeddings
  again as ``lm_head``.

Layout: transformers' in-projection rows are ``[z | x | B | C | dt]`` over all heads and groups, the
conv's channels ``[x | B | C]``; megazero's are laid out by group (``[group][z, x, B, C, dt]`` and
``[group][x, B, C]``, :mod:`models.mamba`), so the import gathers each group's rows and the export
scatters them back.  ``A_log``, ``D``, ``dt_bias``, the gated norm's scale and the out-projection keep
their order (heads in order, each group's heads together).  Both normalise the gated output in groups of
``d_inner / n_groups`` channels after the gate (``norm_before_gate`` false), the same groups.

Config fields megazero cannot reproduce are refused by name (:func:`import_settings`); what these
architectures cannot hold of a megazero model is :func:`missing`.  ``residual_in_fp32`` (Mamba2) changes
nothing in fp32 and is accepted either way; an export writes false (megazero's residual stream is in
the model's dtype).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, List, Optional

import torch

from megazero.config import ConfigError
from .hf_sigmoid_moe import GROUP_SCORE_TOPK, routing_settings

HYBRID_ARCHS = ("mamba2", "nemotron_h")
ROOT = {"mamba2": "backbone.", "nemotron_h": "backbone."}  # their files' names
KINDS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
CONV_KERNEL = 4  # megazero's Mamba-2 conv width (megazero.config.hybrid.MAMBA_CONV_KERNEL)
ONE_TO_ONE = [  # (megazero name within a layer, transformers name within a layer)
    ("input_norm.weight", "norm.weight"), ("mixer.A_log", "mixer.A_log"), ("mixer.D", "mixer.D"),
    ("mixer.dt_bias", "mixer.dt_bias"), ("mixer.norm.weight", "mixer.norm.weight"),
    ("mixer.out_proj.weight", "mixer.out_proj.weight"), ("mixer.out_proj.bias", "mixer.out_proj.bias"),
    ("attention.proj.weight", "mixer.o_proj.weight"), ("mlp.fc1.weight", "mixer.up_proj.weight"),
    ("mlp.fc2.weight", "mixer.down_proj.weight"), ("mlp.router.weight", "mixer.gate.weight"),
    ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias"),
    ("mlp.shared_experts.fc1.weight", "mixer.shared_experts.up_proj.weight"),
    ("mlp.shared_experts.fc2.weight", "mixer.shared_experts.down_proj.weight")]
EXPERT = re.compile(r"mlp\.experts\.(?:(\d+)\.)?(fc1|fc2)_weight")  # stacked, or one (the checkpoint's)
EXPERT_HF = {"fc1": "up_proj", "fc2": "down_proj"}


def _refuse(field: str, value, fix: str):
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def _mamba_settings(c, kind: str) -> Dict[str, Any]:
    """The Mamba-2 mixers' settings, refusing what megazero's mixer does not compute."""
    act = c.hidden_act if kind == "mamba2" else c.mamba_hidden_act
    if act != "silu":
        _refuse("hidden_act" if kind == "mamba2" else "mamba_hidden_act", act,
                "megazero's Mamba-2 mixer applies SiLU after its conv")
    if int(c.conv_kernel) != CONV_KERNEL:
        _refuse("conv_kernel", c.conv_kernel, f"megazero's Mamba-2 conv has width {CONV_KERNEL} (no setting)")
    if not c.use_conv_bias:
        _refuse("use_conv_bias", False, "megazero's Mamba-2 conv always has a bias")
    low, high = (float(v) for v in c.time_step_limit)
    if low > 0.0 or high != math.inf:
        _refuse("time_step_limit", tuple(c.time_step_limit), "clamping the time step is not implemented "
                "(megazero's dt is softplus(dt + dt_bias), unclamped: (0.0, inf))")
    if getattr(c, "norm_before_gate", False):
        _refuse("norm_before_gate", True, "megazero's Mamba-2 gates before the grouped norm")
    heads = c.num_heads if kind == "mamba2" else c.mamba_num_heads
    head_dim = c.head_dim if kind == "mamba2" else c.mamba_head_dim
    state = c.state_size if kind == "mamba2" else c.ssm_state_size
    return dict(mamba_num_heads=int(heads), mamba_head_dim=int(head_dim), mamba_state_dim=int(state),
                mamba_num_groups=int(c.n_groups), mamba_chunk_size=int(c.chunk_size))


def import_settings(c, kind: str) -> Dict[str, Any]:
    """ModelConfig settings of a transformers ``Mamba2Config`` or ``NemotronHConfig``; a
    :class:`ConfigError` naming the field, its value and what megazero lacks otherwise."""
    out = dict(_mamba_settings(c, kind), hidden_size=c.hidden_size, vocab_size=c.vocab_size,
               norm_epsilon=float(c.layer_norm_epsilon), normalization="RMSNorm",
               position_embedding_type="none", init_method_std=float(c.initializer_range),
               hidden_dropout=0.0, attention_dropout=0.0, hf_model_type=kind)
    if kind == "mamba2":
        layers = int(c.num_hidden_layers)
        # no attention layer: its head count only has to split as the groups do under TP
        return dict(out, num_layers=layers, hybrid_layer_pattern="M" * layers, num_attention_heads=c.n_groups,
                    kv_channels=max(1, c.hidden_size // c.n_groups),
                    ffn_hidden_size=4 * c.hidden_size, max_position_embeddings=4096, seq_length=4096,
                    add_bias_linear=bool(c.use_bias),
                    untie_embeddings_and_output_weights=not c.tie_word_embeddings)
    pattern = "".join(KINDS[t] for t in c.layers_block_type)
    for field, ok, fix in (
            ("mlp_hidden_act", c.mlp_hidden_act == "relu2",
             "megazero's Nemotron-H MLP is squared ReLU (relu2)"),
            ("use_bias", not c.use_bias, "biases on the Mamba-2 projections alone are not implemented"),
            ("mlp_bias", not c.mlp_bias, "MLP biases without attention biases are not implemented"),
            ("attention_bias", not c.attention_bias, "Nemotron-H's attention projections have no bias"),
            ("sliding_window", c.sliding_window is None, "Nemotron-H's attention is full"),
            ("num_nextn_predict_layers", not c.num_nextn_predict_layers,
             "multi-token prediction in hybrid stacks is not implemented")):
        if not ok:
            _refuse(field, getattr(c, field), fix)
    if "E" in pattern:
        out.update(moe_settings(c))
    return dict(out, num_layers=len(pattern), hybrid_layer_pattern=pattern,
                num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
                kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size, activation="squared_relu",
                add_bias_linear=False, max_position_embeddings=c.max_position_embeddings,
                seq_length=c.max_position_embeddings, attention_dropout=float(c.attention_dropout),
                hidden_dropout=float(c.hidden_dropout), untie_embeddings_and_output_weights=True)


def moe_settings(c) -> Dict[str, Any]:
    """megazero's MoE settings of NemotronH's ``moe`` layers: sigmoid scores, an expert bias moving the
    choice only (``e_score_correction_bias``), group-limited routing (a group's score the sum of its two
    best), the chosen weights normalised (``norm_topk_prob``; megazero normalises whenever top-k > 1)
    and scaled (``routed_scaling_factor``), non-gated squared-ReLU experts and one shared expert of
    ``moe_shared_expert_intermediate_size``; no load-balancing loss."""
    experts, topk = int(c.n_routed_experts), int(c.num_experts_per_tok)
    if c.moe_latent_size is not None:
        _refuse("moe_latent_size", c.moe_latent_size, "the experts' latent projections (fc1_latent_proj, "
                "fc2_latent_proj) are not implemented")
    return routing_settings(c, experts, topk, int(c.moe_shared_expert_intermediate_size))


# ---- tensors ------------------------------------------------------------------------------------
def global_names(arch: str) -> Dict[str, str]:
    root = ROOT[arch]
    return {"word_embeddings.weight": root + "embeddings.weight",
            "final_norm.weight": root + "norm_f.weight", "output_layer.weight": "lm_head.weight"}


def layer_prefix(arch: str) -> str:
    return ROOT[arch] + "layers."


def _sizes(m):
    from megazero.config.hybrid import mamba_num_heads
    heads, groups = mamba_num_heads(m), m.mamba_num_groups
    return heads, groups, heads // groups, m.mamba_head_dim, m.mamba_state_dim


def _by_group(t, parts: List[int], per_group: List[int], groups: int):
    """Rows of ``t`` laid out ``[part 0 | part 1 | ...]`` (each over all groups) -> ``[group][parts]``."""
    pieces = t.split(parts)
    rest = list(t.shape[1:])
    grouped = [p.reshape(groups, n, *rest) for p, n in zip(pieces, per_group)]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def _by_part(t, per_group: List[int], groups: int):
    """The inverse of :func:`_by_group`."""
    rest = list(t.shape[1:])
    pieces = t.reshape(groups, sum(per_group), *rest).split(per_group, dim=1)
    return torch.cat([p.reshape(-1, *rest) for p in pieces])


def _layouts(m, what: str):
    """``(HF parts, per group)`` of the in-projection (``in``) or the conv's channels (``conv``)."""
    heads, groups, r, p, n = _sizes(m)
    if what == "in":
        return [heads * p, heads * p, groups * n, groups * n, heads], [r * p, r * p, n, n, r], groups
    return [heads * p, groups * n, groups * n], [r * p, n, n], groups


def megazero_tensor(name: str, cfg, get: Callable[[str], torch.Tensor], arch: str) -> torch.Tensor:
    """The full megazero tensor ``name`` from the transformers tensors of a ``mamba2`` or ``nemotron_h``
    model, fetched one by one with ``get(hf_name)``."""
    if arch == "nemotron_h":
        get = _in_memory_too(get)
    if not name.startswith("decoder."):
        hf = global_names(arch)[name]
        try:
            return get(hf)
        except KeyError:  # the original Mamba-2 files name the embeddings "embedding"
            if name != "word_embeddings.weight":
                raise
            return get(ROOT[arch] + "embedding.weight")
    _, i, rest = name.split(".", 2)
    src = f"{layer_prefix(arch)}{i}."
    one = dict(ONE_TO_ONE)
    if rest in one:
        return get(src + one[rest])
    expert = EXPERT.fullmatch(rest)
    if expert:
        return _expert(get, src, expert, cfg.moe.num_experts)
    leaf = rest.rsplit(".", 1)[1]
    if rest.startswith("mixer.in_proj."):
        return _by_group(get(src + "mixer.in_proj." + leaf), *_layouts(cfg.model, "in"))
    if rest.startswith("mixer.conv1d."):
        return _by_group(get(src + "mixer.conv1d." + leaf), *_layouts(cfg.model, "conv"))
    if rest == "attention.qkv.weight":
        from .hf import _fuse_qkv
        return _fuse_qkv(*(get(f"{src}mixer.{n}_proj.weight") for n in "qkv"), cfg.model.num_query_groups)
    raise KeyError(f"no {arch} tensor holds megazero's {name}")


def _expert(get, src: str, expert, experts: int) -> torch.Tensor:
    """One expert's ``fc1`` (up) or ``fc2`` (down) weight, or all stacked: from the files' per-expert
    tensors (``mixer.experts.<e>.up_proj.weight``) or transformers' fused ones in memory
    (``mixer.experts.up_proj [E, F, h]``)."""
    e, hf = expert.group(1), EXPERT_HF[expert.group(2)]
    try:
        if e is not None:
            return get(f"{src}mixer.experts.{e}.{hf}.weight")
        return torch.stack([get(f"{src}mixer.experts.{j}.{hf}.weight") for j in range(experts)])
    except KeyError:
        fused = get(f"{src}mixer.experts.{hf}")
        return fused if e is None else fused[int(e)]


def _in_memory_too(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get`` that also finds NemotronH's ``backbone.*`` tensors (its files' names) under ``model.*``
    (a transformers model's ``state_dict``)."""
    def found(name: str) -> torch.Tensor:
        try:
            return get(name)
        except KeyError:
            if not name.startswith("backbone."):
                raise
            return get("model." + name[len("backbone."):])
    return found


def export_groups(cfg, arch: str, names: List[str]):
    """``(megazero names, HF names, f)`` of every parameter ``names`` of a model of ``cfg`` (the
    inverse of :func:`megazero_tensor`); with a tied head Nemotron-H's ``lm_head`` from the
    embeddings."""
    m, glob, groups = cfg.model, global_names(arch), []
    for name in names:
        if not name.startswith("decoder."):
            groups.append(([name], [glob[name]], lambda t: [t]))
            continue
        _, i, rest = name.split(".", 2)
        dst = f"{layer_prefix(arch)}{i}."
        one = dict(ONE_TO_ONE)
        leaf = rest.rsplit(".", 1)[1]
        expert = EXPERT.fullmatch(rest)
        if rest in one:
            groups.append(([name], [dst + one[rest]], lambda t: [t]))
        elif expert and expert.group(1) is not None:  # one expert at a time, the files' names
            hf = f"{dst}mixer.experts.{expert.group(1)}.{EXPERT_HF[expert.group(2)]}.weight"
            groups.append(([name], [hf], lambda t: [t]))
        elif rest.startswith(("mixer.in_proj.", "mixer.conv1d.")):
            _, per_group, count = _layouts(m, "in" if "in_proj" in rest else "conv")
            groups.append(([name], [dst + rest.rsplit(".", 1)[0] + "." + leaf],
                           lambda t, per=per_group, g=count: [_by_part(t, per, g)]))
        elif rest == "attention.qkv.weight":
            from .hf import _split_qkv
            groups.append(([name], [f"{dst}mixer.{n}_proj.weight" for n in "qkv"],
                           lambda t: _split_qkv(t, m.num_attention_heads, m.num_query_groups, m.kv_channels)))
        else:
            raise ConfigError(f"megazero's {name} has no place in transformers' {arch}")
    if arch == "nemotron_h" and not m.untie_embeddings_and_output_weights:
        groups.append((["word_embeddings.weight"], ["lm_head.weight"], lambda t: [t.clone()]))
    return groups


# ---- export: what the architecture holds, and its config -----------------------------------------
def missing(m, t: str, moe=None) -> Optional[str]:
    """What transformers' ``mamba2`` or ``nemotron_h`` lacks to hold ModelConfig ``m`` (None: nothing)."""
    from megazero.config.patterns import windowed_layers
    pattern = getattr(m, "hybrid_layer_pattern", None) or ""
    allowed = "M" if t == "mamba2" else "M*-E"
    if not pattern:
        return f"a transformer layer stack ({t} holds hybrid stacks: --hybrid-layer-pattern of {allowed})"
    other = sorted(set(pattern) - set(allowed))
    if other:
        return f"--hybrid-layer-pattern {pattern!r} has {other[0]!r} layers ({t} has {allowed} only)"
    if moe is not None and moe.num_experts:
        why = moe_missing(moe)
        if why:
            return why
    if m.normalization != "RMSNorm":
        return f"--normalization {m.normalization} ({t} has RMSNorm)"
    heads, _, _, p, _ = _sizes(m)
    if t == "mamba2" and (heads * p) % m.hidden_size:
        return f"--mamba-num-heads x --mamba-head-dim {heads * p} not a multiple of --hidden-size " \
               f"{m.hidden_size} (mamba2's width is expand x hidden)"
    if t == "mamba2" and m.position_embedding_type == "learned_absolute":
        return "learned absolute position embeddings (mamba2 has none)"
    if m.scale_embedding or m.final_logit_softcapping is not None:
        return f"{'--scale-embedding' if m.scale_embedding else 'a final logit soft-cap'} ({t} has none)"
    if t == "mamba2":
        return None
    wants = [("--position-embedding-type none", m.position_embedding_type == "none"),
             ("--squared-relu", m.activation == "squared_relu"),
             ("--disable-bias-linear", not m.add_bias_linear and not m.add_qkv_bias)]
    absent = [flag for flag, ok in wants if not ok]
    if absent:
        return f"nemotron_h needs {absent[0]}"
    if m.qk_layernorm or any(windowed_layers(m)):
        return f"{'--qk-layernorm' if m.qk_layernorm else 'a sliding window'} (nemotron_h has none)"
    for field in ("attn_logit_softcapping", "softmax_scale"):
        if getattr(m, field) is not None:
            return f"{field} {getattr(m, field)} (nemotron_h has none)"
    return None


def moe_missing(moe) -> Optional[str]:
    """What NemotronH's MoE layers lack to hold MoEConfig ``moe`` (:func:`moe_settings`' inverse)."""
    if moe.moe_router_score_function != "sigmoid":
        return f"--moe-router-score-function {moe.moe_router_score_function} (nemotron_h: sigmoid)"
    if moe.moe_router_bias:
        return "--moe-router-bias (nemotron_h's router has no bias)"
    if not moe.moe_shared_expert_intermediate_size or moe.moe_shared_expert_gate:
        return "no ungated shared expert (nemotron_h has one: --moe-shared-expert-intermediate-size)"
    if moe.moe_router_num_groups and moe.moe_router_group_score_topk != GROUP_SCORE_TOPK:
        return f"a group's score of other than its {GROUP_SCORE_TOPK} best experts, " \
               f"--moe-router-group-score-topk (nemotron_h sums {GROUP_SCORE_TOPK})"
    return None


def _moe_fields(moe) -> Dict[str, Any]:
    """NemotronH's MoE fields of MoEConfig ``moe`` (without an expert bias: a zero one, the same routing)."""
    if moe is None or not moe.num_experts:
        return {}
    groups = moe.moe_router_num_groups or 1
    return dict(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
                moe_intermediate_size=moe.moe_ffn_hidden_size, n_shared_experts=1,
                moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
                moe_latent_size=None, n_group=groups,
                topk_group=moe.moe_router_group_topk if groups > 1 else 1,
                norm_topk_prob=moe.moe_router_topk > 1,
                routed_scaling_factor=moe.moe_router_topk_scaling_factor or 1.0)


def hf_config(m, t: str, moe=None):
    """The transformers config of ModelConfig ``m`` as architecture ``t`` (:func:`missing` holds)."""
    import transformers
    heads, groups, _, p, n = _sizes(m)
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, n_groups=groups,
                  conv_kernel=CONV_KERNEL, use_conv_bias=True, chunk_size=m.mamba_chunk_size,
                  layer_norm_epsilon=m.norm_epsilon, initializer_range=m.init_method_std, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, time_step_limit=(0.0, float("inf")))
    if t == "mamba2":
        out = transformers.Mamba2Config(num_heads=heads, head_dim=p, state_size=n, **common,
                                        num_hidden_layers=m.num_layers, expand=heads * p // m.hidden_size,
                                        use_bias=m.add_bias_linear, hidden_act="silu",
                                        residual_in_fp32=False,
                                        tie_word_embeddings=not m.untie_embeddings_and_output_weights)
        out.architectures = ["Mamba2ForCausalLM"]
        return out
    kinds = {v: k for k, v in KINDS.items()}
    out = transformers.NemotronHConfig(
        **common, layers_block_type=[kinds[s] for s in m.hybrid_layer_pattern], tie_word_embeddings=False,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels, max_position_embeddings=max(m.max_position_embeddings, m.seq_length),
        attention_bias=False, attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
        intermediate_size=m.ffn_hidden_size, mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=n,
        mamba_num_heads=heads, mamba_head_dim=p, mamba_hidden_act="silu", use_bias=False,
        num_nextn_predict_layers=0, **_moe_fields(moe))
    out.architectures = ["NemotronHForCausalLM"]
    return out
