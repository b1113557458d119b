"""Whose vocabulary size the model takes when a ``--load`` checkpoint and a tokenizer both name one.

As in Megatron-LM (``load_args_from_checkpoint`` copies the checkpoint's padded vocabulary size), a run
with ``--use-checkpoint-args`` builds the checkpoint's embedding, whatever the tokenizer's id count: a
published model's vocabulary is often padded beyond its tokenizer (Qwen2.5 and Qwen3, Phi-3 and OLMo 2
do this), and building the tokenizer's size instead would not load the weights.  The tokenizer's ids
must fit within it; a tokenizer with more ids than the checkpoint's rows is refused in one line.
Without ``--use-checkpoint-args`` the tokenizer sets the vocabulary, as before.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megazero.errors import ConfigError


class SavedVocab:
    """The vocabulary size the ``--load`` checkpoint's model was built with."""

    def __init__(self, size: int, null_tokenizer: bool, source: Optional[str]):
        self.size, self.null_tokenizer, self.source = int(size), null_tokenizer, source

    def check_fits(self, tokenizer_ids: int) -> int:
        """The model's vocabulary size: the checkpoint's, once the tokenizer's ``tokenizer_ids`` fit in it
        (NullTokenizer's one extra id is already counted in the checkpoint's size)."""
        if self.null_tokenizer or tokenizer_ids <= self.size:
            return self.size
        raise ConfigError(f"--use-checkpoint-args: the tokenizer ({self.source}) has {tokenizer_ids:,} ids, "
                          f"but the checkpoint's vocabulary has {self.size:,} rows: its ids would not fit; "
                          "use the tokenizer the checkpoint was trained with (drop --tokenizer-model to take "
                          "the checkpoint's)")

    def notes(self, tokenizer_ids: int) -> List[str]:
        """The start-up note when the checkpoint's rows outnumber the tokenizer's ids."""
        if self.null_tokenizer or tokenizer_ids >= self.size:
            return []
        return [f"vocabulary: the checkpoint's {self.size:,} rows, padding the tokenizer's {tokenizer_ids:,} "
                "ids (--use-checkpoint-args keeps the checkpoint's vocabulary size, as Megatron-LM does)"]


def checkpoint_vocab(settings: Dict[str, Any],
                     per_section: Dict[str, Dict[str, Any]]) -> Optional[SavedVocab]:
    """The checkpoint's vocabulary when ``--use-checkpoint-args`` took it from there (not given here as
    ``--vocab-size``), or None."""
    model, data = per_section["model"], per_section["data"]
    if not settings.get("use_checkpoint_args") or "vocab_size" in settings or "vocab_size" not in model:
        return None
    return SavedVocab(model["vocab_size"], data.get("tokenizer_type") == "NullTokenizer",
                      data.get("tokenizer_model") or data.get("vocab_file"))
