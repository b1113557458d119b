"""Real DeepSpeed as a peer: one training program, run under DeepSpeed 0.19.8 itself and under megazero's
engine with only its import changed (``import deepspeed`` / ``import megazero.deepspeed as deepspeed``),
2 gloo ranks on 127.0.0.1, CPU, fp32.  The program (:data:`PROGRAM`) trains a small Hugging Face GPT-2
(2 layers, width 32, tied head, dropout 0) with AdamW (torch's arithmetic: ``torch_adam``) over two
parameter groups (weight decay on the matrices only, as Hugging Face scripts group them), DeepSpeed's
WarmupDecayLR, clipping 1.0, 8 sequences a step as 2 ranks x 2 micro-batches x 2 accumulation steps (at
DP 1: 4 accumulation steps over the same 8), the batch of step t drawn from seed t whatever the ranks.

DeepSpeed runs under its own interpreter, ``.venv/deepspeed/bin/python`` that ``scripts/setup_env.sh``
installs (``MEGAZERO_DS_PYTHON`` names another); without it these tests skip, saying so.  Each DeepSpeed
run is made once per session (cached under pytest's temporary root, shared by xdist workers) and also
saves its checkpoint after step 3, which tests/test_ds_migration.py loads.

Tolerance: both sides fp32, the same products; only the order of a few sums differs (DeepSpeed's bucketed
all-reduce against megazero's reduce-scatter, the accumulation at DP 1), which moves a loss near 4 by a few
U32 (2.4e-7 each).  Losses must agree within 1e-5 (about 40 U32 of the loss, the bound issue 45 sets),
learning rates exactly; each comparison is shown to fail on a change well below a real bug (a lost
optimizer state moves the losses by > 1e-3)."""
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DS_VENV = ROOT / ".venv" / "deepspeed"
STEPS, SAVE_AFTER, LOSS_BOUND = 6, 3, 1e-5

PROGRAM = '''\
import argparse
import json

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

{import_line}

VOCAB, SEQ = 64, 16
p = argparse.ArgumentParser()
p.add_argument("--config")
p.add_argument("--steps", type=int)
p.add_argument("--width", type=int, default=32)
p.add_argument("--save")
p.add_argument("--save-after", type=int, default=-1)
p.add_argument("--load")
p.add_argument("--fresh-optimizer", action="store_true")
p.add_argument("--out")
a = p.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
with open(a.config) as fh:
    cfg = json.load(fh)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=a.width, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=0, eos_token_id=0))
# weight decay on the matrices only, as Hugging Face scripts group the parameters
groups = [{{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01}},
          {{"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}}]
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
start, client = 0, {{}}
if a.load:
    _, client = engine.load_checkpoint(a.load, load_optimizer_states=not a.fresh_optimizer)
    start = client["next_step"]
rank, dp = dist.get_rank(), dist.get_world_size()
micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
losses, lrs = [], []
for step in range(start, start + a.steps):
    g = torch.Generator().manual_seed(step)
    batch = torch.randint(0, VOCAB, (cfg["train_batch_size"], SEQ), generator=g)
    mine = batch[rank * micro * gas:(rank + 1) * micro * gas]
    total = torch.zeros(())
    for m in range(gas):
        x = mine[m * micro:(m + 1) * micro]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    dist.all_reduce(total)
    losses.append(float(total) / (gas * dp))
    lrs.append(engine.get_lr()[0])
    if a.save and step + 1 - start == a.save_after:
        engine.save_checkpoint(a.save, client_state={{"next_step": step + 1, "note": "peer"}})
if rank == 0 and a.out:
    with open(a.out, "w") as fh:
        json.dump({{"losses": losses, "lrs": lrs, "client": {{k: client[k] for k in ("next_step", "note")
                                                             if k in client}},
                   "global_steps": engine.global_steps}}, fh)
'''
IMPORTS = {"deepspeed": "import deepspeed", "megazero": "import megazero.deepspeed as deepspeed"}

# DeepSpeedExamples' training/cifar/cifar10_deepspeed.py in outline: its argument parsing with
# add_config_arguments, its network, initialize(args=..., training_data=...) and the loader it returns,
# get_accelerator().device_name(), the loop; random images in place of the download
CIFAR_PROGRAM = '''\
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

{import_line}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.pool, self.conv2 = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc3(F.relu(self.fc2(x)))


class RandomImages(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


parser = argparse.ArgumentParser(description="CIFAR")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--out")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=RandomImages(128))
local_device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
criterion = nn.CrossEntropyLoss()
losses, lrs = [], []
for epoch in range(args.epochs):
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
        lrs.append(model_engine.get_lr()[0])
if dist.get_rank() == 0:
    with open(args.out, "w") as fh:
        json.dump({{"losses": losses, "lrs": lrs}}, fh)
'''

# DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py in outline: a RoBERTa masked-LM wrapped to
# return its loss, HelloDeepSpeed's ds_config (Adam lr 1e-4, bf16, ZeRO-1 with the optimizer offloaded to
# the CPU), engine.parameters() counted, model.train(), the loop, save_checkpoint with
# client_state={'checkpoint_step': step} and a resume from load_checkpoint; random masked tokens in place
# of wikitext, a small model, and --steps/--load/--save/--out for the test
HELLO_PROGRAM = '''\
import argparse
import json

import torch
import torch.distributed as dist
from transformers import RobertaConfig, RobertaForMaskedLM

{import_line}


class RobertaMLMModel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.backbone = RobertaForMaskedLM(config)

    def forward(self, src_tokens, tgt_tokens):
        return self.backbone(input_ids=src_tokens, labels=tgt_tokens).loss


def batch_at(step, batch_size, vocab, seq):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(5, vocab, (batch_size, seq), generator=g)
    masked = torch.rand(batch_size, seq, generator=g) < 0.15
    return {{"src_tokens": torch.where(masked, torch.full_like(tokens, 4), tokens),
            "tgt_tokens": torch.where(masked, tokens, torch.full_like(tokens, -100))}}


p = argparse.ArgumentParser()
p.add_argument("--steps", type=int)
p.add_argument("--load")
p.add_argument("--save")
p.add_argument("--out")
a = p.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(42)
config = RobertaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
model = RobertaMLMModel(config)
ds_config = {{"train_micro_batch_size_per_gpu": 4, "optimizer": {{"type": "Adam", "params": {{"lr": 1e-4}}}},
             "bf16": {{"enabled": True}},
             "zero_optimization": {{"stage": 1, "offload_optimizer": {{"device": "cpu"}}}}}}
model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
device = torch.device(deepspeed.accelerator.get_accelerator().device_name()
                      if deepspeed.accelerator.get_accelerator().is_available() else "cpu")
start_step = 1
if a.load:
    _, client_state = model.load_checkpoint(load_dir=a.load)
    start_step = client_state["checkpoint_step"] + 1
count = sum([p.numel() for p in model.parameters()])
model.train()
losses = []
for step in range(start_step, start_step + a.steps):
    batch = {{k: v.to(device) for k, v in batch_at(step, 4, config.vocab_size, 32).items()}}
    loss = model(**batch)
    model.backward(loss)
    model.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    losses.append(float(total) / dist.get_world_size())
if a.save:
    model.save_checkpoint(save_dir=a.save, client_state={{"checkpoint_step": step}})
if dist.get_rank() == 0:
    with open(a.out, "w") as fh:
        json.dump({{"losses": losses, "parameters": count, "start": start_step}}, fh)
'''


def ds_config(stage: int, bf16: bool = False) -> dict:
    """The run's ds_config (the same file for both frameworks); ``bf16``: DeepSpeed's bf16 section."""
    return {**({"bf16": {"enabled": True}} if bf16 else {}),
            "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR",
                          "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
                                     "total_num_steps": 20, "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}}


def deepspeed_python():
    """(python, None) for an interpreter with DeepSpeed, else (None, the reason to skip)."""
    given = os.environ.get("MEGAZERO_DS_PYTHON")
    if given:
        ok = subprocess.run([given, "-c", "import deepspeed"], capture_output=True).returncode == 0
        return (given, None) if ok else (None, f"MEGAZERO_DS_PYTHON={given} cannot import deepspeed")
    if not (DS_VENV / ".megazero-deepspeed").is_file():
        return None, (f"DeepSpeed is not installed in {DS_VENV} (scripts/setup_env.sh installs it; "
                      "MEGAZERO_DS_PYTHON names another interpreter)")
    return str(DS_VENV / "bin" / "python"), None


def need_deepspeed() -> str:
    python, why = deepspeed_python()
    if python is None:
        pytest.skip(why)
    return python


def deepspeed_fp32(python: str, ckpt, out) -> dict:
    """DeepSpeed's own zero_to_fp32 (its reference reader) on the checkpoint directory ``ckpt``, run by
    DeepSpeed's interpreter ``python``: the fp32 weights by name (saved to ``out`` on the way)."""
    import torch
    code = ("import sys, torch; from deepspeed.utils.zero_to_fp32 import "
            "get_fp32_state_dict_from_zero_checkpoint as g; torch.save(dict(g(sys.argv[1])), sys.argv[2])")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([python, "-c", code, str(ckpt), str(out)], check=True, capture_output=True, env=env,
                   timeout=300)
    return torch.load(out, weights_only=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(python: str, framework: str, nproc: int, workdir: Path, args, timeout: float = 240.0,
           program: str = PROGRAM):
    """Run ``program`` with ``framework``'s import on ``nproc`` ranks (one process each, env://);
    returns ``(exit statuses, [(stdout, stderr)] per rank, parsed --out or None)``."""
    workdir.mkdir(parents=True, exist_ok=True)
    prog = workdir / f"train_{framework}.py"
    prog.write_text(program.format(import_line=IMPORTS[framework]))
    out = workdir / f"out_{framework}_{time.monotonic_ns()}.json"
    port = _free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", WANDB_MODE="disabled", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
                   TORCH_EXTENSIONS_DIR=str(DS_VENV / "torch_extensions"))
        procs.append(subprocess.Popen([python, str(prog), *map(str, args), "--out", str(out)], cwd=workdir,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline, outputs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs.append(p.communicate())
    codes = [p.returncode for p in procs]
    return codes, outputs, (json.loads(out.read_text()) if out.is_file() else None)


def run_ok(python: str, framework: str, nproc: int, workdir: Path, args, program: str = PROGRAM) -> dict:
    codes, outputs, result = launch(python, framework, nproc, workdir, args, program=program)
    assert codes == [0] * nproc and result is not None, (codes, outputs[0][1][-3000:])
    return result


def write_config(workdir: Path, stage: int, bf16: bool = False) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "ds_config.json"
    path.write_text(json.dumps(ds_config(stage, bf16)))
    return path


def deepspeed_reference(tmp_path_factory, stage: int, bf16: bool = False) -> dict:
    """DeepSpeed's own run at ZeRO ``stage`` (0: none), 2 ranks, :data:`STEPS` steps, checkpoint saved
    after :data:`SAVE_AFTER` (``ckpt``): made once per session and shared by the pytest workers."""
    python = need_deepspeed()
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = f"deepspeed_zero{stage}" + ("_bf16" if bf16 else "")
    work = root / name
    done = work / "reference.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            cfg = write_config(work, stage, bf16)
            args = ["--config", cfg, "--steps", STEPS, "--save", work / "ckpt", "--save-after", SAVE_AFTER]
            result = run_ok(python, "deepspeed", 2, work, args)
            done.write_text(json.dumps(result))
    return dict(json.loads(done.read_text()), ckpt=work / "ckpt", config=work / "ds_config.json")


def worst(a, b) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_setup_env_installs_deepspeed_at_its_best_and_never_fails_for_it(tmp_path, monkeypatch):
    """scripts/setup_env.sh against test_setup_env's stub venv (whose python creates no virtualenv):
    the DeepSpeed step says in one line that it could not install and the setup still succeeds with
    the same pip calls; MEGAZERO_DEEPSPEED=0 skips the step."""
    from test_setup_env import _setup_env
    code, err, calls, torch = _setup_env(tmp_path / "a")
    lines = [line for line in err.splitlines() if "DeepSpeed" in line]
    assert code == 0 and calls == ["-q numpy torch==2.13.0+cpu", "-q -e .[test]"]
    assert lines == [f"setup_env.sh: DeepSpeed (a test peer) not installed: could not create "
                     f"{tmp_path / 'a' / 'venv' / 'deepspeed'}; its tests skip"]
    monkeypatch.setenv("MEGAZERO_DEEPSPEED", "0")
    code, err, calls, torch = _setup_env(tmp_path / "b")
    assert code == 0 and "DeepSpeed" not in err


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_one_program_under_deepspeed_and_megazero_gives_the_same_losses(tmp_path_factory, tmp_path, stage):
    ds = deepspeed_reference(tmp_path_factory, stage)
    mz = run_ok(sys.executable, "megazero", 2, tmp_path, ["--config", ds["config"], "--steps", STEPS])
    assert worst(mz["losses"], ds["losses"]) <= LOSS_BOUND, (mz["losses"], ds["losses"])
    assert mz["lrs"] == ds["lrs"]
    assert ds["lrs"][0] == 0.0 and ds["lrs"][3] == 0.01 and ds["lrs"][-1] < 0.01  # warm-up, then decay
    # the losses move step to step far beyond the bound (new batches, then training)
    assert min(abs(x - y) for x, y in zip(ds["losses"], ds["losses"][1:])) > 100 * LOSS_BOUND


@pytest.mark.slow
def test_the_cifar10_program_under_deepspeed_and_megazero_gives_the_same_losses(tmp_path):
    """DeepSpeedExamples' cifar10 program (outline above) with its ds_config as shipped (fp16 off) at
    ZeRO-2, 2 ranks, one epoch of 128 random images (8 steps of 16): DeepSpeed's own Adam here is its
    compiled FusedAdam (adam_w_mode), megazero's torch's AdamW arithmetic; the losses agree within the
    bound (seen: 2.4e-7), the WarmupLR rates exactly."""
    from test_ds_config_keys import cifar10_config
    python = need_deepspeed()
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(cifar10_config(2)))
    args = ["--deepspeed", "--deepspeed_config", cfg]
    ds = run_ok(python, "deepspeed", 2, tmp_path / "ds", args, program=CIFAR_PROGRAM)
    mz = run_ok(sys.executable, "megazero", 2, tmp_path / "mz", args, program=CIFAR_PROGRAM)
    assert len(ds["losses"]) == 8 and worst(mz["losses"], ds["losses"]) <= LOSS_BOUND, (mz, ds)
    assert mz["lrs"] == ds["lrs"] and ds["lrs"][-1] > ds["lrs"][1] > 0.0
    assert min(abs(x - y) for x, y in zip(ds["losses"], ds["losses"][1:])) > 100 * LOSS_BOUND


@pytest.mark.slow
def test_the_hellodeepspeed_program_runs_and_resumes_a_deepspeed_run_with_the_same_losses(tmp_path):
    """DeepSpeedExamples' HelloDeepSpeed program (outline above, its ds_config: bf16, ZeRO-1, Adam
    offloaded to the CPU, which DeepSpeed runs with its compiled DeepSpeedCPUAdam) on 2 ranks: 6 steps
    under each framework from the same start, then each resumes DeepSpeed's checkpoint of step 6 for 3
    steps.  The losses are bf16 numbers (the model computes in bf16): they must agree within one bf16
    spacing of the loss (2^-5 for values in [4, 8), halved by the mean over two ranks; seen: all equal).
    The fp32 comparisons above are the sharp ones; this one shows the program runs unchanged."""
    python = need_deepspeed()
    ckpt = tmp_path / "ckpt"
    ds = run_ok(python, "deepspeed", 2, tmp_path / "ds", ["--steps", 6, "--save", ckpt],
                program=HELLO_PROGRAM)
    mz = run_ok(sys.executable, "megazero", 2, tmp_path / "mz", ["--steps", 6], program=HELLO_PROGRAM)
    ds_resumed = run_ok(python, "deepspeed", 2, tmp_path / "ds2", ["--steps", 3, "--load", ckpt],
                        program=HELLO_PROGRAM)
    mz_resumed = run_ok(sys.executable, "megazero", 2, tmp_path / "mz2", ["--steps", 3, "--load", ckpt],
                        program=HELLO_PROGRAM)
    spacing = 2.0 ** -5
    assert worst(mz["losses"], ds["losses"]) <= spacing, (mz, ds)
    assert mz["parameters"] == ds["parameters"]
    assert worst(mz_resumed["losses"], ds_resumed["losses"]) <= spacing, (mz_resumed, ds_resumed)
    assert mz_resumed["start"] == ds_resumed["start"] == 7
