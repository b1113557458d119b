"""Which parameters train, with which optimizer settings, and the optimizer object ``initialize``
returns.

The update itself is always megazero's ZeRO optimizer (:func:`megazero.zero.build_optimizer`), whose
flat AdamW and SGD act on this rank's shard.  What DeepSpeed lets the user give is read into it:

- a ``torch.optim`` optimizer (an instance, or a callable that builds one from the parameters):
  ``AdamW``, ``Adam`` (without weight decay, or with ``decoupled_weight_decay``) or ``SGD``; its
  param groups say which parameters train and their settings, and its ``param_groups`` stay the
  ones the learning rate is read from, so a scheduler built on it keeps working;
- else the ds_config ``optimizer`` section over ``model_parameters`` (parameters, or groups as dicts
  with their own ``weight_decay``), or over every parameter that requires a gradient.

Groups may differ in weight decay only between 0 and one value (the Hugging Face Trainer's "no decay
for biases and norms" groups): each parameter is marked ``apply_weight_decay``
(:func:`megazero.zero.update.decays`).  Other differences between groups are refused naming them.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from megazero.errors import ConfigError

SETTINGS = ("lr", "betas", "eps", "momentum")


def _groups_of(params) -> List[Dict[str, Any]]:
    """``model_parameters`` (or a torch optimizer's ``param_groups``) as a list of group dicts."""
    items = list(params)
    if not items:
        raise ConfigError("model_parameters is empty: pass model.parameters() or parameter groups")
    if all(isinstance(x, dict) for x in items):
        return [dict(g, params=list(g["params"])) for g in items]
    if any(isinstance(x, dict) for x in items):
        raise ConfigError("model_parameters mixes parameters and parameter groups; give one or the other")
    return [{"params": items}]


def _from_torch(opt: torch.optim.Optimizer) -> Tuple[str, Dict[str, Any]]:
    """``("adam" | "sgd", defaults)`` of a torch optimizer megazero can run, else ConfigError."""
    name, d = type(opt).__name__, opt.defaults
    for flag in ("amsgrad", "maximize", "nesterov", "capturable", "differentiable"):
        if d.get(flag):
            raise ConfigError(f"optimizer {name}({flag}=True) is not supported by megazero's engine")
    decoupled = d.get("decoupled_weight_decay") or not d.get("weight_decay")
    if isinstance(opt, torch.optim.AdamW) or (isinstance(opt, torch.optim.Adam) and decoupled):
        return "adam", {"lr": float(d["lr"]), "betas": [float(b) for b in d["betas"]], "eps": float(d["eps"]),
                        "weight_decay": float(d.get("weight_decay", 0.0))}
    if isinstance(opt, torch.optim.Adam):
        raise ConfigError("optimizer torch.optim.Adam with weight_decay (L2 added to the gradient) is not "
                          "supported: megazero's Adam decays decoupled; use torch.optim.AdamW")
    if isinstance(opt, torch.optim.SGD):
        if d.get("dampening"):
            raise ConfigError("optimizer SGD(dampening != 0) is not supported by megazero's engine")
        return "sgd", {"lr": float(d["lr"]), "momentum": float(d.get("momentum", 0.0)),
                       "weight_decay": float(d.get("weight_decay", 0.0))}
    raise ConfigError(f"optimizer {name} is not supported by megazero's engine: give torch.optim.AdamW, Adam "
                      "or SGD, or an optimizer section (Adam, AdamW, SGD) in the ds_config")


def _uniform(groups: List[Dict[str, Any]], kind: str, base: Dict[str, Any]) -> float:
    """Check the groups agree on everything but weight decay (0 or one value); returns that value."""
    decays = set()
    for i, g in enumerate(groups):
        for k in SETTINGS:
            if k in g and k in base and _value(g[k]) != _value(base[k]):
                raise ConfigError(f"parameter group {i} sets {k}={g[k]} but the others {base[k]}; megazero's "
                                  "engine trains every group with one setting (weight decay: 0 or one value)")
        decays.add(float(g.get("weight_decay", base.get("weight_decay", 0.0))))
    nonzero = decays - {0.0}
    if len(nonzero) > 1:
        raise ConfigError(f"parameter groups use weight decays {sorted(nonzero)}; megazero's engine allows 0 "
                          "and one other value")
    return nonzero.pop() if nonzero else 0.0


def _value(v):
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v)


def read_optimizer(model: torch.nn.Module, optimizer, model_parameters, section, cfg):
    """Decide the trained parameters and the optimizer settings; fill ``cfg.optimizer`` and mark
    every trained parameter's ``apply_weight_decay``.  Returns ``(param_groups, client)``: the groups
    whose ``lr`` the engine reads (the client optimizer's own list when one is given) and the client
    torch optimizer (or None)."""
    client = None
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        params = model_parameters if model_parameters is not None else \
            [p for p in model.parameters() if p.requires_grad]
        optimizer = optimizer(params)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable building one, got "
                              f"{type(optimizer).__name__}")
        if section is not None:
            raise ConfigError("an optimizer was given both to initialize() and in the ds_config 'optimizer' "
                              "section; give one")
        client = optimizer
        kind, base = _from_torch(optimizer)
        groups = optimizer.param_groups
    else:
        if section is None:
            raise ConfigError("no optimizer: give one to initialize(optimizer=...) or an 'optimizer' section "
                              "(Adam, AdamW or SGD) in the ds_config")
        kind, base = section
        source = model_parameters if model_parameters is not None else \
            [p for p in model.parameters() if p.requires_grad]
        groups = [dict(base, **g) for g in _groups_of(source)]
    wd = _uniform(groups, kind, base)
    _mark(model, groups, base)
    opt = cfg.optimizer
    opt.optimizer, opt.lr, opt.weight_decay = kind, float(groups[0].get("lr", base["lr"])), wd
    if kind == "adam":
        opt.adam_beta1, opt.adam_beta2 = base["betas"]
        opt.adam_eps = base["eps"]
    else:
        opt.sgd_momentum = base["momentum"]
    return groups, client


def _mark(model: torch.nn.Module, groups: List[Dict[str, Any]], base: Dict[str, Any]) -> None:
    """``apply_weight_decay`` on every trained parameter; trainable parameters of the model outside
    every group are refused (they would silently not train)."""
    trained = {}
    for g in groups:
        for p in g["params"]:
            trained[id(p)] = float(g.get("weight_decay", base.get("weight_decay", 0.0))) > 0.0
            p.apply_weight_decay = trained[id(p)]
    named = dict((id(p), n) for n, p in model.named_parameters())
    left = [named[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in trained]
    if left:
        raise ConfigError(f"model_parameters leaves out {len(left)} trainable parameters of the model (e.g. "
                          f"{left[0]}); pass model.parameters(), or set requires_grad=False on those")
    outside = [p for g in groups for p in g["params"] if id(p) not in named]
    if outside:
        raise ConfigError("the optimizer's parameters include tensors that are not parameters of the model")


class EngineOptimizer(torch.optim.Optimizer):
    """What ``initialize`` returns as the optimizer: DeepSpeed's meaning, a wrapper around the ZeRO
    optimizer whose ``param_groups`` hold the learning rate a scheduler sets (the client optimizer's
    own groups when one was given).  Call ``engine.step()``, not ``step()``, in a training loop: the
    engine applies the update at the gradient-accumulation boundary."""

    def __init__(self, groups: List[Dict[str, Any]], engine):
        defaults = {k: v for k, v in groups[0].items() if k != "params"}
        super().__init__([dict(g) for g in groups], defaults)
        self.param_groups = groups  # shared: a scheduler on the client optimizer drives these
        self.engine = engine

    def step(self, closure=None):
        """Apply the ZeRO update now (the engine calls this at the accumulation boundary)."""
        if closure is not None:
            raise ConfigError("optimizer.step(closure) is not supported; call engine.step()")
        return self.engine._apply_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @property
    def loss_scale(self) -> float:
        return self.engine.zero.loss_scale

    cur_scale = loss_scale

    def state_dict(self):
        raise NotImplementedError("the optimizer state is sharded over the data-parallel ranks: save it with "
                                  "engine.save_checkpoint(dir)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("load the optimizer state with engine.load_checkpoint(dir)")


def check_one_schedule(scheduler, groups: List[Dict[str, Any]]) -> None:
    """Refuse, before training, a learning-rate scheduler that would move the parameter groups' rates
    apart (the engine applies one rate to every group): per-group functions (``LambdaLR`` with a list),
    a per-group list of settings (``max_lrs``, ``min_lrs``, ...) whose entries differ, or schedule keys
    it wrote into the groups (``max_lr``, ``initial_lr``, ...) that differ."""
    if scheduler is None or len(groups) < 2:
        return
    name = type(scheduler).__name__
    for attr, value in vars(scheduler).items():
        if attr == "optimizer" or not isinstance(value, (list, tuple)) or len(value) != len(groups):
            continue
        same = (all(v is value[0] for v in value) if callable(value[0])
                else all(_comparable(v) == _comparable(value[0]) for v in value))
        if not same:
            raise ConfigError(f"lr_scheduler {name} gives the {len(groups)} parameter groups different "
                              f"schedules ({attr} differs between groups); megazero's engine applies one "
                              "learning rate to every group: give every group the same schedule")
    for key in sorted({k for g in groups for k in g} - {"params", "weight_decay", "name"}):
        values = [_comparable(g.get(key)) for g in groups]
        if any(v != values[0] for v in values):
            raise ConfigError(f"the parameter groups differ in {key!r} ({values}) under lr_scheduler {name}; "
                              "megazero's engine applies one learning rate to every group")


def _comparable(v):
    try:
        return _value(v)
    except (TypeError, ValueError):
        return repr(v)


def current_lr(groups: List[Dict[str, Any]]) -> float:
    """The learning rate of the next update: every group's must agree."""
    rates = {float(g["lr"]) for g in groups}
    if len(rates) > 1:
        raise ConfigError(f"the parameter groups' learning rates differ ({sorted(rates)}); megazero's engine "
                          "applies one rate to every group")
    return rates.pop()
