"""What the routers of one model chunk share: the backward scale of the auxiliary losses, and what they
saw during a step (losses, tokens per expert, dropped tokens), reduced once per step for the logs and
the expert-bias update.

Auxiliary losses enter backward as Megatron-core's ``MoEAuxLossAutoScaler`` does: :func:`attach_loss`
returns its input unchanged and, in backward, hands the loss the gradient ``stats.backward_scale``,
which the pipeline executor sets before each schedule to ``loss_scale / num_micro_batches`` (the
factor the language-model loss of a micro-batch gets). So the objective is the mean over the step's
micro-batches of (language-model loss + every MoE layer's coefficient x loss), on every pipeline stage
where its layers are, whatever the schedule. No module-level state: the scale lives on the chunk's
:class:`MoEStats`.

Recorded only in a forward that builds a graph (training: the first forward, or the replay of a
recomputed one), so evaluation and recomputation never count twice.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x``; in backward the loss gets ``stats.backward_scale`` as its gradient."""

    @staticmethod
    def forward(ctx, x, loss, stats):
        ctx.stats, ctx.loss_shape, ctx.loss_dtype = stats, loss.shape, loss.dtype
        return x

    @staticmethod
    def backward(ctx, grad):
        scale = torch.full(ctx.loss_shape, float(ctx.stats.backward_scale), dtype=ctx.loss_dtype,
                           device=grad.device)
        return grad, scale, None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, stats: "MoEStats") -> torch.Tensor:
    """``x``, with ``loss`` (a scalar of the graph) added to the objective through its backward."""
    return _AttachLoss.apply(x, loss, stats)


class MoEStats:
    """Per model chunk: ``backward_scale`` and this step's records of its MoE layers (global indices
    ``layers``), each a tensor on the chunk's device (no host synchronisation while training)."""

    def __init__(self, layers: Sequence[int], num_experts: int, device):
        self.layers, self.num_experts, self.device = list(layers), num_experts, torch.device(device)
        self.backward_scale = 1.0
        self.reset()

    def reset(self) -> None:
        """Forget the step's records (the trainer calls it after reading them)."""
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=self.device)  # noqa: E731
        self.aux_loss = {i: zeros(()) for i in self.layers}
        self.z_loss = {i: zeros(()) for i in self.layers}
        self.tokens = {i: zeros(self.num_experts) for i in self.layers}
        self.dropped = {i: zeros(()) for i in self.layers}

    def record(self, layer: int, *, aux_loss: Optional[torch.Tensor] = None,
               z_loss: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None,
               dropped: Optional[torch.Tensor] = None) -> None:
        """Add one micro-batch's values of MoE layer ``layer`` (this rank's share of each)."""
        for table, value in ((self.aux_loss, aux_loss), (self.z_loss, z_loss), (self.tokens, tokens),
                             (self.dropped, dropped)):
            if value is not None:
                table[layer] += value.detach().to(torch.float64)


def chunk_stats(chunks) -> List[MoEStats]:
    """The :class:`MoEStats` of the chunks that have MoE layers (``chunk.moe_stats``)."""
    return [s for s in (getattr(c, "moe_stats", None) for c in chunks) if s is not None]


def set_backward_scale(chunks, scale: float) -> None:
    """Before a schedule: the auxiliary losses' gradient is ``scale`` (loss scale / micro-batches)."""
    for s in chunk_stats(chunks):
        s.backward_scale = scale
    for c in chunks:  # multi-token prediction's losses (models/mtp.py) take the same scale
        mtp = getattr(c, "mtp", None)
        if mtp is not None:
            mtp.stats.backward_scale = scale


def reduce_step(chunks, mesh, moe_layers: Sequence[int], num_experts: int, num_micro_batches: int,
                data_parallel_size: int) -> Optional[Dict[str, torch.Tensor]]:
    """One all-reduce over the world of every MoE layer's step records (collective: every rank calls it;
    each rank adds its own share of its own layers).  Returns per layer (rows in ``moe_layers`` order):
    ``aux_loss`` and ``z_loss`` (means over the step's micro-batches), ``tokens [L, E]`` (tokens routed
    to each expert, kept ones, over the whole global batch) and ``dropped [L]``; resets the records.
    None for a model without MoE layers."""
    if not moe_layers:
        return None
    row = {layer: i for i, layer in enumerate(moe_layers)}
    table = torch.zeros(len(moe_layers), num_experts + 3, dtype=torch.float64, device=mesh.device)
    for s in chunk_stats(chunks):
        for layer in s.layers:
            r = row[layer]
            table[r, 0] += s.aux_loss[layer]
            table[r, 1] += s.z_loss[layer]
            table[r, 2] += s.dropped[layer]
            table[r, 3:] += s.tokens[layer]
        s.reset()
    if mesh.world_size > 1:
        table = mesh.collective_tensor(table)
        dist.all_reduce(table, group=mesh.world_group)
    steps = max(1, num_micro_batches * data_parallel_size)
    return {"aux_loss": table[:, 0] / steps, "z_loss": table[:, 1] / steps, "dropped": table[:, 2],
            "tokens": table[:, 3:]}


def step_metrics(reduced: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The metrics row's MoE entries from :func:`reduce_step`: the losses averaged over the MoE layers,
    tokens per expert (min, max over layers and experts; imbalance: the largest max / mean of a layer)
    and the dropped token-expert pairs of the step (all layers), read on the host at once."""
    tokens = reduced["tokens"]
    mean = tokens.mean(dim=1).clamp(min=1e-30)
    values = torch.stack([reduced["aux_loss"].mean(), reduced["z_loss"].mean(), tokens.min(), tokens.max(),
                          (tokens.max(dim=1).values / mean).max(), reduced["dropped"].sum()])
    names = ("moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max",
             "moe_imbalance", "moe_dropped_tokens")
    return dict(zip(names, values.tolist()))  # the step's one read of them
