"""launch/slurm.sbatch under a real SLURM: Debian's slurm-wlm, set up on this machine by
scripts/setup_slurm.sh as a cluster of two nodes (n1, n2: two slurmds on 127.0.0.1) with slurmdbd, so
job states come from sacct.  Skipped, with the script's one line, where it cannot be set up (not
root, no apt-get, a site's own slurm.conf).

One test (slow tier): the script as written (its #SBATCH lines, with --gpus-per-node 4 on the
command line) runs the demo's layout with a tiny model, 2 nodes x 4 ranks = TP 2 x PP 2 x DP 2 with
ZeRO-2, once uninterrupted and once preempted: `scancel --signal=TERM` mid-run; the ranks save and
exit 0, and the script (REQUEUE=1) finds the run short of --train-iters and requeues the job; it
resumes from its checkpoint and finishes, and its losses equal the uninterrupted job's at every
iteration."""
import os
import re
import subprocess
import time

import pytest

from megazero.checkpoint import latest_iteration
from tests.sockets import listening, loopback
from tests.test_operations import ROOT, TINY, _env, _metrics

pytestmark = pytest.mark.slow

SETUP = os.path.join(ROOT, "scripts", "setup_slurm.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")
ITERS = 24


def _run(*cmd, timeout=60):
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def cluster():
    """scripts/setup_slurm.sh: installs (when missing) and starts the cluster; exit 3 means skip."""
    if not os.path.exists("/usr/bin/apt-get") and not os.path.exists("/usr/sbin/slurmctld"):
        pytest.skip("SLURM: no slurmctld installed and no apt-get to install it")
    started = time.monotonic()
    try:
        out = subprocess.run(["bash", SETUP], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("SLURM: scripts/setup_slurm.sh took over 300 s (apt-get?)")
    text = out.stdout + out.stderr
    if out.returncode == 3:
        pytest.skip(text.strip().splitlines()[-1])
    assert out.returncode == 0, text
    print(f"setup_slurm.sh: {time.monotonic() - started:.1f} s")
    return text


def _submit(tmp_path, name, env, extra=()):
    d = tmp_path / name
    cmd = ["sbatch", "--parsable", "--nodes", "2", "--gpus-per-node", "4", "--requeue", "--job-name", name,
           SBATCH, *TINY, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--zero-stage", "2", "--train-iters", str(ITERS),
           "--save", str(d), "--load", str(d), "--save-interval", "3", "--metrics-file", f"{d}.jsonl", *extra]
    job = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    return job.stdout.strip().split(";")[0]


def _state(job):
    """The job's state from squeue (PENDING, RUNNING, ...), '' once it has left the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def _wait(what, check, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _sacct(job):
    """(job id, state, exit code) of each run of the job itself (not its steps), oldest first."""
    out = _run("sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode")
    return [tuple(line.split("|")) for line in out.split()]


def _finished(runs, count):
    """The runs once there are ``count`` and the last one has finished (slurmdbd may lag a little)."""
    return runs if len(runs) == count and runs[-1][1] not in ("PENDING", "RUNNING") else None


def _lines(path):
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_sbatch_on_two_nodes_preempted_with_term_requeued_resumes_to_the_same_losses(cluster, tmp_path):
    env = _env(REQUEUE="1")  # exported to the job (sbatch's --export=ALL): one thread a rank, this python
    for key in [k for k in env if k.startswith("SLURM_")] + ["MEGAZERO_ROOT", "MASTER_ADDR", "MASTER_PORT"]:
        env.pop(key, None)  # the repository is found from the submitted script's path
    started = time.monotonic()
    jobs = []
    try:
        pre = _submit(tmp_path, "preempted", env)
        jobs.append(pre)
        metrics = tmp_path / "preempted.jsonl"
        _wait("4 iterations of the job", lambda: _lines(metrics) >= 4, 120)
        rendezvous = 29500 + int(pre) % 1000  # slurm.sbatch's MASTER_PORT; its join listens 1000 above
        stores = {port: [a for a, _ in listening(port=port)] for port in (rendezvous, rendezvous + 1000)}
        _run("scancel", "--signal=TERM", pre)  # to every process of the job's steps, as a preemption does
        # the ranks save and exit 0; REQUEUE=1: the script finds the run unfinished and requeues the job
        _wait("the preempted job back in the queue", lambda: _state(pre) == "PENDING", 60)
        whole = _submit(tmp_path, "uninterrupted", env)  # runs while the requeued job waits
        jobs.append(whole)
        _wait("both jobs to finish", lambda: not _state(pre) and not _state(whole), 150)
        runs = _wait("sacct's records of both runs", lambda: _finished(_sacct(pre), 2), 30)
        wall = time.monotonic() - started
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], capture_output=True)
    print(f"SLURM jobs: {wall:.1f} s wall for the preempted + requeued and the uninterrupted job")

    assert runs == [(pre, "REQUEUED", "0:0"), (pre, "COMPLETED", "0:0")], runs
    # the rendezvous store and the join listen on the first node's NodeAddr (127.0.0.1) only
    assert stores[rendezvous] and all(loopback(a) for addrs in stores.values() for a in addrs), stores
    whole_runs = _wait("sacct's record", lambda: _finished(_sacct(whole), 1), 30)
    assert [r[1:] for r in whole_runs] == [("COMPLETED", "0:0")], whole_runs
    out = open(tmp_path / f"megazero-{pre}.out").read()  # --open-mode=append: both attempts
    assert out.count("slurm.sbatch: 2 nodes x 4 GPUs") == 2, out[-3000:]
    assert "rendezvous 127.0.0.1:" in out  # the first node's NodeAddr
    stop = re.search(r"stopping after iteration (\d+): SIGTERM received", out)
    assert stop and int(stop.group(1)) < ITERS, out[-3000:]
    k = int(stop.group(1))
    requeued = f"slurm.sbatch: stopped at iteration {k} of {ITERS}: requeueing job {pre} (REQUEUE=1)"
    assert requeued in out, out[-3000:]
    assert re.search(rf"loaded checkpoint \S+ \(iteration {k},", out), out[-3000:]
    assert "rank 0/8: tp 0/2 pp 0/2 dp 0/2" in out, out[-3000:]
    assert _run("sacct", "-X", "-n", "-P", "-j", whole, "-o", "NodeList").split() == ["n[1-2]"]
    assert latest_iteration(str(tmp_path / "preempted")) == ITERS
    assert latest_iteration(str(tmp_path / "uninterrupted")) == ITERS

    resumed, reference = _metrics(metrics), _metrics(tmp_path / "uninterrupted.jsonl")
    assert sorted(resumed) == sorted(reference) == list(range(1, ITERS + 1))
    assert [resumed[i]["loss"] for i in reference] == [reference[i]["loss"] for i in reference]
    assert [resumed[i]["grad_norm"] for i in reference] == [reference[i]["grad_norm"] for i in reference]
