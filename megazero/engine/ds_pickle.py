"""``torch.save`` of a value holding a reference to one of DeepSpeed's classes, without DeepSpeed.

DeepSpeed's ZeRO-3 loader reads its loss scaler from the optimizer file as an object
(``state_dict["loss_scaler"]``, a ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` whose methods it
calls), so a file DeepSpeed is to load must name that class.  megazero does not import DeepSpeed: a
:class:`Foreign` value is written as the pickle opcodes DeepSpeed's own ``torch.save`` writes for such
an object (``GLOBAL module name``, the constructor's arguments, ``NEWOBJ`` or ``REDUCE``, then
``BUILD`` with its attributes), by a pure-Python pickler handed to ``torch.save``; everything else is
pickled as torch pickles it.  Such a file is read by DeepSpeed, and by ``torch.load(weights_only=True)``
only with that class allowed (megazero's own reader allows it, :data:`megazero.engine.ds_checkpoint.
STORED`).
"""
from __future__ import annotations

import pickle
import types
from typing import Any, Optional

import torch


class Foreign:
    """An object of class ``module.name`` (not imported): ``cls.__new__(cls, *args)`` (``new``) or
    ``cls(*args)``, then its ``__dict__`` updated with ``state``."""

    def __init__(self, module: str, name: str, args: tuple = (), state: Optional[dict] = None,
                 new: bool = True):
        self.module, self.name, self.args, self.state, self.new = module, name, tuple(args), state, new


class _Pickler(pickle._Pickler):
    """Python's own pickler, with :class:`Foreign` values written by name."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if not isinstance(obj, Foreign):
            return super().save(obj, save_persistent_id)
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.save(obj.args)
        self.write(pickle.NEWOBJ if obj.new else pickle.REDUCE)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)
        return None


def save_with_foreign(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, :class:`Foreign` values inside written as references to their class."""
    module = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")
    torch.save(obj, path, pickle_module=module)
