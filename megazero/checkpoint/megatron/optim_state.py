"""The optimizer state of a Megatron-LM checkpoint: Adam's moments, its step and (mixed precision) the
fp32 main weights, per Megatron-core tensor, so that :mod:`~.convert` writes them next to the weights.

Where Megatron-LM keeps them (its non-distributed optimizer: ``FP32Optimizer`` for fp32 weights,
``Float16OptimizerWithFloat16Params`` for bf16/fp16 ones; and the ``DistributedOptimizer`` saved in the
model's space)::

    torch_dist   optimizer.state.exp_avg.<model key>, optimizer.state.exp_avg_sq.<model key>
                 (sharded as the weight <model key>, stacked over layers as it is),
                 optimizer.state.fp32_param.<model key> (mixed precision); common.pt's
                 optimizer.state.common_step and optimizer.param_groups (betas, eps)
    torch        each mp_rank_*/model_optim_rng.pt's "optimizer": torch's optimizer.state_dict()
                 (state by index; mixed precision wraps it as {"optimizer": ..., "grad_scaler": ...,
                 "fp32_from_fp16_params": [[...]]}); the index is the parameter's place in its group
                 (Megatron-core's groups: weights with weight decay, then biases and 1-D parameters
                 without, each in the model's parameter order), checked against every state's shape
    distributed  torch_dist ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``):
                 optimizer.state.{exp_avg,exp_avg_sq,param}.<model key> as above (``param``: the fp32
                 main weights), the step in common.pt's optimizer.optimizer.param_groups

:class:`StateView` shows one kind of state with a checkpoint's interface (``has``/``tensor``), so the
weights' name mapping (:class:`~megazero.checkpoint.megatron.mapping.NameMap`) maps it unchanged; the
legacy files' states are named in :mod:`~.optim_legacy`.
The distributed optimizer's bucket-space formats (torch_dist ``dp_reshardable``: flat buffers in the
saving run's DDP bucket layout, one set per TP/PP domain; legacy ``distrib_optim.pt``, per rank) are
read by :mod:`~.optim_distrib`; ``dp_zero_gather_scatter`` is refused by name (``--no-load-optim``).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError
from megazero.checkpoint.megatron import optim_distrib
from megazero.checkpoint.megatron.optim_legacy import FRESH, MAIN, MOMENTS, LegacyOptimizer, unwrap

MAINS = (MAIN, "param")  # the fp32 main weights: the mixed-precision optimizer's, the distributed one's
MODEL_SPACE = ("fully_sharded_model_space", "fully_reshardable")  # the distributed optimizer's, read here
BUCKET_SPACE = "dp_reshardable"  # its bucket-space format read by optim_distrib
PREFIX = "optimizer.state."


class StateView:
    """Optimizer state ``kind`` of a :class:`~megazero.checkpoint.megatron.files.MegatronCheckpoint`
    under the weights' names (whole tensors, float32)."""

    def __init__(self, ck, kind: str, legacy: Optional[LegacyOptimizer] = None):
        self.ck, self.kind, self.legacy = ck, kind, legacy
        self.format, self.directory, self.path = ck.format, ck.directory, ck.path

    def has(self, name: str) -> bool:
        if self.legacy is not None:
            return self.ck.has(name)
        return self.ck.has(f"{PREFIX}{self.kind}.{name}")

    def tensor(self, name: str, glu: bool = False, layer: Optional[int] = None) -> torch.Tensor:
        if self.legacy is not None:
            return self.ck.tensor(name, glu=glu, fetch=self.legacy.fetcher(self.kind))
        try:
            return self.ck.tensor(f"{PREFIX}{self.kind}.{name}", layer=layer)
        except CheckpointCorrupt as err:  # a chunk of the optimizer's state missing or damaged
            raise CheckpointCorrupt(f"{err}{FRESH}") from None


def _step_of(value) -> Optional[int]:
    if value is None:
        return None
    return int(value.item() if torch.is_tensor(value) else value)


class OptimizerState:
    """What a Megatron-LM checkpoint holds of its optimizer: :attr:`kinds` (the moments, and
    ``fp32_param`` when stored), :attr:`step`, :attr:`groups` (the parameter groups' hyperparameters),
    :attr:`scaler` (megazero's loss-scaler state) and :meth:`view`."""

    def __init__(self, ck, kinds: List[str], step: int, groups: list, scaler: dict, legacy=None,
                 buckets=None):
        self.ck, self.kinds, self.step, self.groups, self.scaler = ck, kinds, step, groups, scaler
        self.legacy, self.buckets = legacy, buckets

    def view(self, kind: str) -> StateView:
        if self.buckets is not None:  # torch_dist dp_reshardable
            return self.buckets.view(kind)
        return StateView(self.ck, kind, self.legacy)


def _scaler_of(saved) -> dict:
    """megazero's loss-scaler state for Megatron's ``grad_scaler`` (fp16) or none (a scale of 1)."""
    if not isinstance(saved, dict) or "scale" not in saved:
        return {"scale": 1.0, "dynamic": False}
    scale = saved["scale"]
    return {"scale": float(scale.item() if torch.is_tensor(scale) else scale), "dynamic": True,
            "growth_tracker": int(saved.get("growth_tracker", 0)),
            "hysteresis_tracker": int(saved.get("hysteresis_tracker", 1))}


def _refuse_distributed(ck) -> None:
    """The distributed optimizer's format megazero does not read: torch_dist's
    ``dp_zero_gather_scatter`` (``optimizer.distributed.*`` buffers gathered over the data-parallel
    ranks); ``dp_reshardable`` is read (:mod:`~.optim_distrib`)."""
    if ck.format == "torch":
        return
    kind = (ck.state.get("optimizer") or {}).get("param_state_sharding_type") \
        if isinstance(ck.state.get("optimizer"), dict) else None
    names = [n for n in ck.meta.state_dict_metadata if n.startswith("optimizer.distributed.")
             and (kind != BUCKET_SPACE or not _bucket_name(n))]
    if names or kind not in (None, BUCKET_SPACE) + MODEL_SPACE:
        raise CheckpointError(f"--load {ck.directory}: the distributed optimizer's state is saved as "
                              f"{kind or 'dp_reshardable'} ({(names or ['?'])[0]}), which megazero does not "
                              "read (save it with --dist-ckpt-optim-fully-reshardable)" + FRESH)


def _bucket_name(name: str) -> bool:
    """One of ``dp_reshardable``'s items: a bucket's buffer, its sizes or its parameter groups."""
    return bool(optim_distrib.DIST.match(name)) or name.split("/")[0].rsplit(".", 1)[-1] in (
        "optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")


def _distributed_state(ck) -> Optional[OptimizerState]:
    """The distributed optimizer's bucket-space state (None when ``ck`` holds none)."""
    kinds = list(MOMENTS) + ["param"]
    if ck.format == "torch_dist":
        if not any(optim_distrib.DIST.match(n) for n in ck.shapes):
            return None
        step, groups = optim_distrib.dist_step_and_groups(ck)
        common = ck.state.get("optimizer") if isinstance(ck.state.get("optimizer"), dict) else {}
        return _checked(ck, kinds, step, groups, common.get("grad_scaler"),
                        buckets=optim_distrib.DistTorchBuckets(ck))
    if not optim_distrib.has_legacy_files(ck):
        return None
    step, groups = optim_distrib.legacy_step_and_groups(ck)
    saved = ck._rank(0, 0).get("optimizer")
    scaler = saved.get("grad_scaler") if isinstance(saved, dict) else None
    return _checked(ck, kinds, step, groups, scaler, optim_distrib.LegacyBuckets(ck))


def optimizer_state(ck) -> Optional[OptimizerState]:
    """The optimizer state of ``ck`` (None when it stores none: Megatron-LM's ``--no-save-optim``)."""
    _refuse_distributed(ck)
    distributed = _distributed_state(ck)
    if distributed is not None:
        return distributed
    if ck.format == "torch_dist":
        kinds = [k for k in MOMENTS + MAINS if any(n.startswith(f"{PREFIX}{k}.") for n in ck.shapes)]
        common = ck.state.get("optimizer")
        if not kinds and not isinstance(common, dict):
            return None
        common = common if isinstance(common, dict) else {}
        inner = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else common
        groups = inner.get("param_groups") or []
        step = _step_of((inner.get("state") or {}).get("common_step"))
        if step is None:  # the distributed optimizer: in every parameter group
            step = next((_step_of(g["step"]) for g in groups if g.get("step") is not None), None)
        return _checked(ck, kinds, step, groups, common.get("grad_scaler"))
    rank = ck._rank(0, 0)
    if not isinstance(rank.get("optimizer"), dict):
        others = [f for key, f in sorted(ck._files.items()) if key != (0, 0)
                  and isinstance(ck._rank(*key).get("optimizer"), dict)]
        if others:
            raise CheckpointError(f"{ck._files[(0, 0)]}: holds no optimizer state ({others[0]} does)" + FRESH)
        return None
    legacy = LegacyOptimizer(ck)
    first = legacy.rank_state(0, 0)
    kinds = [k for k in MOMENTS + (MAIN,) if any(k in s for s in first.values())]
    steps = {_step_of(s.get("step")) for s in first.values()} - {None}
    groups = unwrap(rank["optimizer"])[0]["param_groups"]
    return _checked(ck, kinds, max(steps) if steps else None, groups,
                    rank["optimizer"].get("grad_scaler"), legacy)


def _checked(ck, kinds, step, groups, scaler, legacy=None, buckets=None) -> OptimizerState:
    missing = [k for k in MOMENTS if k not in kinds]
    if missing:
        raise CheckpointError(f"--load {ck.directory}: the optimizer state has no {missing[0]} (Adam's "
                              "moments are read)" + FRESH)
    if step is None:
        raise CheckpointError(f"--load {ck.directory}: the optimizer state records no step" + FRESH)
    return OptimizerState(ck, kinds, step, groups, _scaler_of(scaler), legacy, buckets)


def check_hyperparameters(state: OptimizerState, opt_cfg, directory: str) -> None:
    """Megatron-LM resumes with the checkpoint's Adam betas and eps (torch's ``load_state_dict``);
    megazero with this run's: they must agree."""
    if opt_cfg.optimizer != "adam":
        raise CheckpointError(f"--load {directory}: the Megatron-LM checkpoint holds Adam's state but this "
                              f"run uses --optimizer {opt_cfg.optimizer}; pass --optimizer adam" + FRESH)
    for group in state.groups[:1]:
        betas, eps = group.get("betas"), group.get("eps")
        mine = (opt_cfg.adam_beta1, opt_cfg.adam_beta2)
        if betas is not None and tuple(float(b) for b in betas) != mine:
            raise CheckpointError(f"--load {directory}: the Megatron-LM optimizer's betas are "
                                  f"{tuple(betas)}, "
                                  f"this run's {mine}; pass --adam-beta1 {betas[0]} --adam-beta2 {betas[1]}")
        if eps is not None and float(eps) != opt_cfg.adam_eps:
            raise CheckpointError(f"--load {directory}: the Megatron-LM optimizer's eps is {eps}, this run's "
                                  f"{opt_cfg.adam_eps}; pass --adam-eps {eps}")


def scheduler_fields(ck) -> dict:
    """megazero's schedule settings Megatron-LM's scheduler state and arguments fix (checked at
    ``--load`` as megazero checks its own, unless ``--override-opt-param-scheduler``)."""
    sched = ck.state.get("opt_param_scheduler") or {}
    out = {}
    if isinstance(sched, dict):
        for mine, theirs in (("lr", "max_lr"), ("min_lr", "min_lr"), ("lr_decay_style", "lr_decay_style")):
            if sched.get(theirs) is not None:
                out[mine] = sched[theirs] if mine == "lr_decay_style" else float(sched[theirs])
    args = vars(ck.args) if ck.args is not None else {}
    for k in ("lr_warmup_iters", "lr_decay_iters", "lr_warmup_samples", "lr_decay_samples"):
        if args.get(k):
            out[k] = int(args[k])
    return out


def _want(name: str, p, vocab: int) -> tuple:
    if name in ("word_embeddings.weight", "output_layer.weight"):
        return (vocab,) + tuple(p.shape[1:])
    return tuple(p.shape)


def write_with_optimizer(ck, state: OptimizerState, dst: str, chunks, whole, values, opt_cfg) -> str:
    """:func:`~.convert.convert`'s output with the optimizer: ``values(name, p)`` the checked weights;
    the fp32 main weights replace them where stored; ``opt_cfg``: the run's optimizer settings.  Every
    state is found and checked before anything is written."""
    from megazero.checkpoint.megatron.files import trainer_extra
    from megazero.checkpoint.megatron.mapping import NameMap
    from megazero.checkpoint.megatron.optim_write import save_with_optimizer
    from megazero.mesh import ParallelMesh
    check_hyperparameters(state, opt_cfg, ck.directory)
    one_p = bool(ck.args is not None and getattr(ck.args, "apply_layernorm_1p", False))
    maps = {k: NameMap(state.view(k), whole, layernorm_1p=one_p and k in MAINS) for k in state.kinds}
    main = next((k for k in MAINS if k in state.kinds), None)
    vocab = whole.model.vocab_size

    def get(kind: str, name: str, p) -> torch.Tensor:
        t = maps[kind].tensor(name)
        if tuple(t.shape) != _want(name, p, vocab):
            raise CheckpointError(f"--load {ck.directory}: the optimizer's {kind} of "
                                  f"{maps[kind].source(name)} "
                                  f"is {tuple(t.shape)}, the weight {_want(name, p, vocab)}" + FRESH)
        return t
    named = [(n, p) for c in ([chunks] if isinstance(chunks, torch.nn.Module) else chunks)
             for n, p in c.named_parameters()]
    for name, _ in named:  # every state is there before anything is written
        for kind in list(MOMENTS) + ([main] if main else []):
            if maps[kind].source(name) is None:
                raise CheckpointError(f"--load {ck.directory}: the Megatron-LM optimizer state holds no "
                                      f"{kind} "
                                      f"for megazero's {name}" + FRESH)

    def master(name, p):
        w = values(name, p)
        return get(main, name, p) if main is not None else w
    return save_with_optimizer(dst, chunks, ParallelMesh.single(), whole, ck.iteration, trainer_extra(ck),
                               master, state, lambda kind, name, p: get(kind, name, p), scheduler_fields(ck))
