"""DeepSpeed's hostfile and its resource filters, for ``scripts/deepspeed_launch.py``.

A hostfile names one host a line with its slots (GPUs, or processes on CPUs)::

    worker-0 slots=8
    worker-1 slots=8   # a comment

``--include`` / ``--exclude`` take DeepSpeed's syntax: hosts joined by ``@``, each optionally with
``:`` and a comma list of slot indices (``worker-0@worker-1:0,2``); a host alone means all its slots.
``--num_nodes N`` keeps the first N hosts and ``--num_gpus N`` the first N slots of each, as
DeepSpeed's launcher does.  Every function returns an ordered ``{host: [slot, ...]}`` and raises
:class:`HostfileError` with one line naming the flag for bad input.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

Pool = Dict[str, List[int]]
_LINE = re.compile(r"^(\S+)\s+slots\s*=\s*(\d+)$")


class HostfileError(ValueError):
    """Bad hostfile or filter; the message is the one line to print."""


def parse_hostfile(text: str, name: str = "--hostfile") -> Pool:
    """``{host: [0 .. slots-1]}`` in the file's order; blank lines and ``#`` comments are skipped."""
    pool: Pool = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise HostfileError(f"{name} line {number}: {line!r} is not 'HOST slots=N'")
        host, slots = m.group(1), int(m.group(2))
        if host in pool:
            raise HostfileError(f"{name} line {number}: host {host} is listed twice")
        if slots < 1:
            raise HostfileError(f"{name} line {number}: {host} needs slots >= 1, got {slots}")
        pool[host] = list(range(slots))
    if not pool:
        raise HostfileError(f"{name}: no hosts in it (one 'HOST slots=N' a line)")
    return pool


def _parse_filter(spec: str, flag: str, pool: Pool) -> Pool:
    out: Pool = {}
    for part in spec.split("@"):
        host, _, slots = part.strip().partition(":")
        if not host:
            raise HostfileError(f"{flag} {spec!r}: an empty host (hosts are joined by '@')")
        if host not in pool:
            raise HostfileError(f"{flag} {spec!r}: host {host} is not in the hostfile ({', '.join(pool)})")
        if not slots:
            out[host] = list(pool[host])
            continue
        chosen = []
        for s in slots.split(","):
            if not s.strip().isdigit():
                raise HostfileError(f"{flag} {spec!r}: slot {s!r} of {host} is not a number")
            if int(s) not in pool[host]:
                raise HostfileError(f"{flag} {spec!r}: {host} has slots 0-{len(pool[host]) - 1}, not {s}")
            chosen.append(int(s))
        out[host] = sorted(set(out.get(host, []) + chosen))
    return out


def select(pool: Pool, include: str = "", exclude: str = "", num_nodes: Optional[int] = None,
           num_gpus: Optional[int] = None) -> Pool:
    """The hosts and slots that run: ``pool`` filtered by --include or --exclude, then cut to
    --num_nodes hosts and --num_gpus slots each."""
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together (DeepSpeed's rule)")
    if include:
        wanted = _parse_filter(include, "--include", pool)
        active = {h: wanted[h] for h in pool if h in wanted}
    elif exclude:
        dropped = _parse_filter(exclude, "--exclude", pool)
        active = {}
        for host, slots in pool.items():
            keep = [] if dropped.get(host) == slots else [s for s in slots if s not in dropped.get(host, [])]
            if keep:
                active[host] = keep
    else:
        active = {h: list(s) for h, s in pool.items()}
    for flag, value in (("--num_nodes", num_nodes), ("--num_gpus", num_gpus)):
        if value is not None and value < 1:
            raise HostfileError(f"{flag} must be >= 1, got {value}")
    if num_nodes is not None:
        if num_nodes > len(active):
            raise HostfileError(f"--num_nodes {num_nodes}: only {len(active)} hosts are left "
                                f"({', '.join(active) or 'none'})")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        short = [h for h, s in active.items() if len(s) < num_gpus]
        if short:
            raise HostfileError(f"--num_gpus {num_gpus}: {', '.join(short)} has fewer slots "
                                f"({', '.join(str(len(active[h])) for h in short)})")
        active = {h: s[:num_gpus] for h, s in active.items()}
    if not active:
        raise HostfileError("--exclude leaves no host to run on")
    return active
