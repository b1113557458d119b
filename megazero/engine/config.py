"""A DeepSpeed ``ds_config`` (dict or JSON file) read into megazero's config sections.

Every key is one of three kinds (docs/engine.md lists them):

- *supported*: read into a :class:`~megazero.config.MegazeroConfig` section (``parallel``:
  ``zero_optimization``, the offload tiers, ``aio``; ``precision``: ``fp16``/``bf16``;
  ``optimizer``: the ``optimizer`` section and ``gradient_clipping``; ``training``: the batch keys)
  or into :class:`EngineConfig` (what only the engine uses: printing, the scheduler, the ZeRO-3
  gather settings);
- *accepted*: a key at DeepSpeed's default, or whose value changes nothing in megazero (a DeepSpeed
  implementation choice, a monitor, a deprecated spelling, a section switched off); silently at the
  default, else named with its meaning in ``notes``, which the engine prints once
  (:mod:`megazero.engine.ds_defaults` has the tables);
- anything else: a :class:`~megazero.errors.ConfigError` naming the key, one line.  A key with a value
  megazero does not implement is refused the same way, naming key, value and the value supported.

Numbers must be finite and in range (NaN and inf are refused, naming the key), and a JSON file must
not repeat a key (DeepSpeed's rule).

``"auto"`` values are resolved first (:mod:`megazero.engine.auto`).  The batch keys follow
DeepSpeed's rule: any two determine the third, ``train_batch_size = micro x accumulation x DP``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from megazero.config.sections import MegazeroConfig
from megazero.engine.auto import resolve_auto
from megazero.engine.ds_defaults import (ACTIVATION_CHECKPOINTING, CHECKPOINT, DATA_TYPES, SWITCHED, TOP,
                                         read_switched, read_table)
from megazero.engine.keys import (Reader, optimizer_section, read_aio, read_precision, read_zero,
                                  scheduler_section)
from megazero.errors import ConfigError

SECTIONS = {"activation_checkpointing": ACTIVATION_CHECKPOINTING, "checkpoint": CHECKPOINT,
            "data_types": DATA_TYPES}
TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "fp16", "bf16", "bfloat16",
            "zero_optimization", "optimizer", "scheduler", "aio", "dataloader_drop_last", "timers") + \
    tuple(TOP) + tuple(SWITCHED) + tuple(SECTIONS)


@dataclass
class EngineConfig:
    """A ds_config, read (see the module docstring).  ``megazero`` holds the sections the shared
    ZeRO, precision, offload and checkpoint code reads; the rest is the engine's own."""
    megazero: MegazeroConfig
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    optimizer: Optional[Tuple[str, Dict[str, Any]]] = None  # ("adam" | "sgd", params) from the file
    scheduler: Optional[Tuple[str, Dict[str, Any]]] = None  # (type, params)
    prefetch_numel: Optional[int] = None          # stage3_prefetch_bucket_size
    max_live_numel: Optional[int] = None          # stage3_max_live_parameters
    persistence_threshold: int = 100_000          # stage3_param_persistence_threshold
    gather_16bit_on_save: bool = False            # stage3_gather_16bit_weights_on_model_save
    drop_last: bool = False
    raw: Dict[str, Any] = field(default_factory=dict)  # the ds_config with "auto" resolved
    notes: List[str] = field(default_factory=list)


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs):
    """json's object_pairs_hook: an object that repeats a key is refused (DeepSpeed's rule), not read as
    its last value."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def load_ds_config(config) -> Dict[str, Any]:
    """The ds_config as a dict: ``config`` is a dict (copied) or the path of a JSON file (a key repeated
    within one object is an error, as in DeepSpeed)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as fh:
                out = json.load(fh, object_pairs_hook=_no_duplicates)
        except OSError as err:
            raise ConfigError(f"ds_config {config}: cannot read it ({err.strerror or err})") from None
        except _DuplicateKey as err:
            raise ConfigError(f"ds_config {config}: the key {err.args[0]!r} appears twice in one object "
                              "(DeepSpeed refuses duplicate keys); keep one") from None
        except ValueError as err:
            raise ConfigError(f"ds_config {config}: not valid JSON ({err})") from None
        if not isinstance(out, dict):
            raise ConfigError(f"ds_config {config}: must hold a JSON object, got {type(out).__name__}")
        return out
    raise ConfigError(f"config must be a dict or the path of a ds_config.json, got {type(config).__name__}")


def _batch(r: Reader, dp: int) -> Tuple[int, int, int]:
    """DeepSpeed's rule for the three batch keys (any two determine the third)."""
    tb, mb, ga = (r.pos_int(k, None) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps"))
    if tb is None and mb is None:
        raise ConfigError("ds_config needs train_batch_size or train_micro_batch_size_per_gpu "
                          "(the batch of one optimizer step, or of one rank's forward)")
    if mb is None:
        ga = ga or 1
        mb = tb // (dp * ga)
    elif tb is None:
        ga = ga or 1
        tb = mb * ga * dp
    elif ga is None:
        ga = tb // (mb * dp)
    if mb < 1 or ga < 1 or tb != mb * ga * dp:
        raise ConfigError(f"ds_config batch sizes disagree: train_batch_size {tb} must equal "
                          f"train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {ga} x "
                          f"data-parallel size {dp}")
    return tb, mb, ga


def read_config(config, dp: int, device_type: str = "cpu", args=None, model=None,
                lr: Optional[float] = None) -> EngineConfig:
    """Read ``config`` (dict or path) for ``dp`` data-parallel ranks on ``device_type``; ``args`` and
    ``model`` resolve ``"auto"`` (:mod:`megazero.engine.auto`), as does ``lr`` (a client
    optimizer's learning rate).  Raises :class:`ConfigError` naming the key."""
    raw = load_ds_config(config)
    types = raw.get("data_types") if isinstance(raw.get("data_types"), dict) else {}
    keep = types.pop("keep_in_fp32_modules", None)  # DeepSpeed's own default is the word "auto"
    raw = resolve_auto(raw, args, model, lr)
    if keep is not None:
        raw["data_types"]["keep_in_fp32_modules"] = keep
    r = Reader(raw, "")
    r.only(TOP_KEYS)
    r.number("gradient_predivide_factor", None, above=0.0)
    read_table(r, TOP)
    for k in SWITCHED:
        if k in r:
            read_switched(r, k)
    for k, table in SECTIONS.items():
        section = r.section(k)
        section.only(table)
        read_table(section, table)
    r.section("timers")  # throughput timers: printing only
    tb, mb, ga = _batch(r, dp)
    cfg = MegazeroConfig()
    cfg.training.micro_batch_size, cfg.training.global_batch_size = mb, tb
    cfg.training.num_micro_batches = ga
    cfg.parallel.world_size = cfg.parallel.data_parallel_size = dp
    read_precision(r, cfg.precision)
    out = EngineConfig(cfg, tb, mb, ga, raw=raw)
    out.steps_per_print = r.pos_int("steps_per_print", 10)
    out.wall_clock_breakdown = r.boolean("wall_clock_breakdown", False)
    out.drop_last = r.boolean("dataloader_drop_last", False)
    cfg.optimizer.clip_grad = r.number("gradient_clipping", 1.0, minimum=0.0)  # DeepSpeed >= 0.18: 1.0
    read_zero(r.section("zero_optimization"), cfg.parallel, out, device_type)
    read_aio(r.section("aio"), cfg.parallel)
    out.optimizer = optimizer_section(r.section("optimizer"))
    out.scheduler = scheduler_section(r.section("scheduler"))
    out.notes += r.notes
    return out
