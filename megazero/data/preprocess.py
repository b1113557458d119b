"""``scripts/preprocess_data.py``: text to Megatron-LM's indexed format
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
import argparse
import json
import os
import re
import sys
import time

import numpy as np

from megazero.data.indexed import IndexedDatasetWriter, best_dtype
from megazero.data.tokenizer import load_tokenizer

TOKENIZER_TYPES = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer"]
PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")
BATCH_BYTES = 1 << 18  # characters of text per task of the worker pool
BATCH_DOCS = 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL or text files.")
    p.add_argument("--output-prefix", required=True, help="Writes PREFIX_{key}_document.bin/.idx.")
    p.add_argument("--tokenizer-model", required=True,
                   help="sentencepiece .model file, or a Hugging Face tokenizer directory.")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="Accepted for Megatron compatibility; the kind is taken from --tokenizer-model "
                   "(a directory is a Hugging Face tokenizer, a file a sentencepiece model).")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default text).")
    p.add_argument("--append-eod", action="store_true", help="End every document with the EOD id.")
    p.add_argument("--workers", type=int, default=1, help="Tokenizer processes (default 1; inputs under 2 x 256 KB use 1).")
    p.add_argument("--text-document", default="paragraph", choices=["paragraph", "file"],
                   help="Plain-text inputs: a document per blank-line-separated paragraph or per file.")
    p.add_argument("--split-sentences", action="store_true", help="Not supported (refused).")
    p.add_argument("--keep-newlines", action="store_true",
                   help="Accepted for Megatron compatibility (no effect): text reaches the tokenizer with its "
                   "newlines; whether they become tokens depends on how the tokenizer was trained "
                   "(scripts/train_tokenizer.py --keep-newlines).")
    p.add_argument("--log-interval", type=int, default=0, help="Print progress every this many documents.")
    args = p.parse_args(argv)
    if args.split_sentences:
        p.error("--split-sentences is not supported: documents are tokenized whole")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    for path in args.input:
        if not os.path.isfile(path):
            p.error(f"--input file not found: {path}")
    if any(not _is_json(f) for f in args.input) and args.json_keys != ["text"]:
        p.error("--json-keys applies to JSONL inputs; plain-text inputs give the key 'text'")
    return args


def _is_json(path: str) -> bool:
    return path.endswith((".json", ".jsonl"))


def read_documents(paths, keys, text_document="paragraph"):
    """Yield ``{key: text}`` per document, in input order."""
    for path in paths:
        if _is_json(path):
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
        return ({k: (np.asarray(ids[k], dtype=np.int64), np.asarray(lengths[k], dtype=np.int64)) for k in ids},
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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer_model)
        if args.append_eod:
            tokenizer.eod  # noqa: B018 - fails now if the tokenizer has none
    except (FileNotFoundError, ValueError) as err:
        print(f"preprocess_data.py: error: --tokenizer-model: {err}", file=sys.stderr)
        return 2
    keys = args.json_keys if any(_is_json(f) for f in args.input) else ["text"]
    dtype = best_dtype(tokenizer.vocab_size)
    in_bytes = sum(os.path.getsize(f) for f in args.input)
    # below a few batches of input, worker processes cost more than they save
    workers = args.workers if in_bytes > 2 * BATCH_BYTES else 1
    encoder = Encoder(args.tokenizer_model, args.append_eod)
    docs = read_documents(args.input, keys, args.text_document)
    start = time.perf_counter()
    n_docs = n_tokens = n_bytes = 0
    pool = None
    writers = {}
    try:
        for k in keys:
            writers[k] = IndexedDatasetWriter(f"{args.output_prefix}_{k}_document", dtype)
        if workers > 1:
            import multiprocessing as mp
            pool = mp.get_context("fork").Pool(workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode_batch, batches(docs, BATCH_BYTES, BATCH_DOCS))
        else:
            results = map(encoder.encode_batch, batches(docs, BATCH_BYTES, BATCH_DOCS))
        for encoded, batch_docs, batch_bytes in results:
            for key, (ids, lengths) in encoded.items():
                writers[key].add_documents(ids, lengths)
                n_tokens += int(ids.size)
            before, n_docs, n_bytes = n_docs, n_docs + batch_docs, n_bytes + batch_bytes
            if args.log_interval and n_docs // args.log_interval > before // args.log_interval:
                elapsed = time.perf_counter() - start
                print(f"processed {n_docs} documents ({n_docs / elapsed:.0f} docs/s, "
                      f"{n_bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr)
        if n_tokens == 0:
            what = "no documents" if n_docs == 0 else f"{n_docs} documents but no tokens"
            raise ValueError(f"--input {' '.join(args.input)}: {what}; nothing to write to "
                             f"{args.output_prefix}_*_document")
        for w in writers.values():
            w.finalize()
    except ValueError as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the output cannot be written (a read-only directory, a full disk)
        where = err.filename or args.output_prefix
        print(f"preprocess_data.py: error: --output-prefix {args.output_prefix}: cannot write {where} "
              f"({err.strerror or err}); choose a writable location", file=sys.stderr)
        return 2
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for w in writers.values():
            w.abort()  # a no-op after finalize; else the old dataset at the prefix is kept
    elapsed = max(time.perf_counter() - start, 1e-9)
    for key in keys:
        print(f"preprocess_data.py: wrote {args.output_prefix}_{key}_document.bin/.idx "
              f"({dtype.__name__})")
    print(f"preprocess_data.py: {n_docs} documents, {n_tokens} tokens, {n_bytes / 1e6:.2f} MB in "
          f"{elapsed:.2f} s ({n_bytes / elapsed / 1e6:.2f} MB/s, {n_tokens / elapsed:.0f} tokens/s, "
          f"{workers} worker{'s' if workers > 1 else ''})")
    return 0
