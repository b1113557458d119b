"""Text to Megatron-LM's indexed format
(``{prefix}_{key}_document.bin/.idx``).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model data/tok.model --append-eod --workers 2

Flags follow Megatron-LM's ``tools/preprocess_data.py``.  ``--input`` takes files, directories
(every input file inside, recursively, in sorted order) and glob patterns:

* ``.json`` / ``.jsonl`` files, gzipped or not (``.jsonl.gz``): one JSON object per line; each
  ``--json-keys`` field (default ``text``) is one document of the dataset ``{prefix}_{key}_document``;
* ``.parquet`` files: one record per row, the ``--json-keys`` columns read (needs ``pyarrow``);
* any other file is plain text (gzipped or not), written to ``{prefix}_text_document``.
  ``--text-document paragraph`` (the default) makes each blank-line-separated paragraph a document
  (whitespace at its ends stripped, empty paragraphs dropped); ``--text-document file`` makes each
  file one.

A document's ids are one sequence (no sentence splitting); ``--append-eod`` ends each non-empty
document with the tokenizer's EOD (EOS) id, as Megatron does.  Documents keep input order, except
that with ``--partitions N`` (Megatron's meaning) document ``i`` goes to partition ``i mod N``
(``--keep-sequential-samples``: to consecutive ranges), each partition is written as
``{prefix}_{p}_{key}_document`` and the partitions are then merged, in order, into
``{prefix}_{key}_document``.
"""
import glob
import gzip
import json
import os
import re
from typing import List, NamedTuple, Optional

import numpy as np

from megazero.data.tokenizer import tokenizer_from_settings

TOKENIZER_TYPES = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"]
PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")
BATCH_BYTES = 1 << 18  # characters of text per task of the worker pool
BATCH_DOCS = 4096
JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
INPUT_SUFFIXES = JSON_SUFFIXES + (".parquet", ".txt", ".txt.gz", ".text")


class TokenizerSettings(NamedTuple):
    """What names the tokenizer (Megatron-LM's tokenizer flags); picklable, so each worker builds its own."""
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None

    def build(self):
        tokenizer = tokenizer_from_settings(*self)
        if tokenizer is None:
            raise ValueError("no tokenizer: give --tokenizer-model, --vocab-file and --merge-file "
                             "(GPT2BPETokenizer) or --tokenizer-type NullTokenizer --vocab-size N")
        return tokenizer


def is_json(path: str) -> bool:
    return path.endswith(JSON_SUFFIXES)


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


def input_files(paths: List[str]) -> List[str]:
    """``--input``'s files: each path a file, a directory (its files with an input suffix, recursively,
    sorted) or a glob pattern (its matches, sorted).  Raises ``ValueError`` naming a path that gives none."""
    out: List[str] = []
    for path in paths:
        if os.path.isfile(path):
            out.append(path)
        elif os.path.isdir(path):
            found = sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                           if f.endswith(INPUT_SUFFIXES))
            if not found:
                raise ValueError(f"--input {path}: a directory with no input files "
                                 f"({', '.join(INPUT_SUFFIXES)})")
            out += found
        else:
            found = sorted(f for f in glob.glob(path) if os.path.isfile(f))
            if not found:
                raise ValueError(f"--input {path}: no such file, directory or matching files")
            out += found
    return out


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _parquet_records(path: str, keys):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--input {path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        reader = pq.ParquetFile(path)
        missing = [k for k in keys if k not in reader.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r} (--json-keys {' '.join(keys)}); it has "
                             f"{', '.join(reader.schema_arrow.names)}")
        row = 0
        for batch in reader.iter_batches(columns=list(keys)):
            for obj in batch.to_pylist():
                row += 1
                yield obj, f"{path}: row {row}"
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None


def read_documents(paths, keys, text_document="paragraph"):
    """Yield ``{key: text}`` per document, in input order."""
    for path in paths:
        if is_parquet(path):
            for obj, where in _parquet_records(path, keys):
                yield _json_document(obj, keys, where)
            continue
        try:
            yield from (_json_lines(path, keys) if is_json(path) else _text_documents(path, text_document))
        except (OSError, EOFError) as err:  # a truncated or corrupt .gz
            raise ValueError(f"{path}: cannot be read ({err})") from None


def _json_lines(path: str, keys):
    with _open_text(path) as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from None
            yield _json_document(obj, keys, f"{path}:{line_no}")


def _text_documents(path: str, text_document: str):
    with _open_text(path) as fh:
        text = fh.read().lstrip("\ufeff").replace("\r\n", "\n")
    if text_document == "file":
        yield {"text": text}
        return
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


def partitioned(docs, partitions: int, sequential_total: Optional[int] = None):
    """``(partition, document)`` pairs: document ``i`` goes to partition ``i mod partitions`` (Megatron's
    round robin), or with ``sequential_total`` (``--keep-sequential-samples``, the number of documents)
    to consecutive ranges of ``ceil(total / partitions)`` documents."""
    size = -(-sequential_total // partitions) if sequential_total else None
    for i, doc in enumerate(docs):
        yield (min(i // size, partitions - 1) if size else i % partitions), doc


class Encoder:
    """Tokenizes documents; one per worker process (the tokenizer loads in each)."""

    def __init__(self, settings: TokenizerSettings, append_eod: bool):
        self.settings, self.append_eod = settings, append_eod
        self.tokenizer = None

    def initializer(self) -> None:
        self.tokenizer = self.settings.build()

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

    def encode_batch(self, task):
        """``(partition, documents)`` -> ``(partition, {key: (ids, lengths)}, n_docs, n_bytes)``: each
        key's ids of all the documents back to back (int64) and each document's length (arrays
        pickle cheaply)."""
        part, docs = task
        ids, lengths, n_bytes = {}, {}, 0
        for doc in docs:
            out, nbytes = self.encode(doc)
            n_bytes += nbytes
            for key, seq in out.items():
                ids.setdefault(key, []).extend(seq)
                lengths.setdefault(key, []).append(len(seq))
        return (part, {k: (np.asarray(ids[k], dtype=np.int64), np.asarray(lengths[k], dtype=np.int64))
                       for k in ids}, len(docs), n_bytes)


def batches(docs, max_bytes: int = BATCH_BYTES, max_docs: int = BATCH_DOCS):
    """Group ``(partition, document)`` pairs into ``(partition, documents)`` of about ``max_bytes`` of
    text (at most ``max_docs`` documents) per partition: one task per list keeps a worker pool's
    per-task overhead small next to the tokenizing.  A partition's lists come in its documents' order."""
    pending = {}
    for part, doc in docs:
        batch, size = pending.get(part, ([], 0))
        batch.append(doc)
        size += sum(len(t) for t in doc.values())
        if size >= max_bytes or len(batch) >= max_docs:
            yield part, batch
            pending.pop(part, None)
        else:
            pending[part] = (batch, size)
    for part in sorted(pending):
        yield part, pending[part][0]
