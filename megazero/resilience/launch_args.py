"""The launcher's own arguments (torchrun's flags), read and checked before anything starts: a bad one
is one line naming the flag (``scripts/launch.py``'s exit status 2), where torchrun would print its
whole usage, or raise deep inside the launch with a traceback."""
from __future__ import annotations

import copy
import os
from typing import Optional, Sequence, Tuple


_FLAG_OF = {"nproc_per_node": "--nproc-per-node", "rendezvous configuration": "--rdzv-conf",
            "local_ranks_filter": "--local-ranks-filter", "does not match": "--redirects or --tee"}


class LaunchUsageError(ValueError):
    """A launcher argument that cannot be used; the message names the flag."""


def parse_launch_args(argv: Sequence[str]):
    """torchrun's parsed arguments; :class:`LaunchUsageError` (one line) where argparse would print its
    usage and exit.  ``--help`` still prints torchrun's help."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()

    def error(message):
        raise LaunchUsageError(f"{message} (launch.py --help lists torchrun's flags)")
    parser.error = error
    return parser.parse_args(list(argv))


def _nproc_problem(value) -> Optional[str]:
    """A count below 1 (torch asserts deep in the agent); a word it does not know is torch's to name."""
    try:
        number = int(str(value))
    except ValueError:
        return None
    return None if number > 0 else f"--nproc-per-node {value}: give 1 or more processes per node"


def _rdzv_backend_problem(args) -> Optional[str]:
    if args.standalone:  # --standalone sets its own c10d rendezvous
        return None
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    known = sorted(getattr(rendezvous_handler_registry, "_registry", None) or {})
    if known and args.rdzv_backend not in known:
        return f"--rdzv-backend {args.rdzv_backend}: not a rendezvous backend; give one of {', '.join(known)}"
    return None


# the --rdzv-conf options torchrun's c10d rendezvous reads as whole numbers above 0, and as booleans
_RDZV_NUMBERS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "read_timeout",
                 "keep_alive_interval", "keep_alive_max_attempt")
_RDZV_BOOLEANS = ("is_host",)


def _rdzv_conf_problem(args) -> Optional[str]:
    """A number or boolean of --rdzv-conf that torch would refuse inside the launch, with a traceback."""
    for item in filter(None, (args.rdzv_conf or "").split(",")):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key in _RDZV_NUMBERS and not (value.isdigit() and int(value) > 0):
            return f"--rdzv-conf {key}={value}: give a whole number above 0"
        if key in _RDZV_BOOLEANS and value.lower() not in ("1", "0", "true", "false", "yes", "no", "y", "n",
                                                           "on", "off"):
            return f"--rdzv-conf {key}={value}: give 1 or 0 (true or false)"
    return None


def _numbers_problem(args) -> Optional[str]:
    from torch.distributed.run import parse_min_max_nnodes
    try:
        low, high = parse_min_max_nnodes(str(args.nnodes))
        if not 0 < low <= high:
            raise ValueError
    except (ValueError, RuntimeError):
        return f"--nnodes {args.nnodes}: give a number of nodes, or MIN:MAX"
    if args.master_port is not None and not 0 <= args.master_port < 65536:
        return f"--master-port {args.master_port}: a port number is between 0 and 65535"
    if args.max_restarts < 0:
        return f"--max-restarts {args.max_restarts}: give 0 (no restart) or more"
    if not args.monitor_interval > 0:
        return f"--monitor-interval {args.monitor_interval:g}: give a number of seconds above 0"
    if args.node_rank < 0:
        return f"--node-rank {args.node_rank}: give 0 or more (this node's place among --nnodes)"
    return None


def usage_problem(args) -> Optional[str]:
    """What is wrong with torchrun's parsed ``args`` (a bad --nproc-per-node, --nnodes, --rdzv-backend,
    --rdzv-endpoint, --master-port, --max-restarts, --monitor-interval, --node-rank, --rdzv-conf (its
    timeouts, keep-alive and is_host too), --log-dir: torch raises on them deep inside the launch, with
    a traceback), in one line naming the flag; None when they are usable."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import config_from_args
    problem = (_nproc_problem(args.nproc_per_node) or _numbers_problem(args) or _rdzv_backend_problem(args)
               or _rdzv_conf_problem(args))
    if problem:
        return problem
    if args.rdzv_endpoint and not args.standalone:
        try:
            parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        except ValueError as err:
            return f"--rdzv-endpoint {args.rdzv_endpoint}: {err}"
    if args.log_dir:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as err:
            return f"--log-dir {args.log_dir}: cannot create it ({err.strerror}); give a writable directory"
    try:
        config_from_args(copy.copy(args))  # --rdzv-conf, --redirects, --tee, --local-ranks-filter, ...
    except (ValueError, RuntimeError, AssertionError) as err:
        said = str(err)
        flags = [flag for key, flag in _FLAG_OF.items() if key in said]
        return f"{flags[0] if flags else 'launcher arguments'}: {said}"
    return None


def read_launch_args(argv: Sequence[str]) -> Tuple[Optional[object], Optional[str]]:
    """(torchrun's parsed arguments, None), or (None, the one line saying what is wrong with them)."""
    try:
        args = parse_launch_args(argv)
    except LaunchUsageError as err:
        return None, str(err)
    return args, usage_problem(args)
