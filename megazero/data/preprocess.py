"""Text to Megatron-LM's indexed format
(``{prefix}_{key}_document.bin/.idx``).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model data/tok.model --append-eod --workers 2

Flags follow Megatron-LM's ``tools/preprocess_data.py``.  Inputs:

* ``.json`` / ``.jsonl`` files: one JSON object per line; each ``--json-keys`` field (default
  ``text``) is one document of the dataset ``{prefix}_{key}_document``.
* any other file is plain text, written to ``{prefix}_text_document``.  ``--text-document
  paragraph`` (the default) makes each blank-line-separated paragraph a document (whitespace at
  its ends stripped, empty paragraphs dropped); ``--text-document file`` makes each file one.

A document's ids are one sequence (no sentence splitting); ``--append-eod`` ends each non-empty
document with the tokenizer's EOD (EOS) id, as Megatron does.  Documents keep input order.
"""
import json
import re

import numpy as np

from megazero.data.tokenizer import load_tokenizer

TOKENIZER_TYPES = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer"]
PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")
BATCH_BYTES = 1 << 18  # characters of text per task of the worker pool
BATCH_DOCS = 4096


def is_json(path: str) -> bool:
    return path.endswith((".json", ".jsonl"))


def read_documents(paths, keys, text_document="paragraph"):
    """Yield ``{key: text}`` per document, in input order."""
    for path in paths:
        if is_json(path):
            with open(path, encoding="utf-8") as fh:
                for line_no, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from None
                    yield _json_document(obj, keys, f"{path}:{line_no}")
        else:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read().lstrip("\ufeff").replace("\r\n", "\n")
            if text_document == "file":
                yield {"text": text}
            else:
                for para in PARAGRAPH.split(text):
                    para = para.strip()
                    if para:
                        yield {"text": para}


def _json_document(obj, keys, where: str):
    """``{key: text}`` of one JSONL record; anything but a string under a key is refused (a null or a
    number would otherwise be tokenized as the text "None" or "12345")."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{where}: no field {missing[0]!r} (--json-keys {' '.join(keys)})")
    bad = [k for k in keys if not isinstance(obj[k], str)]
    if bad:
        value = obj[bad[0]]
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: field {bad[0]!r} is {kind} ({json.dumps(value)[:40]}), not text; fix or "
                         "drop that record")
    return {k: obj[k] for k in keys}


class Encoder:
    """Tokenizes documents; one per worker process (the tokenizer loads in each)."""

    def __init__(self, tokenizer_model: str, append_eod: bool):
        self.tokenizer_model, self.append_eod = tokenizer_model, append_eod
        self.tokenizer = None

    def initializer(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_model)

    def encode(self, doc):
        if self.tokenizer is None:
            self.initializer()
        out, nbytes = {}, 0
        for key, text in doc.items():
            ids = self.tokenizer.encode(text)
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            out[key] = ids
            nbytes += len(text.encode("utf-8"))
        return out, nbytes

    def encode_batch(self, docs):
        """Documents -> ``({key: (ids, lengths)}, n_docs, n_bytes)``: each key's ids of all the
        documents back to back (int64) and each document's length (arrays pickle cheaply)."""
        ids = {}
        lengths = {}
        n_bytes = 0
        for doc in docs:
            out, nbytes = self.encode(doc)
            n_bytes += nbytes
            for key, seq in out.items():
                ids.setdefault(key, []).extend(seq)
                lengths.setdefault(key, []).append(len(seq))
        return ({k: (np.asarray(ids[k], dtype=np.int64), np.asarray(lengths[k], dtype=np.int64))
                 for k in ids},
                len(docs), n_bytes)


def batches(docs, max_bytes: int = BATCH_BYTES, max_docs: int = BATCH_DOCS):
    """Group documents into lists of about ``max_bytes`` of text (at most ``max_docs`` documents):
    one task per list keeps a worker pool's per-task overhead small next to the tokenizing."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += sum(len(t) for t in doc.values())
        if size >= max_bytes or len(batch) >= max_docs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
