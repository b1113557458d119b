"""Multi-token prediction's records (the model side: ``models/mtp.py``): the losses of each depth summed
over a step's micro-batches on the last stage, and their reduction for the metrics row (``mtp_loss``)."""
from __future__ import annotations

import torch
import torch.distributed as dist


class MTPStats:
    """The chunk's MTP records: ``backward_scale`` (set with the MoE layers', before each schedule) and
    the step's sum of each depth's micro-batch losses (float64, on the device)."""

    def __init__(self, depths: int, device):
        self.depths, self.device, self.backward_scale = depths, torch.device(device), 1.0
        self.reset()

    def reset(self) -> None:
        self.losses = torch.zeros(self.depths, dtype=torch.float64, device=self.device)

    def record(self, depth: int, loss: torch.Tensor) -> None:
        self.losses[depth] += loss.detach().to(torch.float64)


def mtp_step_metrics(chunks, mesh, cfg, num_micro_batches: int) -> dict:
    """After a step: ``mtp_loss`` (the depths' mean) and ``mtp_<k>_loss`` per depth, each the mean over
    the step's micro-batches and data-parallel ranks.  Collective over the world (every rank calls it;
    ``{}`` at once without MTP)."""
    n = cfg.model.mtp_num_layers
    if not n:
        return {}
    total = torch.zeros(n, dtype=torch.float64, device=mesh.collective_device)
    owner = mesh.coord("tp") == 0 and mesh.coord("cp") == 0
    for chunk in chunks:
        mtp = getattr(chunk, "mtp", None)
        if mtp is not None:
            if owner:
                total += mtp.stats.losses.to(total.device)
            mtp.stats.reset()
    if mesh.world_size > 1:
        dist.all_reduce(total, group=mesh.world_group)
    total = (total / max(1, num_micro_batches * mesh.size("dp"))).tolist()
    out = {"mtp_loss": sum(total) / n}
    if n > 1:
        out.update({f"mtp_{k + 1}_loss": v for k, v in enumerate(total)})
    return out
