"""``scripts/preprocess_data.py``: tokenize text into Megatron-LM's indexed format
(:mod:`megazero.data.preprocess`)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from megazero.data import preprocess
from megazero.data.indexed import IndexedDatasetWriter, best_dtype
from megazero.data.preprocess import (TOKENIZER_TYPES, Encoder, TokenizerSettings, batches, input_files,
                                      is_json, is_parquet, partitioned, read_documents)
from megazero.errors import EXIT_OK, EXIT_USAGE


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=preprocess.__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="Files, directories (their .json/.jsonl[.gz], .parquet and .txt[.gz] files, "
                   "sorted) or glob patterns: JSONL (gzipped or not), parquet, or plain text.")
    p.add_argument("--output-prefix", required=True, help="Writes PREFIX_{key}_document.bin/.idx.")
    p.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model file, or a Hugging Face tokenizer directory.")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="Megatron-LM's tokenizer type; default from the files given (a directory is a "
                   "Hugging Face tokenizer, a file a sentencepiece model, --vocab-file/--merge-file GPT-2 "
                   "BPE). NullTokenizer reads text that holds token ids separated by spaces.")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json.")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt.")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids are below this.")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON fields (parquet columns) to tokenize, a dataset each (default text).")
    p.add_argument("--append-eod", action="store_true", help="End every document with the EOD id.")
    p.add_argument("--workers", type=int, default=1,
                   help="Tokenizer processes (default 1; inputs under 2 x 256 KB use 1); a multiple of "
                   "--partitions.")
    p.add_argument("--partitions", type=int, default=1,
                   help="Megatron-LM's partitions: document i goes to partition i mod N, each written as "
                   "PREFIX_{p}_{key}_document, then all merged in order into PREFIX_{key}_document.")
    p.add_argument("--keep-sequential-samples", action="store_true",
                   help="With --partitions: consecutive documents per partition, so the merged dataset "
                   "keeps the input order.")
    p.add_argument("--text-document", default="paragraph", choices=["paragraph", "file"],
                   help="Plain-text inputs: a document per blank-line-separated paragraph or per file.")
    p.add_argument("--split-sentences", action="store_true", help="Not supported (refused).")
    p.add_argument("--keep-newlines", action="store_true",
                   help="Accepted for Megatron compatibility: in Megatron it matters only with "
                   "--split-sentences; text reaches the tokenizer with its newlines either way.")
    p.add_argument("--log-interval", type=int, default=1000,
                   help="Print progress every this many documents (0: never).")
    args = p.parse_args(argv)
    if args.split_sentences:
        p.error("--split-sentences is not supported: documents are tokenized whole")
    if args.workers < 1 or args.partitions < 1:
        p.error(f"--workers ({args.workers}) and --partitions ({args.partitions}) must be >= 1")
    if args.workers % args.partitions:
        p.error(f"--workers {args.workers} is not a multiple of --partitions {args.partitions} (each "
                "partition gets the same number of workers, as in Megatron-LM); use e.g. --workers "
                f"{args.partitions * max(1, args.workers // args.partitions)}")
    try:
        args.input = input_files(args.input)
    except ValueError as err:
        p.error(str(err))
    plain = [f for f in args.input if not (is_json(f) or is_parquet(f))]
    if plain and args.json_keys != ["text"]:
        p.error(f"--json-keys applies to JSONL and parquet inputs; plain-text inputs ({plain[0]}) give the "
                "key 'text'")
    return args


def _writers(prefix: str, keys, partitions: int, dtype):
    """``{(partition, key): writer}``: the final datasets, or each partition's (merged later)."""
    if partitions == 1:
        return {(0, k): IndexedDatasetWriter(f"{prefix}_{k}_document", dtype) for k in keys}
    return {(p, k): IndexedDatasetWriter(f"{prefix}_{p}_{k}_document", dtype)
            for p in range(partitions) for k in keys}


def _merge(prefix: str, keys, partitions: int, dtype) -> None:
    """Megatron-LM's last step with --partitions: each key's partitions appended in order."""
    for k in keys:
        with IndexedDatasetWriter(f"{prefix}_{k}_document", dtype) as out:
            for p in range(partitions):
                out.add_index(f"{prefix}_{p}_{k}_document")


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = TokenizerSettings(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                 args.vocab_size)
    try:
        tokenizer = settings.build()
        if args.append_eod:
            tokenizer.eod  # noqa: B018 - fails now if the tokenizer has none
    except (FileNotFoundError, ValueError) as err:
        print(f"preprocess_data.py: error: tokenizer: {err}", file=sys.stderr)
        return EXIT_USAGE
    keys = args.json_keys if any(is_json(f) or is_parquet(f) for f in args.input) else ["text"]
    dtype = best_dtype(tokenizer.vocab_size)
    in_bytes = sum(os.path.getsize(f) for f in args.input)
    # below a few batches of input, worker processes cost more than they save
    workers = args.workers if in_bytes > 2 * preprocess.BATCH_BYTES else 1
    encoder = Encoder(settings, args.append_eod)
    start = time.perf_counter()
    n_docs = n_tokens = n_bytes = 0
    pool = None
    writers = {}
    try:
        total = (sum(1 for _ in read_documents(args.input, keys, args.text_document))
                 if args.keep_sequential_samples and args.partitions > 1 else None)
        docs = partitioned(read_documents(args.input, keys, args.text_document), args.partitions, total)
        writers = _writers(args.output_prefix, keys, args.partitions, dtype)
        tasks = batches(docs, preprocess.BATCH_BYTES, preprocess.BATCH_DOCS)
        if workers > 1:
            import multiprocessing as mp
            pool = mp.get_context("fork").Pool(workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode_batch, tasks)
        else:
            results = map(encoder.encode_batch, tasks)
        for part, encoded, batch_docs, batch_bytes in results:
            for key, (ids, lengths) in encoded.items():
                writers[part, key].add_documents(ids, lengths)
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
        if args.partitions > 1:
            _merge(args.output_prefix, keys, args.partitions, dtype)
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
