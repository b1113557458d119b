"""Reading and writing Hugging Face weight files one tensor at a time, so a conversion holds about one
tensor in memory, never the model.

- :class:`HFWeights`: the tensors of a Hugging Face directory (``model.safetensors``, or shards with
  ``model.safetensors.index.json``); :meth:`HFWeights.get` reads one tensor's bytes with ordinary file
  reads into fresh memory (no memory map: mapped pages would stay in the process's resident set);
  ``pytorch_model.bin`` directories are read with ``torch.load(mmap=True)``.  The files come from
  outside, so they are checked before anything is read from them: every file must lie inside the
  directory (:func:`file_inside`: no ``..``, no absolute path, no link out of it), and every header
  (:func:`read_header`) must be bounded by its file and describe tensors that lie inside it; anything
  else is a :class:`~megazero.errors.ConfigError` naming the file.
- :class:`ShardedWriter`: writes tensors into ``model-0000i-of-0000N.safetensors`` files of at most
  ``max_shard_bytes`` each, with ``model.safetensors.index.json`` (or one ``model.safetensors``),
  casting and copying in chunks. A safetensors file starts with its JSON header, which names every
  tensor and its byte range; the writer reserves the header's room first, streams the data after it,
  then writes the header into that room padded with spaces, as the format allows.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import struct
from typing import Dict, List, Optional, Tuple

import torch

from megazero.errors import ConfigError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
HEADER_PER_TENSOR = 320  # bytes of header room reserved per tensor (a name, dtype, shape and offsets)
CHUNK_BYTES = 16 << 20  # at most this many bytes are read, cast or copied at once
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound on a header
WIDTHS = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}


def file_inside(directory: str, name, where: str) -> str:
    """The path of the file ``name`` that ``where`` names in ``directory``; :class:`ConfigError`
    naming ``where`` and the entry unless it stays inside the directory: a relative name without
    ``..`` whose real path (links followed) lies in the directory, or, in a Hugging Face hub cache
    (``.../snapshots/<revision>/``), in the ``blobs`` folder its links point at."""
    fix = "a model directory's files must be relative names inside it (no '..', no absolute path, " \
        "no link out of it)"
    if not isinstance(name, str) or not name or os.path.isabs(name) or \
            ".." in name.replace("\\", "/").split("/"):
        raise ConfigError(f"{where}: {name!r} is not a file inside {directory}: {fix}")
    path = os.path.join(directory, name)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":  # the hub cache links files to ../../blobs
        roots.append(os.path.realpath(os.path.join(root, "..", "..", "blobs")))
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise ConfigError(f"{where}: {name!r} resolves to {real}, outside {directory}: {fix}")
    return path


def read_header(path: str) -> Tuple[dict, int]:
    """``(header, data_start)`` of a safetensors file, checked: the header's length is bounded by the
    file (and :data:`MAX_HEADER_BYTES`), it is a JSON object, and each tensor has a known dtype, a
    shape and a byte range inside the file of exactly its size; :class:`ConfigError` naming the file
    otherwise."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: not a safetensors file ({size} bytes, no 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ConfigError(f"{path}: not a safetensors file: its first 8 bytes announce a header of {n} "
                              f"bytes in a file of {size}")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ConfigError(f"{path}: not a safetensors file: its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file: its header is not a JSON object")
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, size - 8 - n)
    return header, 8 + n


def _check_entry(path: str, name: str, entry, data_bytes: int) -> None:
    """One tensor's header entry: a dtype of :data:`DTYPES`, a shape of sizes >= 0 and a byte range
    within the ``data_bytes`` after the header that holds exactly shape x dtype."""
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: tensor {name!r}: its header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise ConfigError(f"{path}: tensor {name!r} has dtype {dtype!r}; megazero reads {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(count(d) for d in shape):
        raise ConfigError(f"{path}: tensor {name!r} has shape {shape!r}; a shape is a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(count(o) for o in offsets)
            and offsets[0] <= offsets[1] <= data_bytes):
        raise ConfigError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, not a byte range within "
                          f"the file's {data_bytes} data bytes")
    need = math.prod(shape) * WIDTHS[dtype]
    if offsets[1] - offsets[0] != need:
        raise ConfigError(f"{path}: tensor {name!r} ({dtype}, shape {shape}) needs {need} bytes; its "
                          f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")


def _index_files(directory: str) -> List[str]:
    """The shard files ``model.safetensors.index.json`` names, each checked to lie inside the directory
    and to exist."""
    index = file_inside(directory, INDEX, os.path.join(directory, INDEX))
    if os.path.getsize(index) > MAX_HEADER_BYTES:
        raise ConfigError(f"{index}: {os.path.getsize(index)} bytes, not a safetensors index (at most "
                          f"{MAX_HEADER_BYTES})")
    try:
        with open(index, "rb") as fh:
            weight_map = json.loads(fh.read().decode("utf-8")).get("weight_map")
    except (UnicodeDecodeError, ValueError, RecursionError, AttributeError) as err:
        raise ConfigError(f"{index}: not a safetensors index (a JSON object with a weight_map): {err}") \
            from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}: its weight_map is {weight_map!r}, not an object naming each tensor's "
                          "file")
    files = {}
    for tensor, f in weight_map.items():
        if not isinstance(f, str) or f not in files:
            files[f] = file_inside(directory, f, f"{index}: weight_map entry {tensor!r}")
            if not os.path.isfile(files[f]):
                raise ConfigError(f"{index}: weight_map entry {tensor!r} names {f!r}, which is not in "
                                  f"{directory} (an incomplete download?)")
    return sorted(files)


class HFWeights:
    """The weights of a Hugging Face model directory, one tensor at a time."""

    def __init__(self, directory: str):
        self.directory = directory
        self.entries: Dict[str, Tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        self._bin = None
        if os.path.isfile(os.path.join(directory, INDEX)):
            files = _index_files(directory)
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        elif os.path.isfile(os.path.join(directory, "pytorch_model.bin")):
            self._bin = _load_bin(directory)
            files = []
        else:
            raise ConfigError(f"{directory}: no model.safetensors, {INDEX} or pytorch_model.bin")
        for f in files:
            header, start = read_header(file_inside(directory, f, os.path.join(directory, f)))
            for name, entry in header.items():
                if name in self.entries:
                    raise ConfigError(f"{os.path.join(directory, f)}: tensor {name!r} is in "
                                      f"{self.entries[name][0]} too; a tensor must be in one file")
                if name != "__metadata__":
                    self.entries[name] = (f, entry, start)

    def names(self) -> List[str]:
        return sorted(self._bin) if self._bin is not None else sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in (self._bin if self._bin is not None else self.entries)

    def where(self, name: str) -> str:
        """The path of the file that holds tensor ``name``."""
        f = "pytorch_model.bin" if self._bin is not None else self.entries[name][0]
        return os.path.join(self.directory, f)

    def meta(self, name: str) -> torch.Tensor:
        """Tensor ``name`` on the meta device: its shape and dtype, nothing read (KeyError if absent)."""
        if self._bin is not None:
            return torch.empty_like(self._bin[name], device="meta")
        entry = self.entries[name][1]
        return torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]], device="meta")

    def same(self, a: str, b: str) -> bool:
        """Whether tensors ``a`` and ``b`` hold the same dtype, shape and bytes (compared a chunk at a
        time, neither held whole)."""
        if self._bin is not None:
            return self._bin[a].dtype == self._bin[b].dtype and torch.equal(self._bin[a], self._bin[b])
        (fa, ea, sa), (fb, eb, sb) = self.entries[a], self.entries[b]
        if (ea["dtype"], ea["shape"]) != (eb["dtype"], eb["shape"]):
            return False
        n = ea["data_offsets"][1] - ea["data_offsets"][0]
        with open(os.path.join(self.directory, fa), "rb") as ha, \
                open(os.path.join(self.directory, fb), "rb") as hb:
            ha.seek(sa + ea["data_offsets"][0])
            hb.seek(sb + eb["data_offsets"][0])
            for lo in range(0, n, CHUNK_BYTES):
                k = min(CHUNK_BYTES, n - lo)
                if ha.read(k) != hb.read(k):
                    return False
        return True

    def get(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Tensor ``name`` in memory of its own, in ``dtype`` (default: as stored); a conversion goes a
        chunk at a time, so the stored copy is never held whole beside the converted one."""
        if self._bin is not None:
            return self._bin[name].to(dtype or self._bin[name].dtype, copy=True)
        f, entry, start = self.entries[name]
        stored = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        width = WIDTHS[entry["dtype"]]
        out = torch.empty((end - begin) // width, dtype=dtype or stored)
        raw = out.view(torch.uint8) if out.dtype == stored else torch.empty(0, dtype=torch.uint8)
        with open(os.path.join(self.directory, f), "rb", buffering=0) as fh:
            fh.seek(start + begin)
            for lo in range(0, end - begin, CHUNK_BYTES):
                n = min(CHUNK_BYTES, end - begin - lo)
                buf = raw[lo:lo + n] if raw.numel() else torch.empty(n, dtype=torch.uint8)
                if fh.readinto(memoryview(buf.numpy())) != n:
                    raise OSError(f"{self.directory}/{f}: tensor {name} is truncated")
                if not raw.numel():
                    out[lo // width:(lo + n) // width] = buf.view(stored)
        return out.reshape(entry["shape"])


def _load_bin(directory: str) -> Dict[str, torch.Tensor]:
    """The tensors of ``pytorch_model.bin`` (memory-mapped, weights only); :class:`ConfigError` naming
    the file when it is not a PyTorch file of named tensors."""
    path = file_inside(directory, "pytorch_model.bin", os.path.join(directory, "pytorch_model.bin"))
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path}: not a PyTorch weights file ({first})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConfigError(f"{path}: not a state dict (a mapping of names to tensors)")
    return state


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"64KB"`` or a number of bytes."""
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
    t = str(text).strip().upper()
    for unit, size in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * size)
    return int(t)


class ShardedWriter:
    """Write tensors one at a time into safetensors shards of at most ``max_shard_bytes``.

    ``expected_tensors``: how many tensors will be written in all (bounds each shard's header)."""

    def __init__(self, directory: str, max_shard_bytes: int, expected_tensors: int):
        self.directory, self.max_bytes = directory, max_shard_bytes
        self.room = -(-(HEADER_PER_TENSOR * expected_tensors + 256) // 8) * 8
        self.shards: List[Tuple[str, Dict[str, dict]]] = []  # (temporary path, header)
        self.fh, self.offset, self.total = None, 0, 0
        os.makedirs(directory, exist_ok=True)

    def _open(self) -> None:
        path = os.path.join(self.directory, f".shard-{len(self.shards):05d}.tmp")
        self.fh = open(path, "wb")
        self.fh.write(b"\0" * (8 + self.room))
        self.shards.append((path, {}))
        self.offset = 0

    def add(self, name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
        """Append ``tensor`` (cast to ``dtype``), in chunks of rows."""
        dtype = dtype or tensor.dtype
        nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        if self.fh is None or (self.offset and self.offset + nbytes > self.max_bytes):
            self._close_shard()
            self._open()
        rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)
        step = max(1, CHUNK_BYTES // max(1, rows.shape[1] * 4))
        for i in range(0, rows.shape[0], step):
            chunk = rows[i:i + step].to(dtype).contiguous().reshape(-1)
            self.fh.write(memoryview(chunk.view(torch.uint8).numpy()))
        self.shards[-1][1][name] = {"dtype": NAMES[dtype], "shape": list(tensor.shape),
                                    "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes
        self.total += nbytes

    def _close_shard(self) -> None:
        if self.fh is None:
            return
        header = dict(self.shards[-1][1], __metadata__={"format": "pt"})
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self.room:
            raise RuntimeError(f"safetensors header of {len(text)} bytes exceeds the {self.room} reserved")
        self.fh.seek(0)
        self.fh.write(struct.pack("<Q", self.room) + text + b" " * (self.room - len(text)))
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        self.fh = None

    def abort(self) -> None:
        """Remove the shards written so far (the directory is left as it was found)."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        for tmp, _ in self.shards:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.shards = []

    def close(self) -> List[str]:
        """Finish the last shard, name the files and write the index; returns the file names."""
        self._close_shard()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                      for i in range(n)]
        weight_map = {}
        for (tmp, header), final in zip(self.shards, names):
            os.replace(tmp, os.path.join(self.directory, final))
            weight_map.update({name: final for name in header})
        if n > 1:
            with open(os.path.join(self.directory, INDEX), "w") as fh:
                index = {"metadata": {"total_size": self.total},
                         "weight_map": dict(sorted(weight_map.items()))}
                json.dump(index, fh, indent=2)
        return names
