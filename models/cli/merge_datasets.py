"""``scripts/merge_datasets.py``: Megatron-LM's ``tools/merge_datasets.py``.  Every ``.bin``/``.idx``
pair of an ``--input`` directory, in name order, appended into one dataset at ``--output-prefix``
(same token dtype; documents and sequences kept as they are)."""
from __future__ import annotations

import argparse
import os
import sys

from megazero.data.indexed import IndexedDatasetWriter, IndexedDataset
from megazero.errors import EXIT_OK, EXIT_USAGE


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="merge_datasets.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="A directory of PREFIX.bin/PREFIX.idx pairs.")
    p.add_argument("--output-prefix", required=True, help="Writes OUTPUT_PREFIX.bin/.idx.")
    p.add_argument("--multimodal", action="store_true", help="Not supported (refused).")
    args = p.parse_args(argv)
    if args.multimodal:
        p.error("--multimodal is not supported: megazero's datasets hold text")
    if not os.path.isdir(args.input):
        p.error(f"--input {args.input} is not a directory")
    return args


def dataset_prefixes(directory: str):
    """The prefixes of the complete ``.bin``/``.idx`` pairs in ``directory``, sorted."""
    names = set(os.listdir(directory))
    return sorted(os.path.join(directory, n[:-4]) for n in names
                  if n.endswith(".idx") and n[:-4] + ".bin" in names)


def main(argv=None) -> int:
    args = parse_args(argv)
    prefixes = dataset_prefixes(args.input)
    try:
        if not prefixes:
            raise ValueError(f"--input {args.input}: no .bin/.idx pairs to merge")
        with IndexedDatasetWriter(args.output_prefix, IndexedDataset(prefixes[0]).dtype) as out:
            for prefix in prefixes:
                out.add_index(prefix)
    except (ValueError, OSError) as err:
        print(f"merge_datasets.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"merge_datasets.py: merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx")
    return EXIT_OK
