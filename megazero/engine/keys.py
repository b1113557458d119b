"""The ds_config keys, section by section: what each becomes in megazero's config, which are accepted
without effect (named in the engine's notes) and which values are refused (one line naming the key).
Every number must be finite and in its range.  DeepSpeed's keys that megazero only accepts are in
:mod:`megazero.engine.ds_defaults`; see :mod:`megazero.engine.config` for the whole and docs/engine.md
for the table."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

from megazero.engine.ds_defaults import (BF16, OFFLOAD_OPTIMIZER, ZERO, ZERO_ALIASES, json_value,
                                         read_table, same_value)
from megazero.errors import ConfigError

ADAM_TYPES = ("adam", "adamw")
SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                       "warmup_type", "last_batch_iteration"),
}


class Reader:
    """Typed access to one section of a ds_config; every error names the key's full path."""

    def __init__(self, tree: Dict[str, Any], prefix: str, notes: Optional[List[str]] = None):
        self.tree, self.prefix = tree, prefix
        self.notes = notes if notes is not None else []

    def key(self, k: str) -> str:
        return self.prefix + k

    def __contains__(self, k: str) -> bool:
        return k in self.tree

    def only(self, known: Iterable[str]) -> None:
        """Refuse the first key that is not in ``known``."""
        known = set(known)
        for k in self.tree:
            if k not in known:
                raise ConfigError(f"ds_config: unknown key {self.key(k)!r}; megazero's engine reads only "
                                  "the keys docs/engine.md lists (remove it, or see there what replaces it)")

    def section(self, k: str) -> "Reader":
        value = self.tree.get(k)
        value = {} if value is None else value  # DeepSpeed's null: the section's defaults
        if not isinstance(value, dict):
            raise ConfigError(f"ds_config {self.key(k)} must be an object, got {value!r}")
        return Reader(value, self.key(k) + ".", self.notes)

    def get(self, k: str, default=None):
        return self.tree.get(k, default)

    def boolean(self, k: str, default: bool) -> bool:
        value = self.tree.get(k)
        value = default if value is None else value  # null: DeepSpeed's default (overlap_comm's is dynamic)
        if not isinstance(value, bool):
            raise ConfigError(f"ds_config {self.key(k)} must be true or false, got {value!r}")
        return value

    def number(self, k: str, default, minimum: Optional[float] = None, integer: bool = False,
               above: Optional[float] = None, below: Optional[float] = None, maximum: Optional[float] = None):
        """The finite number at ``k`` (``default`` when absent; None stays None) within ``minimum`` <=,
        ``above`` <, < ``below``, <= ``maximum``; else one line naming the key and the range."""
        value = self.tree.get(k, default)
        if value is None:
            return None
        bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        if not bad and integer:
            bad = float(value) != int(value)
            value = int(value)
        bad = bad or (minimum is not None and value < minimum) or (above is not None and value <= above) \
            or (below is not None and value >= below) or (maximum is not None and value > maximum)
        if bad:
            what = "an integer" if integer else "a finite number"
            bounds = ((">=", minimum), (">", above), ("<", below), ("<=", maximum))
            limits = [f"{op} {b:g}" for op, b in bounds if b is not None]
            raise ConfigError(f"ds_config {self.key(k)} must be {what}{' ' if limits else ''}"
                              f"{' and '.join(limits)}, got {json_value(self.tree.get(k))}")
        return value

    def pos_int(self, k: str, default) -> Optional[int]:
        return self.number(k, default, minimum=1, integer=True)

    def choice(self, k: str, default, choices: Tuple) -> Any:
        value = self.tree.get(k, default)
        if value not in choices:
            raise ConfigError(f"ds_config {self.key(k)} must be one of {', '.join(map(str, choices))}, "
                              f"got {value!r}")
        return value

    def fixed(self, k: str, value, why: str) -> None:
        """A key megazero implements at one value only: any other is refused."""
        if k in self.tree and self.tree[k] != value:
            raise ConfigError(f"ds_config {self.key(k)} = {self.tree[k]!r} is not supported ({why}); "
                              f"remove it or give {json_value(value)}")

    def accept(self, k: str, why: str, default=None) -> None:
        """A key that changes nothing in megazero: named in the notes when given, unless at DeepSpeed's
        ``default``."""
        if k in self.tree and (default is None or not same_value(self.tree[k], default)):
            self.notes.append(f"ds_config {self.key(k)}: accepted, {why}")


def read_precision(r: Reader, pre) -> None:
    """``fp16`` / ``bf16`` (``bfloat16``) into the precision section."""
    fp, bf = r.section("fp16"), r.section("bf16" if "bf16" in r else "bfloat16")
    fp.only(("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale", "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"))
    bf.only(("enabled", "immediate_grad_update", "check_grad_overflow") + tuple(BF16))
    pre.fp16, pre.bf16 = fp.boolean("enabled", False), bf.boolean("enabled", False)
    if pre.fp16 and pre.bf16:
        raise ConfigError("ds_config enables both fp16 and bf16; enable one")
    fp.fixed("consecutive_hysteresis", False, "the hysteresis refills only when the scale grows")
    fp.fixed("auto_cast", False, "inputs are passed to the model as given")
    fp.fixed("fp16_master_weights_and_grads", False, "master weights are fp32")
    bf.accept("immediate_grad_update", "gradients go to their fp32 buffers as they arrive", False)
    bf.accept("check_grad_overflow", "megazero skips any step whose gradients hold inf or NaN", True)
    read_table(bf, BF16)
    scale = fp.number("loss_scale", 0.0, minimum=0.0)
    pre.loss_scale = float(scale) if scale else None  # 0: dynamic
    pre.initial_loss_scale = 2.0 ** fp.number("initial_scale_power", 16, minimum=0, below=128, integer=True)
    pre.loss_scale_window = fp.pos_int("loss_scale_window", 1000)
    pre.hysteresis = fp.pos_int("hysteresis", 2)
    pre.min_loss_scale = float(fp.number("min_loss_scale", 1.0, minimum=0.0) or 1.0)


def _offload(r: Reader, stage: int) -> Tuple[str, Optional[str]]:
    device = r.choice("device", "none", ("none", "cpu", "nvme"))
    path = r.get("nvme_path")
    if device == "nvme" and not path:
        raise ConfigError(f"ds_config {r.key('device')} is nvme but {r.key('nvme_path')} is not given: "
                          "name a directory on a local disk")
    if device != "none" and stage == 0:
        raise ConfigError(f"ds_config {r.key('device')} = {device} needs zero_optimization.stage 1, 2 or 3")
    r.accept("pin_memory", "megazero pins its host buffers whenever the model is on a GPU", True)
    return device, (str(path) if path else None)


def _read_offload(z: Reader, par, device_type: str) -> None:
    oo, op = z.section("offload_optimizer"), z.section("offload_param")
    oo.only(("device", "nvme_path", "pin_memory", "buffer_count", "fast_init", "ratio")
            + tuple(OFFLOAD_OPTIMIZER))
    op.only(("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"))
    odev, opath = _offload(oo, par.zero_stage)
    pdev, ppath = _offload(op, par.zero_stage)
    par.offload_optimizer_device = odev
    par.optimizer_offload_fraction = float(oo.number("ratio", 1.0, minimum=0.0, maximum=1.0))
    par.nvme_buffer_count = oo.number("buffer_count", par.nvme_buffer_count, minimum=2, integer=True)
    oo.accept("fast_init", "the swap file is allocated at start-up", False)
    read_table(oo, OFFLOAD_OPTIMIZER)
    if pdev != "none" and par.zero_stage != 3:
        raise ConfigError(f"ds_config zero_optimization.offload_param.device = {pdev} needs "
                          f"zero_optimization.stage 3 (got {par.zero_stage})")
    if pdev == "cpu" and device_type == "cpu":
        z.notes.append("ds_config zero_optimization.offload_param.device cpu: the parameter shards already "
                       "live in host memory on a CPU run")
        pdev = "none"
    par.offload_param_device = pdev
    for k, default in (("buffer_count", 5), ("buffer_size", 100_000_000), ("max_in_cpu", 1_000_000_000)):
        op.accept(k, "megazero reads each unit's shard from NVMe one unit ahead, into its own buffer",
                  default)
    if opath and ppath and opath != ppath:
        raise ConfigError("ds_config offload_optimizer.nvme_path and offload_param.nvme_path differ; "
                          "megazero keeps both swap files in one directory: give the same path")
    par.nvme_path = opath or ppath


def _zero_spellings(z: Reader) -> Reader:
    """``zero_optimization`` with DeepSpeed's other spellings in the ones read below: the field names of
    the ``stage3_`` keys, and the deprecated ``cpu_offload`` / ``cpu_offload_param`` (true: the
    optimizer / the parameters offloaded to the CPU)."""
    tree = dict(z.tree)
    for short, name in ZERO_ALIASES.items():
        if short in tree:
            if name in tree:
                raise ConfigError(f"ds_config {z.key(short)} and {z.key(name)} are one setting; give one")
            tree[name] = tree.pop(short)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if tree.get(old) is not None and z.boolean(old, False):  # null: DeepSpeed's default
            if tree.get(new):
                raise ConfigError(f"ds_config {z.key(old)} is DeepSpeed's deprecated spelling of "
                                  f"{z.key(new)}.device cpu; give one of them")
            if new == "offload_param" and tree.get("stage", 0) != 3:
                raise ConfigError(f"ds_config {z.key(old)} = true (the parameters on the CPU) needs "
                                  f"{z.key('stage')} 3, got {tree.get('stage', 0)}")
            tree[new] = {"device": "cpu"}
            z.notes.append(f"ds_config {z.key(old)} = true: accepted, DeepSpeed's deprecated spelling of "
                           f"{z.key(new)}.device cpu")
        tree.pop(old, None)
    return Reader(tree, z.prefix, z.notes)


def read_zero(z: Reader, par, out, device_type: str) -> None:
    """``zero_optimization`` into the parallel section (and the engine's ZeRO-3 gather settings)."""
    z = _zero_spellings(z)
    z.only(("stage", "offload_optimizer", "offload_param", "overlap_comm", "contiguous_gradients",
            "reduce_bucket_size", "allgather_bucket_size", "reduce_scatter", "allgather_partitions",
            "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
            "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save", "sub_group_size") + tuple(ZERO))
    par.zero_stage = z.choice("stage", 0, (0, 1, 2, 3))
    read_table(z, ZERO)
    _read_offload(z, par, device_type)
    overlap = z.boolean("overlap_comm", par.zero_stage == 3)  # DeepSpeed's default
    par.overlap_grad_reduce = par.overlap_param_gather = overlap
    bucket = z.number("reduce_bucket_size", None, minimum=1, integer=True)
    gather = z.number("allgather_bucket_size", None, minimum=1, integer=True)
    par.ddp_bucket_size = bucket or gather
    if bucket and gather and bucket != gather:
        z.notes.append("ds_config zero_optimization.allgather_bucket_size: megazero's buckets serve the "
                       "reductions and the gathers alike; reduce_bucket_size sets both")
    if not z.boolean("contiguous_gradients", True):
        z.notes.append("ds_config zero_optimization.contiguous_gradients false: megazero always "
                       "keeps gradients in contiguous buffers")
    z.accept("reduce_scatter", "ZeRO 1-3 reduce-scatter the gradients, stage 0 all-reduces them", True)
    z.accept("allgather_partitions", "updated partitions are all-gathered per bucket", True)
    z.accept("stage3_max_reuse_distance", "a unit is freed after its forward and gathered again for its "
             "backward", 1_000_000_000)
    out.prefetch_numel = z.number("stage3_prefetch_bucket_size", 50_000_000, minimum=0, integer=True)
    out.max_live_numel = z.number("stage3_max_live_parameters", 1_000_000_000, minimum=0, integer=True)
    out.persistence_threshold = z.number("stage3_param_persistence_threshold", 100_000, minimum=0,
                                         integer=True)
    key = ("stage3_gather_16bit_weights_on_model_save" if "stage3_gather_16bit_weights_on_model_save" in z
           else "stage3_gather_fp16_weights_on_model_save")
    out.gather_16bit_on_save = z.boolean(key, False)
    groups = z.number("sub_group_size", None, minimum=1, integer=True)
    if groups is not None and "nvme" in (par.offload_optimizer_device,):
        # megazero's NVMe optimizer streams sub-groups that fill one buffer: fp32 master + two moments
        par.nvme_buffer_size = -(-groups * 12 // 4096) * 4096
    elif groups is not None and groups != 1_000_000_000:  # DeepSpeed's default: nothing to say
        z.notes.append("ds_config zero_optimization.sub_group_size: only used with the optimizer on NVMe")


def read_aio(a: Reader, par) -> None:
    """``aio`` (DeepSpeed's NVMe I/O) into the NVMe tunables."""
    a.only(("block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
            "overlap_events", "use_gds"))
    par.nvme_block_size = a.number("block_size", par.nvme_block_size, minimum=4096, integer=True)
    par.nvme_io_threads = a.pos_int("queue_depth", par.nvme_io_threads)
    for k in ("thread_count", "intra_op_parallelism"):
        a.accept(k, "megazero runs aio.queue_depth I/O threads, one request in flight each", 1)
    for k, default in (("single_submit", False), ("overlap_events", True)):
        a.accept(k, "megazero submits each request from its own I/O thread", default)
    a.fixed("use_gds", False, "GPUDirect Storage is not implemented")


def optimizer_section(r: Reader) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The ``optimizer`` section as ``("adam" | "sgd", settings)``, or None when absent."""
    if not r.tree:
        return None
    r.only(("type", "params", "legacy_fusion"))
    r.accept("legacy_fusion", "megazero's optimizers have one implementation each", False)
    kind = str(r.get("type", "")).lower()
    p = r.section("params")
    if "max_grad_norm" in p:
        p.number("max_grad_norm", None, minimum=0.0)
        p.notes.append("ds_config optimizer.params.max_grad_norm: ignored, as DeepSpeed ignores it; "
                       "gradient_clipping clips the gradients")
    if kind in ADAM_TYPES:
        p.only(("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad",
                "torch_adam", "max_grad_norm"))
        p.fixed("bias_correction", True, "Adam is bias-corrected")
        p.fixed("amsgrad", False, "AMSGrad is not implemented")
        p.accept("torch_adam", "megazero's Adam follows torch.optim.AdamW's arithmetic", False)
        wd = float(p.number("weight_decay", 0.0, minimum=0.0))
        if kind == "adam" and not p.boolean("adam_w_mode", True) and wd:
            raise ConfigError("ds_config optimizer.params.adam_w_mode false with weight_decay (L2 added to "
                              "the gradient) is not supported: megazero's Adam decays decoupled (AdamW)")
        betas = p.get("betas", [0.9, 0.999])
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ConfigError(f"ds_config optimizer.params.betas must be [beta1, beta2], got {betas!r}")
        pair = Reader({"betas[0]": betas[0], "betas[1]": betas[1]}, p.prefix)
        betas = [float(pair.number(k, None, minimum=0.0, below=1.0)) for k in ("betas[0]", "betas[1]")]
        return "adam", {"lr": float(p.number("lr", 1e-3, minimum=0.0)), "betas": betas,
                        "eps": float(p.number("eps", 1e-8, above=0.0)), "weight_decay": wd}
    if kind == "sgd":
        p.only(("lr", "momentum", "weight_decay", "dampening", "nesterov", "max_grad_norm"))
        p.fixed("dampening", 0, "SGD's momentum has no dampening")
        p.fixed("nesterov", False, "Nesterov momentum is not implemented")
        if "lr" not in p:
            raise ConfigError("ds_config optimizer.params.lr is required for SGD")
        return "sgd", {"lr": float(p.number("lr", None, minimum=0.0)),
                       "momentum": float(p.number("momentum", 0.0, minimum=0.0)),
                       "weight_decay": float(p.number("weight_decay", 0.0, minimum=0.0))}
    raise ConfigError(f"ds_config optimizer.type {r.get('type')!r} is not supported; megazero's engine "
                      "implements Adam, AdamW and SGD")


def scheduler_section(r: Reader) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The ``scheduler`` section as ``(type, params)``, or None when absent."""
    if not r.tree:
        return None
    r.only(("type", "params"))
    kind = r.get("type")
    if kind not in SCHEDULERS:
        raise ConfigError(f"ds_config scheduler.type {kind!r} is not supported; megazero's engine implements "
                          f"{', '.join(SCHEDULERS)}")
    p = r.section("params")
    p.only(SCHEDULERS[kind])
    if kind != "WarmupLR" and "total_num_steps" not in p:
        raise ConfigError(f"ds_config scheduler.params.total_num_steps is required for {kind}")
    if "warmup_type" in p:
        p.choice("warmup_type", "log", ("log", "linear"))
    for k in ("warmup_min_lr", "warmup_max_lr"):
        p.number(k, None, minimum=0.0)
    for k in ("warmup_min_ratio", "cos_min_ratio"):
        p.number(k, None, minimum=0.0, maximum=1.0)
    p.number("warmup_num_steps", None, minimum=0, integer=True)
    p.number("total_num_steps", None, minimum=1, integer=True)
    p.number("last_batch_iteration", None, minimum=-1, integer=True)
    return kind, dict(p.tree)
