"""DeepSpeed's universal checkpoints into megazero's engine (issue 45 item 1; engine/ds_universal.py).

DeepSpeed 0.19.8 trains tests/test_deepspeed_peer.py's program (GPT-2, AdamW over two groups,
WarmupDecayLR, 2 gloo ranks, fp32) at ZeRO-2 and saves after step 3 (the session's shared run);
DeepSpeed's own ``ds_to_universal.py`` converts that checkpoint (``--inject_missing_state``: a Hugging Face
model carries no ``universal_checkpoint_info``); DeepSpeed continues from the universal checkpoint itself
(``checkpoint.load_universal: true``) for steps 4-6.  megazero's engine loads the same directory at DP 2
(ZeRO-2, tag from ``latest_universal``), at DP 1 (ZeRO-2, the tag given, load_universal off: recognised by
its layout) and at DP 2 under ZeRO-3, and trains steps 4-6: the losses must equal DeepSpeed's within 1e-5
(test_deepspeed_peer's bound: fp32 on both sides, only the order of a few sums differs), the learning
rates exactly.  The bound is shown to matter: the model before loading is far from the loaded one, and
without the Adam moments (``load_optimizer_states=False``) the later losses move by far more than it.
A universal checkpoint converted from DeepSpeed's ZeRO-3 checkpoint (bare flat tensors, the step in
optimizer_state.pt) continues as DeepSpeed continued the checkpoint converted.

Bad input gets one line: a parameter missing from the checkpoint, one of another shape, one the model
lacks, a truncated file, a pickle that would run code (never run), a universal checkpoint converted from
a tensor- or pipeline-parallel run, ``load_universal`` without ``latest_universal``; a script ends with
exit status 2 and that line."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from test_deepspeed_peer import (LOSS_BOUND, SAVE_AFTER, STEPS, deepspeed_reference, ds_config, launch,
                                 need_deepspeed, run_ok, worst)

TAG = "global_step3_universal"
CONTINUE = STEPS - SAVE_AFTER


def _config(stage: int, load_universal: bool) -> dict:
    return {**ds_config(stage), "checkpoint": {"load_universal": load_universal}}


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    """DeepSpeed's ZeRO-2 checkpoint converted by ds_to_universal.py, and DeepSpeed's own continuation
    from it (made once for the module)."""
    ds = deepspeed_reference(tmp_path_factory, 2)
    python = need_deepspeed()
    work = tmp_path_factory.mktemp("universal")
    ckpt = work / "ckpt"
    shutil.copytree(ds["ckpt"], ckpt)
    _convert(python, ckpt)
    config = work / "ds_config_universal.json"
    config.write_text(json.dumps(_config(2, True)))
    args = ["--config", config, "--steps", CONTINUE, "--load", ckpt]
    dsu = run_ok(python, "deepspeed", 2, work / "ds", args)
    return dict(ckpt=str(ckpt), config=config, losses=dsu["losses"], lrs=dsu["lrs"], client=dsu["client"],
                regular=ds, work=work)


def _engine(width: int, config: dict):
    from test_ds_migration import _engine as build
    return build(width, config)


def _train(engine, start: int, steps: int):
    """test_deepspeed_peer's loop: step t's 8 sequences, this rank's share as micro-batches; the loss
    averaged over the ranks, and the learning rate after each step."""
    import torch
    import torch.distributed as dist
    rank, dp = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses, lrs = [], []
    for step in range(start, start + steps):
        batch = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
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
    return losses, lrs


def _continue(ckpt: str, config: dict, tag, fresh: bool):
    """One rank of a megazero run: load the universal checkpoint, train steps 4-6; with ``fresh`` the
    loss on step 3's batch before loading, and steps 4-6 again from the weights with a fresh Adam."""
    from test_ds_migration import _loss
    engine = _engine(32, config)
    before = _loss(engine, SAVE_AFTER) if fresh else None
    path, client = engine.load_checkpoint(ckpt, tag=tag)
    after = _loss(engine, SAVE_AFTER)
    losses, lrs = _train(engine, SAVE_AFTER, CONTINUE)
    out = {"path": path, "client": {k: client[k] for k in ("next_step", "note")}, "losses": losses,
           "lrs": lrs, "before": before, "after": after, "global_steps": engine.global_steps}
    if fresh:
        engine.load_checkpoint(ckpt, tag=tag, load_optimizer_states=False)
        out["fresh"] = _train(engine, SAVE_AFTER, CONTINUE)[0]
    return out


@pytest.mark.slow
def test_megazero_continues_a_universal_checkpoint_as_deepspeed_does(universal):
    from megazero.process.local_ranks import run_ranks
    want = universal["losses"]
    # DeepSpeed itself continues the same from its universal checkpoint as from the checkpoint converted
    assert worst(want, universal["regular"]["losses"][SAVE_AFTER:]) <= LOSS_BOUND
    assert universal["client"] == {"next_step": SAVE_AFTER, "note": "peer"}
    runs = {"dp2 zero2 (latest_universal)": run_ranks(_continue, 2, universal["ckpt"], _config(2, True), None,
                                                      False, timeout=300)[0],
            "dp1 zero2 (the tag)": run_ranks(_continue, 1, universal["ckpt"], _config(2, False), TAG, True,
                                             timeout=300)[0],
            "dp2 zero3 (latest_universal)": run_ranks(_continue, 2, universal["ckpt"], _config(3, True), None,
                                                      False, timeout=300)[0]}
    for name, got in runs.items():
        assert got["path"].endswith(TAG), (name, got["path"])
        assert worst(got["losses"], want) <= LOSS_BOUND, (name, got["losses"], want)
        assert got["lrs"] == universal["lrs"], (name, got["lrs"], universal["lrs"])
        assert got["client"] == {"next_step": SAVE_AFTER, "note": "peer"} and got["global_steps"] == STEPS
    one = runs["dp1 zero2 (the tag)"]
    # the loaded weights are the checkpoint's: the first continued loss is DeepSpeed's, far from the start
    assert abs(one["after"] - want[0]) <= LOSS_BOUND < abs(one["before"] - one["after"]) / 100
    # without the Adam moments the first loss still agrees (the weights), the later ones move far beyond it
    assert abs(one["fresh"][0] - want[0]) <= LOSS_BOUND
    moved = min(abs(a - b) for a, b in zip(one["fresh"][1:], want[1:]))
    assert moved > 100 * LOSS_BOUND, (one["fresh"], want)


def _convert(python: str, ckpt, tag: str = "global_step3", inject: bool = True) -> None:
    """DeepSpeed's ds_to_universal.py on ``ckpt/tag`` (one worker each: the machine is small)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [python, "-W", "ignore", "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ckpt / tag,
           "--output_folder", ckpt / f"{tag}_universal", "--num_extract_workers", "1",
           "--num_merge_workers", "1"]
    proc = subprocess.run(list(map(str, cmd + (["--inject_missing_state"] if inject else []))),
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "latest_universal").read_text().strip() == f"{tag}_universal"


@pytest.mark.slow
def test_a_universal_checkpoint_converted_from_zero3_continues_as_deepspeed_did(tmp_path_factory, tmp_path):
    """ds_to_universal.py on a ZeRO-3 checkpoint writes each state as the bare flat tensor and the step
    only in optimizer_state.pt.  The oracle is DeepSpeed's own continuation of the checkpoint converted
    (steps 4-6 of its run): DeepSpeed 0.19.8's continuation from this universal checkpoint is not one,
    as its ZeRO-3 universal loader gives every sub-group one shared step tensor, which torch's AdamW
    increments once per group (seen: step 3 -> 5 -> 7 over two steps, the losses 3.5e-4 off), and its
    ZeRO-2 loader cannot open it."""
    from megazero.process.local_ranks import run_ranks
    ds = deepspeed_reference(tmp_path_factory, 3)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ds["ckpt"], ckpt)
    _convert(need_deepspeed(), ckpt, inject=False)
    assert not (ckpt / TAG / "zero" / "transformer.wte.weight" / "step.pt").exists()
    got = run_ranks(_continue, 2, str(ckpt), _config(2, True), None, False, timeout=300)[0]
    assert worst(got["losses"], ds["losses"][SAVE_AFTER:]) <= LOSS_BOUND, (got["losses"], ds["losses"])
    assert got["lrs"] == ds["lrs"][SAVE_AFTER:] and got["client"] == {"next_step": SAVE_AFTER, "note": "peer"}


class _Payload:
    """Pickles as a call of os.system: loading it with pickle would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _bad_inputs(ckpt: str, work: str):
    """One rank: each broken copy of the universal checkpoint gives its one-line error."""
    import torch

    from megazero.checkpoint.errors import CheckpointError
    engine = _engine(32, _config(2, False))

    def broken(name, change, width=32, config=None, tag=TAG):
        d = os.path.join(work, name)
        shutil.copytree(ckpt, d)
        change(os.path.join(d, TAG))
        target = engine if width == 32 and config is None else _engine(width, config or _config(2, False))
        try:
            target.load_checkpoint(d, tag=tag)
        except CheckpointError as err:
            return str(err)
        return None

    zero = "zero/transformer.h.0.mlp.c_fc"

    def truncate(t):
        path = os.path.join(t, zero + ".weight", "exp_avg.pt")
        os.truncate(path, os.path.getsize(path) // 2)

    def payload(t):
        torch.save({"param": _Payload(os.path.join(work, "ran"))}, os.path.join(t, zero + ".bias", "fp32.pt"))

    def extra(t):
        other = os.path.join(t, "zero", "transformer.h.2.mlp.c_fc.bias")
        shutil.copytree(os.path.join(t, zero + ".bias"), other)

    def copy_as(t, name):
        shutil.copy(os.path.join(t, "mp_rank_00_model_states.pt"), os.path.join(t, name))

    return {"missing": broken("missing", lambda t: shutil.rmtree(os.path.join(t, zero + ".bias"))),
            "shape": broken("shape", lambda t: None, width=48),
            "extra": broken("extra", extra),
            "truncated": broken("truncated", truncate),
            "payload": broken("payload", payload),
            "model_states": broken("model_states",
                                   lambda t: os.remove(os.path.join(t, "mp_rank_00_model_states.pt"))),
            "tp": broken("tp", lambda t: copy_as(t, "mp_rank_01_model_states.pt")),
            "pipeline": broken("pipeline", lambda t: copy_as(t, "layer_01-model_states.pt")),
            "no_latest": broken("no_latest", lambda t: os.remove(os.path.join(os.path.dirname(t),
                                                                              "latest_universal")),
                                config=_config(2, True), tag=None)}, os.path.exists(os.path.join(work, "ran"))


@pytest.mark.slow
def test_a_broken_universal_checkpoint_is_refused_in_one_line(universal, tmp_path):
    from megazero.process.local_ranks import run_ranks
    errors, ran = run_ranks(_bad_inputs, 1, universal["ckpt"], str(tmp_path), timeout=300)[0]
    c_fc = "transformer.h.0.mlp.c_fc"
    assert f"parameter {c_fc}.bias is not in the universal checkpoint (no zero/{c_fc}.bias/)" in \
        errors["missing"]
    assert ("parameter transformer.wte.weight has shape [64, 32] in the universal checkpoint but shape "
            "[64, 48] in this model") in errors["shape"]
    assert "holds parameter transformer.h.2.mlp.c_fc.bias, which this model lacks" in errors["extra"]
    assert f"{c_fc}.weight/exp_avg.pt cannot be read (" in errors["truncated"]
    assert "truncated" in errors["truncated"]
    assert f"{c_fc}.bias/fp32.pt is refused: it names posix.system" in errors["payload"] and not ran
    assert "mp_rank_00_model_states.pt is missing: ds_to_universal.py copies the model-states files" in \
        errors["model_states"]
    assert "converted from a tensor-parallel (mp_rank_01_model_states.pt) DeepSpeed run" in errors["tp"]
    assert "converted from a pipeline-parallel (layer_01-model_states.pt) DeepSpeed run" in errors["pipeline"]
    assert "latest_universal does not exist, and ds_config checkpoint.load_universal is true" in \
        errors["no_latest"]
    assert all(e is not None and "\n" not in e for e in errors.values()), errors


@pytest.mark.slow
def test_a_script_on_a_truncated_universal_checkpoint_ends_with_one_line_and_status_2(universal, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(universal["ckpt"], ckpt)
    bad = ckpt / TAG / "zero" / "transformer.wpe.weight" / "fp32.pt"
    os.truncate(bad, bad.stat().st_size // 2)
    codes, outputs, _ = launch(sys.executable, "megazero", 1, tmp_path / "run",
                               ["--config", universal["config"], "--steps", 1, "--load", ckpt])
    text = outputs[0][0] + outputs[0][1]
    lines = [line for line in text.splitlines() if "fp32.pt cannot be read" in line]
    assert codes == [2], (codes, text[-3000:])
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert "transformer.wpe.weight/fp32.pt cannot be read (" in lines[0] and "truncated" in lines[0]


def _key_errors(work: str):
    """One rank: load_universal that is not a boolean, and load_universal without latest_universal."""
    from megazero.checkpoint.errors import CheckpointError
    from megazero.errors import ConfigError
    out = {}
    for name, value, error in (("not_bool", "yes", ConfigError), ("no_latest", True, CheckpointError)):
        engine = _engine(32, {**ds_config(2), "checkpoint": {"load_universal": value}})
        try:
            engine.load_checkpoint(work)
        except error as err:
            out[name] = str(err)
    return out


def test_load_universal_is_a_boolean_and_needs_latest_universal(tmp_path):
    """Without DeepSpeed: the ds_config key's two one-line errors (no checkpoint is read)."""
    pytest.importorskip("transformers")
    from megazero.process.local_ranks import run_ranks
    (tmp_path / "latest").write_text("global_step3")
    errors = run_ranks(_key_errors, 1, str(tmp_path), timeout=120)[0]
    assert errors["not_bool"] == "ds_config checkpoint.load_universal = 'yes' must be true or false"
    assert errors["no_latest"].startswith(f"{tmp_path / 'latest_universal'} does not exist, and ds_config "
                                          "checkpoint.load_universal is true")
    assert "\n" not in errors["no_latest"]
