#!/usr/bin/env python
"""Tokenize text into Megatron-LM's indexed format (``{prefix}_{key}_document.bin/.idx``).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model data/tok.model --append-eod --workers 2

Megatron-LM's flags; ``--help`` and :mod:`megazero.data.preprocess` describe the inputs
(JSONL with ``--json-keys``, or plain text: a document per blank-line-separated paragraph,
or per file with ``--text-document file``).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from models.cli.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
