"""``--no-mmap-bin-files``: a ``.bin`` file's tokens read with plain file reads instead of a memory map.

:class:`FileTokens` answers the slices :class:`megazero.data.indexed.IndexedDataset` takes of its
``tokens`` (``tokens[a:b]``, a numpy array) by seeking and reading those bytes, so the dataset returns
the same ids either way; each read opens the file anew (no handle is held, so the object pickles and
forked workers share nothing).
"""
from __future__ import annotations

import numpy as np


class FileTokens:
    """The ``count`` little-endian ``dtype`` tokens of ``path``, sliceable like the memory map."""

    def __init__(self, path: str, dtype, count: int):
        self.path, self.dtype, self.count = path, np.dtype(dtype).newbyteorder("<"), int(count)

    def __len__(self) -> int:
        return self.count

    @property
    def shape(self):
        return (self.count,)

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("FileTokens takes contiguous slices only (tokens[a:b])")
        start, stop, _ = key.indices(self.count)
        n = max(0, stop - start)
        if n == 0:
            return np.zeros(0, dtype=self.dtype)
        with open(self.path, "rb") as fh:
            fh.seek(start * self.dtype.itemsize)
            out = np.fromfile(fh, dtype=self.dtype, count=n)
        if out.size != n:
            raise ValueError(f"{self.path}: {out.size} tokens where {n} were expected at token {start}: the "
                             "file is shorter than its .idx says (truncated while reading?)")
        return out
