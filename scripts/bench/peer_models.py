"""Torch-native peers of megazero's GPT for the benchmarks (same shape, same arithmetic).

:class:`PlainGPT` is the model a PyTorch user would write: ``nn.Embedding``, pre-norm blocks of
``nn.LayerNorm``, a fused QKV ``nn.Linear``, ``F.scaled_dot_product_attention``, a GELU-tanh MLP,
an untied (or tied) head and ``F.cross_entropy``, batch-first ``[b, s, h]``.  Its parameters have
the same shapes as megazero's (``tensor_model_parallel`` layers at TP 1), so
:func:`copy_from_megazero` can load megazero's initial weights for a like-for-like run.

:func:`hf_gpt2` builds ``transformers``' ``GPT2LMHeadModel`` of a given shape (fp32 or bf16),
for the profile and the GPU throughput check.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int, bias: bool):
        super().__init__()
        self.head_dim = h // heads
        self.input_norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.post_attention_norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, h, bias=bias)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        # QKV features laid out [head][q, k, v][head_dim] (megazero's layout): a tensor-parallel
        # (column) shard holds whole heads, so the local heads are inferred from the local width
        b, s = x.shape[:2]
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.post_attention_norm(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2-style decoder (learned positions, LayerNorm, GELU-tanh), batch-first.

    ``forward(ids, labels=None)``: the mean token loss with labels, logits otherwise.  A pipeline
    stage is built with ``first``/``last`` and a layer count: a stage without the embedding takes
    hidden states ``[b, s, h]``; one without the head returns them."""

    def __init__(self, vocab: int, h: int, heads: int, layers: int, seq: int, ffn: Optional[int] = None,
                 bias: bool = False, tied: bool = False, first: bool = True, last: bool = True):
        super().__init__()
        self.first, self.last, self.tied = first, last, tied
        self.sequence_shard = None  # (rank, ranks): this rank's part of the sequence (sequence parallel)
        if first:
            self.word_embeddings = nn.Embedding(vocab, h)
            self.position_embeddings = nn.Embedding(seq, h)
        self.layers = nn.ModuleList(PlainBlock(h, heads, ffn or 4 * h, bias) for _ in range(layers))
        if last:
            self.final_norm = nn.LayerNorm(h)
            if not tied:
                self.output_layer = nn.Linear(h, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.first:
            seq = x.shape[1]
            x = self.word_embeddings(x)
            if self.sequence_shard is not None:  # x is this rank's part of the sequence
                rank, ranks = self.sequence_shard
                x = x + self.position_embeddings.weight[rank * seq // ranks:(rank + 1) * seq // ranks]
            else:
                x = x + self.position_embeddings(torch.arange(seq, device=x.device))
        for layer in self.layers:
            x = layer(x)
        if not self.last:
            return x
        x = self.final_norm(x)
        logits = F.linear(x, self.word_embeddings.weight) if self.tied else self.output_layer(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


# names of PlainGPT parameters in megazero's GPTModel (decoder.<i>.<...>)
_BLOCK_NAMES = {"input_norm": "input_norm", "qkv": "attention.qkv", "proj": "attention.proj",
                "post_attention_norm": "post_attention_norm", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def megazero_name(name: str, first_layer: int = 0) -> str:
    """The megazero GPTModel parameter name of PlainGPT parameter ``name``."""
    parts = name.split(".")
    if parts[0] == "layers":
        i = int(parts[1]) + first_layer
        return f"decoder.{i}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return name


@torch.no_grad()
def copy_from_megazero(plain: PlainGPT, state: dict, first_layer: int = 0,
                       vocab: Optional[int] = None) -> None:
    """Load megazero's full (TP-gathered, unpadded) parameters ``state`` into ``plain``."""
    for name, p in plain.named_parameters():
        t = state[megazero_name(name, first_layer)]
        p.copy_(t[:vocab] if vocab is not None and t.shape[0] > p.shape[0] else t)


def hf_gpt2(vocab: int, h: int, heads: int, layers: int, seq: int, dtype=torch.float32, device="cpu",
            attn: str = "sdpa"):
    """``transformers.GPT2LMHeadModel`` of this shape (tied head, biases, dropout off)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=h, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn)
    return GPT2LMHeadModel(cfg).to(device=device, dtype=dtype)


def gpt_params(vocab: int, h: int, layers: int, seq: int, ffn: Optional[int] = None, tied: bool = False,
               bias: bool = False) -> int:
    """Parameters of a GPT-2-style model of this shape (LayerNorm weights and biases included)."""
    ffn = ffn or 4 * h
    per_layer = 4 * h * h + 2 * h * ffn + 4 * h + ((4 * h + ffn + h) if bias else 0)
    return vocab * h * (1 if tied else 2) + seq * h + layers * per_layer + 2 * h


def flops_per_token(h: int, layers: int, seq: int, vocab: int, ffn: Optional[int] = None) -> float:
    """Model FLOPs per token of forward + backward (6 per weight multiply-add plus attention)."""
    ffn = ffn or 4 * h
    matmul = layers * (4 * h * h + 2 * h * ffn) + vocab * h
    return 6.0 * matmul + 6.0 * layers * seq * h  # causal attention: half of 12 * s * h per layer


__all__ = ["PlainGPT", "copy_from_megazero", "hf_gpt2", "gpt_params", "flops_per_token", "megazero_name"]


def clip_peer_grads(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """``clip_grad_norm_`` for a peer whose parameters mix DTensors (tensor/data-parallel shards) and
    plain tensors (replicated), and whose pipeline stages each hold part of the model: the global
    norm over every stage (``pp_group``), then every gradient scaled by one factor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    parts: dict = {}  # one part per device mesh (a DTensor norm cannot mix meshes), plain tensors apart
    for p in params:
        if p.grad is not None:
            parts.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    parts = list(parts.values())
    total = torch.zeros((), dtype=torch.float32)
    for part in parts:
        if part:
            norm = torch.nn.utils.get_total_norm([p.grad for p in part], 2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            total = total + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    for part in parts:
        if part:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return norm
