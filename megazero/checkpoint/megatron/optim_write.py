"""A converted Megatron-LM checkpoint with its optimizer: the weights (or the fp32 main weights) as
``master`` and Adam's moments as ``exp_avg`` / ``exp_avg_sq`` of the one-process shard, with the
metadata of a megazero checkpoint that holds optimizer state (Adam's, the step, the loss scale, the
schedule's settings).  ``--load`` then spreads them over any layout (TP, PP, DP, ZeRO 0-3, the
distributed optimizer's flat shards) exactly as it resumes megazero's own checkpoints."""
from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from megazero.checkpoint.format import layout_of
from megazero.checkpoint.names import is_expert, param_info, stored, writes
from megazero.checkpoint.shards import (BlockWriter, _refuse_nonfinite, _write_index, _write_ranges,
                                        shard_stem)
from megazero.checkpoint.writer import save_whole

PAD = 1 << 22  # zeros written at a time for the vocabulary padding


def _write_entry(writer, entries: list, params: dict, name: str, p, mesh, key: str, value) -> None:
    """``value`` (``p``'s unpadded values) as ``p``'s entry ``key``, the padding rows zero."""
    t = value.to("cpu", torch.float32).reshape(-1).contiguous()
    _refuse_nonfinite(t, [(name, p, 0, t.numel(), 0)], 0, key)
    if t.numel() > p.numel():
        raise ValueError(f"{name}: {t.numel()} values for a parameter of {p.numel()}")
    if is_expert(p):
        _write_ranges(writer, entries, name, p, p.shape, key, t, 0, mesh)
        params.update(stored(name, p, p.shape, mesh.coord("pp"), mesh))
        return
    start = writer.write(t.numpy())
    for pad in range(t.numel(), p.numel(), PAD):
        writer.write(np.zeros(min(PAD, p.numel() - pad), dtype=np.float32))
    entries.append([name, key, 0, p.numel(), start])
    params[name] = param_info(p, p.shape, mesh.coord("pp"))


def save_with_optimizer(directory: str, chunks, mesh, cfg, iteration: int, extra: dict, values, state,
                        moments, scheduler: dict) -> str:
    """Write ``chunks``' weights (``values(name, p)``) and Adam's moments (``moments(kind, name, p)``)
    as the checkpoint of ``iteration`` in ``directory`` (one process, the whole model); ``state``:
    the :class:`~megazero.checkpoint.megatron.optim_state.OptimizerState` (step, loss scale).
    Returns the checkpoint's path."""
    from megazero.checkpoint.format import named_params
    from megazero.checkpoint.megatron.optim_legacy import MOMENTS
    if mesh.is_distributed:
        raise ValueError("save_with_optimizer writes from one process")
    if os.path.isdir(directory):
        shutil.rmtree(directory)

    def write(tmp: str, run_id: str):
        stem = shard_stem(0, 0, 0)
        writer = BlockWriter(os.path.join(tmp, stem + ".bin"))
        entries, params = [], {}
        try:
            for name, p in named_params(chunks):
                if not writes(p, mesh):
                    continue
                _write_entry(writer, entries, params, name, p, mesh, "master", values(name, p))
                for kind in MOMENTS:
                    _write_entry(writer, entries, params, name, p, mesh, kind, moments(kind, name, p))
        finally:
            crcs = writer.close()
        files = _write_index(tmp, stem, writer, crcs, entries, mesh, run_id)
        adam = {"name": "adam", "state_names": sorted(MOMENTS), "step": int(state.step), "skipped_steps": 0,
                "scaler": state.scaler}
        # no run's layout equals it: Megatron's generators are not taken, a run reseeds from (seed, iteration)
        layout = dict(layout_of(cfg, mesh), converted_from="Megatron-LM")
        return files, params, dict(optimizer=adam, scheduler=dict(scheduler), layout=layout), {}
    return save_whole(directory, iteration, mesh, cfg, extra, write)
