"""A run started under DeepSpeed continues under megazero's engine (issue 45, DeepSpeed -> megazero).

DeepSpeed 0.19.8 itself trains tests/test_deepspeed_peer.py's program (GPT-2, AdamW, WarmupDecayLR, 2
gloo ranks, fp32) at ZeRO-2 and ZeRO-3 for 6 steps and saves its checkpoint after step 3, in its own
layout; DeepSpeed's losses for steps 4-6 are what it gets continuing itself.  The same program with only
the import changed loads that checkpoint (``engine.load_checkpoint(dir)``) at DP 2 and at DP 1 and trains
steps 4-6: its losses must equal DeepSpeed's within 1e-5 (test_deepspeed_peer's bound), its learning
rates exactly, and ``client_state`` comes back.  The bound is shown to matter: without the Adam moments
(``load_optimizer_states=False``) the first continued loss still agrees (the weights) and the later ones
move by far more than the bound (4e-3 to 9e-3); the model before loading is far from the loaded one.

Bad input gets one line and exit status 2: a truncated shard, a missing rank file, a model of another
shape, a pickle that would run code (never run)."""
import os
import shutil
import subprocess
import sys

import pytest

from test_deepspeed_peer import (IMPORTS, LOSS_BOUND, PROGRAM, ROOT, SAVE_AFTER, STEPS, deepspeed_reference,
                                 run_ok, worst)

OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"
# bf16 continuation: three updates at lr <= 0.01 move this loss by a few 1e-3 (with and without the Adam
# state the continued losses differ by up to 9e-3); gradients rounded to bf16 (2^-8 relative) at other
# places perturb that movement by ~2^-8 x 0.03 = 1.2e-4; the bound is about three times that
BF16_BOUND = 4e-4


@pytest.mark.slow
@pytest.mark.parametrize("stage,dp", [(2, 2), (2, 1), (3, 2), (3, 1)])
def test_megazero_continues_a_deepspeed_run_as_deepspeed_does(tmp_path_factory, tmp_path, stage, dp):
    ds = deepspeed_reference(tmp_path_factory, stage)
    args = ["--config", ds["config"], "--steps", STEPS - SAVE_AFTER, "--load", ds["ckpt"]]
    mz = run_ok(sys.executable, "megazero", dp, tmp_path, args)
    want = ds["losses"][SAVE_AFTER:]
    assert worst(mz["losses"], want) <= LOSS_BOUND, (mz["losses"], want)
    assert mz["lrs"] == ds["lrs"][SAVE_AFTER:]
    assert mz["client"] == {"next_step": SAVE_AFTER, "note": "peer"} and mz["global_steps"] == STEPS


def _engine(width: int, config: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import megazero.deepspeed as deepspeed
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=width, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0))
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    return deepspeed.initialize(model=model, model_parameters=groups, config=config)[0]


def _train(engine, start: int, steps: int):
    """The peer program's loop on one rank: step t's 8 sequences as micro-batches of 2."""
    import torch
    losses = []
    for step in range(start, start + steps):
        batch = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
        total = 0.0
        for m in range(0, 8, 2):
            loss = engine(input_ids=batch[m:m + 2], labels=batch[m:m + 2]).loss
            engine.backward(loss)
            engine.step()
            total += float(loss)
        losses.append(total / 4)
    return losses


def _loss(engine, step: int) -> float:
    import torch
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
    with torch.no_grad():
        return float(engine(input_ids=x, labels=x).loss)


class _Payload:
    """Pickles as a call of os.system: loading it with pickle would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _bad_inputs(ckpt: str, config: dict, work: str):
    """One rank: the weights load (the loss on step 3's batch before and after), then each broken copy
    of the checkpoint gives its one-line error."""
    import torch

    from megazero.checkpoint.errors import CheckpointError
    engine = _engine(32, config)
    before = _loss(engine, SAVE_AFTER)
    engine.load_checkpoint(ckpt)
    after = _loss(engine, SAVE_AFTER)
    tag = open(os.path.join(ckpt, "latest")).read().strip()

    def broken(name, change, width=32):
        d = os.path.join(work, name)
        shutil.copytree(ckpt, d)
        change(os.path.join(d, tag))
        try:
            (engine if width == 32 else _engine(width, config)).load_checkpoint(d)
        except CheckpointError as err:
            return str(err)
        return None

    def truncate(t):
        path = os.path.join(t, OPTIM1)
        os.truncate(path, os.path.getsize(path) // 2)

    def copy_as(t, name):
        shutil.copy(os.path.join(t, MODEL), os.path.join(t, name))

    def payload(t):
        torch.save({"module": {}, "step": _Payload(os.path.join(work, "ran"))},
                   os.path.join(t, "mp_rank_00_model_states.pt"))

    errors = {"truncated": broken("truncated", truncate),
              "missing": broken("missing", lambda t: os.remove(os.path.join(t, OPTIM1))),
              "shape": broken("shape", lambda t: None, width=48),
              "payload": broken("payload", payload),
              # layouts megazero does not map, named by DeepSpeed's file names (copies of real files)
              "tp": broken("tp", lambda t: copy_as(t, "mp_rank_01_model_states.pt")),
              "pipeline": broken("pipeline", lambda t: copy_as(t, "layer_01-model_states.pt")),
              # an empty zero/ is read as a universal checkpoint (tests/test_ds_universal.py) lacking every
              # parameter
              "universal": broken("universal", lambda t: os.mkdir(os.path.join(t, "zero")))}
    engine.load_checkpoint(ckpt, load_optimizer_states=False)  # the weights, a fresh Adam
    fresh = _train(engine, SAVE_AFTER, STEPS - SAVE_AFTER)
    return before, after, errors, os.path.exists(os.path.join(work, "ran")), fresh


@pytest.mark.slow
def test_the_weights_and_moments_load_and_bad_input_is_refused_in_one_line(tmp_path_factory, tmp_path):
    from megazero.process.local_ranks import run_ranks
    from test_deepspeed_peer import ds_config
    ds = deepspeed_reference(tmp_path_factory, 2)
    before, after, errors, ran, fresh = run_ranks(_bad_inputs, 1, str(ds["ckpt"]), ds_config(2),
                                                  str(tmp_path), timeout=300)[0]
    assert abs(after - ds["losses"][SAVE_AFTER]) <= LOSS_BOUND < abs(before - after) / 100
    # without the Adam moments (load_optimizer_states=False) the first continued loss still agrees (the
    # weights), the later ones move far beyond the bound: the moments loaded above are what makes them agree
    want = ds["losses"][SAVE_AFTER:]
    assert abs(fresh[0] - want[0]) <= LOSS_BOUND
    assert min(abs(a - b) for a, b in zip(fresh[1:], want[1:])) > 100 * LOSS_BOUND, (fresh, want)
    assert f"{OPTIM1} cannot be read (" in errors["truncated"] and "truncated" in errors["truncated"]
    assert f"{OPTIM1} is missing: the checkpoint was saved by 2 data-parallel ranks" in errors["missing"]
    assert ("parameter transformer.wte.weight has shape [64, 32] in the DeepSpeed checkpoint but [64, 48] in "
            "this model") in errors["shape"]
    assert "is refused: it names posix.system" in errors["payload"] and not ran
    assert "was saved with DeepSpeed tensor parallelism (mp_rank_01_model_states.pt)" in errors["tp"]
    assert "is a DeepSpeed pipeline-engine (PipelineModule) checkpoint (layer_01-model_states.pt" in \
        errors["pipeline"]
    assert "parameter transformer.wte.weight is not in the universal checkpoint" in errors["universal"]
    assert all("\n" not in e for e in errors.values()), errors


def _bf16_masters(ckpt: str, config: dict, work: str):
    """One rank: load DeepSpeed's bf16 checkpoint, save it in megazero's format and read that back with
    megazero's zero_to_fp32 (the fp32 masters); the loss on step 3's batch."""
    from megazero.engine import get_fp32_state_dict_from_zero_checkpoint
    engine = _engine(32, config)
    engine.load_checkpoint(ckpt)
    engine.save_checkpoint(work)
    return get_fp32_state_dict_from_zero_checkpoint(work), _loss(engine, SAVE_AFTER)


@pytest.mark.slow
def test_a_bf16_zero1_run_continues_with_deepspeeds_fp32_masters(tmp_path_factory, tmp_path):
    """bf16 at ZeRO-1 (DeepSpeed's bf16_zero_pp_rank_* files): the fp32 masters megazero loads equal
    what DeepSpeed's zero_to_fp32 reads, bitwise; the first continued loss (the same bf16 weights)
    within 1e-5.  The later steps compute gradients in bf16, which DeepSpeed and megazero round at
    other places: those losses agree within BF16_BOUND (seen: 6e-5; a lost Adam state moves them by
    4e-3 to 9e-3)."""
    from megazero.process.local_ranks import run_ranks
    from test_deepspeed_peer import deepspeed_fp32, deepspeed_python, ds_config
    ds = deepspeed_reference(tmp_path_factory, 1, bf16=True)
    want = deepspeed_fp32(deepspeed_python()[0], ds["ckpt"], tmp_path / "ds_fp32.pt")
    got, loss = run_ranks(_bf16_masters, 1, str(ds["ckpt"]), ds_config(1, bf16=True), str(tmp_path / "mz"),
                          timeout=300)[0]
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k].float()) for k in want)
    assert abs(loss - ds["losses"][SAVE_AFTER]) <= LOSS_BOUND
    args = ["--config", ds["config"], "--steps", STEPS - SAVE_AFTER, "--load", ds["ckpt"]]
    mz = run_ok(sys.executable, "megazero", 2, tmp_path / "run", args)
    assert abs(mz["losses"][0] - ds["losses"][SAVE_AFTER]) <= LOSS_BOUND
    assert worst(mz["losses"], ds["losses"][SAVE_AFTER:]) <= BF16_BOUND, (mz["losses"], ds["losses"])
    assert mz["lrs"] == ds["lrs"][SAVE_AFTER:]


def _weights_only(ckpt: str, config: dict):
    """One rank: a checkpoint without ZeRO refuses the optimizer state and loads the weights."""
    from megazero.checkpoint.errors import CheckpointError
    engine = _engine(32, config)
    try:
        engine.load_checkpoint(ckpt)
        error = None
    except CheckpointError as err:
        error = str(err)
    _, client = engine.load_checkpoint(ckpt, load_optimizer_states=False)
    return error, _loss(engine, SAVE_AFTER), client["next_step"]


@pytest.mark.slow
def test_a_checkpoint_without_zero_gives_its_weights_and_refuses_its_optimizer(tmp_path_factory):
    from megazero.process.local_ranks import run_ranks
    from test_deepspeed_peer import ds_config
    ds = deepspeed_reference(tmp_path_factory, 0)
    error, loss, step = run_ranks(_weights_only, 1, str(ds["ckpt"]), ds_config(0), timeout=300)[0]
    assert "a DeepSpeed checkpoint without ZeRO, whose optimizer state megazero does not map; " \
        "load_optimizer_states=False" in error
    assert abs(loss - ds["losses"][SAVE_AFTER]) <= LOSS_BOUND and step == SAVE_AFTER


@pytest.mark.slow
def test_a_broken_checkpoint_ends_the_program_with_one_line_and_status_2(tmp_path_factory, tmp_path):
    ds = deepspeed_reference(tmp_path_factory, 3)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ds["ckpt"], ckpt)
    shard = ckpt / "global_step3" / OPTIM1
    os.truncate(shard, shard.stat().st_size // 2)
    prog = tmp_path / "train.py"
    prog.write_text(PROGRAM.format(import_line=IMPORTS["megazero"]))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "scripts" / "launch.py"), "--standalone", "--nproc-per-node", "2",
           str(prog), "--config", str(ds["config"]), "--steps", "1", "--load", str(ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if f"{OPTIM1} cannot be read" in line]
    assert proc.returncode == 2, (proc.returncode, text[-3000:])
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert "failed finding central directory): truncated or not a torch.save file" in lines[0]
