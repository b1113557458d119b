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


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (Megatron-LM's GPT2BPETokenizer),
    read by the ``tokenizers`` library; the end of document is ``<|endoftext|>``."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: no such file")
        from tokenizers import ByteLevelBPETokenizer
        self.paths = (vocab_file, merge_file)
        try:
            self.tok = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE "
                             f"vocabulary ({err})") from None
        self.vocab_size = int(self.tok.get_vocab_size())
        eod = self.tok.token_to_id(self.EOD_TOKEN)
        self.eos_id = -1 if eod is None else int(eod)
        self.bos_id, self.pad_id, self.unk_id = self.eos_id, -1, -1

    @property
    def eod(self) -> int:
        if self.eos_id < 0:
            raise ValueError(f"--vocab-file {self.paths[0]}: no {self.EOD_TOKEN} token to mark the end "
                             "of a document")
        return self.eos_id

    def encode(self, text: str) -> List[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def __getstate__(self):
        return {"paths": self.paths}

    def __setstate__(self, state):
        self.__init__(*state["paths"])


class NullTokenizer:
    """No tokenizer (Megatron-LM's NullTokenizer): token ids below ``vocab_size`` and one more id,
    ``vocab_size``, for the end of a document; text cannot be encoded."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size) + 1
        self.eos_id = self.bos_id = int(vocab_size)
        self.pad_id = self.unk_id = -1

    @property
    def eod(self) -> int:
        return self.eos_id

    def encode(self, text: str) -> List[int]:
        """Text that already holds token ids, separated by whitespace (Megatron-LM's NullTokenizer)."""
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"--tokenizer-type NullTokenizer reads token ids separated by spaces, found "
                             f"{text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.eos_id]
        if bad:
            raise ValueError(f"--tokenizer-type NullTokenizer: token id {bad[0]} is outside "
                             f"[0, {self.eos_id}) (--vocab-size {self.eos_id})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def tokenizer_from_settings(tokenizer_type, tokenizer_model, vocab_file, merge_file, vocab_size):
    """The tokenizer that ``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``/``--merge-file``
    describe, or None when they name none.  Without a type it follows the files given."""
    if tokenizer_type is None:
        if tokenizer_model:
            return load_tokenizer(tokenizer_model)
        if vocab_file or merge_file:
            tokenizer_type = "GPT2BPETokenizer"
        else:
            return None
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size (its ids are below it)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json and "
                             "--merge-file merges.txt")
        return GPT2BPETokenizer(vocab_file, merge_file)
    hf_types = ("HuggingFaceTokenizer", "SFTTokenizer")  # Megatron-LM's SFTTokenizer: a HF directory too
    if not tokenizer_model:
        what = ("a Hugging Face tokenizer directory" if tokenizer_type in hf_types
                else "a sentencepiece .model file")
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model ({what})")
    if tokenizer_type in hf_types:
        if not os.path.isdir(tokenizer_model):
            raise ValueError(f"--tokenizer-type {tokenizer_type}: --tokenizer-model {tokenizer_model} "
                             "is not a directory (save the tokenizer with save_pretrained)")
        return HFTokenizer(tokenizer_model)
    if os.path.isdir(tokenizer_model):
        raise ValueError(f"--tokenizer-type {tokenizer_type}: --tokenizer-model {tokenizer_model} is a "
                         "directory; give the sentencepiece .model file (or --tokenizer-type "
                         "HuggingFaceTokenizer)")
    return SentencePieceTokenizer(tokenizer_model)


def tokenizer_from_config(cfg):
    """The tokenizer of a config (its data section), or None."""
    d = cfg.data
    vocab = cfg.model.vocab_size - 1 if d.tokenizer_type == "NullTokenizer" else cfg.model.vocab_size
    return tokenizer_from_settings(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, vocab)
