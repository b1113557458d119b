"""The settings of ``--sft`` (supervised fine-tuning data, :mod:`megazero.data.sft`), checked before any
file is read: conversations come from files and are encoded by a tokenizer, in a prompt format megazero
has."""
from __future__ import annotations

from megazero.errors import ConfigError

PROMPT_FORMATS = ("default", "identity")
NOT_IMPLEMENTED = ("nemotron-h-aligned", "nemotron-nano-v2")


def prompt_format_error(fmt) -> str:
    """'' when ``fmt`` (``--sft-tokenizer-prompt-format``) is a prompt format megazero has, else why not."""
    if fmt is None or fmt in PROMPT_FORMATS:
        return ""
    if fmt in NOT_IMPLEMENTED:
        return (f"--sft-tokenizer-prompt-format {fmt}: Nemotron's prompt formats are not implemented (they "
                "need Nemotron's tokenizer); use default (the tokenizer's chat template) or identity")
    return f"--sft-tokenizer-prompt-format {fmt}: choose default (the tokenizer's chat template) or identity"


def check_sft(cfg) -> None:
    """One-line errors for ``--sft`` settings that cannot work (a ConfigError naming the flag)."""
    data = cfg.data
    if not data.sft:
        return
    if data.mock_data:
        raise ConfigError("--sft reads conversations from --data-path FILE.jsonl; it does not go with "
                          "--mock-data")
    if data.tokenizer_type == "NullTokenizer" or not (data.tokenizer_model or data.vocab_file):
        raise ConfigError("--sft encodes the conversations' text: give --tokenizer-model (a Hugging Face "
                          "directory or a sentencepiece model) or --vocab-file/--merge-file")
    message = prompt_format_error(data.sft_tokenizer_prompt_format)
    if message:
        raise ConfigError(message)
    for flag, items in (("--data-path", data.data_path), ("--train-data-path", data.train_data_path),
                        ("--valid-data-path", data.valid_data_path)):
        weighted = [x for x in items or [] if _is_number(x)]
        if weighted:
            raise ConfigError(f"--sft: {flag} takes JSON-lines files without weights (got {weighted[0]!r}); "
                              "their conversations are read in order")


def _is_number(text) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True
