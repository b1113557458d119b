"""GPT training samples from Megatron-format datasets (``--data-path``), optionally blended.

One dataset prefix and one split (train/valid/test, by ``--split`` over *documents*, as
Megatron-LM does) become an endless stream of samples of ``seq_length + 1`` tokens:

* epoch ``e`` lays the split's documents end to end in an order shuffled by ``(seed, split, e)``
  (Megatron's document index); a document of several sequences (sentences) keeps them together
  and in order;
* sample ``j`` of an epoch is the tokens ``[j * seq_length, (j + 1) * seq_length + 1)`` of that
  stream, so consecutive samples share one token and samples run across document boundaries
  (Megatron's sample index); the stream's tail that does not fill a sample is dropped, so every
  epoch holds ``(tokens - 1) // seq_length`` samples;
* the samples of an epoch are taken in an order shuffled by ``(seed, split, e)`` (Megatron's
  shuffle index).

Global sample ``i`` is therefore a pure function of ``(files, split, seed, seq_length, i)``:
the same at every parallel layout, whichever rank asks and in whatever order.  Epochs are
built when first needed, so there is no fixed number of samples.

Several prefixes with weights (``--data-path 0.7 a 0.3 b``) are blended like Megatron's
``BlendedDataset``: global sample ``i`` goes to the dataset whose share so far lags its weight
the most (``argmax_d w_d * (i + 1) - taken_d``, ties to the first), and is that dataset's next
sample.  Each split is blended separately with the same weights.

Differences from Megatron-LM: the indices are not byte-identical to Megatron's (its C++ helper
builds all epochs up front and shuffles across them), and nothing is cached on disk.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megazero.data.indexed import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
_KEEP_EPOCHS = 4  # per split, the most recently used epochs' indices stay in memory


def parse_split(split: str) -> List[float]:
    """``"969,30,1"`` (or ``"98/2/0"``, or fewer parts, padded with 0) -> normalized weights."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three numbers such as 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_bounds(num_documents: int, weights: Sequence[float]) -> List[int]:
    """Document boundaries ``[0, a, b, num_documents]`` of the train/valid/test splits."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    excess = bounds[-1] - num_documents  # rounding can overshoot or undershoot by a little
    return [0] + [max(0, b - excess) for b in bounds[1:]]


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> List[Tuple[float, str]]:
    """``[p]`` / ``[w1, p1, w2, p2, ...]`` / ``[p1, p2, ...]`` -> ``[(weight, prefix)]``, weights sum to 1.
    A weight must be a finite number > 0 (a prefix without a share is left out, not weighted 0)."""
    items = list(data_path)
    if not items:
        raise ValueError(f"{flag}: no dataset prefix given")

    def number(s: str) -> Optional[float]:
        try:
            return float(s)
        except ValueError:
            return None

    if len(items) > 1 and number(items[0]) is not None:
        if len(items) % 2:
            raise ValueError(f"{flag} {' '.join(items)}: weighted prefixes come in pairs 'WEIGHT PREFIX'")
        pairs = []
        for w, p in zip(items[0::2], items[1::2]):
            v = number(w)
            if v is None or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{flag}: the weight {w!r} before {p!r} must be a finite number > 0 (a "
                                 "blend is 'WEIGHT PREFIX' pairs; leave out a prefix to give it no share)")
            pairs.append((v, p))
    else:
        pairs = [(1.0, p) for p in items]
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


class _SplitStream:
    """The samples of one split of one indexed dataset (see the module docstring).

    ``doc_bounds`` is the split's slice of the document index (``n_docs + 1`` entries): document
    ``k`` is sequences ``[doc_bounds[k], doc_bounds[k + 1])``."""

    def __init__(self, ds: IndexedDataset, doc_bounds: np.ndarray, seq_length: int, seed: int, split: int):
        self.ds, self.seq_length = ds, seq_length
        self.seed, self.split = seed, split
        self.doc_bounds = np.asarray(doc_bounds, dtype=np.int64)
        self.tokens_per_epoch = int(
            ds.sequence_lengths[self.doc_bounds[0]:self.doc_bounds[-1]].sum(dtype=np.int64))
        self.samples_per_epoch = max(0, (self.tokens_per_epoch - 1) // seq_length)
        self._epochs: Dict[int, Tuple[np.ndarray, ...]] = {}

    def _epoch(self, e: int):
        """``(sequences, begins, ends, sample_order)`` of epoch ``e``: its sequences in stream order
        (documents shuffled, each document's sequences kept together and in order), where each
        begins and ends in the stream, and the order in which its samples are taken."""
        if e not in self._epochs:
            rng = np.random.default_rng([self.seed, self.split, e, 0x475054])  # "GPT"
            order = rng.permutation(len(self.doc_bounds) - 1)
            first = self.doc_bounds[:-1][order]
            counts = np.diff(self.doc_bounds)[order]
            before = np.cumsum(counts) - counts  # position of each document's first sequence
            seqs = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(first - before, counts)
            lengths = self.ds.sequence_lengths[seqs].astype(np.int64)
            ends = np.cumsum(lengths)  # stream offset where each sequence ends
            sample_order = rng.permutation(self.samples_per_epoch)
            if len(self._epochs) >= _KEEP_EPOCHS:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[e] = (seqs, ends - lengths, ends, sample_order)
        return self._epochs[e]

    def sample(self, index: int) -> np.ndarray:
        epoch, j = divmod(int(index), self.samples_per_epoch)
        seqs, begins, ends, sample_order = self._epoch(epoch)
        start = int(sample_order[j]) * self.seq_length
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        k = int(np.searchsorted(ends, start, side="right"))  # the sequence holding token `start`
        filled = 0
        while filled < need:
            take = min(need - filled, int(ends[k]) - (start + filled))
            offset = start + filled - int(begins[k])
            out[filled:filled + take] = self.ds.get(int(seqs[k]), offset, take)
            filled += take
            k += 1
        return out


class GPTDataset:
    """One indexed dataset cut into train/valid/test by documents, each an endless sample stream."""

    def __init__(self, prefix: str, seq_length: int, split: str = "969,30,1", seed: int = 1234,
                 mmap: bool = True, flag: str = "--data-path"):
        self.prefix, self.seq_length, self.seed, self.flag = prefix, seq_length, seed, flag
        self.indexed = IndexedDataset(prefix, mmap=mmap)
        self.bounds = split_bounds(self.indexed.num_documents, parse_split(split))
        self.split = split
        self._streams: Dict[str, _SplitStream] = {}

    def documents(self, split: str) -> range:
        s = SPLIT_NAMES.index(split)
        return range(self.bounds[s], self.bounds[s + 1])

    def stream(self, split: str) -> _SplitStream:
        if split not in SPLIT_NAMES:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLIT_NAMES)}")
        if split not in self._streams:
            docs = self.documents(split)
            stream = _SplitStream(self.indexed, self.indexed.document_indices[docs.start:docs.stop + 1],
                                  self.seq_length, self.seed, SPLIT_NAMES.index(split))
            if stream.samples_per_epoch == 0 and self.flag != "--data-path":  # a whole set
                raise ValueError(
                    f"{self.flag} {self.prefix}: the {split} set holds {stream.tokens_per_epoch} tokens "
                    f"({self.indexed.num_documents} documents), fewer than one sample of --seq-length "
                    f"{self.seq_length} + 1; use more data or a shorter --seq-length")
            if stream.samples_per_epoch == 0:
                raise ValueError(
                    f"--data-path {self.prefix}: the {split} split (documents {docs.start}..{docs.stop - 1} "
                    f"of {self.indexed.num_documents}, --split {self.split}) holds {stream.tokens_per_epoch} "
                    f"tokens, fewer than one sample of --seq-length {self.seq_length} + 1; give that split "
                    "more documents (--split) or use more data")
            self._streams[split] = stream
        return self._streams[split]

    def num_samples_per_epoch(self, split: str) -> int:
        return self.stream(split).samples_per_epoch

    def sample(self, index: int, split: str = "train") -> np.ndarray:
        return self.stream(split).sample(index)


def _greedy_steps(weights: Sequence[float], taken: List[int], first: int, count: int) -> np.ndarray:
    """The blend rule, one index at a time: the dataset of each global index ``first .. first +
    count - 1`` given the samples ``taken`` from each dataset before ``first`` (updated in place)."""
    out = np.empty(count, dtype=np.int64)
    for j in range(count):
        i = first + j
        best, best_err = 0, -math.inf
        for d, w in enumerate(weights):
            err = w * (i + 1) - taken[d]
            if err > best_err:
                best, best_err = d, err
        out[j] = best
        taken[best] += 1
    return out


class _BlendIndex:
    """Which dataset each global index of one split is (``which``), built in chunks; and, per block
    of ``BLOCK`` indices, how many samples each dataset had given before it (``counts``), so that
    the dataset's own sample number (``local``) of any index is a short count away.

    Each chunk is computed with numpy and is exactly :func:`_greedy_steps` (same float operations,
    same ties): a guess (each dataset's picks placed where its share ``w * (i + 1) - taken`` would
    cross 1/2, merged by that time) is checked in one vectorised pass, which evaluates the rule at
    every index from the guess's counts; wherever the counts agree with the truth the rule's pick
    there is the truth.  At the first disagreement the exact rule runs index by index until the
    counts agree with the guess again (usually a step or two: the guess swapped two near-ties)."""

    CHUNK = 1 << 16
    BLOCK = 1 << 12

    def __init__(self, weights: Sequence[float]):
        self.weights = [float(w) for w in weights]
        self.w = np.asarray(self.weights, dtype=np.float64)
        self.size = 0
        self.which = np.zeros(0, dtype=np.int16 if len(self.weights) < 2 ** 15 else np.int64)
        self.counts = np.zeros((1, len(self.weights)), dtype=np.int64)  # before each block (and the end)

    def _guess(self, taken: np.ndarray, count: int) -> np.ndarray:
        times, ds = [], []
        for d, w in enumerate(self.weights):
            if w > 0:
                k = taken[d] + np.arange(int(math.ceil(w * count)) + 2, dtype=np.float64)
                times.append((k + 0.5) / w - 1.0)
                ds.append(np.full(k.size, d, dtype=np.int64))
        order = np.argsort(np.concatenate(times), kind="stable")[:count]
        return np.concatenate(ds)[order]

    def _chunk(self, first: int, count: int, taken: np.ndarray) -> np.ndarray:
        K = len(self.weights)
        guess = self._guess(taken, count)
        onehot = np.zeros((count, K), dtype=np.int64)
        onehot[np.arange(count), guess] = 1
        before = np.cumsum(onehot, axis=0) - onehot + taken  # the guess's counts before each index
        share = self.w[None, :] * np.arange(first + 1, first + count + 1, dtype=np.float64)[:, None] - before
        out = np.argmax(share, axis=1)  # the rule's pick at each index, from the guess's counts
        done = 0  # out[:done] is final and the true counts before `done` equal before[done]
        for m in np.flatnonzero(out != guess).tolist():
            if m < done:
                continue
            true = before[m].tolist()
            j = m
            while j < count:
                out[j] = _greedy_steps(self.weights, true, first + j, 1)[0]
                j += 1
                if j < count and true == before[j].tolist():
                    break
            done = j
            if done >= count:
                break
        return out

    def extend(self, upto: int) -> None:
        if upto <= self.size:
            return
        new_size = -(-upto // self.CHUNK) * self.CHUNK
        which = np.empty(new_size, dtype=self.which.dtype)
        which[:self.size] = self.which
        counts = [self.counts]
        K = len(self.weights)
        taken = self.counts[-1].copy()
        for first in range(self.size, new_size, self.CHUNK):
            out = self._chunk(first, self.CHUNK, taken)
            which[first:first + self.CHUNK] = out
            per_block = np.bincount((np.arange(self.CHUNK) // self.BLOCK) * K + out,
                                    minlength=self.CHUNK // self.BLOCK * K).reshape(-1, K)
            cum = taken + np.cumsum(per_block, axis=0)
            counts.append(cum)
            taken = cum[-1].copy()
        self.which, self.size = which, new_size
        self.counts = np.concatenate(counts)

    def lookup(self, indices: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        """``(which, local)`` of the given (built) global indices."""
        which = np.empty(len(indices), dtype=np.int64)
        local = np.empty(len(indices), dtype=np.int64)
        for row, i in enumerate(indices):
            d, b = int(self.which[i]), i // self.BLOCK
            which[row] = d
            local[row] = int(self.counts[b, d]) + int(np.count_nonzero(self.which[b * self.BLOCK:i] == d))
        return which, local


class BlendedGPTData:
    """A token source for :func:`megazero.data.micro_batches`: ``get_tokens(indices, split)``.

    Args:
        data_path: ``--data-path`` items: one prefix, prefixes, or ``WEIGHT PREFIX`` pairs.
        seq_length: tokens per training sequence (samples have one more, for the labels).
        split: ``--split``, e.g. ``"969,30,1"``.
        seed: shuffles documents and samples.
        vocab_size: if given, a token id at or above it raises a clear error.
        mmap: read the ``.bin`` files through memory maps (``--no-mmap-bin-files``: plain reads).
        threads: ``--num-dataset-builder-threads``: the datasets are opened and indexed by this many
            threads (:meth:`check` too); the samples do not depend on it.
        flag: the flag the prefixes came from, for the errors (``--valid-data-path`` ...).
    """

    def __init__(self, data_path: Sequence[str], seq_length: int, split: str = "969,30,1", seed: int = 1234,
                 vocab_size: Optional[int] = None, mmap: bool = True, threads: int = 1,
                 flag: str = "--data-path"):
        self.blend = parse_data_path(data_path, flag)
        self.weights = [w for w, _ in self.blend]
        self.threads, self.flag = max(1, int(threads)), flag
        self.datasets = self._each(lambda p: GPTDataset(p, seq_length, split, seed, mmap, flag),
                                   [p for _, p in self.blend])
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self._assign: Dict[str, _BlendIndex] = {}
        self.eval_sets = None  # the evaluation plan (megazero.data.eval_sets), set by build_data

    def _each(self, fn, items: Sequence) -> list:
        """``[fn(x) for x in items]``, by ``threads`` threads (results in order; the first error raised)."""
        if self.threads == 1 or len(items) < 2:
            return [fn(x) for x in items]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=min(self.threads, len(items))) as pool:
            return list(pool.map(fn, items))

    def check(self, splits: Sequence[str] = ("train",)) -> None:
        """Raise now (not mid-training) if a split of a dataset with weight > 0 holds no sample."""
        self._each(lambda ds: [ds.stream(split) for split in splits], self.datasets)

    def samples_per_epoch(self, split: str) -> int:
        """Samples in one epoch of ``split`` (one dataset: a blend has no single epoch)."""
        if len(self.datasets) != 1:
            raise ValueError(f"{self.flag}: a blend of {len(self.datasets)} datasets has no single epoch to "
                             "read whole; give one prefix")
        return self.datasets[0].num_samples_per_epoch(split)

    def check_vocab(self) -> None:
        """Raise now (not at the first batch that holds one) if a dataset holds a token id at or above
        ``vocab_size``: the data was tokenized with a larger vocabulary."""
        if self.vocab_size is None:
            return
        for (_, prefix), ds in zip(self.blend, self.datasets):
            indexed = ds.indexed
            if np.iinfo(indexed.dtype).max < self.vocab_size and np.iinfo(indexed.dtype).min == 0:
                continue  # the file's dtype cannot hold an id that large (a signed one may hold one < 0)
            top = indexed.max_token_id()
            if top >= self.vocab_size:
                raise ValueError(f"{self.flag} {prefix}: token id {top} is outside --vocab-size "
                                 f"{self.vocab_size}; the data was tokenized with a larger vocabulary: "
                                 "pass its --tokenizer-model (which sets the vocabulary size) or raise "
                                 "--vocab-size")

    def _assignment(self, split: str, upto: int) -> "_BlendIndex":
        """The blend of ``split``, built to at least global index ``upto - 1``."""
        if split not in self._assign:
            self._assign[split] = _BlendIndex(self.weights)
        blend = self._assign[split]
        blend.extend(upto)
        return blend

    def get_tokens(self, indices: Sequence[int], split: str = "train") -> torch.Tensor:
        """Token ids ``[len(indices), seq_length + 1]`` (int64) of the given global samples."""
        indices = [int(i) for i in indices]
        out = np.empty((len(indices), self.seq_length + 1), dtype=np.int64)
        if len(self.datasets) == 1:
            for row, i in enumerate(indices):
                out[row] = self.datasets[0].sample(i, split)
        elif indices:
            which, local = self._assignment(split, max(indices) + 1).lookup(indices)
            for row in range(len(indices)):
                out[row] = self.datasets[which[row]].sample(int(local[row]), split)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            bad = int(out.max())
            from megazero.resilience.errors import DataError
            raise DataError(f"{self.flag}: token id {bad} is outside --vocab-size {self.vocab_size}; the "
                            "data was tokenized with a larger vocabulary: pass its --tokenizer-model (which "
                            "sets the vocabulary size) or raise --vocab-size")
        return torch.from_numpy(out)
