"""DeepSpeed's names over megazero's engine: a DeepSpeed training script runs after changing one import,
``import deepspeed`` to ``import megazero.deepspeed as deepspeed`` (docs/engine.md).

``initialize``, ``init_distributed``, ``add_config_arguments``, ``zero.Init``,
``zero.GatheredParameters``, ``zero.register_external_parameter`` and
``utils.zero_to_fp32`` are megazero's (:mod:`megazero.engine`).  A configuration error raised and not
caught ends the script as megazero's own scripts end: one line from rank 0, exit status 2.
"""
import sys

from megazero.deepspeed import utils, zero
from megazero.engine import Engine as DeepSpeedEngine
from megazero.engine import add_config_arguments
from megazero.engine import init_distributed as _init_distributed
from megazero.engine import initialize as _initialize

__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize", "utils", "zero"]


def _report_and_exit(kind, err, tb, previous=sys.excepthook):
    """``sys.excepthook`` for a script: megazero's errors end it with one line (status 2 for a
    configuration error, 1 otherwise); anything else keeps its traceback."""
    from megazero.errors import MegazeroError
    if not isinstance(err, MegazeroError):
        return previous(kind, err, tb)
    import atexit
    import os
    from megazero.resilience.errors import report_failure
    code = report_failure(err, prog=os.path.basename(sys.argv[0] or "script"))
    atexit._run_exitfuncs()
    os._exit(code)


def _install_hook() -> None:
    if getattr(sys.excepthook, "__name__", "") != "_report_and_exit":
        sys.excepthook = _report_and_exit


def initialize(*args, **kwargs):
    """:func:`megazero.engine.initialize` (DeepSpeed's ``deepspeed.initialize``)."""
    _install_hook()
    return _initialize(*args, **kwargs)


def init_distributed(*args, **kwargs):
    """:func:`megazero.engine.init_distributed` (DeepSpeed's ``deepspeed.init_distributed``)."""
    _install_hook()
    return _init_distributed(*args, **kwargs)
