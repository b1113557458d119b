"""Several nodes on one host: launch/run_multinode.sh started once per "node" (each launcher with its
ranks in a session of its own), a node lost mid-run and started again, the job re-formed in a new
rendezvous round and resumed from the last checkpoint (docs/operations.md, "When a node dies")."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from megazero.process.local_ranks import run_ranks
from models.cli import pretrain_main
from tests.test_operations import ROOT, TINY, _children, _metrics

SCRIPT = os.path.join(ROOT, "launch", "run_multinode.sh")
ITERS = 12
LOSS = re.compile(r"iteration +(\d+)/ *\d+ \| loss ([0-9.]+)")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=sys.executable)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGAZERO_FAULT", "NPROC",
                "NODE_RANK", "NNODES", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    env.update(extra)
    return env


def _ports(host="127.0.0.1"):
    """A rendezvous port whose pre-rendezvous port (+1000) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + 1000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, port + 1000))
            return port
        except OSError:
            continue
    raise AssertionError("no free pair of ports")


class Node:
    """One ``run_multinode.sh`` (own session, output to ``log``); :meth:`kill` ends it as a node
    failure does: the launcher and every rank at once (stopped first, then killed)."""

    def __init__(self, tmp, name, node_rank, port, nnodes, flags, addr="127.0.0.1", extra=()):
        self.log = str(tmp / f"{name}.log")
        cmd = ["bash", SCRIPT, "--nnodes", str(nnodes), "--master-addr", addr, "--master-port", str(port),
               "--nproc-per-node", "2", "--max-restarts", "2", "--rdzv-id", "drill", "--node-rank",
               str(node_rank), "--run-dir", str(tmp / f"run{node_rank}"), *extra, "--", *flags]
        self.proc = subprocess.Popen(cmd, env=_env(), cwd=str(tmp), stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.known = set()

    def text(self):
        return open(self.log, errors="replace").read()

    def pids(self):
        self.known.update(_children(self.proc.pid))
        return [self.proc.pid] + _children(self.proc.pid)

    def wait_for(self, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pids()
            match = re.search(pattern, self.text())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in {self.log}:\n{self.text()[-4000:]}")

    def kill(self, launcher_only=False):
        pids = [self.proc.pid] if launcher_only else self.pids()
        for sig in ((signal.SIGKILL,) if launcher_only else (signal.SIGSTOP, signal.SIGKILL)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        self.proc.wait()

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.text()[-4000:]}") from None

    def close(self):
        for pid in set(self.pids()) | self.known:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


def _losses(text):
    """iteration -> the last loss rank 0 logged for it (a resumed run repeats some)."""
    return {int(it): float(loss) for it, loss in LOSS.findall(text)}


def _flags(tmp, extra=(), load=True):
    d = str(tmp / "ckpt")
    return [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", str(ITERS), "--save", d,
            *(["--load", d] if load else []), "--save-interval", "3",
            "--metrics-file", str(tmp / "metrics.jsonl"), *extra]


# dead nodes are noticed after 1 s x 5 missed keep-alives (torchrun: 5 s x 3); a MIN:MAX job forms 2 s
# after MIN nodes are there (torchrun: 30 s)
RDZV = ["--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=5,last_call_timeout=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Every loss of the same job without a failure: 4 forked ranks, TP 2 x DP 2 (the oracle here)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    assert run_ranks(pretrain_main, 4, _flags(tmp, load=False), timeout=300) == [0] * 4
    return {it: m["loss"] for it, m in _metrics(str(tmp / "metrics.jsonl")).items()}


def _ipv4(hex_addr):
    return ".".join(str(int(hex_addr[i:i + 2], 16)) for i in (6, 4, 2, 0))


def _listening(pid):
    """The addresses of the TCP sockets process ``pid`` listens on (from /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                out.append((_ipv4(addr) if len(addr) == 8 else addr, int(port, 16)))
    return out


def _wait_any(nodes, pattern, timeout):
    """Until ``pattern`` is in the output of one of ``nodes`` (global rank 0 logs, on either node)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            node.pids()
            if re.search(pattern, node.text()):
                return
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(n.text()[-3000:] for n in nodes))


@pytest.mark.slow
def test_a_node_killed_mid_run_rejoins_and_the_job_ends_as_an_uninterrupted_one(tmp_path, uninterrupted):
    """Two run_multinode.sh on loopback (2 ranks each, TP 2 x DP 2, --max-restarts 2, a save every 3
    iterations): after iteration 5 node 1 dies at once (launcher and ranks stopped, then killed) and is
    started again 3 s later.  Node 0's ranks fail, its launcher restarts them in a new rendezvous round
    that node 1 joins; the job resumes from the last checkpoint, both launchers exit 0 and every loss
    equals the uninterrupted run's.  Every store the launchers serve listens on the address given."""
    port, flags = _ports(), _flags(tmp_path)
    nodes = [Node(tmp_path, f"node{r}", r, port, 2, flags, extra=RDZV) for r in range(2)]
    try:
        _wait_any(nodes, r"iteration +2/", 300)
        stores = _listening(nodes[0].proc.pid) + _listening(nodes[1].proc.pid)
        assert (("127.0.0.1", port) in stores and ("127.0.0.1", port + 1000) in stores
                and all(addr == "127.0.0.1" for addr, _ in stores)), stores  # torchrun's: every interface
        _wait_any(nodes, r"iteration +5/", 300)
        nodes[1].kill()
        time.sleep(3)
        nodes[1] = Node(tmp_path, "node1-again", 1, port, 2, flags, extra=RDZV)
        codes = [node.wait(300) for node in nodes]
    finally:
        for node in nodes:
            node.close()
    out = nodes[0].text() + nodes[1].text()
    assert codes == [0, 0], out[-4000:]
    assert "joining it in torchrun's next rendezvous round" in nodes[1].text()
    assert re.search(r"loaded checkpoint .*iter_000000[36]", out), out[-4000:]
    got = {it: m["loss"] for it, m in _metrics(str(tmp_path / "metrics.jsonl")).items()}
    assert got == uninterrupted and len(got) == ITERS
