"""Multi-token prediction (DeepSeek-V3; Megatron-core's MTP block), ``--mtp-num-layers N``.

The last pipeline stage's chunk holds N depths after its final norm.  Depth ``k`` (0-based) takes the
previous depth's output ``h`` (depth 0: the main model's hidden state after the final norm) and the
embedding of the tokens one place further on (token ``t+k+1`` at position ``t``: the labels rolled
left by ``k``), and computes

    h' = final_norm_k(layer_k(eh_proj_k([enorm_k(embed(ids_k)); hnorm_k(h)])))

(the embedding first, as Megatron-core and DeepSeek-V3's weights have it), whose logits through the
shared output head predict token ``t+k+2`` (the labels rolled left by ``k+1``; positions past the end
masked).  The loss of depth ``k`` is the mean over the micro-batch's unmasked tokens, as the main loss;
``--mtp-loss-scaling-factor / N`` times their sum enters the objective through backward
(:func:`megazero.moe.stats.attach_loss`, with the same per-micro-batch gradient scale as the MoE
auxiliary losses), and the step's mean per depth is reported as ``mtp_loss`` (``mtp_<k+1>_loss``).

Parameter names (global, the same at every pipeline layout), ``i = --num-layers + k`` as in DeepSeek-V3's
checkpoints (``model.layers.{i}.*``):

=====================================  ==================================================
``mtp.<i>.enorm.weight``                ``model.layers.<i>.enorm.weight``
``mtp.<i>.hnorm.weight``                ``model.layers.<i>.hnorm.weight``
``mtp.<i>.eh_proj.weight``              ``model.layers.<i>.eh_proj.weight``
``mtp.<i>.layer.<name>``                ``model.layers.<i>.<name>`` (the transformer layer's own names)
``mtp.<i>.final_norm.weight``           ``model.layers.<i>.shared_head.norm.weight``
(the shared head and embedding)         ``shared_head.head`` / ``embed_tokens``: the model's own
=====================================  ==================================================

The embedding is shared: in a chunk that embeds, the word embedding itself; on a last stage under
pipeline parallelism with tied embeddings, the head's weight (the embedding's tied copy, its lookup
gradient arriving through ``.grad`` beside the head's product, ``grad_arrivals = 2``); with untied
embeddings, ``mtp.word_embeddings.weight``, a copy of the word embedding marked ``shared_embedding`` and
``tied_copy`` (gradients summed with the first stage's over the embedding group, checkpointed once).
The MTP transformer layers are MoE layers when the last decoder layer is one (Megatron-core builds them
with its spec; :func:`megazero.moe.settings.mtp_moe_layers`), their routers' records and expert biases
with the decoder's; otherwise they have the dense MLP.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.context_parallel import gather_cp_loss, split_for_cp
from megazero.moe.stats import attach_loss
from megazero.training.mtp import MTPStats
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, init_full, linear,
                                             normal_init)
from megazero.tensor_parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                               reduce_scatter_to_sp, scatter_to_sp)
from .layers import Norm, TransformerLayer
from .moe import moe_mlp

EMBEDDING_KEY = (-1, "word_embeddings.weight")  # the word embedding's init key (models/gpt.py's)


class MTPDepth(nn.Module):
    """One depth: its two input norms, the 2h -> h projection, a transformer layer and its final norm."""

    def __init__(self, cfg, mesh, index: int, rng_tracker, onednn: bool = False, moe_stats=None):
        super().__init__()
        m, sp = cfg.model, cfg.parallel.sequence_parallel
        self.mesh, self.sequence_parallel = mesh, sp
        norm = lambda: Norm(m.hidden_size, m.normalization, m.norm_epsilon, mesh.device, sp)  # noqa: E731
        self.enorm, self.hnorm = norm(), norm()
        seed, std, h = cfg.training.seed, m.init_method_std, m.hidden_size
        self.eh_proj = ColumnParallelLinear(2 * h, h, mesh, bias=False, sequence_parallel=sp, onednn=onednn,
                                            init=lambda shape: init_full(shape, seed, index, "eh_proj.weight",
                                                                         std))
        # the layer sees a model of num_layers + N layers (its index exists in every per-layer rule)
        wide = dataclasses.replace(cfg.model, num_layers=m.num_layers + m.mtp_num_layers)
        self.layer = TransformerLayer(_with_model(cfg, wide), mesh, index, rng_tracker, onednn,
                                      mlp=moe_mlp(cfg, mesh, index, moe_stats, onednn))
        self.final_norm = norm()

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope, masks) -> torch.Tensor:
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)
        x = gather_from_tp(self.eh_proj(x), self.mesh)  # [s, b, h] on every TP rank
        if self.sequence_parallel:
            x = scatter_to_sp(x, self.mesh)
        return self.final_norm(self.layer(x, rope, masks=masks))


def _with_model(cfg, model):
    out = cfg._copy() if hasattr(cfg, "_copy") else cfg
    out.model = model
    return out


def roll_left(t: torch.Tensor, shift: int) -> torch.Tensor:
    """``t [b, s]`` moved ``shift`` places left along the sequence, zeros after its end."""
    if shift == 0:
        return t
    out = torch.zeros_like(t)
    out[:, :-shift] = t[:, shift:]
    return out


class MultiTokenPrediction(nn.Module):
    """The N depths of a last stage's chunk (``mtp.<num_layers + k>``), see the module docstring."""

    def __init__(self, cfg, mesh, rng_tracker, model):
        """``model``: the chunk (a last stage's) this belongs to, not kept: its embedding and head are
        read at each forward; here only marked for the gradient bookkeeping (module docstring)."""
        super().__init__()
        m = cfg.model
        self.cfg, self.mesh, self.n = cfg, mesh, m.mtp_num_layers
        # each depth a child named by its global index, not an nn.ModuleDict: ZeRO-3 takes the largest
        # ModuleDict's blocks (the decoder's layers) for its units, and the depths stay in the root unit,
        # whose backward comes before the layers' (megazero.zero.buckets.find_units)
        for i in range(m.num_layers, m.num_layers + self.n):
            self.add_module(str(i), MTPDepth(cfg, mesh, i, rng_tracker, model.onednn, model.moe_stats))
        self.stats = MTPStats(self.n, mesh.device)
        self.word_embeddings = None
        if model.pre_process:
            return
        if not m.untie_embeddings_and_output_weights:  # the head's weight is the tied copy: looked up too
            w = model.output_layer.weight
            w.linear_weight, w.grad_arrivals = False, 2
            return
        seed, std = cfg.training.seed, m.init_method_std
        self.word_embeddings = VocabParallelEmbedding(
            m.vocab_size, m.padded_vocab_size, m.hidden_size, mesh, reduce_scatter=model.sequence_parallel,
            init=normal_init(seed, *EMBEDDING_KEY, std))
        w = self.word_embeddings.weight
        w.shared_embedding = w.tied_copy = True
        w.is_embedding_or_output_parameter = True

    def depths(self) -> List[MTPDepth]:
        return [getattr(self, str(self.cfg.model.num_layers + k)) for k in range(self.n)]

    def embedding_weight(self, model) -> torch.Tensor:
        """The shared word embedding as this chunk holds it (module docstring)."""
        if model.pre_process:
            return model.word_embeddings.weight
        if self.word_embeddings is not None:
            return self.word_embeddings.weight
        return model.output_layer.weight

    def loss(self, model, x: torch.Tensor, labels: torch.Tensor,
             loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The chunk's per-token main loss ``[b, s]`` from its normed hidden state ``x``, with the depths'
        losses attached: one product with the shared head for the main model and every depth."""
        mesh, vocab = self.mesh, self.cfg.model.vocab_size
        rope, masks = model._rope(x), model.window_masks(x)
        hs = [x] + self.hidden_states(x, labels, self.embedding_weight(model), model, rope, masks)
        hs = [gather_from_sp(h, mesh) if model.sequence_parallel else copy_to_tp(h, mesh) for h in hs]
        logits = model.softcap(linear(torch.cat(hs, dim=0), model.output_weight(), onednn=model.onednn))
        targets = [labels] + [roll_left(labels, k + 1) for k in range(self.n)]
        if model.cp_size > 1:
            targets = [split_for_cp(t, 1, model.cp_size, model.cp_rank) for t in targets]
        per_token = vocab_parallel_cross_entropy(logits, torch.cat([t.t() for t in targets], dim=0), mesh,
                                                 vocab)
        losses = [gather_cp_loss(t.t().contiguous(), mesh.group("cp"), model.cp_size, model.cp_rank)
                  for t in per_token.chunk(1 + self.n, dim=0)]
        mask = loss_mask if loss_mask is not None else torch.ones_like(losses[0])
        return self.add_losses(losses[0], losses[1:], mask, model.training and torch.is_grad_enabled())

    def embed(self, ids: torch.Tensor, weight: torch.Tensor, model) -> torch.Tensor:
        """Token ids ``[b, s]`` -> ``[s (/cp) (/tp), b, h]`` through the (vocabulary-parallel) ``weight``,
        as the model's embedding computes them (with its dropout; no position embedding: refused)."""
        if model.cp_size > 1:
            ids = split_for_cp(ids, 1, model.cp_size, model.cp_rank)
        ids = ids.t()
        sparse = bool(getattr(weight, "sparse_grad", False))
        mesh = self.mesh
        if mesh.size("tp") == 1:
            x = F.embedding(ids, weight, sparse=sparse)
        else:
            per = weight.shape[0]
            local = ids - mesh.coord("tp") * per
            outside = (local < 0) | (local >= per)
            x = F.embedding(local.masked_fill(outside, 0), weight, sparse=sparse).masked_fill(
                outside.unsqueeze(-1), 0.0)
            x = reduce_scatter_to_sp(x, mesh) if model.sequence_parallel else reduce_from_tp(x, mesh)
        if self.cfg.model.scale_embedding:
            x = x * torch.tensor(self.cfg.model.hidden_size ** 0.5, dtype=x.dtype, device=x.device)
        p = self.cfg.model.hidden_dropout  # the embedding's dropout, as the model's (and Megatron-core's)
        if model.training and p > 0:
            if model.sequence_parallel:
                with model.rng_tracker.fork():
                    return F.dropout(x, p)
            return F.dropout(x, p)
        return x

    def hidden_states(self, h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, model, rope,
                      masks) -> List[torch.Tensor]:
        """Each depth's output ``[s (/cp) (/tp), b, h]`` from the main model's normed hidden state ``h``."""
        out = []
        for k, depth in enumerate(self.depths()):
            h = depth(h, self.embed(roll_left(labels, k), weight, model).to(h.dtype), rope, masks)
            out.append(h)
        return out

    def add_losses(self, loss: torch.Tensor, per_token: List[torch.Tensor], labels_mask: torch.Tensor,
                   record: bool) -> torch.Tensor:
        """``loss`` (the main per-token loss) with the depths' losses attached for backward; ``per_token``
        ``[b, s]`` each, ``labels_mask [b, s]`` the main loss mask."""
        total = None
        for k, t in enumerate(per_token):
            dt = torch.promote_types(t.dtype, torch.float32)  # fp32 (float64 in the float64 check)
            mask = roll_left(labels_mask, k + 1).to(dt)
            mean = (t.to(dt) * mask).sum() / mask.sum().clamp(min=1.0)
            if record:
                self.stats.record(k, mean)
            total = mean if total is None else total + mean
        if total is None or not torch.is_grad_enabled():
            return loss
        scale = self.cfg.model.mtp_loss_scaling_factor / self.n
        return attach_loss(loss, total * scale, self.stats)
