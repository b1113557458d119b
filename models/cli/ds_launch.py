"""``scripts/deepspeed_launch.py``: DeepSpeed's ``deepspeed`` launcher conventions over megazero's
launcher (``scripts/launch.py``, torchrun underneath).

    python scripts/deepspeed_launch.py [--hostfile F] [--include S | --exclude S] [--num_nodes N]
        [--num_gpus N] [--master_addr A] [--master_port P] [--launcher pdsh|ssh] [--ssh_port P]
        train.py ARGS...

One host left after the filters: the ranks start here (``--standalone``).  Several: one
``scripts/launch.py`` per host, started over pdsh (DeepSpeed's default; ``%n`` is the node rank) or
plain ssh, each with ``--nnodes``, ``--node-rank``, ``--master-addr``/``--master-port`` and
``CUDA_VISIBLE_DEVICES`` = the host's slots.  The remote side runs in this directory with this
Python; it gets the variables named in ``.deepspeed_env`` (here or in ``~``; ``KEY=VALUE`` lines)
and those starting with the prefixes in :data:`EXPORT_PREFIXES`.  ``PDSH_SSH_ARGS_APPEND`` adds ssh
options for both launchers (DeepSpeed's variable for pdsh).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from megazero.errors import EXIT_USAGE
from megazero.process.hostfile import HostfileError, Pool, parse_hostfile, select

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "MEGAZERO_", "OMP_", "WANDB_", "TORCH_", "GLOO_", "UCX_", "MV2_")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepspeed_launch.py", allow_abbrev=False,
                                description="DeepSpeed's launcher flags over scripts/launch.py")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, help="lines 'HOST slots=N'")
    p.add_argument("-i", "--include", default="", help="HOST[:SLOT,...]@HOST... to use")
    p.add_argument("-e", "--exclude", default="", help="HOST[:SLOT,...]@HOST... to leave out")
    p.add_argument("--num_nodes", type=int, default=None, help="the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=None,
                   help="the first N slots of each host")
    p.add_argument("--master_addr", default="", help="the rendezvous address (default: the first host)")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--launcher", choices=("pdsh", "ssh"), default=None,
                   help="how hosts are reached: pdsh (default where installed) or ssh")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--force_multi", action="store_true", help="the multi-node path even for one host")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def resources(args, local_slots: int) -> Pool:
    """The hosts and slots that run; without a hostfile, this host with ``local_slots``."""
    if os.path.isfile(args.hostfile):
        with open(args.hostfile) as fh:
            pool = parse_hostfile(fh.read(), f"--hostfile {args.hostfile}")
    elif args.hostfile != DEFAULT_HOSTFILE:
        raise HostfileError(f"--hostfile {args.hostfile}: no such file")
    else:
        if args.include or args.exclude:
            raise HostfileError("--include/--exclude need a --hostfile (none at /job/hostfile)")
        pool = {"localhost": list(range(local_slots))}
    return select(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)


def exported_env(environ: Dict[str, str], cwd: str) -> Dict[str, str]:
    """What a remote host gets: the prefixed variables, then .deepspeed_env's lines (here, else ~)."""
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    for where in (cwd, os.path.expanduser("~")):
        path = os.path.join(where, ".deepspeed_env")
        if os.path.isfile(path):
            for line in open(path):
                key, sep, value = line.strip().partition("=")
                if sep and key and not key.startswith("#"):
                    out[key] = value
            break
    return out


def node_command(args, active: Pool, node_rank: str, env: Dict[str, str], python: str, cwd: str,
                 visible: str, watch_stdin: bool = False) -> str:
    """The shell line one host runs (``node_rank`` may be pdsh's ``%n``).  With ``watch_stdin`` (ssh)
    the end of its standard input (this launcher stopped, or its ssh gone) sends SIGTERM to the
    host's scripts/launch.py, which forwards it to the ranks (with --exit-signal-handler they save)."""
    hosts = list(active)
    nproc = len(active[hosts[0]])
    master = args.master_addr or hosts[0]
    launch = [python, os.path.join(ROOT, "scripts", "launch.py"), "--nnodes", str(len(hosts)), "--node-rank",
              node_rank, "--nproc-per-node", str(nproc), "--master-addr", master, "--master-port",
              str(args.master_port), args.user_script, *args.user_args]
    assigns = " ".join(["env"] + [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())])
    words = " ".join(shlex.quote(a) if a != node_rank else a for a in launch)
    if not watch_stdin:
        return f"{visible}cd {shlex.quote(cwd)} && exec {assigns} {words}"
    return (f"{visible}cd {shlex.quote(cwd)} && exec 3<&0 && {{ {assigns} {words} <&- & pid=$!; "
            "{ while read -r _ <&3; do :; done; kill -TERM $pid 2>/dev/null; } & watch=$!; "
            "wait $pid; rc=$?; kill $watch 2>/dev/null; exit $rc; }")


def plan(args, active: Pool, environ: Dict[str, str], python: str, cwd: str,
         which=shutil.which) -> List[List[str]]:
    """The commands to run here: one per host with ssh, one in all with pdsh (whose ssh options,
    --ssh_port included, go through PDSH_SSH_ARGS_APPEND: :func:`launcher_env`)."""
    hosts = list(active)
    sizes = {h: len(s) for h, s in active.items()}
    if len(set(sizes.values())) > 1:
        counts = ", ".join(f"{h}: {n}" for h, n in sizes.items())
        raise HostfileError(f"hosts with different slot counts ({counts}): every node runs the same number "
                            "of ranks here; --num_gpus N evens them")
    launcher = args.launcher or ("pdsh" if which("pdsh") else "ssh")
    if which(launcher) is None:
        package = "pdsh" if launcher == "pdsh" else "openssh-client"
        raise HostfileError(f"--launcher {launcher}: {launcher} is not installed (Debian: apt-get install "
                            f"{package}), and {len(hosts)} hosts need it")
    env = exported_env(environ, cwd)
    ssh_args = (["-p", str(args.ssh_port)] if args.ssh_port is not None else []) \
        + shlex.split(environ.get("PDSH_SSH_ARGS_APPEND", ""))
    slots = {h: ",".join(map(str, s)) for h, s in active.items()}
    if launcher == "ssh":
        return [["ssh", *ssh_args, host,
                 node_command(args, active, str(rank), env, python, cwd,
                              f"export CUDA_VISIBLE_DEVICES={slots[host]} && ", watch_stdin=True)]
                for rank, host in enumerate(hosts)]
    cases = " ".join(f"{r}) CUDA_VISIBLE_DEVICES={slots[h]};;" for r, h in enumerate(hosts))
    visible = f"case %n in {cases} esac && export CUDA_VISIBLE_DEVICES && "
    return [["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts),
             node_command(args, active, "%n", env, python, cwd, visible)]]


def launcher_env(args, environ: Dict[str, str]) -> Dict[str, str]:
    """The environment of ssh/pdsh here: pdsh over ssh, --ssh_port among pdsh's ssh options."""
    env = dict(environ, PDSH_RCMD_TYPE=environ.get("PDSH_RCMD_TYPE", "ssh"))
    if args.ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"-p {args.ssh_port} {environ.get('PDSH_SSH_ARGS_APPEND', '')}".strip()
    return env


def _run_all(commands: Sequence[List[str]], environ: Dict[str, str]) -> int:
    """Run the ssh/pdsh commands; SIGTERM or SIGINT closes the ssh sessions' standard input, which
    stops every host's ranks (see :func:`node_command`), and waits for them (pdsh: ends pdsh)."""
    procs = [subprocess.Popen(c, env=environ, stdin=subprocess.PIPE if c[0] == "ssh" else subprocess.DEVNULL)
             for c in commands]

    def stop(signum, frame):
        for p in procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
            elif p.stdin is None:
                p.terminate()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return max(codes, key=abs)


def main(argv: Optional[List[str]] = None, environ: Optional[Dict[str, str]] = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    args = parser().parse_args(argv)
    local_slots = args.num_gpus or _local_devices()
    try:
        active = resources(args, local_slots)
        launch = os.path.join(ROOT, "scripts", "launch.py")
        if len(active) == 1 and not args.force_multi:
            (host, slots), = active.items()
            env = dict(environ, CUDA_VISIBLE_DEVICES=",".join(map(str, slots)))
            cmd = [sys.executable, launch, "--standalone", "--nproc-per-node", str(len(slots)),
                   args.user_script, *args.user_args]
            return subprocess.call(cmd, env=env)
        commands = plan(args, active, environ, sys.executable, os.getcwd())
    except HostfileError as e:
        sys.stderr.write(f"deepspeed_launch.py: error: {e}\n")
        return EXIT_USAGE
    return _run_all(commands, launcher_env(args, environ))


def _local_devices() -> int:
    """GPUs here (torch's count), else 1 process."""
    try:
        import torch
        return max(1, torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch or no driver: one process
        return 1
