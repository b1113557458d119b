"""Checksums, sizes and durable writes: every checkpoint file is written to disk before it counts,
recorded in ``metadata.json`` and checked on load.

* data shards (``shard_*.bin``) carry a CRC-32 per block of ``BLOCK`` bytes in their index, so a
  rank that reads a few byte ranges verifies just the blocks under them;
* every other file (indexes, RNG states, ``config.json``) has its size and CRC-32 in
  ``metadata.json``; ``metadata.json`` holds the CRC-32 of its own content;
* a file that is missing, of the wrong size, or whose bytes do not match raises
  :class:`CheckpointCorrupt` naming it, and ``--load`` falls back to the previous complete
  checkpoint;
* files are flushed to disk (``fsync``) before the directory entries that name them, and the
  directory entries before a rename or the tracker (:func:`write_bytes_durably`, :func:`fsync_dir`).
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Dict

from megazero.checkpoint.errors import CheckpointCorrupt

BLOCK = 4 << 20  # bytes per checksummed block of a data shard


def crc32_bytes(data, crc: int = 0) -> int:
    return zlib.crc32(data, crc) & 0xFFFFFFFF


def crc32_file(path: str, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while True:
            data = fh.read(chunk)
            if not data:
                return crc
            crc = crc32_bytes(data, crc)


def describe_file(path: str) -> Dict[str, int]:
    """``{"size", "crc32"}`` of a file just written (read back once: small files only)."""
    return {"size": os.path.getsize(path), "crc32": crc32_file(path)}


def check_file(directory: str, name: str, expected: Dict[str, int], read_bytes: bool = True) -> str:
    """Raise :class:`CheckpointCorrupt` unless ``directory/name`` exists with the recorded size (and
    CRC-32 when ``read_bytes``); returns the path."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise CheckpointCorrupt(f"{path}: missing (the checkpoint lists it)")
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise CheckpointCorrupt(f"{path}: {size} bytes, but the checkpoint recorded {expected['size']} "
                                "(truncated or overwritten)")
    if read_bytes and "crc32" in expected and crc32_file(path) != expected["crc32"]:
        raise CheckpointCorrupt(f"{path}: checksum mismatch (the file's bytes changed after it was saved)")
    return path


def seal(meta: dict) -> dict:
    """``meta`` with ``checksum``: the CRC-32 of its canonical JSON (without that key)."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return dict(body, checksum=crc32_bytes(json.dumps(body, sort_keys=True).encode()))


def read_sealed_json(path: str) -> dict:
    """A JSON file written through :func:`seal`, checked; raises :class:`CheckpointCorrupt`."""
    try:
        with open(path, "rb") as fh:
            meta = json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointCorrupt(f"{path}: unreadable JSON ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"{path}: not a JSON object")
    if "checksum" in meta and seal(meta)["checksum"] != meta["checksum"]:
        raise CheckpointCorrupt(f"{path}: checksum mismatch (the file's content changed after it was saved)")
    return meta


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created, renames) durable, where supported."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: str, write) -> None:
    """``write(fh)`` into ``path``, flushed to disk before returning."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_json(path: str, obj) -> None:
    write_bytes_durably(path, lambda fh: fh.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def read_json(path: str):
    with open(path) as fh:
        return json.load(fh)
