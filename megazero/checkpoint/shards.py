"""Data shards: every rank writes its own slice of the optimizer state, and reads back only the byte
ranges its new layout needs.

Writing (every rank at once): for each bucket, this data-parallel rank's slice
(:meth:`Bucket.shard_range`; at ZeRO stage 0 every rank holds the whole bucket and still writes only
its slice, so the writes are spread over the DP ranks) of the fp32 master weights and of each moment
goes to ``shard_tpTT_ppPPP_dpDDD.bin`` as raw little-endian float32, straight from the optimizer's
memory (a CPU tensor is written without a copy; a GPU one through one bucket slice at a time).
Its index ``shard_….json`` lists each piece as ``[name, key, lo, hi, offset]``: elements
``[lo, hi)`` of the parameter's flattened tensor-parallel-local tensor, at byte ``offset``; the
CRC-32 of every 4 MiB block of the ``.bin``; the run id.  Parameters replicated over TP are written
by TP rank 0 only, the last stage's tied copy of the embedding not at all.  A NaN or inf refuses the
save.  Experts are stored one by one under names of their own, split over expert TP, and their
pieces carry a sixth element, the expert-TP coordinate (:mod:`megazero.checkpoint.names`); the
bucket slices of experts are those of expert DP.

Reading (:class:`SavedShards`): the ``.bin`` files are memory-mapped; a read checks the blocks under
it once (:class:`ShardFile`) and copies the bytes out.  :func:`fill_range` assembles any element
range of a parameter under the new TP layout from the saved TP pieces (split along
``partition_dim``, vocabulary padding redone), so a rank touches only the rows it needs.
"""
from __future__ import annotations

import json
import mmap
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError
from megazero.checkpoint.integrity import BLOCK, check_file, crc32_bytes, describe_file, write_bytes_durably
from megazero.checkpoint.names import is_expert, param_info, split_coord, stored, stored_ranges, writes

SHARD_FORMAT = "megazero-shard-v1"
__all__ = ["param_info", "writes"]  # (defined in megazero.checkpoint.names)


def shard_stem(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"shard_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:03d}"


class BlockWriter:
    """Appends bytes to a file and keeps the CRC-32 of every ``BLOCK`` bytes."""

    def __init__(self, path: str):
        self.path, self.fh, self.offset = path, open(path, "wb"), 0
        self.crcs: List[int] = []
        self._crc, self._filled = 0, 0

    def write(self, array: np.ndarray) -> int:
        """Append ``array``'s bytes; returns the offset they start at."""
        data, start, pos = memoryview(np.ascontiguousarray(array)).cast("B"), self.offset, 0
        while pos < len(data):
            take = min(BLOCK - self._filled, len(data) - pos)
            self._crc = crc32_bytes(data[pos:pos + take], self._crc)
            self._filled, pos = self._filled + take, pos + take
            if self._filled == BLOCK:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0
        self.fh.write(data)
        self.offset += len(data)
        return start

    def close(self) -> List[int]:
        """Flush to disk and close; returns the block CRCs (a last partial block included)."""
        if self.fh is not None:
            if self._filled:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0
            try:
                self.fh.flush()
                os.fsync(self.fh.fileno())
            finally:
                self.fh.close()
                self.fh = None
        return self.crcs


def _bucket_pieces(optimizer, b, mesh, dp_rank: int, names):
    """Yield ``(lo, [(name, param, a, e, start)], host tensors by key)`` for bucket ``b``'s slice, one
    piece of the optimizer's at a time (the whole slice in memory, each sub-group on NVMe), so a
    shard on disk is never staged whole."""
    lo, hi = b.shard_range(dp_rank)
    ulo, uhi = optimizer.storage.updated_range(b)
    if not (ulo <= lo and hi <= uhi):
        raise CheckpointError(f"bucket {b.index}: slice [{lo}, {hi}) is not held by this rank")
    starts = {id(p): s for p, s in zip(b.params, b.starts)}
    update = optimizer.update
    for j, (pa, pe) in enumerate(update.pieces(b)):
        plo, phi = max(lo, ulo + pa), min(hi, ulo + pe)
        if plo >= phi:
            continue
        segs = [(names[id(p)], p, a, e, starts[id(p)]) for p, a, e in b.segments(plo, phi)
                if writes(p, mesh)]
        if not segs:
            continue
        tensors = update.piece_tensors(b, j)
        base = ulo + pa
        yield plo, segs, {k: t[plo - base:phi - base].detach().to("cpu", torch.float32)
                          for k, t in tensors.items()}


def write_rank_shard(directory: str, optimizer, named, mesh, run_id: str) -> Tuple[Dict[str, dict], dict]:
    """Write this rank's shard into ``directory``; returns ``({file: size/crc}, {name: param_info})``.
    ``named``: ``[(global name, param)]`` of this rank.  Raises on a NaN/inf or an I/O error."""
    names = {id(p): n for n, p in named}
    shapes = optimizer.param_shapes()
    stem = shard_stem(mesh.coord("tp"), mesh.coord("pp"), mesh.coord("dp", "cp"))
    writer = BlockWriter(os.path.join(directory, stem + ".bin"))
    entries, params = [], {}
    try:
        for b in optimizer.buckets:
            for lo, segs, host in _bucket_pieces(optimizer, b, mesh, optimizer.storage.rank_of(b), names):
                for key, t in host.items():
                    _refuse_nonfinite(t, segs, lo, key)
                    for name, p, a, e, start in segs:
                        _write_ranges(writer, entries, name, p, shapes.get(p, p.shape), key,
                                      t[a - lo:e - lo], a - start, mesh)
                for name, p, a, e, start in segs:
                    params.update(stored(name, p, shapes.get(p, p.shape), mesh.coord("pp"), mesh))
        if mesh.coord("dp", "cp") == 0:  # parameters without optimizer state: the weight itself
            for name, p in named:
                if p not in shapes and writes(p, mesh):
                    _write_weight(writer, entries, params, name, p, mesh)
    finally:
        crcs = writer.close()
    return _write_index(directory, stem, writer, crcs, entries, mesh, run_id), params


def write_weights_shard(directory: str, named, mesh, run_id: str,
                        values=None) -> Tuple[Dict[str, dict], dict]:
    """Write the weights of a whole model held by one process (no optimizer: the ``master`` entries
    only) as the shard of rank (0, 0, 0) into ``directory``; returns ``({file: size/crc}, {name:
    param_info})`` as :func:`write_rank_shard`.  Raises on a NaN/inf or an I/O error.

    ``values(name, p)``: the parameter's full values when they are not in ``p`` itself (a model on the
    meta device: a conversion streams them one at a time); a vocabulary-padded parameter may get its
    unpadded rows, the padding is written as zeros."""
    stem = shard_stem(mesh.coord("tp"), mesh.coord("pp"), mesh.coord("dp", "cp"))
    writer = BlockWriter(os.path.join(directory, stem + ".bin"))
    entries, params = [], {}
    try:
        for name, p in named:
            if writes(p, mesh):
                _write_weight(writer, entries, params, name, p, mesh,
                              values(name, p) if values is not None else None)
    finally:
        crcs = writer.close()
    return _write_index(directory, stem, writer, crcs, entries, mesh, run_id), params


def _write_ranges(writer, entries: list, name: str, p, shape, key: str, values: torch.Tensor, a: int,
                  mesh) -> None:
    """Append ``values``, elements ``[a, a + len)`` of ``p`` (full ``shape`` here), as the pieces of its
    stored tensors (:func:`megazero.checkpoint.names.stored_ranges`)."""
    coord = [split_coord(p, mesh)] if is_expert(p) else []
    for stored_name, lo, hi, at in stored_ranges(name, p, shape, a, a + values.numel(), mesh):
        offset = writer.write(values[at:at + hi - lo].numpy())
        entries.append([stored_name, key, lo, hi, offset] + coord)


def _write_weight(writer, entries: list, params: dict, name: str, p, mesh, value=None) -> None:
    """Append parameter ``p``'s fp32 values (``value``, zero-padded to ``p``'s size, when given) as its
    ``master`` entry (refusing NaN/inf)."""
    t = (p.detach() if value is None else value).to("cpu", torch.float32).reshape(-1).contiguous()
    _refuse_nonfinite(t, [(name, p, 0, t.numel(), 0)], 0, "master")
    if t.numel() > p.numel():
        raise ValueError(f"{name}: {t.numel()} values for a parameter of {p.numel()}")
    if is_expert(p):  # stored expert by expert (never vocabulary-padded)
        _write_ranges(writer, entries, name, p, p.shape, "master", t, 0, mesh)
        params.update(stored(name, p, p.shape, mesh.coord("pp"), mesh))
        return
    start = writer.write(t.numpy())
    for pad in range(t.numel(), p.numel(), 1 << 22):  # vocabulary padding, in bounded pieces
        writer.write(np.zeros(min(1 << 22, p.numel() - pad), dtype=np.float32))
    entries.append([name, "master", 0, p.numel(), start])
    params[name] = param_info(p, p.shape, mesh.coord("pp"))


def _write_index(directory: str, stem: str, writer, crcs, entries: list, mesh,
                 run_id: str) -> Dict[str, dict]:
    """Write the shard's index (entries, block checksums) durably; ``{file: size/crc}`` of both files."""
    index = {"format": SHARD_FORMAT, "run_id": run_id, "tp": mesh.coord("tp"), "pp": mesh.coord("pp"),
             "dp": mesh.coord("dp", "cp"), "size": writer.offset, "block": BLOCK, "block_crc32": crcs,
             "entries": entries}
    index_path = os.path.join(directory, stem + ".json")
    write_bytes_durably(index_path, lambda fh: fh.write(json.dumps(index).encode()))
    return {stem + ".bin": {"size": writer.offset}, stem + ".json": describe_file(index_path)}


def _finite(t: torch.Tensor) -> bool:
    """One vectorised pass, no temporary: min and max are finite exactly when every element is (NaN
    propagates into both)."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _refuse_nonfinite(t: torch.Tensor, segs, lo: int, key: str) -> None:
    if _finite(t):
        return
    bad = [name for name, p, a, e, start in segs if not _finite(t[a - lo:e - lo])]
    raise CheckpointError(f"refusing to save a non-finite model: {key} of parameter "
                          f"{bad[0] if bad else '(padding)'} holds NaN or inf")


class ShardFile:
    """A memory-mapped ``.bin`` whose blocks are checked against their CRC-32 on first read."""

    def __init__(self, path: str, size: int, block: int, crcs: List[int]):
        self.path, self.size, self.block, self.crcs = path, size, block, crcs
        self.verified = set()
        self._fh, self._mm = None, None

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            self._fh = open(self.path, "rb")
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def read_into(self, offset: int, out: np.ndarray, copy: bool = True) -> None:
        """Copy the float32 values at byte ``offset`` into ``out`` (its length decides how many), after
        checking the blocks under them (each block once; ``copy=False`` only checks)."""
        nbytes = out.nbytes
        if offset < 0 or offset + nbytes > self.size:
            raise CheckpointCorrupt(f"{self.path}: bytes {offset}-{offset + nbytes} lie beyond its "
                                    f"{self.size} bytes (truncated)")
        mm = self._map()
        for k in range(offset // self.block, -(-(offset + nbytes) // self.block)):
            if k not in self.verified:
                start, end = k * self.block, min((k + 1) * self.block, self.size)
                if k >= len(self.crcs) or crc32_bytes(memoryview(mm)[start:end]) != self.crcs[k]:
                    raise CheckpointCorrupt(f"{self.path}: bytes {start}-{end} (block {k}) do not match "
                                            "their checksum (the file changed after it was saved)")
                self.verified.add(k)
        if copy:
            np.copyto(out, np.frombuffer(mm, dtype="<f4", count=out.size, offset=offset))

    def release(self) -> None:
        """Drop the mapped pages from this process's memory (they are re-read if needed)."""
        if self._mm is not None and hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._fh.close()
            self._mm = self._fh = None


class SavedShards:
    """The data of one checkpoint, read lazily: only the (tp, pp) coordinates a parameter needs (every
    rank of its pipeline stage for an expert's, which any of them may have written)."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta = path, meta
        self.params: Dict[str, dict] = meta["params"]
        self.tp, self.dp = int(meta["layout"]["tp"]), int(meta["layout"]["dp"])
        self._pieces: Dict[Tuple[int, int], Dict[Tuple[str, str], list]] = {}
        # pp -> the experts' pieces by (expert-TP coordinate, name, key)
        self._experts: Dict[int, Dict[Tuple[int, str, str], list]] = {}
        self.files: List[ShardFile] = []
        self.verify_only = False  # reads check their blocks and coverage but copy nothing

    def parts(self, name: str) -> int:
        """How many TP (or expert-TP) pieces ``name`` was saved in."""
        info = self.params[name]
        return int(info.get("tp", self.tp)) if info["split"] else 1

    def _coordinate(self, tp: int, pp: int) -> Dict[Tuple[str, str], list]:
        if (tp, pp) in self._pieces:
            return self._pieces[(tp, pp)]
        pieces: Dict[Tuple[str, str], list] = {}
        experts = self._experts.setdefault(pp, {})
        for dp in range(self.dp):
            stem = shard_stem(tp, pp, dp)
            files = self.meta["files"]
            if stem + ".json" not in files or stem + ".bin" not in files:
                raise CheckpointCorrupt(f"{self.path}: {stem} is not in the checkpoint's file list")
            with open(check_file(self.path, stem + ".json", files[stem + ".json"])) as fh:
                index = json.load(fh)
            if index.get("run_id") != self.meta.get("run_id"):
                raise CheckpointCorrupt(f"{self.path}/{stem}.json: written by run {index.get('run_id')}, "
                                        f"not by run {self.meta.get('run_id')} (a mixed checkpoint)")
            check_file(self.path, stem + ".bin", {"size": index["size"]}, read_bytes=False)
            shard = ShardFile(os.path.join(self.path, stem + ".bin"), index["size"], index["block"],
                              index["block_crc32"])
            self.files.append(shard)
            for name, key, lo, hi, offset, *coord in index["entries"]:
                if coord:  # an expert's piece: indexed by its expert-TP coordinate
                    experts.setdefault((coord[0], name, key), []).append((lo, hi, shard, offset))
                else:
                    pieces.setdefault((name, key), []).append((lo, hi, shard, offset))
        self._pieces[(tp, pp)] = pieces
        return pieces

    def _pieces_of(self, tp: int, name: str, key: str) -> list:
        pp = self.params[name]["pp"]
        if not self.params[name].get("expert"):
            return self._coordinate(tp, pp).get((name, key), [])
        for t in range(self.tp):  # every file of the stage (each is opened once)
            self._coordinate(t, pp)
        return self._experts[pp].get((tp, name, key), [])

    def read(self, tp: int, name: str, key: str, lo: int, out: np.ndarray) -> None:
        """Elements ``[lo, lo + out.size)`` of saved TP (or expert-TP) rank ``tp``'s piece of ``name``
        (``key``: master or a moment) into ``out``."""
        hi = lo + out.size
        pieces = self._pieces_of(tp, name, key)
        covered = 0
        for plo, phi, shard, offset in pieces:
            a, e = max(lo, plo), min(hi, phi)
            if a < e:
                shard.read_into(offset + 4 * (a - plo), out[a - lo:e - lo], copy=not self.verify_only)
                covered += e - a
        if covered != hi - lo:
            raise CheckpointCorrupt(f"{self.path}: {key} of parameter {name} (tensor-parallel rank {tp}) "
                                    f"elements {lo}-{hi} are not all in the checkpoint (a shard is missing)")

    def release(self) -> None:
        for f in self.files:
            f.release()

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files, self._pieces, self._experts = [], {}, {}


def full_shape(info: dict, tp_size: int, vocab: Optional[int]) -> Tuple[int, ...]:
    """The whole (unpadded) shape of a parameter from its TP-local layout (``tp_size`` pieces, or the
    expert-TP size the layout records for an expert)."""
    shape = list(info["shape"])
    if info["split"]:
        shape[info["dim"]] *= int(info.get("tp", tp_size))
    if info["vocab_parallel"] and vocab is not None:
        shape[0] = vocab
    return tuple(shape)


ROWS_AT_ONCE = 1 << 22  # elements per step when columns are re-split (bounds the temporary)


def fill_range(src: SavedShards, name: str, key: str, new: dict, tp_rank: int, lo: int,
               out: np.ndarray) -> None:
    """``out`` (float32, numpy) = elements ``[lo, lo + out.size)`` of this rank's TP-local tensor of
    ``name`` under the new layout ``new`` (:func:`param_info` of this run's parameter)."""
    saved = src.params[name]
    d, s_shape, n_shape = new["dim"], list(saved["shape"]), list(new["shape"])
    if not new["split"]:
        src.read(0, name, key, lo, out)
    elif s_shape == n_shape and tp_rank < src.parts(name):  # the same TP split: the same flat offsets
        src.read(tp_rank, name, key, lo, out)
    elif d == 0:
        _fill_row_split(src, name, key, saved, new, tp_rank, lo, out)
    else:
        row = int(np.prod(n_shape[1:], dtype=np.int64))
        step = max(1, ROWS_AT_ONCE // max(1, row)) * row
        for a in range(lo - lo % row, lo + out.size, step):  # whole rows at a time, re-split columns
            r0, r1 = a // row, -(-min(a + step, lo + out.size) // row)
            block = torch.zeros((r1 - r0,) + tuple(n_shape[1:]), dtype=torch.float32)
            for t in range(src.parts(name)):
                _fill_columns_from(src, name, key, saved, new, tp_rank, t, r0, r1, block)
            flat, b0 = block.reshape(-1).numpy(), r0 * row
            x0, x1 = max(lo, b0), min(lo + out.size, r1 * row)
            out[x0 - lo:x1 - lo] = flat[x0 - b0:x1 - b0]


def _fill_row_split(src, name, key, saved, new, tp_rank, lo, out) -> None:
    """Dim 0 is split: this rank's tensor is a contiguous run of the whole one's rows, so each saved
    piece maps to one flat range; rows past the vocabulary (padding) are zero."""
    s_shape, n_shape = saved["shape"], new["shape"]
    row = int(np.prod(n_shape[1:], dtype=np.int64)) if len(n_shape) > 1 else 1
    g_lo = tp_rank * n_shape[0] * row + lo  # global flat position (padded rows)
    g_hi = g_lo + out.size
    limit = src.meta["model"]["vocab_size"] * row if new["vocab_parallel"] else g_hi
    if g_hi > limit:
        out[max(0, limit - g_lo):] = 0.0
    for t in range(src.parts(name)):
        s_lo = t * s_shape[0] * row
        a, e = max(g_lo, s_lo), min(g_hi, s_lo + s_shape[0] * row, limit)
        if a < e:
            src.read(t, name, key, a - s_lo, out[a - g_lo:e - g_lo])


def _fill_columns_from(src, name, key, saved, new, tp_rank, t, r0, r1, block) -> None:
    """Copy what saved TP rank ``t`` holds of rows ``[r0, r1)`` (dim ``d`` >= 1 split) into ``block``."""
    d, s_shape, n_shape = new["dim"], list(saved["shape"]), list(new["shape"])
    off_s, off_n = t * s_shape[d], tp_rank * n_shape[d]
    c0, c1 = max(off_n, off_s), min(off_n + n_shape[d], off_s + s_shape[d])
    if c0 < c1:
        row_s = int(np.prod(s_shape[1:], dtype=np.int64))
        data = np.empty((r1 - r0) * row_s, dtype=np.float32)
        src.read(t, name, key, r0 * row_s, data)
        part = torch.from_numpy(data).view(r1 - r0, *s_shape[1:]).narrow(d, c0 - off_s, c1 - c0)
        block.narrow(d, c0 - off_n, c1 - c0).copy_(part)
