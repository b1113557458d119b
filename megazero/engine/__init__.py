"""DeepSpeed's engine for any ``nn.Module``: a second front end over megazero's ZeRO, precision,
offload and checkpoint code (docs/engine.md).

- :func:`initialize` (also ``megazero.initialize``): ``(engine, optimizer, dataloader, lr_scheduler)``;
- :mod:`~megazero.engine.config`, :mod:`~megazero.engine.keys`, :mod:`~megazero.engine.auto`: a
  ds_config read into megazero's config sections, every key it does not support named;
- :mod:`~megazero.engine.engine`: the :class:`Engine` (forward, backward, step, counters);
- :mod:`~megazero.engine.units`: ZeRO-3 units for any module (per-submodule gathering);
- :mod:`~megazero.zero.partition`: :class:`Init` and :class:`GatheredParameters`;
- :mod:`~megazero.engine.optim`, :mod:`~megazero.engine.schedulers`: the optimizer settings and
  DeepSpeed's learning-rate schedules;
- :mod:`~megazero.engine.checkpointing`, :mod:`~megazero.engine.consolidate`: checkpoints in
  megazero's format under DeepSpeed's layout, and ``zero_to_fp32``.

The DeepSpeed-compatible names (``import megazero.deepspeed as deepspeed``) are in
:mod:`megazero.deepspeed`.
"""
from megazero.engine.consolidate import (convert_zero_checkpoint_to_fp32_state_dict,
                                         get_fp32_state_dict_from_zero_checkpoint,
                                         load_state_dict_from_zero_checkpoint)
from megazero.engine.engine import Engine
from megazero.engine.initialize import add_config_arguments, init_distributed, initialize
from megazero.zero.partition import GatheredParameters, Init
from megazero.engine.units import register_external_parameter

__all__ = ["Engine", "GatheredParameters", "Init", "add_config_arguments",
           "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "init_distributed", "initialize",
           "load_state_dict_from_zero_checkpoint", "register_external_parameter"]
