"""Reading and writing Hugging Face weight files one tensor at a time, so a conversion holds about one
tensor in memory, never the model.

- :class:`HFWeights`: the tensors of a Hugging Face directory (``model.safetensors``, or shards with
  ``model.safetensors.index.json``); :meth:`HFWeights.get` reads one tensor's bytes with ordinary file
  reads into fresh memory (no memory map: mapped pages would stay in the process's resident set);
  ``pytorch_model.bin`` directories are read with ``torch.load(mmap=True)``.
- :class:`ShardedWriter`: writes tensors into ``model-0000i-of-0000N.safetensors`` files of at most
  ``max_shard_bytes`` each, with ``model.safetensors.index.json`` (or one ``model.safetensors``),
  casting and copying in chunks. A safetensors file starts with its JSON header, which names every
  tensor and its byte range; the writer reserves the header's room first, streams the data after it,
  then writes the header into that room padded with spaces, as the format allows.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
HEADER_PER_TENSOR = 320  # bytes of header room reserved per tensor (a name, dtype, shape and offsets)
CHUNK_BYTES = 16 << 20  # at most this many bytes are read, cast or copied at once


def read_header(path: str) -> Tuple[dict, int]:
    """``(header, data_start)`` of a safetensors file."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


class HFWeights:
    """The weights of a Hugging Face model directory, one tensor at a time."""

    def __init__(self, directory: str):
        self.directory = directory
        self.entries: Dict[str, Tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        self._bin = None
        if os.path.isfile(os.path.join(directory, INDEX)):
            with open(os.path.join(directory, INDEX)) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        elif os.path.isfile(os.path.join(directory, "pytorch_model.bin")):
            self._bin = torch.load(os.path.join(directory, "pytorch_model.bin"), map_location="cpu",
                                   mmap=True, weights_only=True)
            files = []
        else:
            raise FileNotFoundError(f"{directory}: no model.safetensors, {INDEX} or pytorch_model.bin")
        for f in files:
            header, start = read_header(os.path.join(directory, f))
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = (f, entry, start)

    def names(self) -> List[str]:
        return sorted(self._bin) if self._bin is not None else sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in (self._bin if self._bin is not None else self.entries)

    def get(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Tensor ``name`` in memory of its own, in ``dtype`` (default: as stored); a conversion goes a
        chunk at a time, so the stored copy is never held whole beside the converted one."""
        if self._bin is not None:
            return self._bin[name].to(dtype or self._bin[name].dtype, copy=True)
        f, entry, start = self.entries[name]
        stored = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        width = torch.empty((), dtype=stored).element_size()
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
