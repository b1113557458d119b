"""Cross-entropy over vocabulary-parallel logits, without ever gathering the full logits.

Each TP rank holds ``logits[..., r * V/tp : (r + 1) * V/tp]`` of the padded vocabulary ``V``.
The softmax normaliser, the target logit and (for label smoothing) the sum of the logits are
reduced over the TP group as a handful of scalars per token. Columns at or beyond the real
vocabulary size are padding: they are left out of the softmax and get zero gradient.
Computed in fp32 whatever the logits' dtype.

Cost: with one TP rank this is PyTorch's own ``F.cross_entropy`` on the unpadded columns (its
fused log-softmax kernels).  Otherwise the forward makes one fp32 buffer (the shifted logits,
exponentiated and normalised in place into the softmax it saves) and the backward turns that
saved softmax into the gradient in place (Megatron-LM's scheme): about four passes over the
logits in all, where a textbook version makes a dozen.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, mesh, vocab_size, label_smoothing, z_loss):
        group = mesh.group("tp")
        part = logits.shape[-1]
        start = mesh.coord("tp") * part
        padded = start + part > vocab_size  # this shard holds padding columns
        # global max over the real columns, for stability
        real = logits[..., :max(0, vocab_size - start)] if padded else logits
        xmax = real.max(dim=-1).values.float() if real.shape[-1] else \
            torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        dist.all_reduce(xmax, op=dist.ReduceOp.MAX, group=group)
        x = logits.float() - xmax.unsqueeze(-1)  # the one full-size fp32 buffer
        if padded:
            x[..., max(0, vocab_size - start):] = float("-inf")
        local = labels - start
        mine = (local >= 0) & (local < part)
        index = local.clamp(0, part - 1).unsqueeze(-1)
        target = torch.gather(x, -1, index).squeeze(-1).masked_fill_(~mine, 0.0)
        stats = [None, target]
        if label_smoothing > 0:
            stats.append(x[..., :max(0, vocab_size - start)].sum(-1) if padded else x.sum(-1))
        stats[0] = x.exp_().sum(-1)  # padded columns: exp(-inf) = 0
        stats = torch.stack(stats)
        dist.all_reduce(stats, group=group)
        log_z = stats[0].log()
        loss = log_z - stats[1]
        if label_smoothing > 0:
            smooth = log_z - stats[2] / vocab_size  # mean over the vocabulary of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        softmax = x.div_(stats[0].unsqueeze(-1))
        if z_loss:  # + z lse^2 (lse: the unshifted log-normaliser), whose gradient is 2 z lse softmax
            lse = log_z + xmax
            loss = loss + z_loss * lse * lse
            softmax.mul_((1.0 + 2.0 * z_loss * lse).unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        ctx.real_columns = max(0, vocab_size - start) if padded else part
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logits = softmax - (1 - eps) * onehot - eps / V on the real columns;
        # the saved softmax becomes the gradient in place (this backward runs once)
        grad, index, mine = ctx.saved_tensors  # with a z-loss: (1 + 2 z lse) softmax
        eps = ctx.label_smoothing
        if eps > 0:
            grad[..., :ctx.real_columns] -= eps / ctx.vocab_size
        grad.scatter_add_(-1, index, mine.unsqueeze(-1).to(grad.dtype).mul_(eps - 1.0))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def _cross_entropy_one_rank(logits, labels, vocab_size, label_smoothing, z_loss):
    """All columns on this rank: PyTorch's fused cross-entropy on the real (unpadded) ones, in fp32."""
    x = logits[..., :vocab_size] if logits.shape[-1] > vocab_size else logits
    x = x.float().reshape(-1, vocab_size)
    loss = F.cross_entropy(x, labels.reshape(-1), reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, dim=-1).square()
    return loss.view(labels.shape)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mesh, vocab_size: int,
                                 label_smoothing: float = 0.0, z_loss: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``labels``) from this rank's vocabulary shard.

    ``logits``: ``[..., padded_vocab / tp]`` (any float dtype); ``labels``: int64 ``[...]`` in
    ``[0, vocab_size)``; ``vocab_size``: the real (unpadded) vocabulary; ``mesh``: the
    :class:`~megazero.mesh.ParallelMesh` (``None`` for one process). Matches
    ``F.cross_entropy(full_logits[..., :vocab_size], labels, reduction="none",
    label_smoothing=label_smoothing)``, plus ``z_loss * logsumexp(logits)^2`` per token when ``z_loss``
    (a z-loss on the output logits: PaLM's, Swallow's ``--use-z-loss`` with 1e-4). Apply a loss mask to
    the result.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if mesh is None or mesh.size("tp") == 1:
        return _cross_entropy_one_rank(logits, labels, vocab_size, label_smoothing, z_loss)
    return _VocabParallelCrossEntropy.apply(logits, labels, mesh, vocab_size, label_smoothing, z_loss)
