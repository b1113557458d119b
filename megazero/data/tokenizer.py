"""Tokenizers: a sentencepiece ``.model`` file (read by sentencepiece itself), or a Hugging Face
tokenizer directory (read by ``transformers.AutoTokenizer``).

Both expose ``encode(text) -> List[int]`` (no BOS/EOS added), ``decode(ids) -> str``,
``vocab_size``, ``eod`` (the end-of-document id that ``--append-eod`` appends: the EOS id) and
``bos_id``/``eos_id``/``pad_id``/``unk_id`` (-1 where the tokenizer has none).

Note: in transformers 5.x ``LlamaTokenizer(vocab_file=...)`` silently ignores the file, which
is why a ``.model`` file goes straight to sentencepiece and a Hugging Face tokenizer is loaded
from its directory and checked by a round trip.
"""
from __future__ import annotations

import os
from typing import List, Sequence

ROUND_TRIP_TEXT = "Hello world, this is a tokenizer check: 12345."


class SentencePieceTokenizer:
    """A sentencepiece model file."""

    def __init__(self, model_file: str):
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"tokenizer model not found: {model_file}")
        import sentencepiece as spm
        self.path = model_file
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_file)
        except (OSError, RuntimeError) as err:
            raise ValueError(f"{model_file}: not a sentencepiece model ({err})") from None
        self.vocab_size = int(self.sp.GetPieceSize())
        self.bos_id, self.eos_id = int(self.sp.bos_id()), int(self.sp.eos_id())
        self.pad_id, self.unk_id = int(self.sp.pad_id()), int(self.sp.unk_id())

    @property
    def eod(self) -> int:
        if self.eos_id < 0:
            raise ValueError(f"{self.path}: the sentencepiece model has no EOS piece to mark the end of "
                             "a document; train it with an eos id (scripts/train_tokenizer.py does)")
        return self.eos_id

    def encode(self, text: str) -> List[int]:
        return list(self.sp.EncodeAsIds(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class HFTokenizer:
    """A Hugging Face tokenizer directory (``tokenizer.json`` / ``tokenizer_config.json`` ...)."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"tokenizer directory not found: {directory}")
        from transformers import AutoTokenizer
        self.path = directory
        self.tok = AutoTokenizer.from_pretrained(directory)
        self.vocab_size = len(self.tok)

        def tid(name: str) -> int:
            v = getattr(self.tok, name, None)
            return -1 if v is None else int(v)
        self.bos_id, self.eos_id = tid("bos_token_id"), tid("eos_token_id")
        self.pad_id, self.unk_id = tid("pad_token_id"), tid("unk_token_id")
        ids = self.encode(ROUND_TRIP_TEXT)
        back = self.decode(ids)
        if not ids or set(ids) <= {self.unk_id} or back.strip() != ROUND_TRIP_TEXT:
            raise ValueError(f"{directory}: the tokenizer does not round-trip text ({ROUND_TRIP_TEXT!r} -> "
                             f"{ids[:12]} -> {back!r}); is the vocabulary file missing?")

    @property
    def eod(self) -> int:
        if self.eos_id < 0:
            raise ValueError(f"{self.path}: the tokenizer has no eos token to mark the end of a document")
        return self.eos_id

    def encode(self, text: str) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def load_tokenizer(path: str):
    """A directory loads as a Hugging Face tokenizer, a file as a sentencepiece model."""
    if os.path.isdir(path):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
