"""scripts/deepspeed_launch.py: DeepSpeed's hostfile (``HOST slots=N``), --include/--exclude,
--num_nodes/--num_gpus, and the hosts reached over ssh or pdsh.  The fast tier checks the parsing,
the filters (against DeepSpeed's documented examples) and the commands; the slow tier starts an
sshd on 127.0.0.1 (skipped, naming what is missing, without sshd or root) and runs a TP 2 x DP 2
job on two "hosts" (127.0.0.1 and localhost, two ranks each) over ssh and over pdsh: their losses
equal one process's (the oracle) within R_TRAIN, and each other's exactly."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from megazero.checkpoint import latest_iteration
from megazero.process.hostfile import HostfileError, parse_hostfile, select
from models.cli import ds_launch
from tests.test_operations import ROOT, TINY, _env, _losses, _metrics, _settings, _train
from tolerance import R_TRAIN

HOSTFILE = """# two nodes
worker-0 slots=4
worker-1 slots=4   # trailing comment

"""


def test_hostfile_lines_comments_and_refusals():
    assert parse_hostfile(HOSTFILE) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    for text, needle in (("worker-0 4", "line 1: 'worker-0 4' is not 'HOST slots=N'"),
                         ("a slots=2\na slots=1", "line 2: host a is listed twice"),
                         ("a slots=0", "a needs slots >= 1"),
                         ("# nothing\n", "no hosts in it")):
        with pytest.raises(HostfileError, match=needle):
            parse_hostfile(text)


def test_include_exclude_num_nodes_num_gpus_as_deepspeed_documents_them():
    pool = parse_hostfile(HOSTFILE)
    assert select(pool, include="worker-0:0,2@worker-1") == {"worker-0": [0, 2], "worker-1": [0, 1, 2, 3]}
    assert select(pool, include="worker-1") == {"worker-1": [0, 1, 2, 3]}
    assert select(pool, exclude="worker-1:0") == {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}
    assert select(pool, exclude="worker-0") == {"worker-1": [0, 1, 2, 3]}
    assert select(pool, num_nodes=1) == {"worker-0": [0, 1, 2, 3]}
    assert select(pool, num_gpus=2) == {"worker-0": [0, 1], "worker-1": [0, 1]}
    assert select(pool, include="worker-1:1,3@worker-0", num_gpus=1) == {"worker-0": [0], "worker-1": [1]}
    for kwargs, needle in ((dict(include="worker-0", exclude="worker-1"), "cannot be used together"),
                           (dict(include="worker-9"), "host worker-9 is not in the hostfile"),
                           (dict(include="worker-0:7"), "worker-0 has slots 0-3, not 7"),
                           (dict(include="worker-0:x"), "slot 'x' of worker-0 is not a number"),
                           (dict(exclude="worker-0@worker-1"), "--exclude leaves no host"),
                           (dict(num_nodes=3), "--num_nodes 3: only 2 hosts are left"),
                           (dict(num_gpus=5), "--num_gpus 5: worker-0, worker-1 has fewer slots"),
                           (dict(num_nodes=0), "--num_nodes must be >= 1")):
        with pytest.raises(HostfileError, match=needle):
            select(pool, **kwargs)


def _args(*argv):
    return ds_launch.parser().parse_args([*argv, "train.py", "--deepspeed_config", "ds.json"])


def test_commands_over_ssh_and_pdsh(tmp_path):
    active = {"node-a": [0, 2], "node-b": [1, 3]}
    env = {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO", "SECRET": "x"}
    (tmp_path / ".deepspeed_env").write_text("MY_VAR=a b\n")
    ssh = ds_launch.plan(_args("--launcher", "ssh", "--ssh_port", "2222", "--master_port", "29600"), active,
                         env, "/py", str(tmp_path), which=lambda _: "/usr/bin/x")
    assert [c[:4] for c in ssh] == [["ssh", "-p", "2222", "node-a"], ["ssh", "-p", "2222", "node-b"]]
    for rank, (cmd, slots) in enumerate(zip(ssh, ("0,2", "1,3"))):
        line = cmd[-1]
        start = f"export CUDA_VISIBLE_DEVICES={slots} && cd {tmp_path} && exec 3<&0 && {{ env "
        assert line.startswith(start), line
        assert "MY_VAR='a b'" in line and "NCCL_DEBUG=INFO" in line and "SECRET" not in line
        words = (f"/py {ROOT}/scripts/launch.py --nnodes 2 --node-rank {rank} --nproc-per-node 2 "
                 "--master-addr node-a --master-port 29600 train.py --deepspeed_config ds.json")
        assert f"{words} <&- & pid=$!;" in line, line
        assert "while read -r _ <&3; do :; done; kill -TERM $pid" in line  # stdin's end stops the host
    pdsh, = ds_launch.plan(_args("--launcher", "pdsh"), active, env, "/py", str(tmp_path),
                           which=lambda _: "/x")
    assert pdsh[:5] == ["pdsh", "-S", "-f", "1024", "-w"] and pdsh[5] == "node-a,node-b"
    assert pdsh[6].startswith("case %n in 0) CUDA_VISIBLE_DEVICES=0,2;; 1) CUDA_VISIBLE_DEVICES=1,3;; esac")
    assert "--node-rank %n --nproc-per-node 2" in pdsh[6]
    assert ds_launch.launcher_env(_args("--ssh_port", "2222"), {"PDSH_SSH_ARGS_APPEND": "-i k"}) == {
        "PDSH_SSH_ARGS_APPEND": "-p 2222 -i k", "PDSH_RCMD_TYPE": "ssh"}
    with pytest.raises(HostfileError, match="--launcher pdsh: pdsh is not installed .*apt-get install pdsh"):
        ds_launch.plan(_args("--launcher", "pdsh"), active, env, "/py", "/", which=lambda _: None)
    with pytest.raises(HostfileError, match=r"different slot counts \(a: 1, b: 2\).*--num_gpus N"):
        ds_launch.plan(_args(), {"a": [0], "b": [0, 1]}, env, "/py", "/", which=lambda _: "/x")


def test_bad_input_is_one_line_naming_the_flag(tmp_path, capsys):
    hostfile = tmp_path / "hf"
    hostfile.write_text("a slots=2\nb slots\n")
    assert ds_launch.main(["--hostfile", str(hostfile), "train.py"]) == 2
    assert capsys.readouterr().err == (f"deepspeed_launch.py: error: --hostfile {hostfile} line 2: "
                                       "'b slots' is not 'HOST slots=N'\n")
    assert ds_launch.main(["--hostfile", str(tmp_path / "none"), "train.py"]) == 2
    assert "--hostfile" in capsys.readouterr().err


def test_one_host_runs_here_with_its_slots(monkeypatch, tmp_path):
    if os.path.exists(ds_launch.DEFAULT_HOSTFILE):
        pytest.skip(f"{ds_launch.DEFAULT_HOSTFILE} exists on this machine")
    calls = []
    monkeypatch.setattr(ds_launch.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    assert ds_launch.main(["--num_gpus", "2", "train.py", "--x", "1"], environ={}) == 0
    (cmd, env), = calls
    assert cmd[1:] == [os.path.join(ROOT, "scripts", "launch.py"), "--standalone", "--nproc-per-node", "2",
                       "train.py", "--x", "1"] and env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    hostfile = tmp_path / "hf"
    hostfile.write_text("gpu-box slots=4\n")
    assert ds_launch.main(["-H", str(hostfile), "-i", "gpu-box:1,3", "train.py"], environ={}) == 0
    assert calls[1][0][3:5] == ["--nproc-per-node", "2"] and calls[1][1] == {"CUDA_VISIBLE_DEVICES": "1,3"}


# ---- over ssh and pdsh, against an sshd this test starts on 127.0.0.1 --------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    sshd_bin = "/usr/sbin/sshd"
    # the project's own script installs openssh and pdsh where apt-get and root are there
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_ssh.sh")], timeout=600)
    missing = [n for n, ok in (("sshd (Debian: openssh-server)", os.path.exists(sshd_bin)),
                               ("ssh (openssh-client)", shutil.which("ssh")),
                               ("ssh-keygen", shutil.which("ssh-keygen")),
                               ("root (sshd needs it)", os.geteuid() == 0)) if not ok]
    if missing:
        pytest.skip("deepspeed_launch over ssh: missing " + ", ".join(missing))
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "user.pub", d / "authorized_keys")
    port = _free_port()
    (d / "config").write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\n"
                              f"PidFile {d / 'pid'}\n"
                              f"AuthorizedKeysFile {d / 'authorized_keys'}\nStrictModes no\nUsePAM no\n"
                              "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                              "PermitRootLogin prohibit-password\n")
    os.makedirs("/run/sshd", exist_ok=True)
    proc = subprocess.Popen([sshd_bin, "-D", "-f", str(d / "config"), "-E", str(d / "log")])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    opts = (f"-i {d / 'user'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes "
            "-o LogLevel=ERROR")
    yield port, opts, d / "log"
    proc.terminate()
    proc.wait(10)


def _launch(tmp_path, name, argv, env):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "deepspeed_launch.py"), *argv,
           os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *TINY, "--tensor-model-parallel-size", "2",
           "--train-iters", "3", "--metrics-file", str(metrics)]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "rank 0/4: tp 0/2 pp 0/1 dp 0/2" in out.stdout, out.stdout[-3000:]
    return [m["loss"] for _, m in sorted(_metrics(metrics).items())]


@pytest.mark.slow
def test_two_hosts_over_ssh_and_pdsh_equal_one_process(sshd, tmp_path):
    port, opts, log = sshd
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")
    env = _env(PDSH_SSH_ARGS_APPEND=opts)
    oracle = _losses(_train(_settings(train_iters=3)))  # one process, the same model, data and batch
    launchers = ["ssh"] + (["pdsh"] if shutil.which("pdsh") else [])
    runs = {}
    for launcher in launchers:
        before = open(log).read().count("Accepted publickey")
        argv = ["--hostfile", "hostfile", "--launcher", launcher, "--ssh_port", str(port),
                "--master_port", str(_free_port())]
        runs[launcher] = _launch(tmp_path, launcher, argv, env)
        assert len(runs[launcher]) == 3, launcher
        assert runs[launcher] == pytest.approx(oracle, rel=R_TRAIN), (launcher, runs[launcher], oracle)
        assert open(log).read().count("Accepted publickey") - before == 2, launcher  # one login a host
    assert len(set(map(tuple, runs.values()))) == 1  # ssh and pdsh: the same job, bitwise
    if "pdsh" not in launchers:
        argv = ["--hostfile", str(tmp_path / "hostfile"), "--launcher", "pdsh", "train.py"]
        out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "deepspeed_launch.py"), *argv],
                             capture_output=True, text=True)
        assert out.returncode == 2 and "--launcher pdsh: pdsh is not installed" in out.stderr


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_host_which_saves(sshd, tmp_path):
    """SIGTERM to deepspeed_launch.py closes the ssh sessions' input; each host's launch.py gets
    SIGTERM and forwards it: the ranks save once and every process exits 0, none left behind."""
    port, opts, _ = sshd
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "deepspeed_launch.py"), "--hostfile", "hostfile",
           "--launcher", "ssh", "--ssh_port", str(port), "--master_port", str(_free_port()),
           os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *TINY, "--tensor-model-parallel-size", "2",
           "--train-iters", "5000", "--exit-signal-handler", "--save", str(ckpt),
           "--metrics-file", str(metrics)]
    log = open(tmp_path / "out.log", "w")
    proc = subprocess.Popen(cmd, env=_env(PDSH_SSH_ARGS_APPEND=opts), cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            alive = proc.poll() is None and time.monotonic() < deadline
            assert alive, (tmp_path / "out.log").read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "out.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "out.log").read_text()
    stop = re.search(r"stopping after iteration (\d+): SIGTERM received", out)
    assert stop and out.count("saved checkpoint at iteration") == 1, out[-3000:]
    assert latest_iteration(str(ckpt)) == int(stop.group(1)) < 5000
    assert out.count("launch.py: SIGTERM received: every rank stopped cleanly") == 2, out[-3000:]
    time.sleep(1)
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).count(str(metrics))]
    assert left == [], [_cmdline(p) for p in left]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""
