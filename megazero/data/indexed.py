"""Megatron-LM's indexed dataset: token ids in ``PREFIX.bin``, their layout in ``PREFIX.idx``.

The ``.bin`` file is every sequence's token ids back to back, in one numpy dtype, nothing else.
The ``.idx`` file (little-endian throughout) is::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version, always 1
    uint8     dtype code of the .bin (see DTYPE_CODES: 8 = uint16, 4 = int32, ...)
    uint64    S, the number of sequences
    uint64    D, the length of the document index (number of documents + 1)
    int32[S]  tokens in each sequence
    int64[S]  byte offset of each sequence in the .bin
    int64[D]  document index: document k is sequences [doc[k], doc[k+1]); doc[0] = 0
    (int8[S]  a "mode" per sequence, only in Megatron's multimodal datasets; ignored here)

Without sentence splitting every document is one sequence.  Files written here read in
Megatron-LM (``megatron.core.datasets.indexed_dataset.IndexedDataset``) and the reverse.
"""
from __future__ import annotations

import os
import struct
from typing import Iterable, List, Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}


def dtype_code(dtype) -> int:
    """Megatron's numeric code of a numpy dtype."""
    dtype = np.dtype(dtype)
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no code in the indexed format; use one of "
                     f"{sorted(np.dtype(t).name for t in DTYPE_CODES.values())}")


def best_dtype(vocab_size: Optional[int]):
    """uint16 for vocabularies below 65500 ids, else int32 (Megatron's choice)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def write_index(path: str, dtype, sequence_lengths: Sequence[int], document_indices: Sequence[int]) -> None:
    """Write an ``.idx`` file for sequences of the given lengths stored contiguously in ``dtype``."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    docs = np.asarray(document_indices, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must fit in int32")
    if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or np.any(np.diff(docs) < 0):
        raise ValueError(f"document indices must rise from 0 to the sequence count {lengths.size}")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        fh.write(struct.pack("<QBQQ", VERSION, dtype_code(dtype), lengths.size, docs.size))
        fh.write(lengths.astype("<i4").tobytes())
        fh.write(pointers.astype("<i8").tobytes())
        fh.write(docs.astype("<i8").tobytes())


_CHECK_CHUNK = 1 << 22  # index entries checked at a time (bounds the temporary memory)


def _check_index(path: str, lengths: np.ndarray, pointers: np.ndarray, docs: np.ndarray,
                 itemsize: int) -> int:
    """Validate an index's arrays (vectorised, in chunks); return the number of tokens it describes.

    Megatron writes ``pointers`` as the running byte offset of the lengths (0, l0*s, (l0+l1)*s, ...),
    and the document index rising from 0 to the sequence count; anything else is a corrupted file.
    """
    n_seq = int(lengths.shape[0])
    total = 0  # tokens before the current chunk
    for lo in range(0, n_seq, _CHECK_CHUNK):
        chunk = lengths[lo:lo + _CHECK_CHUNK].astype(np.int64)
        neg = np.flatnonzero(chunk < 0)
        if neg.size:
            k = lo + int(neg[0])
            raise ValueError(f"{path}: corrupted index: sequence {k} has length {int(lengths[k])} (< 0)")
        ends = np.cumsum(chunk)
        expect = (ends - chunk + total) * itemsize
        bad = np.flatnonzero(pointers[lo:lo + _CHECK_CHUNK] != expect)
        if bad.size:
            k = lo + int(bad[0])
            raise ValueError(f"{path}: corrupted index: sequence {k} points at byte {int(pointers[k])} "
                             f"of the .bin, but the lengths before it put it at byte {int(expect[bad[0]])} "
                             "(pointers must be the running sum of the lengths times the dtype's size; the "
                             "lengths, the pointers or the dtype code are damaged)")
        total += int(ends[-1]) if ends.size else 0
    n_doc = int(docs.shape[0])
    if n_doc == 0:
        raise ValueError(f"{path}: corrupted index: the document index is empty (it must hold at least [0])")
    if int(docs[0]) != 0 or int(docs[-1]) != n_seq:
        raise ValueError(f"{path}: corrupted index: the document index runs from {int(docs[0])} to "
                         f"{int(docs[-1])}; it must run from 0 to the sequence count {n_seq}")
    for lo in range(0, n_doc - 1, _CHECK_CHUNK):
        step = np.diff(docs[lo:lo + _CHECK_CHUNK + 1])
        bad = np.flatnonzero(step < 0)
        if bad.size:
            k = lo + int(bad[0])
            raise ValueError(f"{path}: corrupted index: document {k} ends at sequence {int(docs[k + 1])}, "
                             f"before it starts at sequence {int(docs[k])} (the document index must not "
                             "decrease)")
    return total


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin.tmp`` as documents arrive; :meth:`finalize` writes ``PREFIX.idx.tmp`` and
    moves both into place.

    ``add_document(ids)`` adds a one-sequence document; ``add_document(ids, lengths)`` a document
    cut into sequences (sentences) of those lengths.  Use as a context manager, or call
    :meth:`finalize` (or :meth:`abort`, which deletes the temporary files).  An existing dataset at
    ``PREFIX`` is untouched until :meth:`finalize`; then its ``.idx`` is removed, the new ``.bin``
    moved in, and the new ``.idx`` last, so the presence of ``PREFIX.idx`` means the pair is complete.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        dtype_code(self.dtype)
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin_tmp, self._idx_tmp = bin_path(prefix) + ".tmp", idx_path(prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")

    def _check(self, arr: np.ndarray) -> np.ndarray:
        out = arr.astype(self.dtype)
        if arr.size and not np.array_equal(out.astype(np.int64), arr.astype(np.int64)):
            raise ValueError(f"token ids {arr.min()}..{arr.max()} do not fit in {self.dtype.name}")
        return out

    def add_item(self, ids: Iterable[int]) -> None:
        """Append one sequence to the current document (close it with :meth:`end_document`)."""
        arr = self._check(np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids))
        self._bin.write(arr.tobytes())
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, ids, lengths: Optional[Sequence[int]] = None) -> None:
        """Append a whole document: its ids and, optionally, the lengths of its sequences."""
        arr = self._check(np.asarray(ids if isinstance(ids, np.ndarray) else list(ids)).reshape(-1))
        lengths = [int(arr.size)] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths add up to {sum(lengths)}, the document has {arr.size} ids")
        self._bin.write(arr.tobytes())
        self.sequence_lengths.extend(lengths)
        self.end_document()

    def add_documents(self, ids, lengths) -> None:
        """Append documents of one sequence each: ``ids`` back to back, ``lengths`` per document
        (a document of length 0 holds no sequence)."""
        arr = self._check(np.asarray(ids).reshape(-1))
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if lengths.size and lengths.min() < 0 or int(lengths.sum()) != arr.size:
            raise ValueError(f"document lengths add up to {int(lengths.sum())}, there are {arr.size} ids")
        self._bin.write(arr.tobytes())
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths[lengths > 0].tolist())
        self.document_indices.extend((base + np.cumsum(lengths > 0)).tolist())

    def add_index(self, prefix: str) -> None:
        """Append every document of another indexed dataset (same dtype)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype.name} differs from {self.dtype.name}")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(d) + base for d in other.document_indices[1:])
        self._bin.write(np.asarray(other.tokens).tobytes())

    def finalize(self) -> None:
        if self._bin.closed:
            return
        self._bin.close()
        try:
            if self.document_indices[-1] != len(self.sequence_lengths):
                self.end_document()  # items added without end_document form a last document
            write_index(self._idx_tmp, self.dtype, self.sequence_lengths, self.document_indices)
        except BaseException:
            self.abort()
            raise
        if os.path.exists(idx_path(self.prefix)):
            os.remove(idx_path(self.prefix))  # an old index must never describe the new .bin
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop what was written; an existing dataset at the prefix stays as it was."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader of a ``PREFIX.bin``/``PREFIX.idx`` pair.

    ``ds[i]`` is sequence ``i``'s token ids (a read-only numpy view), ``ds.get(i, offset, length)``
    a part of it; ``sequence_lengths``, ``sequence_pointers`` and ``document_indices`` are the
    index arrays.  Raises ``FileNotFoundError`` naming the missing file and ``ValueError`` for a
    file that is not in this format.
    """

    def __init__(self, prefix: str, mmap: bool = True):
        self.prefix = prefix  # mmap False: the .bin is read with plain file reads (--no-mmap-bin-files)
        for path in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path} (the prefix {prefix!r} "
                                        "needs both .bin and .idx; see scripts/preprocess_data.py)")
        path = idx_path(prefix)
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path}: not a Megatron indexed-dataset index (expected the magic {MAGIC!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise ValueError(f"{path}: index version {version}; only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise ValueError(f"{path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind not in "iu":
            raise ValueError(f"{path}: dtype code {code} ({self.dtype.name}) is not an integer type, and "
                             "token ids are integers: the .idx is damaged or describes other data")
        need = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
        if size < need:
            raise ValueError(f"{path}: truncated: {size} bytes, the header announces {need}")
        idx = np.memmap(path, dtype=np.uint8, mode="r")
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off)
        self._idx = idx
        n_tokens = _check_index(path, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                                self.dtype.itemsize)
        bin_size = os.path.getsize(bin_path(prefix))
        if bin_size != n_tokens * self.dtype.itemsize:
            raise ValueError(f"{bin_path(prefix)}: {bin_size} bytes, but {path} describes {n_tokens} "
                             f"{self.dtype.name} tokens ({n_tokens * self.dtype.itemsize} bytes): its dtype "
                             f"code {code} ({self.dtype.name}) is not the dtype the .bin was written in, or "
                             "a file is truncated or from another dataset")
        self.num_tokens = n_tokens
        if not n_tokens:
            self.tokens = np.zeros(0, dtype=self.dtype)
        elif mmap:
            self.tokens = np.memmap(bin_path(prefix), dtype=self.dtype.newbyteorder("<"), mode="r")
        else:
            from megazero.data.file_tokens import FileTokens
            self.tokens = FileTokens(bin_path(prefix), self.dtype, n_tokens)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def _start(self, i: int) -> int:
        return int(self.sequence_pointers[i]) // self.dtype.itemsize

    def __getitem__(self, i: int) -> np.ndarray:
        start = self._start(i)
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else length
        start = self._start(i) + offset
        return self.tokens[start:start + length]

    def max_token_id(self, budget: int = 1 << 31, chunk: int = 1 << 24) -> int:
        """The largest token id in the ``.bin`` (-1 when empty).  Up to ``budget`` tokens are all
        scanned; beyond that, ``budget`` tokens in evenly spaced chunks (the rest is checked per batch).
        A negative id (in a signed dtype) raises ``ValueError`` naming the files: the ``.idx``'s dtype
        code is not the one the ``.bin`` was written in (uint16 ids labelled int16, say)."""
        n = self.num_tokens
        if n == 0:
            return -1
        starts = range(0, n, chunk)
        if n > budget:
            k = max(1, budget // chunk)
            starts = sorted({int(i * (n - chunk) // max(1, k - 1)) for i in range(k)})
        top = -1
        for s in starts:
            part = self.tokens[s:s + chunk]
            low = int(part.min()) if self.dtype.kind == "i" else 0
            if low < 0:
                raise ValueError(f"{bin_path(self.prefix)}: token id {low} (< 0) where "
                                 f"{idx_path(self.prefix)} says the ids are {self.dtype.name}: its dtype "
                                 "code is not the dtype the .bin was written in")
            top = max(top, int(part.max()))
        return top

    def document(self, k: int) -> np.ndarray:
        """All token ids of document ``k`` (its sequences concatenated)."""
        lo, hi = int(self.document_indices[k]), int(self.document_indices[k + 1])
        if lo == hi:
            return np.zeros(0, dtype=self.dtype)
        start = self._start(lo)
        return self.tokens[start:self._start(hi - 1) + int(self.sequence_lengths[hi - 1])]
