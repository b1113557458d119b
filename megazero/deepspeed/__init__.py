"""DeepSpeed's names over megazero's engine: a DeepSpeed training script runs after changing one import,
``import deepspeed`` to ``import megazero.deepspeed as deepspeed`` (docs/engine.md).

``initialize``, ``init_distributed``, ``add_config_arguments``, ``zero.Init``,
``zero.GatheredParameters``, ``zero.register_external_parameter`` and
``utils.zero_to_fp32`` are megazero's (:mod:`megazero.engine`); ``accelerator.get_accelerator()``
names the device megazero trains on (:mod:`megazero.deepspeed.accelerator`); ``comm`` is ``torch.distributed``
(``deepspeed.comm.get_rank()``, ``barrier()``, ``all_reduce()`` keep their meaning).  A configuration
error raised and not caught ends the script as megazero's own scripts end: one line from rank 0,
exit status 2.
"""
from torch import distributed as comm

from megazero.deepspeed import accelerator, utils, zero
from megazero.engine import Engine as DeepSpeedEngine
from megazero.engine import add_config_arguments, init_distributed, initialize

__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "comm", "init_distributed", "initialize",
           "utils", "zero"]
