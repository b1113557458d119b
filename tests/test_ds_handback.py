"""A run megazero continued is handed back to DeepSpeed (issue 45, megazero -> DeepSpeed).

megazero's engine trains tests/test_deepspeed_peer.py's program (GPT-2, AdamW, WarmupDecayLR, 2 gloo
ranks) for 6 steps and, after step 3, saves in DeepSpeed's layout (``"checkpoint": {"format":
"deepspeed"}`` in the ds_config the program reads; the program itself is unchanged but for printing
logits).  Its steps 4-6 are what megazero gets continuing itself.  DeepSpeed 0.19.8 itself
(``deepspeed.initialize`` + ``engine.load_checkpoint``) then loads that directory at DP 2 and trains steps
4-6: its logits on a fixed batch must equal megazero's at the save (fp32: the same weights, the same
forward; within 1e-5 as the losses), its losses megazero's within 1e-5 (test_deepspeed_peer's bound,
which a lost Adam state exceeds 100-fold), its learning rates exactly.  DeepSpeed's own
``deepspeed.utils.zero_to_fp32`` reads the directory into the fp32 weights megazero holds (bitwise:
they are copied, not computed).

The files hold plain types (``torch.load(weights_only=True)`` reads them) but for the DeepSpeed class
its loader needs: the loss scaler (ZeRO-3, fp16) and, asked for, fragment_address (ZeRO-2 with
slice_mappings; its ds_to_universal.py then converts the DP 2 save, which DeepSpeed continues at DP 1).
bf16 (ZeRO-2): the logits at the load and the first continued loss still within 1e-5 (the same bf16
weights), the later losses within test_ds_migration's BF16_BOUND (gradients rounded to bf16 at other
places); fp16 (ZeRO-2, DeepSpeed's DynamicLossScaler written with megazero's scale) the same, fp16
rounding being finer.  Fast tier, without DeepSpeed: one rank reads back what it wrote in DeepSpeed's
layout (the same logits and post-update loss), and bad input is one line."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from megazero.engine.ds_files import read_file
from megazero.process.local_ranks import run_ranks
from test_ds_migration import BF16_BOUND, _engine as build, _train as train_steps
from test_deepspeed_peer import (LOSS_BOUND, PROGRAM, SAVE_AFTER, STEPS, deepspeed_fp32, ds_config, run_ok,
                                 worst)

ADDED_ARG = 'p.add_argument("--out")\n'
AFTER_LOAD = '    start = client["next_step"]\n'
AFTER_SAVE = ('        engine.save_checkpoint(a.save, client_state={{"next_step": step + 1, "note": "peer"}})'
              '\n')
START = "start, client = 0, {{}}\n"
LOGITS = '''\
def dump_logits(tag):
    x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        out = engine(input_ids=x).logits.float()
    if dist.get_rank() == 0:
        torch.save(out, a.out + "." + tag + ".pt")


'''


def handback_program() -> str:
    """The peer program, printing logits after a save or a load, and (``--native``) also saving in
    megazero's own format for megazero's zero_to_fp32."""
    prog = PROGRAM
    for anchor in (ADDED_ARG, AFTER_LOAD, AFTER_SAVE, START):
        assert prog.count(anchor) == 1, anchor
    prog = prog.replace(ADDED_ARG, ADDED_ARG + 'p.add_argument("--native")\n')
    prog = prog.replace(AFTER_LOAD, AFTER_LOAD + '    dump_logits("loaded")\n')
    prog = prog.replace(AFTER_SAVE, AFTER_SAVE + '        dump_logits("saved")\n'
                        '        if a.native:\n'
                        '            engine.save_checkpoint(a.native, format="megazero")\n')
    return prog.replace(START, LOGITS + START)


def _engine(config: dict):
    """test_ds_migration's GPT-2 (width 32) under megazero.deepspeed."""
    return build(32, config)


def _step(engine, seed: int) -> float:
    """One optimizer step on one rank (test_ds_migration's: step ``seed``'s 8 sequences as 4 micro-batches
    of 2); the mean loss."""
    return train_steps(engine, seed, 1)[0]


def _logits_of(engine) -> torch.Tensor:
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        return engine(input_ids=x).logits.float()


def _one_rank(work: str, stage: int):
    """One rank, no DeepSpeed: three steps, saved in DeepSpeed's layout; a fresh engine (the same initial
    weights) reads it back with megazero's DeepSpeed reader; then (ZeRO-2) the refusals."""
    from megazero.errors import ConfigError
    engine = _engine(ds_config(stage))
    for seed in range(SAVE_AFTER):  # the first two updates run at the warm-up's rate 0
        _step(engine, seed)
    engine.save_checkpoint(work, client_state={"next_step": SAVE_AFTER}, format="deepspeed")
    fresh = _engine(ds_config(stage))
    before = _logits_of(fresh)
    _, client = fresh.load_checkpoint(work)
    no_moments = _engine(ds_config(stage))
    no_moments.load_checkpoint(work, load_optimizer_states=False)
    got = {"saved": _logits_of(engine), "before": before, "loaded": _logits_of(fresh), "client": client,
           "next": [[_step(e, t) for t in (SAVE_AFTER, SAVE_AFTER + 1)] for e in (engine, fresh)],
           "no_moments": [_step(no_moments, t) for t in (SAVE_AFTER, SAVE_AFTER + 1)],
           "files": sorted(os.listdir(os.path.join(work, f"global_step{SAVE_AFTER}")))}
    errors = []
    calls = (lambda: engine.save_checkpoint(work, format="foo"),
             lambda: _engine(dict(ds_config(2), checkpoint={"format": "foo"})),
             lambda: engine.save_checkpoint(work, client_state={"module": 1}, format="deepspeed"),
             lambda: _engine(dict(ds_config(1), bf16={"enabled": True})).save_checkpoint(
                 work, format="deepspeed"))
    for call in calls if stage == 2 else ():
        try:
            call()
        except ConfigError as err:
            errors.append(str(err))
    return got, errors


@pytest.mark.parametrize("stage", [2, 3])
def test_megazero_reads_back_its_deepspeed_layout_and_bad_input_is_one_line(tmp_path, stage):
    got, errors = run_ranks(_one_rank, 1, str(tmp_path), stage)[0]
    prefix = "zero_pp_rank_0_" if stage == 3 else ""
    assert got["files"] == [f"{prefix}mp_rank_00_model_states.pt",
                            "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    # the weights: the loaded logits are the saved ones, far from the fresh engine's; the Adam state: the
    # loss after the next update is the same, which it is not without the moments
    assert got["loaded"].equal(got["saved"]) and (got["before"] - got["saved"]).abs().max() > 1e-3
    assert got["next"][0] == got["next"][1] and got["client"]["next_step"] == SAVE_AFTER
    assert got["no_moments"][0] == got["next"][0][0] and abs(got["no_moments"][1] - got["next"][0][1]) > 1e-4
    if stage == 3:
        return
    assert errors[0].startswith("save_checkpoint format='foo' is not one of megazero, deepspeed")
    assert errors[1] == ('ds_config checkpoint.format = "foo" is not supported (the layout '
                         "engine.save_checkpoint writes: megazero's own or DeepSpeed's, docs/migration.md); "
                         'remove it or give "megazero" or "deepspeed"')
    assert "client_state key 'module' is one of DeepSpeed's own keys" in errors[2]
    assert errors[3].startswith("save_checkpoint(format='deepspeed') does not write bf16 at ZeRO-1")
    assert len(errors) == 4 and all("\n" not in e for e in errors)


def _logits(workdir, tag: str) -> torch.Tensor:
    found = glob.glob(str(workdir / f"*.{tag}.pt"))
    assert len(found) == 1, found
    return torch.load(found[0], weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision,mappings", [
    (2, "fp32", True), (3, "fp32", False), (2, "bf16", False), (2, "fp16", False)])
def test_deepspeed_continues_a_run_megazero_saved_in_its_layout(tmp_path, stage, precision, mappings):
    from megazero.engine import get_fp32_state_dict_from_zero_checkpoint
    from test_deepspeed_peer import need_deepspeed
    python = need_deepspeed()
    bf16 = precision == "bf16"
    cfg = ds_config(stage, bf16)
    if precision == "fp16":  # DeepSpeed's dynamic loss scale from 2^8
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    plain, handing = tmp_path / "ds_config.json", tmp_path / "ds_config_handback.json"
    plain.write_text(json.dumps(cfg))
    handing.write_text(json.dumps(dict(cfg, checkpoint={"format": "deepspeed", "slice_mappings": mappings})))
    ckpt, native = tmp_path / "ckpt", tmp_path / "native"
    prog = handback_program()
    args = ["--config", handing, "--steps", STEPS, "--save", ckpt, "--save-after", SAVE_AFTER,
            "--native", native]
    mz = run_ok(sys.executable, "megazero", 2, tmp_path / "mz", args, program=prog)
    ds = run_ok(python, "deepspeed", 2, tmp_path / "ds", ["--config", plain, "--steps", STEPS - SAVE_AFTER,
                                                          "--load", ckpt], program=prog)
    saved, loaded = _logits(tmp_path / "mz", "saved"), _logits(tmp_path / "ds", "loaded")
    assert (saved - loaded).abs().max() <= LOSS_BOUND and saved.abs().max() > 0.1
    want = mz["losses"][SAVE_AFTER:]
    assert abs(ds["losses"][0] - want[0]) <= LOSS_BOUND
    # fp16 rounds 8 times finer than bf16: BF16_BOUND holds for it too
    bound = LOSS_BOUND if precision == "fp32" else BF16_BOUND
    assert worst(ds["losses"], want) <= bound, (ds["losses"], want)
    assert ds["lrs"] == mz["lrs"][SAVE_AFTER:] and ds["global_steps"] == STEPS
    assert ds["client"] == {"next_step": SAVE_AFTER, "note": "peer"}
    # DeepSpeed's zero_to_fp32 on megazero's files: the fp32 masters megazero held (its own zero_to_fp32 of
    # the same moment saved in megazero's format), bitwise
    theirs = deepspeed_fp32(python, ckpt, tmp_path / "ds_fp32.pt")
    ours = get_fp32_state_dict_from_zero_checkpoint(str(native))
    assert sorted(theirs) == sorted(ours)
    differ = [k for k in ours if not theirs[k].float().equal(ours[k])]
    assert not differ, differ
    # plain types: weights_only reads every file but the optimizer files of ZeRO-3, which name DeepSpeed's
    # loss scaler class only (its ZeRO-3 loader calls the scaler's methods), and of ZeRO 1-2 with
    # slice_mappings, which name fragment_address only; megazero's reader allows those two
    tag = ckpt / "global_step3"
    refused = {f.name: _refused(f) for f in sorted(tag.iterdir())}
    optim = [f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    models = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)] if stage == 3
              else ["mp_rank_00_model_states.pt"])
    assert sorted(refused) == sorted(optim + models)
    scalers = "deepspeed.runtime.fp16.loss_scaler."
    named = (scalers + "DynamicLossScaler" if precision == "fp16" else
             scalers + "LossScaler" if stage == 3 else
             "deepspeed.utils.tensor_fragment.fragment_address" if mappings else None)
    assert refused == {n: (named if n in optim else None) for n in refused}, refused
    for f in tag.iterdir():
        read_file(str(f))
    if precision == "fp16":  # megazero's scale after 3 clean steps, as DeepSpeed keeps it (DeepSpeed's own
        # save of this run holds these values)
        scaler = vars(read_file(str(tag / optim[0]))["optimizer_state_dict"]["loss_scaler"])
        assert scaler == {"cur_scale": 256.0, "dynamic": True, "cur_iter": 3, "last_overflow_iter": -1,
                          "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 2,
                          "cur_hysteresis": 2, "consecutive_hysteresis": False,
                          "raise_error_at_min_scale": True, "dtype": torch.float16}, scaler
    if mappings:  # DeepSpeed's own route to another data-parallel size: its universal checkpoint
        _universal_at_dp1(python, tmp_path, ckpt, cfg, prog, mz)


def _universal_at_dp1(python: str, tmp_path, ckpt, cfg: dict, prog: str, mz: dict) -> None:
    """DeepSpeed's ds_to_universal.py converts megazero's DP 2 save; DeepSpeed at DP 1 loads the universal
    checkpoint (load_universal) and continues with the losses megazero gets continuing itself."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([python, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(ckpt / "global_step3"), "--output_folder", str(ckpt / "global_step3_universal"),
                    "--inject_missing_state"], check=True, capture_output=True, env=env, timeout=300)
    universal = tmp_path / "ds_config_universal.json"
    universal.write_text(json.dumps(dict(cfg, checkpoint={"load_universal": True})))
    ds1 = run_ok(python, "deepspeed", 1, tmp_path / "ds1", ["--config", universal, "--steps",
                                                            STEPS - SAVE_AFTER, "--load", ckpt], program=prog)
    want = mz["losses"][SAVE_AFTER:]
    assert worst(ds1["losses"], want) <= LOSS_BOUND, (ds1["losses"], want)
    assert ds1["lrs"] == mz["lrs"][SAVE_AFTER:] and ds1["client"] == {"next_step": SAVE_AFTER, "note": "peer"}


def _refused(path):
    """The global a plain ``torch.load(weights_only=True)`` refuses in ``path``, or None."""
    try:
        torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - the refused global is what is checked
        return str(err).split("GLOBAL ")[-1].split(" ")[0]
    return None
