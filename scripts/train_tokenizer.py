#!/usr/bin/env python
"""Train a sentencepiece BPE tokenizer on text files.

    python scripts/train_tokenizer.py --input a.txt b.txt --vocab-size 8000 --model-prefix data/tok

writes ``data/tok.model`` (pass it as ``--tokenizer-model``) and ``data/tok.vocab``.  Every line
of the input is one sentencepiece "sentence" (so with ``--keep-newlines`` the newline piece is
learnt from the user symbol, not from the training lines).  Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS, the
end-of-document id that ``preprocess_data.py --append-eod`` appends), 3 <pad>.
"""
import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # run from a checkout without installing

from megazero.errors import EXIT_OK  # noqa: E402 - after the path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="Text files to train on.")
    p.add_argument("--vocab-size", type=int, default=8000, help="Vocabulary size (default 8000).")
    p.add_argument("--model-prefix", required=True,
                   help="Output prefix: writes PREFIX.model and PREFIX.vocab.")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"],
                   help="sentencepiece model type (default bpe).")
    p.add_argument("--character-coverage", type=float, default=1.0,
                   help="Share of characters covered by the vocabulary (default 1.0).")
    p.add_argument("--byte-fallback", action="store_true",
                   help="Encode characters outside the vocabulary as bytes instead of <unk>.")
    p.add_argument("--keep-newlines", action="store_true",
                   help="Keep text exactly: newline is a piece, runs of spaces stay, no NFKC normalization "
                   "(default: sentencepiece's nmt_nfkc, which folds newlines and repeated spaces into one "
                   "space).")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="Sample at most this many lines (0: all).")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    return p.parse_args(argv)


def train(args) -> str:
    import sentencepiece as spm
    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"train_tokenizer.py: error: --input file not found: {path}")
    parent = os.path.dirname(os.path.abspath(args.model_prefix))
    os.makedirs(parent, exist_ok=True)
    keep = dict(normalization_rule_name="identity", remove_extra_whitespaces=False,
                user_defined_symbols=["\n"]) if args.keep_newlines else {}
    spm.SentencePieceTrainer.Train(
        input=args.input, model_prefix=args.model_prefix, vocab_size=args.vocab_size,
        model_type=args.model_type, character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
        num_threads=args.num_threads, max_sentence_length=1 << 16, minloglevel=2, **keep)
    return args.model_prefix + ".model"


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    path = train(args)
    size = sum(os.path.getsize(p) for p in args.input)
    print(f"train_tokenizer.py: {path} ({args.model_type}, vocab {args.vocab_size}) from "
          f"{size / 1e6:.2f} MB in {time.perf_counter() - start:.1f} s")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
