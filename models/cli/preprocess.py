"""``scripts/preprocess_data.py``: tokenize text into Megatron-LM's indexed format
(:mod:`megazero.data.preprocess`)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from megazero.data import preprocess
from megazero.data.indexed import IndexedDatasetWriter, best_dtype
from megazero.data.preprocess import TOKENIZER_TYPES, Encoder, batches, is_json, read_documents
from megazero.data.tokenizer import load_tokenizer
from megazero.errors import EXIT_OK, EXIT_USAGE


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=preprocess.__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL or text files.")
    p.add_argument("--output-prefix", required=True, help="Writes PREFIX_{key}_document.bin/.idx.")
    p.add_argument("--tokenizer-model", required=True,
                   help="sentencepiece .model file, or a Hugging Face tokenizer directory.")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="Accepted for Megatron compatibility; the kind is taken from --tokenizer-model "
                   "(a directory is a Hugging Face tokenizer, a file a sentencepiece model).")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default text).")
    p.add_argument("--append-eod", action="store_true", help="End every document with the EOD id.")
    p.add_argument("--workers", type=int, default=1,
                   help="Tokenizer processes (default 1; inputs under 2 x 256 KB use 1).")
    p.add_argument("--text-document", default="paragraph", choices=["paragraph", "file"],
                   help="Plain-text inputs: a document per blank-line-separated paragraph or per file.")
    p.add_argument("--split-sentences", action="store_true", help="Not supported (refused).")
    p.add_argument("--keep-newlines", action="store_true",
                   help="Accepted for Megatron compatibility (no effect): text reaches the tokenizer "
                   "with its newlines; whether they become tokens depends on how the tokenizer was trained "
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
    if any(not is_json(f) for f in args.input) and args.json_keys != ["text"]:
        p.error("--json-keys applies to JSONL inputs; plain-text inputs give the key 'text'")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer_model)
        if args.append_eod:
            tokenizer.eod  # noqa: B018 - fails now if the tokenizer has none
    except (FileNotFoundError, ValueError) as err:
        print(f"preprocess_data.py: error: --tokenizer-model: {err}", file=sys.stderr)
        return EXIT_USAGE
    keys = args.json_keys if any(is_json(f) for f in args.input) else ["text"]
    dtype = best_dtype(tokenizer.vocab_size)
    in_bytes = sum(os.path.getsize(f) for f in args.input)
    # below a few batches of input, worker processes cost more than they save
    workers = args.workers if in_bytes > 2 * preprocess.BATCH_BYTES else 1
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
            results = pool.imap(encoder.encode_batch,
                                batches(docs, preprocess.BATCH_BYTES, preprocess.BATCH_DOCS))
        else:
            results = map(encoder.encode_batch, batches(docs, preprocess.BATCH_BYTES, preprocess.BATCH_DOCS))
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
        return EXIT_USAGE
    except OSError as err:  # the output cannot be written (a read-only directory, a full disk)
        where = err.filename or args.output_prefix
        print(f"preprocess_data.py: error: --output-prefix {args.output_prefix}: cannot write {where} "
              f"({err.strerror or err}); choose a writable location", file=sys.stderr)
        return EXIT_USAGE
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
    return EXIT_OK
