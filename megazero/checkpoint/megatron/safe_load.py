"""Reading Megatron-LM's pickled files without executing a pickle.

Megatron-LM stores its arguments (an ``argparse.Namespace`` holding plain values, torch dtypes and
a few of Megatron's own enums) in ``common.pt`` / ``model_optim_rng.pt``, and
``torch.distributed.checkpoint`` its index in a pickled ``.metadata`` file.  Both are read with an
allow-list:

- :func:`load_pt`: ``torch.load(weights_only=True)`` with ``argparse.Namespace`` and, for every
  global under ``megatron.`` the file names, an inert stand-in (:class:`Opaque`: it records the name
  and the arguments, runs nothing of Megatron's).  Any other global (``os.system``, ``builtins.exec``,
  a class of ``__main__``) is refused by name before anything is unpickled.
- :func:`load_dcp_metadata`: an unpickler whose ``find_class`` knows only the classes of
  ``torch.distributed.checkpoint``'s metadata, ``torch.Size`` and the dtypes.
"""
from __future__ import annotations

import argparse
import pickle
from typing import Any, List

import torch

from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError

DCP_CLASSES = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"),  # the checkpoint id torch records
}
SAFE_PREFIXES = ("megatron.",)  # globals replaced by an inert Opaque


class Opaque:
    """Stands for an object of Megatron's own classes (an enum member, a small config object): its
    name and whatever the pickle passed, never Megatron's code."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


def _stand_in(name: str):
    return type(name.rsplit(".", 1)[-1], (Opaque,), {"__module__": name.rsplit(".", 1)[0]})


def _refuse(path: str, names: List[str]) -> CheckpointError:
    return CheckpointError(f"{path}: the file's pickle names {', '.join(names[:3])}, which is not a type "
                           "Megatron-LM stores; refusing to load it (nothing was executed)")


def load_pt(path: str) -> Any:
    """The content of a ``torch.save`` file of Megatron-LM's, with no pickle executed."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file
        first = " ".join(str(err).split()).split(". ")[0][:160]
        raise CheckpointCorrupt(f"{path}: truncated or not a torch file ({first})") from None
    foreign = [n for n in names if not n.startswith(SAFE_PREFIXES) and n != "argparse.Namespace"]
    if foreign:
        raise _refuse(path, foreign)
    allowed = [argparse.Namespace] + [(_stand_in(n), n) for n in names if n.startswith(SAFE_PREFIXES)]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # read as used
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused by the weights-only loader: {str(err).splitlines()[0]}") \
            from None
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointCorrupt(f"{path}: truncated or damaged ({' '.join(str(err).split())[:160]})") \
            from None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh, path: str):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in DCP_CLASSES or dtype:
            return super().find_class(module, name)
        raise _refuse(self.path, [f"{module}.{name}"])


def load_dcp_metadata(path: str):
    """``torch.distributed.checkpoint``'s ``Metadata`` from its ``.metadata`` file (allow-listed)."""
    try:
        with open(path, "rb") as fh:
            return _MetadataUnpickler(fh, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete torch_dist checkpoint") from None
    except Exception as err:  # noqa: BLE001 - truncated: EOFError, UnpicklingError, ...
        raise CheckpointCorrupt(f"{path}: truncated or damaged ({type(err).__name__})") from None
