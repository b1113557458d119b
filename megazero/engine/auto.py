"""``"auto"`` in a ds_config, resolved the way the Hugging Face integration fills it, or refused.

transformers' ``HfTrainerDeepSpeedConfig`` replaces each ``"auto"`` with a value of the
``TrainingArguments`` (batch sizes, clipping, the optimizer's and the scheduler's settings, fp16/bf16)
or of the model's config (bucket sizes from ``hidden_size``).  The engine does the same from what
``initialize`` is given: the ``args`` object when it carries the ``TrainingArguments`` field, the
model's ``config.hidden_size``, the optimizer's learning rate; the three batch keys left ``"auto"``
count as not given (DeepSpeed's batch rule then derives them from the others).  Anything else still
``"auto"`` is refused with a one-line :class:`~megazero.errors.ConfigError` naming the key and what
would resolve it.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

from megazero.errors import ConfigError

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
HIDDEN_KEYS = {"reduce_bucket_size": lambda h: h * h,
               "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
               "stage3_param_persistence_threshold": lambda h: 10 * h}


def hidden_size(model) -> Optional[int]:
    """The model's hidden size as the Hugging Face integration reads it (``config.hidden_size``, the
    largest of ``config.hidden_sizes``, or the same in ``config.text_config``), else None."""
    for cfg in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def _arg(args, name: str, key: str, what: str):
    """``args.name``, or a ConfigError naming ``key`` when ``args`` does not carry it."""
    if args is not None and getattr(args, name, None) is not None:
        return getattr(args, name)
    raise ConfigError(f"ds_config {key} is \"auto\" and nothing given to initialize() says {what} (the "
                      f"Hugging Face Trainer fills it from TrainingArguments.{name}); give a value")


def _warmup_steps(args, key: str, total: Optional[int]) -> int:
    if args is not None and callable(getattr(args, "get_warmup_steps", None)) and total:
        return max(1, int(args.get_warmup_steps(total)))
    return max(1, int(_arg(args, "warmup_steps", key, "the warm-up length")))


def _total_steps(args, key: str) -> int:
    steps = _arg(args, "max_steps", key, "the number of training steps")
    if int(steps) <= 0:
        raise ConfigError(f"ds_config {key} is \"auto\" and args.max_steps is {steps}: give the number of "
                          "training steps")
    return int(steps)


def _resolvers(args, model, lr: Optional[float]) -> Dict[str, Callable[[str], Any]]:
    """key path -> function(key) giving its value (may raise ConfigError naming the key)."""
    def optimizer_lr(key):
        return lr if lr is not None else _arg(args, "learning_rate", key, "the learning rate")

    def hidden(name):
        def resolve(key):
            h = hidden_size(model)
            if h is None:
                raise ConfigError(f"ds_config {key} is \"auto\" but the model has no config.hidden_size "
                                  "(the Hugging Face integration sizes it from that); give a number")
            return HIDDEN_KEYS[name](h)
        return resolve

    out = {
        "gradient_clipping": lambda k: float(_arg(args, "max_grad_norm", k, "the clipping norm")),
        "optimizer.params.lr": lambda k: float(_arg(args, "learning_rate", k, "the learning rate")),
        "optimizer.params.betas": lambda k: [float(_arg(args, "adam_beta1", k, "Adam's beta1")),
                                             float(_arg(args, "adam_beta2", k, "Adam's beta2"))],
        "optimizer.params.eps": lambda k: float(_arg(args, "adam_epsilon", k, "Adam's epsilon")),
        "optimizer.params.weight_decay": lambda k: float(_arg(args, "weight_decay", k, "the weight decay")),
        "scheduler.params.warmup_min_lr": lambda k: 0.0,  # not a Trainer argument: HF fills 0
        "scheduler.params.warmup_max_lr": optimizer_lr,
        "scheduler.params.total_num_steps": lambda k: _total_steps(args, k),
        "fp16.enabled": lambda k: bool(_arg(args, "fp16", k, "whether to train in fp16")
                                       or getattr(args, "fp16_full_eval", False)),
        "bf16.enabled": lambda k: bool(_arg(args, "bf16", k, "whether to train in bf16")
                                       or getattr(args, "bf16_full_eval", False)),
    }
    for name in HIDDEN_KEYS:
        out["zero_optimization." + name] = hidden(name)
    for name in BATCH_KEYS:
        attr = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                "gradient_accumulation_steps": "gradient_accumulation_steps"}.get(name)
        out[name] = (lambda k, a=attr: getattr(args, a, None)) if attr else (lambda k: None)
    return out


def _paths(tree: Dict[str, Any], prefix: str = "") -> List[str]:
    out = []
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _paths(v, path + ".")
        elif isinstance(v, str) and v == AUTO:
            out.append(path)
    return out


def resolve_auto(raw: Dict[str, Any], args=None, model=None, lr: Optional[float] = None) -> Dict[str, Any]:
    """A copy of ``raw`` with every ``"auto"`` replaced (see the module docstring); a batch key that
    stays unresolved is dropped (DeepSpeed's rule derives it)."""
    out = copy.deepcopy(raw)
    if lr is None:
        section = out.get("optimizer")
        given = section.get("params", {}).get("lr") if isinstance(section, dict) else None
        lr = None if given in (None, AUTO) else float(given)
    resolvers = _resolvers(args, model, lr)
    paths = sorted(_paths(out), key=lambda p: p != "optimizer.params.lr")  # the rate first: others use it
    total = None
    for path in paths:
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node[p]
        if path == "scheduler.params.warmup_num_steps":
            sched = out.get("scheduler", {}).get("params", {})
            t = sched.get("total_num_steps")
            total = t if isinstance(t, int) else (total or getattr(args, "max_steps", None))
            node[leaf] = _warmup_steps(args, path, total if total and total > 0 else None)
            continue
        if path not in resolvers:
            raise ConfigError(f"ds_config {path} is \"auto\", which only the Hugging Face integration "
                              "resolves for this key; give a value")
        value = resolvers[path](path)
        if path == "optimizer.params.lr":
            lr = float(value)
            resolvers = _resolvers(args, model, lr)
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return out
