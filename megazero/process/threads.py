"""Intra-op threads per rank: the one rule for every launch.

Ranks that share a host's cores each use :data:`THREADS_PER_RANK` intra-op thread (torch's
default, one per core in every rank, oversubscribes the cores and slows every collective), unless
``OMP_NUM_THREADS`` says otherwise.  Forked test ranks (:func:`megazero.process.local_ranks.run_ranks`)
and the benchmarks that measure one rank's work call :func:`set_rank_threads`; code that starts
ranks or launchers as processes passes :func:`rank_thread_env`.  The shell launchers
(``launch/run_local.sh``, ``launch/run_multinode.sh``, ``scripts/demo.sh``, ...) cannot import
this module; each exports ``OMP_NUM_THREADS=1`` when it is unset and says so in a comment pointing
here (``launch/slurm.sbatch`` gives each rank the CPUs per GPU instead, SLURM's allocation).
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

THREADS_PER_RANK = 1


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_rank_threads() -> None:
    """This process is one of several ranks on a host's cores: :data:`THREADS_PER_RANK` intra-op
    threads (whatever ``OMP_NUM_THREADS`` says: forked ranks and single-rank measurements)."""
    import torch
    torch.set_num_threads(THREADS_PER_RANK)


def rank_thread_env(environ: Optional[Mapping[str, str]] = None, force: bool = False) -> Dict[str, str]:
    """A copy of ``environ`` (default: this process's) for processes that run ranks:
    ``OMP_NUM_THREADS`` is :data:`THREADS_PER_RANK` unless it is set already (``force``: always)."""
    env = dict(os.environ if environ is None else environ)
    if force or not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(THREADS_PER_RANK)
    return env
