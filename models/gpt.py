"""GPTModel: one pipeline chunk of a GPT-2- or LLaMA-style decoder (see ``docs/internals.md``).

``GPTModel(cfg, mesh, layers, pre_process, post_process, rng_tracker)`` builds only the
transformer layers in ``layers`` (global indices), plus the embedding when ``pre_process`` and
the final norm and output head when ``post_process``. Parameter names use global layer indices
(``decoder.<i>.attention.qkv.weight``), so names are the same at every pipeline layout.

Tied embeddings: with both ends in one chunk the head multiplies by the embedding weight
itself; otherwise (pp > 1) the last stage holds ``output_layer.weight``, initialised equal to
the embedding and marked ``shared_embedding`` and ``tied_copy`` (the first stage's embedding is
marked ``shared_embedding``); the optimizer sums their gradients over ``mesh.group("embedding")``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.compiling import compile_layers
from megazero.context_parallel import cp_positions, gather_cp_loss, split_for_cp
from megazero.mesh import ParallelMesh
from megazero.tensor_parallel.recompute import recompute
from megazero.tensor_parallel.cpu_matmul import linear_products, resolve_cpu_matmul
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, init_full, linear,
                                             normal_init, pad_rows, shard)
from megazero.tensor_parallel.mappings import copy_to_tp, gather_from_sp, gather_from_tp
from megazero.checkpoint.names import expert_name
from megazero.config.patterns import active_window, layer_window, uses_rope
from megazero.data.documents import document_eod, document_ids, document_mask, document_positions
from megazero.moe import MoEStats, moe_layers
from megazero.moe.settings import mtp_moe_layers
from .layers import KVCache, Norm, TransformerLayer, window_mask
from .mla import mla_rope_model
from .moe import moe_mlp
from .mtp import MultiTokenPrediction
from .rope import rope_tables

EMBEDDING_KEY = (-1, "word_embeddings.weight")  # (layer index, name) of the word-embedding init


class GPTModel(nn.Module):
    """One pipeline chunk; the whole model when ``layers = range(num_layers)`` and both flags are set.

    ``forward(input, labels=None, loss_mask=None, tokens=None)``: ``input`` is token ids ``[b, s]`` when
    ``pre_process`` else the previous stage's hidden states ``[s (/tp), b, h]``. Returns the
    per-token fp32 loss ``[b, s]`` (``post_process`` with labels), logits ``[b, s, vocab]``
    gathered over TP and unpadded (``post_process`` without labels), or hidden states.
    ``loss_mask`` is accepted for the executor's convenience and not applied here.

    Packed documents (``--reset-attention-mask``, ``--reset-position-ids``; ``needs_tokens`` is then
    True): each token attends within its document only and/or its position restarts after each
    end-of-document token (:mod:`megazero.data.documents`).  A chunk that does not embed takes the
    micro-batch's token ids as ``tokens`` to find the documents.
    """

    def __init__(self, cfg, mesh: Optional[ParallelMesh], layers: range, pre_process: bool,
                 post_process: bool, rng_tracker):
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        m = cfg.model
        if m.padded_vocab_size <= 0:
            raise ValueError("the config is not validated: call megazero.config.validate(cfg) first")
        if mesh.size("tp") != cfg.parallel.tensor_model_parallel_size:
            raise ValueError(f"mesh tp size {mesh.size('tp')} != --tensor-model-parallel-size "
                             f"{cfg.parallel.tensor_model_parallel_size}")
        self.cfg, self.mesh, self.rng_tracker = cfg, mesh, rng_tracker
        # the settings of the rotary tables: the model's, or MLA's rotary part (always rotated)
        self.rope_model = mla_rope_model(m) if m.multi_latent_attention else m
        # ZeRO-3 may release this chunk's own weights (embeddings, final norm, head) once backward
        # reaches the layers: the head's and the final norm's backward come before the layers', and
        # the lookups need no weights in backward (megazero.zero.stage3)
        self.zero3_free_root_in_backward = True
        self.layers, self.pre_process, self.post_process = layers, pre_process, post_process
        self.eod = document_eod(cfg)  # None unless documents reset attention or positions
        self.reset_attention = cfg.data.reset_attention_mask
        self.reset_positions = cfg.data.reset_position_ids
        self.needs_tokens = self.reset_attention or self.reset_positions
        self.sequence_parallel = cfg.parallel.sequence_parallel
        self.cp_size, self.cp_rank = mesh.size("cp"), mesh.coord("cp")
        cpu = mesh.device.type == "cpu"  # auto: this rank's products measured (once per machine)
        products = linear_products(cfg, mesh.size("tp"), mesh.size("cp")) if cpu else None
        self.onednn = resolve_cpu_matmul(cfg.precision.cpu_matmul, products)
        seed, std, h = cfg.training.seed, m.init_method_std, m.hidden_size
        tied = not m.untie_embeddings_and_output_weights
        if pre_process:
            self.word_embeddings = VocabParallelEmbedding(
                m.vocab_size, m.padded_vocab_size, h, mesh, reduce_scatter=self.sequence_parallel,
                init=normal_init(seed, *EMBEDDING_KEY, std))
            # tied, or untied with multi-token prediction on the last stage (its copy: models/mtp.py)
            shared = (tied or bool(m.mtp_num_layers)) and mesh.size("pp") > 1
            self.word_embeddings.weight.shared_embedding = shared
            self.word_embeddings.weight.is_embedding_or_output_parameter = True  # --decoupled-lr
            if m.position_embedding_type == "learned_absolute":
                # the deferred init is a closure over this method's locals, called later by the
                # optimizer: each name it reads is bound once (a shared `key` rebound below by the
                # untied head moved the positions' init in one process)
                shape, pos_key = (m.max_position_embeddings, h), "position_embeddings.weight"
                weight = new_param(shape, lambda: init_full(shape, seed, -1, pos_key, std), mesh.device)
                # _weight: take ours, without drawing from the default generator (and keep our parameter)
                self.position_embeddings = nn.Embedding(*shape, _weight=weight)
                self.position_embeddings.weight = weight
                weight.sequence_parallel = self.sequence_parallel
        here = [i for i in moe_layers(cfg) if i in layers]  # this chunk's MoE layers
        here += mtp_moe_layers(cfg) if post_process else []  # and its multi-token prediction's
        self.moe_stats = MoEStats(here, cfg.moe.num_experts, mesh.device) if here else None
        layer_type = TransformerLayer
        if m.hybrid_layer_pattern:  # a hybrid stack: one mixer per layer, by the pattern (models/hybrid.py)
            from .hybrid import HybridLayer as layer_type
        self.decoder = nn.ModuleDict({
            str(i): layer_type(cfg, mesh, i, rng_tracker, self.onednn,
                               mlp=moe_mlp(cfg, mesh, i, self.moe_stats, self.onednn))
            for i in layers})
        if cfg.precision.compile:  # --compile: each layer's forward through torch.compile
            compile_layers(self.decoder.values())
        if post_process:
            self.final_norm = Norm(h, m.normalization, m.norm_epsilon, mesh.device, self.sequence_parallel)
            if not (tied and pre_process):
                head_key = EMBEDDING_KEY if tied else (-1, "output_layer.weight")
                self.output_layer = ColumnParallelLinear(
                    h, m.padded_vocab_size, mesh, bias=False, sequence_parallel=self.sequence_parallel,
                    init=lambda shape: pad_rows(init_full((m.vocab_size, h), seed, *head_key, std), shape[0]))
                w = self.output_layer.weight
                w.vocab_parallel = True
                w.shared_embedding = w.tied_copy = tied
                w.is_embedding_or_output_parameter = True  # --decoupled-lr, as Megatron-LM marks it
            else:  # tied in this chunk: the head's product delivers its part of the gradient itself
                self.word_embeddings.weight.grad_arrivals = 2
            self.mtp = MultiTokenPrediction(cfg, mesh, rng_tracker, self) if m.mtp_num_layers else None

    # ---- pieces of the forward pass -----------------------------------------------------
    def embed(self, ids: torch.Tensor, offset: int = 0,
              positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``[b, s]`` at positions ``offset ..`` (at ``positions [b, s]`` when given) -> hidden
        ``[s (/cp) (/tp), b, h]`` (with dropout); under context parallelism this CP rank's chunks of the
        sequence, at their true global positions."""
        if self.cp_size > 1:
            ids = split_for_cp(ids, 1, self.cp_size, self.cp_rank)
        x = self.word_embeddings(ids.t())
        if self.cfg.model.scale_embedding:  # Gemma: sqrt(h), rounded to the activations' dtype
            x = x * torch.tensor(self.cfg.model.hidden_size ** 0.5, dtype=x.dtype, device=x.device)
        if hasattr(self, "position_embeddings") and positions is not None:  # per token: [s, b, h]
            pe = self.position_embeddings.weight[positions.t()]
            if self.sequence_parallel:
                pe = pe[self.mesh.coord("tp") * x.shape[0]:][:x.shape[0]]
            x = x + pe.to(x.dtype)
        elif hasattr(self, "position_embeddings") and self.cp_size > 1:
            pos = self.positions(ids.shape[1] * self.cp_size, ids.device)
            if self.sequence_parallel:
                pos = pos[self.mesh.coord("tp") * x.shape[0]:][:x.shape[0]]
            x = x + self.position_embeddings.weight[pos].unsqueeze(1).to(x.dtype)
        elif hasattr(self, "position_embeddings"):
            start = offset + (self.mesh.coord("tp") * x.shape[0] if self.sequence_parallel else 0)
            x = x + self.position_embeddings.weight[start:start + x.shape[0]].unsqueeze(1).to(x.dtype)
        p = self.cfg.model.hidden_dropout
        if self.training and p > 0:
            if self.sequence_parallel:
                with self.rng_tracker.fork():
                    return F.dropout(x, p)
            return F.dropout(x, p)
        return x

    def positions(self, seq: int, device) -> torch.Tensor:
        """Global positions of the tokens this CP rank holds of a ``seq``-token sequence."""
        return cp_positions(seq, self.cp_size, self.cp_rank, device=device)

    def _rope(self, x: torch.Tensor, offset: int = 0, positions: Optional[torch.Tensor] = None):
        """``cos, sin`` ``[s, d]`` of the positions ``offset ..`` (``[b, 1, s, d]`` of ``positions [b, s]``
        when given), or None without RoPE."""
        m = self.rope_model
        if not uses_rope(m):
            return None
        seq = x.shape[0] * (self.mesh.size("tp") if self.sequence_parallel else 1)  # this CP rank's tokens
        full = offset + seq * self.cp_size
        if positions is not None:  # every position is below seq: the table covers them
            return rope_tables(m, full, x.device, lambda t: t[positions].unsqueeze(1), positions)
        if self.cp_size > 1:  # the rotation of each token's true global position
            pos = self.positions(full, x.device)
            return rope_tables(m, full, x.device, lambda t: t[pos], pos)
        return rope_tables(m, full, x.device, lambda t: t[offset:] if offset else t,
                           lambda: torch.arange(offset, full, device=x.device))

    def window_masks(self, x: torch.Tensor, docs: Optional[torch.Tensor] = None) -> Dict[int, torch.Tensor]:
        """The additive masks of this chunk's sliding windows, one per window that hides keys of this
        sequence, built once per forward and shared by the layers (SDPA keeps one tensor for all of
        them).  None where the kernel takes the window itself (context parallelism, soft-capping).
        With document ids ``docs [b, s]`` (``--reset-attention-mask``): one ``[b, 1, s, s]`` mask per
        layer window (None included), causal within each document and the window; where the blockwise
        kernel runs (soft-capping) the document ids themselves, and under context parallelism every
        CP rank's document ids (a list, for the ring/Ulysses kernel)."""
        m = self.cfg.model
        seq = x.shape[0] * (self.mesh.size("tp") if self.sequence_parallel else 1)
        windows = {layer_window(m, i) for i in self.layers}
        if docs is not None and self.cp_size > 1:  # the kernel compares every CP rank's document ids
            s = docs.shape[1]
            ranks = [docs[:, cp_positions(s, self.cp_size, r, device=docs.device)]
                     for r in range(self.cp_size)]
            return {w: ranks for w in windows}
        if docs is not None and m.attn_logit_softcapping is not None:  # the kernel compares the ids
            return {w: docs for w in windows}
        if docs is not None:  # one mask per window that differs on this sequence, shared by the layers
            built = {a: document_mask(docs, a, x.dtype) for a in {active_window(w, seq) for w in windows}}
            return {w: built[active_window(w, seq)] for w in windows}
        if self.cp_size > 1 or m.attn_logit_softcapping is not None:
            return {}
        windows = {active_window(layer_window(m, i), seq) for i in self.layers} - {None}
        return {w: window_mask(seq, w, x.dtype, x.device) for w in sorted(windows)}

    def documents(self, tokens: Optional[torch.Tensor]):
        """``(positions, document ids)`` of packed documents, each None where not asked for: the
        positions of this CP rank's tokens ``[b, s (/cp)]``, the document ids of the whole sequence
        ``[b, s]``."""
        if not self.needs_tokens:
            return None, None
        if tokens is None:
            raise ValueError("--reset-attention-mask / --reset-position-ids: this model chunk needs the "
                             "micro-batch's token ids (forward(..., tokens=ids))")
        positions = document_positions(tokens, self.eod) if self.reset_positions else None
        if positions is not None and self.cp_size > 1:
            positions = positions[:, self.positions(tokens.shape[1], tokens.device)]
        return positions, document_ids(tokens, self.eod) if self.reset_attention else None

    def run_layers(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                   docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The transformer layers, with full recomputation (uniform or block) when configured."""
        m, rope, masks = self.cfg.model, self._rope(x, positions=positions), self.window_masks(x, docs)
        layers = list(self.decoder.values())

        def segment(start, end):
            def run(h):
                for layer in layers[start:end]:
                    h = layer(h, rope, masks=masks)
                return h
            return run

        full = m.recompute_granularity == "full" and torch.is_grad_enabled()
        n = m.recompute_num_layers or 1
        if full and m.recompute_method == "uniform":
            for i in range(0, len(layers), n):
                x = recompute(segment(i, i + n), x, tracker=self.rng_tracker, device=x.device)
            return x
        for i in range(len(layers)):
            if full and m.recompute_method == "block" and i < n:
                x = recompute(segment(i, i + 1), x, tracker=self.rng_tracker, device=x.device)
            else:
                x = layers[i](x, rope, masks=masks)
        return x

    def output_weight(self) -> torch.Tensor:
        """The head's weight shard ``[padded_vocab / tp, h]`` (the embedding itself when tied in one
        chunk)."""
        return self.output_layer.weight if hasattr(self, "output_layer") else self.word_embeddings.weight

    def decode(self, ids: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Generation step: logits ``[b, s, vocab]`` (unpadded, gathered over TP) of tokens ``ids``
        ``[b, s]`` that follow the ``kv_cache.length`` positions already in ``kv_cache``, whose keys
        and values it extends.  The whole model only (pp = 1), without sequence parallelism."""
        if not (self.pre_process and self.post_process) or self.sequence_parallel or self.cp_size > 1:
            raise ValueError("decode needs the whole model (pp = 1) without --sequence-parallel or "
                             "--context-parallel-size > 1")
        past = kv_cache.length
        x = self.embed(ids, offset=past)
        rope = self._rope(x, offset=past)
        for layer in self.decoder.values():
            x = layer(x, rope, kv_cache)
        kv_cache.length = past + ids.shape[1]
        x = copy_to_tp(self.final_norm(x), self.mesh)
        logits = self.softcap(linear(x, self.output_weight(), onednn=self.onednn))
        return gather_from_tp(logits, self.mesh)[..., :self.cfg.model.vocab_size].transpose(0, 1)

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap tanh(logits / cap)`` with ``--final-logit-softcapping`` (Gemma 2), else the logits."""
        cap = self.cfg.model.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None,
                tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        positions, docs = self.documents(input if self.pre_process else tokens)
        x = self.embed(input, positions=positions) if self.pre_process else input
        x = self.run_layers(x, positions, docs)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        if labels is not None and self.mtp is not None:  # multi-token prediction: models/mtp.py
            return self.mtp.loss(self, x, labels, loss_mask)
        x = gather_from_sp(x, self.mesh) if self.sequence_parallel else copy_to_tp(x, self.mesh)
        # [s, b, padded_vocab / tp]
        logits = self.softcap(linear(x, self.output_weight(), onednn=self.onednn))
        vocab = self.cfg.model.vocab_size
        if labels is None:
            logits = gather_from_tp(logits, self.mesh)[..., :vocab].transpose(0, 1).contiguous()
            return gather_cp_loss(logits, self.mesh.group("cp"), self.cp_size, self.cp_rank)
        if self.cp_size > 1:
            labels = split_for_cp(labels, 1, self.cp_size, self.cp_rank)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.mesh, vocab,
                                            z_loss=self.cfg.training.z_loss_coeff or 0.0).t().contiguous()
        # every CP rank: the whole sequence's per-token loss (the global token mean follows)
        return gather_cp_loss(loss, self.mesh.group("cp"), self.cp_size, self.cp_rank)


# ---- full (TP-gathered, unpadded) tensors ---------------------------------------------------
def _gather_over(t: torch.Tensor, mesh, axis: str, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(mesh.size(axis))]
    dist.all_gather(parts, t.contiguous(), group=mesh.group(axis))
    return torch.cat(parts, dim=dim)


def _gather(t: torch.Tensor, param, mesh) -> torch.Tensor:
    """The whole tensor: TP pieces joined (expert TP and EP for experts: all experts stacked)."""
    expert = getattr(param, "expert_parallel", False)
    split = "etp" if expert else "tp"
    if getattr(param, "tensor_model_parallel", False) and mesh.size(split) > 1:
        t = _gather_over(t, mesh, split, param.partition_dim)
    if expert and mesh.size("ep") > 1:
        t = _gather_over(t, mesh, "ep", 0)
    return t


def full_state_dict(model: GPTModel, grads: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of this chunk as the full tensor: TP shards gathered
    (collective over the TP group, and the expert TP and EP groups in an MoE model: every rank of
    them must call it) and vocabulary padding removed; an expert parameter as one tensor per expert
    (``...experts.<e>.fc1_weight``, the checkpoint's names).  Gradients of ``sequence_parallel``
    parameters are returned as this rank holds them."""
    vocab, out = model.cfg.model.vocab_size, {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        t = _gather(t, p, model.mesh)
        if getattr(p, "expert_parallel", False):
            out.update({expert_name(name, e): t[e] for e in range(t.shape[0])})
            continue
        out[name] = t[:vocab] if getattr(p, "vocab_parallel", False) else t
    return out


def _expert_keys(model: GPTModel) -> Dict[str, list]:
    """Stacked expert parameter name -> the per-expert names of the experts this rank holds."""
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "expert_parallel", False):
            first = model.mesh.coord("ep") * p.shape[0]
            out[name] = [expert_name(name, first + j) for j in range(p.shape[0])]
    return out


def load_full_state_dict(model: GPTModel, state: Dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded, unpadded) tensors into this chunk's parameters, keeping this rank's
    slice and padding the vocabulary; experts by their own names (``...experts.<e>.fc1_weight``, every
    expert of the model: a rank takes its own). Raises ``KeyError`` naming missing or unexpected keys."""
    names = dict(model.named_parameters())
    experts = _expert_keys(model)
    wanted = {n for n in names if n not in experts}
    all_experts = {k for k in state if k.rsplit(".", 2)[0] + "." + k.rsplit(".", 1)[1] in experts}
    missing = sorted(wanted - set(state)) + sorted({k for ks in experts.values() for k in ks} - set(state))
    unexpected = sorted(set(state) - wanted - all_experts)
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in names.items():
            t = torch.stack([state[k] for k in experts[name]]) if name in experts else state[name]
            if getattr(p, "vocab_parallel", False):
                t = pad_rows(t, model.cfg.model.padded_vocab_size)
            if getattr(p, "tensor_model_parallel", False) and name in experts:
                t = t.chunk(model.mesh.size("etp"), dim=p.partition_dim)[model.mesh.coord("etp")]
            elif getattr(p, "tensor_model_parallel", False):
                t = shard(t, model.mesh, p.partition_dim)
            if t.shape != p.shape:
                raise ValueError(f"{name}: expected a full tensor giving shard {tuple(p.shape)}, "
                                 f"got {tuple(t.shape)}")
            p.copy_(t)
