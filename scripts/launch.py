#!/usr/bin/env python
"""torchrun that speaks once: the same flags as ``torchrun``, one line instead of a ChildFailedError
summary, and a termination signal forwarded to the ranks once (they save and exit 0, and so does
the launcher)::

    python scripts/launch.py --standalone --nproc-per-node 8 scripts/pretrain_gpt.py --mock-data ...
    python scripts/launch.py --signal-grace 300 --nnodes 2 ... scripts/pretrain_gpt.py ...
    python scripts/launch.py --join-timeout 120 --nnodes 4 --node-rank 1 ... scripts/pretrain_gpt.py ...

Its own options come first: --signal-grace SECS (default 120) and --join-timeout SECS (default
600; on several nodes, how long a node waits for the others before naming the missing ones and
exiting 1; 0: no wait; docs/operations.md).  Over several nodes a lost node is a failed attempt that
--max-restarts restarts in a new rendezvous round once the node is started again (docs/operations.md,
"Several nodes, and when a node dies"); the stores listen on the address given.

Installed as the console script ``megazero-launch``; the logic is megazero.resilience.launcher.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.cli import launch_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(launch_main())
