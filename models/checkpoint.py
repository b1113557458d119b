"""A whole model from a training checkpoint written under any layout, for export and generation.

``load_model(directory, iteration=None, mesh=None)`` builds the model of the saving run's
architecture (``config.json``) with pp = 1 at this mesh's TP size (one process by default) and
loads the checkpoint's master weights into it (in fp32, in eval mode).
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Dict, Optional, Tuple

from megazero.config import ModelConfig, MoEConfig, config_from_dict, validate
from megazero.mesh import ParallelMesh
from .gpt import GPTModel, load_full_state_dict

NO_RECOMPUTE = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)


def model_settings(saved_config: Dict[str, Any]) -> Dict[str, Any]:
    """The ModelConfig (and MoEConfig) settings of a saved configuration (``config.json`` of a
    checkpoint), without the derived ones, the expert-parallel sizes (one process by default) and
    recomputation (inference needs none)."""
    out = {}
    for section, cls in (("model", ModelConfig), ("moe", MoEConfig)):
        derived = {f.name for f in fields(cls) if f.metadata.get("derived")}
        known = {f.name for f in fields(cls)} - derived - {"expert_model_parallel_size",
                                                           "expert_tensor_parallel_size"}
        out.update({k: v for k, v in saved_config.get(section, {}).items() if k in known})
    return dict(out, **NO_RECOMPUTE)


def load_model(directory: str, iteration: Optional[int] = None, mesh: Optional[ParallelMesh] = None,
               flag: str = "--load") -> Tuple[GPTModel, Dict[str, Any]]:
    """``(model, info)``: the checkpoint's weights in a whole model (this rank's TP shard; every TP
    rank calls it).  ``info``: ``path``, ``iteration``, ``config`` (the saving run's, a dict) and
    ``notes`` (why that checkpoint is not the newest in ``directory``, when it is not)."""
    from megazero.checkpoint import read_weights
    from . import build_model
    mesh = mesh or ParallelMesh.single()
    notes: list = []
    path, meta, saved, weights = read_weights(directory, iteration, flag, notes)
    settings = dict(model_settings(saved), tensor_model_parallel_size=mesh.size("tp"),
                    pipeline_model_parallel_size=1, seed=saved.get("training", {}).get("seed", 1234))
    moe_tp = bool(settings.get("num_experts")) and mesh.size("tp") > 1
    if moe_tp:  # the mesh's expert layout; validated as training would run it (MoE under TP: with SP)
        settings.update(expert_model_parallel_size=mesh.size("ep"),
                        expert_tensor_parallel_size=mesh.size("etp"), sequence_parallel=True)
    cfg = validate(config_from_dict(settings), mesh.world_size, check_data=False)
    if moe_tp:  # generation runs forward only, the whole sequence on every TP rank (models/moe.py)
        cfg = replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=False))
    model = build_model(cfg, mesh)
    load_full_state_dict(model, weights)
    model.eval()
    return model, {"path": path, "iteration": int(meta["iteration"]), "config": saved, "notes": notes}
