#!/usr/bin/env python
"""Merge every ``.bin``/``.idx`` dataset of a directory into one (Megatron-LM's tools/merge_datasets.py).

    python scripts/merge_datasets.py --input data/parts --output-prefix data/corpus_text_document
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from models.cli.merge_datasets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
