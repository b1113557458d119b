"""Supervised fine-tuning data (``--sft``): conversations from JSON-lines files
(:mod:`megazero.data.conversations`), the loss on the assistant's tokens only, several conversations packed
to a sequence.

``--data-path A.jsonl [B.jsonl ...]`` (the conversations of all files, in order, cut by ``--split``), or
``--train-data-path`` / ``--valid-data-path``.  Every conversation ends with the end-of-document (EOD) id.

* **Packed** (with ``--reset-attention-mask``, which keeps packed documents apart): the split's
  conversations go into sequences of ``seq_length + 1`` tokens by best-fit decreasing (the longest
  first, each into the fullest sequence it still fits), so a sequence holds several and only the tail
  that no conversation fits is filled, with EOD ids that carry no loss (each its own one-token
  document).  The EOD ids are the document boundaries, so a response attends to its own conversation
  only; add ``--reset-position-ids`` for positions that restart with each conversation (as alone).
* **One per sequence** (without it): each conversation is alone in its sequence, the rest filled as
  above, Megatron-LM's SFT without packing.

The loss mask of label ``i`` (the token after input ``i``) is 1 exactly when that token is an
assistant token of the conversation input ``i`` belongs to: prompt tokens never carry loss, nor does
the first token of a conversation (nothing of it precedes it).  Epoch ``e`` takes the split's packed
sequences in an order shuffled by ``(seed, split, e)``, so global sample ``i`` is a pure function of
the files, the tokenizer, the settings and ``i``, the same at every layout.  A conversation longer than
``seq_length + 1`` tokens is an error naming its line (one sequence must hold it).
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megazero.data.conversations import encode, read_conversations, resolve_format
from megazero.data.gpt_dataset import SPLIT_NAMES, parse_split, split_bounds


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Bins (lists of item indices, each bin's lengths summing to at most ``capacity``) holding every item:
    the longest item first (ties by index), each into the bin with the least room that still fits it."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: List[List[int]] = []
    rooms: List[tuple] = []  # (room left, bin index), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(rooms, (n, -1))
        if at == len(rooms):
            bins.append([i])
            bisect.insort(rooms, (capacity - n, len(bins) - 1))
            continue
        room, b = rooms.pop(at)
        bins[b].append(i)
        bisect.insort(rooms, (room - n, b))
    return bins


class _Split:
    """One split's conversations (flat ids and trained flags with offsets) and their sequences."""

    def __init__(self, ids: List[List[int]], trained: List[List[bool]], capacity: int, pack: bool,
                 seed: int, split: int):
        lengths = [len(x) for x in ids]
        self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.ids = np.asarray([t for x in ids for t in x], dtype=np.int64)
        self.trained = np.asarray([t for x in trained for t in x], dtype=bool)
        self.bins = best_fit_decreasing(lengths, capacity) if pack else [[i] for i in range(len(ids))]
        self.capacity, self.seed, self.split = capacity, seed, split
        self.tokens = int(sum(lengths))
        self._orders: Dict[int, np.ndarray] = {}  # the epochs in use (a batch spans at most two)

    def order(self, epoch: int) -> np.ndarray:
        """The order of the sequences in ``epoch``, shuffled by ``(seed, split, epoch)``."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            rng = np.random.RandomState((self.seed, self.split, epoch))
            self._orders[epoch] = rng.permutation(len(self.bins))
        return self._orders[epoch]

    def sample(self, index: int, eod: int):
        """``(ids, trained)`` of sample ``index`` (``capacity`` tokens each)."""
        epoch, j = divmod(int(index), len(self.bins))
        ids = np.full(self.capacity, eod, dtype=np.int64)
        trained = np.zeros(self.capacity, dtype=bool)
        at = 0
        for c in self.bins[int(self.order(epoch)[j])]:
            a, b = self.offsets[c], self.offsets[c + 1]
            ids[at:at + b - a], trained[at:at + b - a] = self.ids[a:b], self.trained[a:b]
            trained[at] = False  # nothing of the conversation precedes its first token
            at += b - a
        return ids, trained


class SFTData:
    """The token source of ``--sft`` (``get_tokens`` as every source, and ``get_loss_mask``).

    ``sets``: ``(files, split, flag)`` triples: JSON-lines files, the ``--split`` that cuts their
    conversations (``"1,0,0"`` for a training-only set) and the flag that named them (for errors); a split
    is taken from the first set that has it.  ``tokenizer``: encodes text (:mod:`megazero.data.tokenizer`);
    ``prompt_format``: ``--sft-tokenizer-prompt-format`` (None: the tokenizer's chat template when it has
    one).  ``pack``: several conversations to a sequence; ``documents``: whether the model finds documents
    at the EOD ids (``--reset-attention-mask`` or ``--reset-position-ids``; default ``pack``), so that an
    EOD inside a conversation is refused."""

    def __init__(self, sets: Sequence[tuple], tokenizer, seq_length: int, seed: int = 1234,
                 prompt_format: Optional[str] = None, pack: bool = True, vocab_size: Optional[int] = None,
                 documents: Optional[bool] = None):
        self.seq_length, self.eod, self.masked_token = seq_length, int(tokenizer.eod), None
        self.tokenizer = tokenizer
        self.prompt_format = resolve_format(prompt_format, tokenizer)
        self.splits: Dict[str, _Split] = {}
        self.pack, self.files = pack, {}
        self.documents = pack if documents is None else documents
        for files, split_text, flag in sets:
            records = [(f"{path}:{line}", m) for path in files for line, m in read_conversations(path)]
            bounds = split_bounds(len(records), parse_split(split_text))
            for s, name in enumerate(SPLIT_NAMES):
                part = records[bounds[s]:bounds[s + 1]]
                if part and name not in self.splits:
                    encoded = [self._encode(where, m, vocab_size, flag) for where, m in part]
                    self.files[name] = list(files)
                    self.splits[name] = _Split([e[0] for e in encoded], [e[1] for e in encoded],
                                               seq_length + 1, pack, seed, s)

    def _encode(self, where: str, messages, vocab_size: Optional[int], flag: str):
        try:
            ids, trained = encode(messages, self.tokenizer, self.prompt_format, self.eod)
        except ValueError as err:
            raise ValueError(f"{flag} {where}: {err}") from None
        if len(ids) > self.seq_length + 1:
            raise ValueError(f"{flag} {where}: the conversation is {len(ids)} tokens, longer than a sequence "
                             f"({self.seq_length} + 1): raise --seq-length or shorten it")
        if self.documents and self.eod in ids[:-1]:
            raise ValueError(f"{flag} {where}: the end-of-document id {self.eod} occurs inside the "
                             "conversation (its text or template holds the tokenizer's EOS), which would "
                             "cut it in two for --reset-attention-mask / --reset-position-ids; remove it, or "
                             "use a tokenizer whose EOS is not a turn end")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"{flag} {where}: token id {max(ids)} is outside the model's vocabulary of "
                             f"{vocab_size}")
        return ids, trained

    def check(self, splits: Sequence[str] = ("train",)) -> None:
        """Raise now (not mid-training) when a split that is read holds no conversation."""
        for split in splits:
            if split not in self.splits:
                raise ValueError(f"--sft: the {split} split holds no conversation (check --split and the "
                                 "files' line counts)")

    def packing(self, split: str = "train") -> float:
        """The fraction of the split's sequence slots that hold conversation tokens (1: no filler)."""
        s = self.splits[split]
        return s.tokens / (len(s.bins) * s.capacity)

    def summary_lines(self, split: str, samples: int) -> List[str]:
        """The start-up summary's lines (megazero.training.summary): the split's conversations, how they
        are packed, and the epochs ``samples`` take."""
        s = self.splits[split]
        how = "packed" if self.pack else "one per sequence (no --reset-attention-mask)"
        files = " ".join(self.files[split])
        return [f"  {files} (--sft, prompt format {self.prompt_format}): {split} split: "
                f"{len(s.offsets) - 1:,} conversations, {s.tokens:,} tokens in {len(s.bins):,} sequences of "
                f"{s.capacity} ({how}, {100 * self.packing(split):.1f}% of the slots hold conversation "
                f"tokens); {samples / len(s.bins):.3g} epochs at this schedule"]

    def _rows(self, indices: Sequence[int], split: str):
        if split not in self.splits:
            raise ValueError(f"--sft: no {split} conversations")
        rows = [self.splits[split].sample(i, self.eod) for i in indices]
        width = self.seq_length + 1
        ids = np.stack([r[0] for r in rows]) if rows else np.empty((0, width), np.int64)
        trained = np.stack([r[1] for r in rows]) if rows else np.empty((0, width), bool)
        return ids, trained

    def get_tokens(self, indices: Sequence[int], split: str = "train") -> torch.Tensor:
        """Token ids ``[len(indices), seq_length + 1]`` (int64) of the given global samples."""
        return torch.from_numpy(self._rows(indices, split)[0])

    def get_loss_mask(self, indices: Sequence[int], split: str = "train") -> torch.Tensor:
        """``[len(indices), seq_length]`` float: 1 where the label (the next token) is trained."""
        return torch.from_numpy(self._rows(indices, split)[1][:, 1:].astype(np.float32))


def build_sft_data(cfg):
    """The ``--sft`` source of a validated config."""
    from megazero.data.tokenizer import tokenizer_from_config
    d = cfg.data
    if d.data_path:
        sets = [(list(d.data_path), d.split, "--data-path")]
    else:
        sets = [(list(d.train_data_path), "1,0,0", "--train-data-path")]
        if d.valid_data_path:
            sets.append((list(d.valid_data_path), "0,1,0", "--valid-data-path"))
    data = SFTData(sets, tokenizer_from_config(cfg), cfg.model.seq_length, cfg.training.seed,
                   d.sft_tokenizer_prompt_format, pack=d.reset_attention_mask,
                   vocab_size=cfg.model.vocab_size,
                   documents=d.reset_attention_mask or d.reset_position_ids)
    splits = ("train", "valid") if cfg.training.eval_interval and cfg.training.eval_iters else ("train",)
    data.check(splits)
    return data
