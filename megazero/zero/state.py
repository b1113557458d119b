"""Optimizer state for checkpoints: layout-free per parameter, or this rank's shard as is.

:func:`param_states` gathers, bucket by bucket, every parameter's full fp32 master weight and
moments (collective over DP); :func:`load_param_states` keeps this rank's slice under any stage
and DP size, so checkpoints reshard.  :func:`shard_state_dict` / :func:`load_shard_state_dict`
save and load this rank's shard unchanged, for the same stage, DP size and bucket layout only.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from megazero.distributed import all_gather_single, gather
from megazero.zero.buffers import Bucket

FORMAT = "megazero-zero-v1"


def _full_bucket(opt, b: Bucket, shard: torch.Tensor, dst: Optional[int]) -> Optional[torch.Tensor]:
    """A whole bucket's fp32 values from each rank's updated slice (collective over DP): on every DP
    rank (``dst`` None, an all-gather) or on DP rank ``dst`` only (a gather; None elsewhere)."""
    mesh = opt.mesh
    receives = dst is None or dst == mesh.dp_rank
    shard = shard.detach().to(mesh.device, torch.float32)
    if opt.storage.updated_range(b) == (0, b.numel):  # stage 0 or one DP rank: the whole bucket is here
        return shard.clone() if receives else None
    full = torch.empty(b.numel, dtype=torch.float32, device=mesh.device) if receives else None
    if dst is None:
        all_gather_single(full, shard.contiguous(), group=mesh.dp_group)
    else:
        gather(shard.contiguous(), list(full.chunk(mesh.dp_size)) if receives else None, mesh.dp_group, dst)
    return full


def param_states(opt, dst: Optional[int] = None) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
    """Every parameter's full fp32 ``master`` weight and optimizer moments (CPU tensors of the
    parameter's shape) plus ``step``; on DP rank ``dst`` only (the others get ``{}`` and never hold
    a copy: one bucket at a time is gathered to it), or on every DP rank when ``dst`` is None."""
    update = opt.update
    out: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
    for b in opt.buckets:
        fulls = {"master": _full_bucket(opt, b, update.master[b.index], dst)}
        fulls.update({k: _full_bucket(opt, b, v, dst) for k, v in update.state[b.index].items()})
        if fulls["master"] is None:
            continue
        for p, s, shape in zip(b.params, b.starts, b.shapes):
            out[p] = {k: v[s:s + shape.numel()].view(shape).to("cpu", copy=True) for k, v in fulls.items()}
            out[p]["step"] = torch.tensor(opt.step_count)
        del fulls
    return out


def load_param_states(opt, states: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]) -> None:
    """Inverse of :func:`param_states` under any layout: keep this rank's slice; parameters follow."""
    update = opt.update
    for b in opt.buckets:
        lo, hi = opt.storage.updated_range(b)
        for key in ("master",) + tuple(update.state[b.index]):
            full = torch.zeros(b.numel, dtype=torch.float32)
            for p, s, shape in zip(b.params, b.starts, b.shapes):
                if p not in states or key not in states[p]:
                    raise ValueError(f"optimizer state for a parameter of shape {tuple(shape)} lacks {key!r}")
                full[s:s + shape.numel()] = states[p][key].reshape(-1).float()
            target = update.master[b.index] if key == "master" else update.state[b.index][key]
            target.copy_(full[lo:hi])
        opt.publish_params(b)
    steps = {int(st["step"]) for st in states.values() if "step" in st}
    if steps:
        opt.step_count = steps.pop()


def _layout(opt):
    return [b.signature() for b in opt.buckets]


def shard_state_dict(opt) -> Dict[str, object]:
    """This rank's optimizer shard (master weights, moments, step, loss scaler)."""
    update = opt.update
    return {"format": FORMAT, "zero_stage": opt.stage, "dp_size": opt.mesh.dp_size, "dp_rank": opt.mesh.dp_rank,
            "optimizer": opt.cfg.optimizer.optimizer, "layout": _layout(opt),
            "step": opt.step_count, "skipped_steps": opt.skipped_steps, "scaler": opt.scaler.state_dict(),
            "master": [update.master[b.index].detach().cpu().clone() for b in opt.buckets],
            "state": [{k: v.cpu().clone() for k, v in update.state[b.index].items()} for b in opt.buckets]}


def load_shard_state_dict(opt, sd: Dict[str, object]) -> None:
    """Load a shard saved by :func:`shard_state_dict` under the same stage, DP size and layout."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise ValueError("not a megazero ZeRO optimizer state dict (missing format tag)")
    mine = (opt.stage, opt.mesh.dp_size, opt.mesh.dp_rank, opt.cfg.optimizer.optimizer)
    saved = (sd["zero_stage"], sd["dp_size"], sd["dp_rank"], sd["optimizer"])
    if mine != saved or sd["layout"] != _layout(opt):
        what = ("the bucket layout (model shapes or --ddp-bucket-size) differs"
                if mine == saved else f"saved with (zero stage, DP size, DP rank, optimizer) = {saved}")
        raise ValueError(
            f"cannot load this optimizer state: {what}, but this run has {mine}. Load a checkpoint "
            "written under the same --zero-stage, data-parallel size and model, or reshard it through "
            "the per-parameter state (param_states / load_param_states)")
    update = opt.update
    for b, master, state in zip(opt.buckets, sd["master"], sd["state"]):
        update.master[b.index].copy_(master)
        for k, v in state.items():
            update.state[b.index][k].copy_(v)
        opt.publish_params(b)
    opt.step_count, opt.skipped_steps = sd["step"], sd["skipped_steps"]
    opt.scaler.load_state_dict(sd["scaler"])
