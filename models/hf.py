"""Hugging Face ``transformers`` interop: GPT-2 (``GPT2LMHeadModel``), LLaMA (``LlamaForCausalLM``, with
LLaMA-3.x RoPE scaling), Qwen2 (``Qwen2ForCausalLM``) and Mistral without a sliding window (imported as
a LLaMA).

- :func:`config_from_hf` (:mod:`models.hf_config`) maps a ``transformers`` config to ModelConfig field
  overrides and rejects what megazero cannot reproduce exactly (naming the field).
- :func:`from_hf` builds a megazero model (pp = 1) holding this rank's TP shard of the weights.
- :func:`to_hf` writes ``config.json`` + ``model.safetensors`` that ``AutoModelForCausalLM``
  loads. With TP > 1 it gathers the shards first: every TP rank must call it (collective) and
  TP rank 0 of data-parallel rank 0 writes.

Layout differences handled here: GPT-2's ``Conv1D`` weights are ``[in, out]`` (transposed) and
its ``c_attn`` stacks ``[q; k; v]``; LLaMA has separate ``q/k/v_proj`` and ``gate/up/down_proj``.
megazero's fused QKV (and Qwen2's QKV bias) is grouped per key/value head (see :mod:`models.layers`).
LLaMA's q/k rows are already in the half-split ``rotate_half`` layout megazero uses, so they are
copied as is.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megazero.config import config_from_dict, validate
from megazero.mesh import ParallelMesh
from .gpt import GPTModel, full_state_dict, load_full_state_dict
from .hf_config import GPT2_ACTIVATIONS, arch_of, config_from_hf, hf_config_from  # noqa: F401 - public names

GPT2_LAYER = [  # (megazero name, HF name, HF stores it transposed)
    ("input_norm.weight", "ln_1.weight", False), ("input_norm.bias", "ln_1.bias", False),
    ("attention.proj.weight", "attn.c_proj.weight", True), ("attention.proj.bias", "attn.c_proj.bias", False),
    ("post_attention_norm.weight", "ln_2.weight", False), ("post_attention_norm.bias", "ln_2.bias", False),
    ("mlp.fc1.weight", "mlp.c_fc.weight", True), ("mlp.fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.fc2.weight", "mlp.c_proj.weight", True), ("mlp.fc2.bias", "mlp.c_proj.bias", False)]
GPT2_GLOBAL = [("word_embeddings.weight", "transformer.wte.weight"),
               ("position_embeddings.weight", "transformer.wpe.weight"),
               ("final_norm.weight", "transformer.ln_f.weight"), ("final_norm.bias", "transformer.ln_f.bias"),
               ("output_layer.weight", "lm_head.weight")]
LLAMA_LAYER = [("input_norm.weight", "input_layernorm.weight", False),
               ("attention.proj.weight", "self_attn.o_proj.weight", False),
               ("post_attention_norm.weight", "post_attention_layernorm.weight", False),
               ("mlp.gate.weight", "mlp.gate_proj.weight", False),
               ("mlp.fc1.weight", "mlp.up_proj.weight", False),
               ("mlp.fc2.weight", "mlp.down_proj.weight", False)]
LLAMA_GLOBAL = [("word_embeddings.weight", "model.embed_tokens.weight"),
                ("final_norm.weight", "model.norm.weight"),
                ("output_layer.weight", "lm_head.weight")]


def _fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv, heads: int, groups: int, head_dim: int):
    per = qkv.reshape(groups, -1, *qkv.shape[1:])
    nq = heads // groups * head_dim
    q, k, v = per[:, :nq], per[:, nq:nq + head_dim], per[:, nq + head_dim:]
    return [t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v)]


def _maps(arch: str):
    """(layer map, global map, HF layer-name prefix) of an architecture."""
    if arch == "gpt2":
        return GPT2_LAYER, GPT2_GLOBAL, "transformer.h."
    return LLAMA_LAYER, LLAMA_GLOBAL, "model.layers."


def megazero_tensor(name: str, cfg, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The full (unsharded, unpadded) megazero tensor ``name`` from a Hugging Face model's tensors,
    fetched one by one with ``get(hf_name)``."""
    m, arch = cfg.model, arch_of(cfg.model)
    layer_map, global_map, prefix = _maps(arch)
    if not name.startswith("decoder."):
        return get(dict(global_map)[name])
    _, i, rest = name.split(".", 2)
    src = f"{prefix}{i}."
    for mz, hf, transposed in layer_map:
        if rest == mz:
            return get(src + hf).t() if transposed else get(src + hf)
    kind = rest.rsplit(".", 1)[1]  # attention.qkv.weight / .bias
    if arch == "gpt2":
        w = get(src + f"attn.c_attn.{kind}")
        return _fuse_qkv(*(w.t() if kind == "weight" else w).chunk(3), m.num_query_groups)
    return _fuse_qkv(*[get(f"{src}self_attn.{n}_proj.{kind}") for n in "qkv"], m.num_query_groups)


def hf_pieces(name: str, tensor: torch.Tensor, cfg) -> List[Tuple[str, torch.Tensor]]:
    """The Hugging Face tensors (name, view or tensor) of megazero tensor ``name`` (full, unpadded)."""
    m, arch = cfg.model, arch_of(cfg.model)
    layer_map, global_map, prefix = _maps(arch)
    if not name.startswith("decoder."):
        return [(dict(global_map)[name], tensor)]
    _, i, rest = name.split(".", 2)
    dst = f"{prefix}{i}."
    for mz, hf, transposed in layer_map:
        if rest == mz:
            return [(dst + hf, tensor.t() if transposed else tensor)]
    kind = rest.rsplit(".", 1)[1]
    q, k, v = _split_qkv(tensor, m.num_attention_heads, m.num_query_groups, m.kv_channels)
    if arch == "gpt2":
        joined = torch.cat([q, k, v])
        return [(dst + f"attn.c_attn.{kind}", joined.t() if kind == "weight" else joined)]
    return [(f"{dst}self_attn.{n}_proj.{kind}", t) for n, t in zip("qkv", (q, k, v))]


def megazero_names(cfg) -> List[str]:
    """Every megazero parameter name of a whole model of ``cfg``, embeddings first, layers in order."""
    m, arch = cfg.model, arch_of(cfg.model)
    layer_map, global_map, _ = _maps(arch)
    names = ["word_embeddings.weight"] + (["position_embeddings.weight"] if arch == "gpt2" else [])
    qkv = ["attention.qkv.weight"] + (["attention.qkv.bias"] if m.add_bias_linear or m.add_qkv_bias else [])
    for i in range(m.num_layers):
        names += [f"decoder.{i}.{mz}" for mz, _, _ in layer_map] + [f"decoder.{i}.{n}" for n in qkv]
    names += [mz for mz, _ in global_map if mz.startswith("final_norm.")]
    names = [n for n in names if arch == "gpt2" or not n.endswith("final_norm.bias")]
    return names + (["output_layer.weight"] if m.untie_embeddings_and_output_weights else [])


def megazero_state_from_hf(hf_state: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """Full megazero tensors (unsharded, unpadded) from a GPT-2 / LLaMA / Qwen2 / Mistral ``state_dict``."""
    return {n: megazero_tensor(n, cfg, hf_state.__getitem__).detach().float() for n in megazero_names(cfg)}


def hf_state_from_megazero(state: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`megazero_state_from_hf` (HF parameter names; tied head omitted)."""
    return {hf: t.contiguous() for name, tensor in state.items() for hf, t in hf_pieces(name, tensor, cfg)}


def from_hf(model_or_dir, mesh: Optional[ParallelMesh] = None,
            cfg_overrides: Optional[Dict[str, Any]] = None) -> GPTModel:
    """A megazero model (pp = 1) with the weights of a ``transformers`` GPT-2 or LLaMA model.

    ``model_or_dir``: a ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` or a directory ``from_pretrained``
    reads. ``mesh``: this process's mesh (one process when None); the model holds this rank's TP
    shard. ``cfg_overrides``: extra settings by field name (``seq_length``, dropout,
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
                    pipeline_model_parallel_size=1, **(cfg_overrides or {}))
    cfg = validate(config_from_dict(settings), mesh.world_size, check_data=False)  # no data of its own
    model = build_model(cfg, mesh)
    load_full_state_dict(model, megazero_state_from_hf(hf.state_dict(), cfg))
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
