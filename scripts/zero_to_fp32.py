#!/usr/bin/env python
"""One fp32 ``state_dict`` from a checkpoint of megazero's engine (``engine.save_checkpoint``, any
data-parallel size and ZeRO stage), with DeepSpeed's ``zero_to_fp32.py`` arguments::

    python scripts/zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--tag global_step20] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters]

writes ``OUTPUT_DIR/pytorch_model.bin`` (``model.safetensors``), in numbered pieces with an index when
larger than ``--max_shard_size``.  The logic is :mod:`megazero.engine.consolidate`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.engine.consolidate import convert_zero_checkpoint_to_fp32_state_dict  # noqa: E402
from megazero.errors import EXIT_OK, MegazeroError, exit_status_of  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zero_to_fp32.py", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (it holds 'latest')")
    p.add_argument("output_dir", help="where to write the state_dict file(s)")
    p.add_argument("--max_shard_size", default="5GB", help="largest file before the state_dict is cut (5GB)")
    p.add_argument("--safe_serialization", action="store_true", help="write safetensors, not torch.save")
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="accepted (DeepSpeed's flag); no effect")
    args = p.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                   args.safe_serialization, args.tag,
                                                   args.exclude_frozen_parameters)
    except MegazeroError as err:
        print(f"zero_to_fp32.py: error: {err}", file=sys.stderr)
        return exit_status_of(err)
    print(f"zero_to_fp32.py: wrote the fp32 state_dict of {args.checkpoint_dir} to {args.output_dir}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
