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

from megazero.checkpoint import latest_iteration
from megazero.process.local_ranks import run_ranks
from models.cli import pretrain_main
from tests.sockets import listening
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

    def __init__(self, tmp, name, node_rank, port, nnodes, flags, addr="127.0.0.1", extra=(), restarts=2,
                 env=None):
        self.log = str(tmp / f"{name}.log")
        cmd = ["bash", SCRIPT, "--nnodes", str(nnodes), "--master-addr", addr, "--master-port", str(port),
               "--nproc-per-node", "2", "--max-restarts", str(restarts), "--rdzv-id", "drill", "--node-rank",
               str(node_rank), "--run-dir", str(tmp / f"run{node_rank}"), *extra, "--", *flags]
        self.proc = subprocess.Popen(cmd, env=_env(**(env or {})), cwd=str(tmp), stdout=open(self.log, "w"),
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

    def wait_stalled(self, timeout):
        """Until every rank of this node has stopped itself (``STALL``): the job waits at iteration 6."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ranks = self.pids()[1:]
            if len(ranks) == 2 and all(_state(pid) == "T" for pid in ranks):
                return ranks
            time.sleep(0.05)
        raise AssertionError(f"node ranks not stopped after {timeout} s:\n{self.text()[-3000:]}")

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


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# node 1's first ranks stop themselves (SIGSTOP) at the start of iteration 6, whatever their global
# ranks: the job then waits there, so the failure lands after iteration 5 however late a busy machine
# lets the test look (12 tiny iterations take a second; the test once saw iteration 5 after 12)
STALL = {"MEGAZERO_FAULT": ",".join(f"sigstop@{rank}:6" for rank in range(4))}


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
    iterations): in iteration 6 node 1 dies at once (launcher and ranks stopped, then killed) and is
    started again 3 s later.  Node 0's ranks fail, its launcher restarts them in a new rendezvous round
    that node 1 joins; the job resumes from the last checkpoint, both launchers exit 0 and every loss
    equals the uninterrupted run's.  Every store the launchers serve listens on the address given."""
    port, flags = _ports(), _flags(tmp_path)
    nodes = [Node(tmp_path, f"node{r}", r, port, 2, flags, extra=RDZV, env=STALL if r else None)
             for r in range(2)]
    try:
        _wait_any(nodes, r"iteration +5/", 300)
        nodes[1].wait_stalled(300)
        stores = listening(nodes[0].proc.pid) + listening(nodes[1].proc.pid)
        assert (("127.0.0.1", port) in stores and ("127.0.0.1", port + 1000) in stores
                and all(addr == "127.0.0.1" for addr, _ in stores)), stores  # torchrun's: every interface
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
    assert re.search(r"launch.py: rank \d (exited with status 1|was killed by SIG[A-Z]+); restarting this "
                     r"node's ranks \(restart 1 of 2\): they resume from the last checkpoint in a new "
                     r"rendezvous round", nodes[0].text()), nodes[0].text()[-4000:]
    assert re.search(r"loaded checkpoint \S*iter_0000003 \(iteration 3", out), out[-4000:]
    got = {it: m["loss"] for it, m in _metrics(str(tmp_path / "metrics.jsonl")).items()}
    assert got == uninterrupted and len(got) == ITERS


@pytest.mark.slow
def test_a_lost_launcher_is_never_a_finished_job(tmp_path):
    """The issue's run without restarts: node 1's launcher is killed (SIGKILL) in iteration 6; its
    ranks get SIGTERM from the kernel and, under --exit-signal-handler, every rank of the job saves and
    exits 0.  Node 0's launcher used to exit 0 for a run that stopped at iteration 6 of 12; it exits 1
    and says why, with the save there to resume from."""
    port, flags = _ports(), _flags(tmp_path, ["--exit-signal-handler"])
    nodes = [Node(tmp_path, f"node{r}", r, port, 2, flags, extra=RDZV, restarts=0, env=STALL if r else None)
             for r in range(2)]
    try:
        _wait_any(nodes, r"iteration +5/", 300)
        ranks = nodes[1].wait_stalled(300)
        nodes[1].kill(launcher_only=True)
        for pid in ranks:  # the parent death signal waits for them
            os.kill(pid, signal.SIGCONT)
        code = nodes[0].wait(300)
    finally:
        for node in nodes:
            node.close()
    out = nodes[0].text()
    stop = re.search(r"stopping after iteration (\d+): SIGTERM received \(--exit-signal-handler\); "
                     r"the launcher of a rank is gone", out)
    assert code == 1 and stop, out[-4000:]
    n = int(stop.group(1))
    assert n == 6 and f"saved checkpoint at iteration {n} " in out, out[-4000:]
    last = out.rstrip().splitlines()[-1]
    lead = f"launch.py: pretrain_gpt.py: training stopped after iteration {n}: SIGTERM received"
    assert last.startswith(lead), last
    assert last.endswith("no restart left (--max-restarts 0): start every node again with the same --load to "
                         "resume from the last checkpoint"), last
    assert latest_iteration(str(tmp_path / "ckpt")) == n


@pytest.mark.slow
def test_with_nnodes_min_max_a_node_that_never_returns_leaves_the_others_to_finish(tmp_path, uninterrupted):
    """--nnodes 1:2: node 1 dies in iteration 6 and is not started again.  Node 0 re-forms the job
    alone (TP 2 x DP 1), loads the DP 2 checkpoint resharded, keeps the global batch and finishes: exit 0,
    every loss equal to the uninterrupted DP 2 run's up to float32 summation order (4 micro-batches
    summed on one rank instead of 2 on each of 2; measured: 2.8e-8 relative at most, one iteration of
    12 differs at all; float32's epsilon is 1.2e-7)."""
    port, flags = _ports(), _flags(tmp_path)
    nodes = [Node(tmp_path, f"node{r}", r, port, "1:2", flags, extra=RDZV, env=STALL if r else None)
             for r in range(2)]
    try:
        _wait_any(nodes, r"iteration +5/", 300)
        nodes[1].wait_stalled(300)
        nodes[1].kill()
        code = nodes[0].wait(300)
    finally:
        for node in nodes:
            node.close()
    out = nodes[0].text()
    assert code == 0, out[-4000:]
    resharded = re.search(r"loaded checkpoint .*saved under tp 2 pp 1 dp 2", out)
    assert "tp 2 pp 1 dp 1" in out and resharded, out[-4000:]
    got = {it: m["loss"] for it, m in _metrics(str(tmp_path / "metrics.jsonl")).items()}
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == pytest.approx(uninterrupted, rel=1e-6, abs=0)


# ---- the pieces, in this process ----------------------------------------------------------------
class _Mesh:
    is_distributed = False


def test_a_rank_whose_launcher_is_gone_stops_with_a_note_for_its_launcher(tmp_path, monkeypatch):
    """StopConditions: under scripts/launch.py (MEGAZERO_AGENT_PID) a rank whose parent is not that
    launcher any more stops after the iteration and leaves a note; without the variable, or while
    the launcher is its parent, it goes on; a lone distributed rank without agreement never stops."""
    from types import SimpleNamespace
    from megazero.resilience.stop import StopConditions
    from megazero.resilience.stop_notes import NOTES_ENV, read_notes
    cfg = SimpleNamespace(exit_duration_in_mins=None, exit_interval=None)
    monkeypatch.setenv(NOTES_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("MEGAZERO_AGENT_PID", raising=False)
    assert StopConditions(cfg, None).reason(4, _Mesh()) is None  # another launcher: nothing to check
    monkeypatch.setenv("MEGAZERO_AGENT_PID", str(os.getppid()))
    assert StopConditions(cfg, None).reason(4, _Mesh()) is None and read_notes(str(tmp_path)) == []
    monkeypatch.setenv("MEGAZERO_AGENT_PID", str(os.getppid() + 100000))  # not the parent: it died
    reason = StopConditions(cfg, None).reason(4, _Mesh())
    assert reason == ("the launcher of a rank is gone (its node was lost): the run is interrupted, "
                      "not finished")
    [note] = read_notes(str(tmp_path))
    assert note["iteration"] == 4 and note["reason"] == reason
    assert os.listdir(tmp_path) == ["rank_3.json"]
    alone = SimpleNamespace(is_distributed=True)  # no signal handler, duration or files: no all-reduce
    assert StopConditions(cfg, None).reason(5, alone) is None


def _fake_original(result):
    def original(agent, worker_group):
        return result
    return original


def test_the_agent_restarts_ranks_that_exited_0_after_a_launcher_was_lost(tmp_path, monkeypatch):
    """rounds.install: a local group that succeeded is a failed attempt (one failure per rank, its
    message the note's) when its ranks left a note; the notes are then cleared; without notes the
    success stands."""
    from types import SimpleNamespace
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from megazero.resilience import rounds
    from megazero.resilience.stop_notes import NOTES_ENV, write_note
    succeeded = _fake_original(RunResult(WorkerState.SUCCEEDED))
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", succeeded)
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", DynamicRendezvousHandler.next_rendezvous)
    monkeypatch.setenv(NOTES_ENV, "")
    seen = rounds.install(str(tmp_path))
    assert os.environ[NOTES_ENV] == str(tmp_path)
    workers = [SimpleNamespace(local_rank=i, global_rank=2 + i, id=1000 + i) for i in range(2)]
    group = SimpleNamespace(workers=workers)
    agent = SimpleNamespace(_pcontext=None)
    assert LocalElasticAgent._monitor_workers(agent, group).state == WorkerState.SUCCEEDED
    write_note(7, "SIGTERM received (--exit-signal-handler); the launcher of a rank is gone",
               {NOTES_ENV: str(tmp_path), "RANK": "2"})
    result = LocalElasticAgent._monitor_workers(agent, group)
    assert result.state == WorkerState.FAILED and sorted(result.failures) == [2, 3]
    failure = result.failures[2]
    assert failure.exitcode == 1 and failure.megazero_interrupted and seen.count == 1
    assert failure.message == ("training stopped after iteration 7: SIGTERM received "
                               "(--exit-signal-handler); the launcher of a rank is gone")
    assert os.listdir(tmp_path) == []  # the next attempt starts without notes
    assert LocalElasticAgent._monitor_workers(agent, group).state == WorkerState.SUCCEEDED
    two = SimpleNamespace(settings=SimpleNamespace(max_nodes=2))
    spec = SimpleNamespace(max_restarts=2, rdzv_handler=two)
    agent = SimpleNamespace(_remaining_restarts=2, _worker_group=SimpleNamespace(spec=spec))
    assert rounds.restart_line(result, agent, seen) == (
        "training stopped after iteration 7: SIGTERM received (--exit-signal-handler); the launcher of a "
        "rank is gone; restarting this node's ranks (restart 1 of 2): they resume from the last checkpoint "
        "in a new rendezvous round, once enough nodes are back (--nnodes; it waits up to --rdzv-conf "
        "join_timeout, 600 s by default)")
    agent._remaining_restarts = 0
    assert rounds.restart_line(result, agent, seen) is None  # the launcher's last line says it


def test_every_round_rebuilds_the_workers_store_and_exports_its_number(monkeypatch):
    """The rendezvous wrapper: the store address learned in an earlier round is dropped before each
    round (group rank 0 serves a new one), a node that is not rank 0 any more closes its old one, and
    the round, the same on every node, is exported for the workers' store prefix."""
    from types import SimpleNamespace
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from megazero.resilience import rounds
    seen = []

    def original(handler):
        seen.append(handler._bootstrap_store_info)
        return SimpleNamespace(rank=1)
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", original)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", LocalElasticAgent._monitor_workers)
    monkeypatch.setenv("MEGAZERO_STOP_NOTES", "")
    monkeypatch.setenv(rounds.ROUND_ENV, "0")
    rounds.install("/nonexistent")
    handler = SimpleNamespace(use_agent_store=True, _bootstrap_store_info="old address",
                              _shared_tcp_store_server="old server",
                              _state_holder=SimpleNamespace(state=SimpleNamespace(round=3)))
    assert DynamicRendezvousHandler.next_rendezvous(handler).rank == 1
    assert seen == [None] and handler._shared_tcp_store_server is None
    assert os.environ[rounds.ROUND_ENV] == "3"


def test_a_node_started_again_after_the_job_formed_goes_straight_to_the_rendezvous():
    """The join: node 0 hosts it and keeps it serving; once both nodes joined, node 1 started again
    (a lost node) passes at once with one line instead of waiting for peers that moved on (before: it
    waited --join-timeout for them, then exited 1), and so does it with no node rank."""
    import io
    import threading
    from megazero.resilience.join import join_nodes
    port = _ports() + 1000
    keep, ok, out = [], {}, {r: io.StringIO() for r in range(2)}

    def node(r):
        ok[r] = join_nodes("127.0.0.1", port, 2, r, 30, interval=1.0, stream=out[r], keep=keep)
    threads = [threading.Thread(target=node, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ok == {0: True, 1: True}, (out[0].getvalue(), out[1].getvalue())
    host, client = sorted(keep, key=lambda joined: not joined.hosting)
    assert host.hosting and not client.hosting
    for rank in (1, None):
        again = io.StringIO()
        start = time.monotonic()
        assert join_nodes("127.0.0.1", port, 2, rank, 30, interval=1.0, stream=again)
        assert time.monotonic() - start < 10
        assert again.getvalue() == (f"launch.py: the job formed at 127.0.0.1:{port} before this node "
                                    "started: joining it in torchrun's next rendezvous round\n")
    assert ("127.0.0.1", port) in listening(os.getpid())  # the host's store, on the address given only
    assert not [a for a, p in listening(os.getpid()) if p == port and a != "127.0.0.1"]
    start = time.monotonic()
    host.leave(wait=0.5)  # node 1 is not done: the host waits, bounded
    waited = time.monotonic() - start
    client.leave()
    start = time.monotonic()
    host.leave(wait=30)  # node 1 is done: at once
    assert waited >= 0.5 and time.monotonic() - start < 5


def test_stores_listen_on_the_address_they_are_given(monkeypatch):
    """A store served under an IP address listens there alone (127.0.0.2: not 127.0.0.1, not every
    interface); a host name listens on the first address it resolves to that other machines can reach;
    one that resolves to loopback addresses only here (Debian's 127.0.1.1 for the machine's name)
    listens on every interface, with one warning."""
    import torch.distributed as dist
    from megazero.resilience import loopback
    store = loopback.bound_store_class(dist.TCPStore)("127.0.0.2", 0, is_master=True, multi_tenant=True)
    client = dist.TCPStore("127.0.0.2", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert [a for a, p in listening(os.getpid()) if p == store.port] == ["127.0.0.2"]
    me = socket.gethostname()  # resolved for real by the store's own client, to whatever it is here
    table = {me: ["127.0.1.1"], "node1": ["127.0.1.1", "10.1.2.3", "fe80::1"], "localhost": ["127.0.0.1"]}

    def resolve(host, *args, **kwargs):
        if host not in table:
            raise socket.gaierror(host)
        return [(None, None, None, "", (a, 0)) for a in table[host]]
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert [loopback.listen_address(h) for h in (me, "node1", "localhost", "nowhere", "::1")] == \
        [None, "10.1.2.3", "127.0.0.1", None, "::1"]
    said = []
    anywhere = loopback.bound_store_class(dist.TCPStore, warn=said.append)(me, 0, is_master=True)
    assert said and said[0].startswith(f"warning: {me} resolves to no address of this machine that other "
                                       "nodes can reach") and "--master-addr" in said[0]
    assert [a for a, p in listening(os.getpid()) if p == anywhere.port] in (["0.0.0.0"], ["::"])


def test_node_rank_0_serves_the_rendezvous_store():
    """is_host for the c10d rendezvous: node rank 0 on the rendezvous host serves the store and every
    other node is a client (on one host both matched the host name: the first to start served it, and
    its death ended the job); an is_host given, --standalone, no node rank or a node 0 elsewhere are
    left alone."""
    from torch.distributed import run as torchrun
    from megazero.resilience.rounds import host_on_node_zero
    base = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
    cases = [(base, 0, "is_host=1"), (base, 1, "is_host=0"), (base, None, ""),
             (base + ["--rdzv-conf", "join_timeout=9"], 1, "join_timeout=9,is_host=0"),
             (base + ["--rdzv-conf", "is_host=0"], 0, "is_host=0"),
             (base[:4] + ["--rdzv-endpoint", "node-elsewhere.invalid:29400"], 0, ""),
             (["--standalone"], 0, "")]
    for argv, node, want in cases:
        args = torchrun.parse_args(argv + ["x.py"])
        host_on_node_zero(args, node)
        assert args.rdzv_conf == want, (argv, node)


def test_rendezvous_failures_are_one_line_each():
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous import api as rdzv
    import torch.distributed as dist
    from megazero.resilience.rounds import rendezvous_failure_line
    args = torchrun.parse_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400",
                                "x.py"])
    lines = {kind: rendezvous_failure_line(kind("deep text\nmore"), args) for kind in (
        rdzv.RendezvousClosedError, rdzv.RendezvousTimeoutError, rdzv.RendezvousConnectionError,
        dist.DistNetworkError, rdzv.RendezvousStateError)}
    assert lines[rdzv.RendezvousClosedError].startswith("the job's rendezvous at node0:29400 is closed")
    assert "--rdzv-conf join_timeout=SECS" in lines[rdzv.RendezvousTimeoutError]
    assert lines[rdzv.RendezvousConnectionError] == lines[dist.DistNetworkError]
    assert lines[dist.DistNetworkError].startswith("lost the rendezvous store at node0:29400: the launcher "
                                                   "of node rank 0")
    assert lines[rdzv.RendezvousStateError] == "the rendezvous at node0:29400 failed: deep text"
    assert all("\n" not in line for line in lines.values())
    assert rendezvous_failure_line(ValueError("a bug"), args) is None  # bugs keep their traceback


@pytest.mark.parametrize("conf,line", [
    ("keep_alive_interval=abc", "--rdzv-conf keep_alive_interval=abc: give a whole number above 0"),
    ("join_timeout=-5", "--rdzv-conf join_timeout=-5: give a whole number above 0"),
    ("is_host=maybe", "--rdzv-conf is_host=maybe: give 1 or 0 (true or false)"),
])
def test_a_bad_rendezvous_setting_is_one_line(capsys, conf, line):
    """torch refused these deep inside the launch, with a traceback."""
    from models.cli import launch_main
    argv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
            "--rdzv-conf", conf, "x.py"]
    assert launch_main(argv) == 2
    assert capsys.readouterr().err == f"launch.py: error: {line}\n"


@pytest.mark.slow
def test_a_job_that_cannot_form_in_time_is_one_line(tmp_path):
    """One node of two, no join before torchrun (--join-timeout 0), the rendezvous' join timeout 3 s:
    exit 1 with one line (as a surviving node whose peer never comes back), not a traceback."""
    port = _ports()
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--join-timeout", "0", "--nnodes", "2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-conf", "join_timeout=3", os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *TINY]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.rstrip().splitlines()[-1] == (
        f"launch.py: the job did not form at 127.0.0.1:{port} within the rendezvous' join timeout "
        "(--rdzv-conf join_timeout=SECS, 600 by default): fewer nodes than --nnodes came (back); start the "
        "missing ones, or give --nnodes MIN:MAX to go on without them")
