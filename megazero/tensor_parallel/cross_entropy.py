"""Cross-entropy over vocabulary-parallel logits, without ever gathering the full logits.

Each TP rank holds ``logits[..., r * V/tp : (r + 1) * V/tp]`` of the padded vocabulary ``V``.
The softmax normaliser, the target logit and (for label smoothing) the sum of the logits are
reduced over the TP group as a handful of scalars per token. Columns at or beyond the real
vocabulary size are padding: they are left out of the softmax and get zero gradient.
Computed in fp32 whatever the logits' dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, mesh, vocab_size, label_smoothing):
        tp = 1 if mesh is None else mesh.tp_size
        group = None if mesh is None else mesh.tp_group
        part = logits.shape[-1]
        start = 0 if mesh is None else mesh.tp_rank * part
        valid = (torch.arange(start, start + part, device=logits.device) < vocab_size)  # [part]
        x = logits.float().masked_fill(~valid, float("-inf"))
        # softmax normaliser: global max (for stability), then sum of exp
        xmax = x.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(xmax, op=dist.ReduceOp.MAX, group=group)
        x = x - xmax.unsqueeze(-1)
        exp = x.exp()  # padded columns: exp(-inf) = 0
        local = labels - start
        mine = (local >= 0) & (local < part)
        target = torch.gather(x, -1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
        stats = [exp.sum(-1), target.masked_fill(~mine, 0.0)]
        if label_smoothing > 0:
            stats.append(x.masked_fill(~valid, 0.0).sum(-1))
        stats = torch.stack(stats)
        if tp > 1:
            dist.all_reduce(stats, group=group)
        log_z = stats[0].log()
        loss = log_z - stats[1]
        if label_smoothing > 0:
            smooth = log_z - stats[2] / vocab_size  # mean over the vocabulary of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine, valid)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # d loss / d logits = softmax - (1 - eps) * onehot - eps / V (valid columns)
        if eps > 0:
            grad = grad - (eps / ctx.vocab_size) * valid.to(grad.dtype)
        onehot = torch.zeros_like(grad).scatter_(-1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1),
                                                 mine.to(grad.dtype).unsqueeze(-1))
        grad = grad - (1.0 - eps) * onehot
        grad = grad * grad_loss.unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mesh, vocab_size: int,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``labels``) from this rank's vocabulary shard.

    ``logits``: ``[..., padded_vocab / tp]`` (any float dtype); ``labels``: int64 ``[...]`` in
    ``[0, vocab_size)``; ``vocab_size``: the real (unpadded) vocabulary; ``mesh``: the
    :class:`~megazero.mesh.ParallelMesh` (``None`` for one process). Matches
    ``F.cross_entropy(full_logits[..., :vocab_size], labels, reduction="none",
    label_smoothing=label_smoothing)``. Apply a loss mask to the result.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(logits, labels, mesh, vocab_size, label_smoothing)
