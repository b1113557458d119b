"""Schedules of Megatron-LM's 2026 scripts: WSD and inverse-square-root learning-rate decay, a decoupled
learning rate for the embedding and output layer, batch-size schedules (``--step-batch-size-schedule``,
``--rampup-batch-size``) that keep the one-process oracle's sample order, ``--exit-on-missing-checkpoint``."""
import math

import pytest
import torch

from megazero.config.batch_schedule import (batch_size_at, consumed_after, iterations_for_samples,
                                            parse_step_schedule, rampup_schedule)
from megazero.config import ConfigError, config_from_dict, parse_args
from megazero.training.lr import lr_from_config, lrs_at
from megazero.process.local_ranks import run_ranks
from tolerance import R_TRAIN


def megatron_get_lr(n, max_lr, min_lr, warmup, decay, style, init=0.0, wsd=None, wsd_style=None):
    """Megatron-LM's OptimizerParamScheduler.get_lr, written out from its description (counts in samples)."""
    if warmup > 0 and n <= warmup:
        return init + (max_lr - init) * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    ratio = (n - warmup) / (decay - warmup)
    if style == "linear":
        c = 1 - ratio
    elif style == "cosine":
        c = (math.cos(math.pi * ratio) + 1) / 2
    else:  # WSD: stable, then the last `wsd` samples anneal
        r = max(0.0, (n - (decay - wsd)) / wsd)
        c = {"linear": 1 - r, "cosine": (math.cos(math.pi * r) + 1) / 2, "exponential": 2 * 0.5 ** r - 1,
             "minus_sqrt": 1 - math.sqrt(r)}[wsd_style]
    return min_lr + c * (max_lr - min_lr)


BASE = ["--mock-data", "--lr", "1.0", "--min-lr", "0.1", "--train-iters", "20", "--global-batch-size", "4",
        "--micro-batch-size", "2"]


@pytest.mark.parametrize("style,extra", [
    ("linear", []), ("cosine", []), ("constant", []), ("inverse-square-root", []),
    ("WSD", ["--lr-wsd-decay-iters", "6"]),
    ("WSD", ["--lr-wsd-decay-iters", "6", "--lr-wsd-decay-style", "linear"]),
    ("WSD", ["--lr-wsd-decay-iters", "6", "--lr-wsd-decay-style", "cosine"]),
    ("WSD", ["--lr-wsd-decay-iters", "6", "--lr-wsd-decay-style", "minus_sqrt"]),
])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_follows_megatrons_scheduler(style, extra, warmup):
    cfg = parse_args(BASE + ["--lr-decay-style", style, "--lr-warmup-iters", str(warmup),
                             "--lr-decay-iters", "16"] + extra, world_size=1)
    wsd = 6 * 4 if extra else None
    wsd_style = (extra[extra.index("--lr-wsd-decay-style") + 1] if "--lr-wsd-decay-style" in extra
                 else "exponential")
    want = [megatron_get_lr((i - 1) * 4, 1.0, 0.1, warmup * 4, 16 * 4, style, wsd=wsd, wsd_style=wsd_style)
            for i in range(1, 22)]
    got = [lr_from_config(cfg, i) for i in range(1, 22)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)  # the same formula: rounding only
    if style == "WSD":  # stable at --lr until the final decay, which starts 6 iterations before the end
        assert got[warmup + 1:11] == [1.0] * (10 - warmup) and got[11] < 1.0 and got[-1] == 0.1


def test_lr_values_worked_out_by_hand():
    cfg = parse_args(BASE + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-decay-iters", "10",
                             "--min-lr", "0"], world_size=1)
    # the final decay starts after 6 iterations; half-way through it (iteration 9) exponential gives
    # 2/sqrt(2) - 1
    assert lr_from_config(cfg, 7) == 1.0
    assert lr_from_config(cfg, 9) == pytest.approx(math.sqrt(2) - 1, rel=1e-12)
    assert lr_from_config(cfg, 11) == 0.0
    isr = parse_args(BASE + ["--lr-decay-style", "inverse-square-root", "--min-lr", "0"], world_size=1)
    # no warm-up: Megatron-LM's max(warmup, 1) sample, so lr / sqrt(samples consumed) from the second
    # iteration
    assert [lr_from_config(isr, i) for i in (1, 2, 3)] == pytest.approx(
        [1.0, 1 / math.sqrt(4), 1 / math.sqrt(8)])


def test_sample_based_wsd_and_decoupled_lr():
    cfg = parse_args(["--mock-data", "--lr", "2.0", "--min-lr", "0.2", "--train-samples", "64",
                      "--global-batch-size", "8", "--micro-batch-size", "8", "--lr-warmup-samples", "8",
                      "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "24",
                      "--decoupled-lr", "4.0", "--decoupled-min-lr", "0.4"],
                     world_size=1)
    for n in range(0, 72, 8):
        lr, dec = lrs_at(cfg, n)
        assert lr == pytest.approx(
            megatron_get_lr(n, 2.0, 0.2, 8, 64, "WSD", wsd=24, wsd_style="exponential"))
        assert dec == pytest.approx(
            megatron_get_lr(n, 4.0, 0.4, 8, 64, "WSD", wsd=24, wsd_style="exponential"))
    no_min = parse_args(BASE + ["--decoupled-lr", "3.0"], world_size=1)
    assert lrs_at(no_min, 10 ** 6) == (0.1, 0.1)  # --decoupled-min-lr defaults to --min-lr, as in Megatron-LM
    assert lrs_at(parse_args(BASE, world_size=1), 0)[1] is None


@pytest.mark.parametrize("flags,needle", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-wsd-decay-samples", "4"], "--lr-wsd-decay-samples needs --train-samples"),
    (["--decoupled-min-lr", "0.1"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--decoupled-lr", "0.05"], r"the decoupled minimum 0.1 \(--decoupled-min-lr, "
                                 r"default --min-lr\) is above"),
    (["--step-batch-size-schedule", "1M:4"], "the first threshold must be 0"),
    (["--step-batch-size-schedule", "0:4 oops"], "'oops' is not THRESHOLD:BATCH"),
    (["--step-batch-size-schedule", "0:2 64K:8", "--global-batch-size", "4"],
     "--global-batch-size 4 differs from the last batch size 8"),
    (["--step-batch-size-schedule", "0:3 64K:4"],
     "--step-batch-size-schedule batch size 3 is not divisible by --micro-batch-size 2"),
    (["--rampup-batch-size", "2", "3", "100", "--global-batch-size", "4"],
     "must be START plus a whole number"),
    (["--rampup-batch-size", "2", "2", "100"], "--rampup-batch-size needs --global-batch-size"),
    (["--rampup-batch-size", "2", "2", "100", "--step-batch-size-schedule", "0:4"], "give one"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load DIR"),
])
def test_schedule_errors_name_the_flag(flags, needle):
    argv = ["--mock-data", "--lr", "1.0", "--min-lr", "0.1", "--train-iters", "20", "--micro-batch-size", "2"]
    with pytest.raises(ConfigError, match=needle):
        parse_args(argv + flags, world_size=1)


# ---- batch-size schedules ---------------------------------------------------------------------
def test_step_schedule_thresholds_are_tokens():
    # Megatron-LM's GPT-3 175B example with --seq-length 2048
    s = parse_step_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert s[0] == (0, 16) and s[1] == (2_400_000_000 // 2048, 320) and s[-1] == (12 * 10 ** 9 // 2048, 1536)
    assert batch_size_at(s, 0) == 16 and batch_size_at(s, s[1][0] - 1) == 16
    assert batch_size_at(s, s[1][0]) == 320
    assert parse_step_schedule("0:4,1K:8", 10) == ((0, 4), (100, 8))


def old_megatron_rampup(consumed, start, increment, samples, final):
    """Megatron-LM's former RampupBatchsizeNumMicroBatchesCalculator.update (float arithmetic)."""
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize("start,increment,samples,final",
                         [(16, 16, 5859375, 1536), (2, 2, 30, 8), (4, 4, 7, 16)])
def test_rampup_matches_older_megatron(start, increment, samples, final):
    schedule = rampup_schedule(start, increment, samples, final)
    assert schedule[0] == (0, start) and schedule[-1][1] == final
    probe = sorted({c for t, _ in schedule for c in (t - 1, t, t + 1) if c >= 0}
                   | set(range(0, min(samples, 500))))
    for consumed in probe:
        assert batch_size_at(schedule, consumed) == old_megatron_rampup(consumed, start, increment,
                                                                        samples, final)


def test_iterations_and_consumed_samples():
    s = ((0, 2), (4, 4), (12, 8))
    assert [batch_size_at(s, consumed_after(s, i)) for i in range(5)] == [2, 2, 4, 4, 8]
    assert consumed_after(s, 5) == 20
    assert iterations_for_samples(s, 20) == 5 and iterations_for_samples(s, 21) == 6
    cfg = parse_args(["--mock-data", "--micro-batch-size", "2", "--train-samples", "21",
                      "--step-batch-size-schedule", "0:2 64:4 192:8", "--seq-length", "16"], world_size=1)
    assert cfg.training.train_iters == 6 and cfg.training.global_batch_size == 8


def _tiny(iters, world_changes=None, **extra):
    settings = dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, micro_batch_size=1, train_iters=iters, optimizer="sgd", lr=0.1,
                    hidden_dropout=0.0, attention_dropout=0.0, log_interval=100)
    settings.update(world_changes or {}, **extra)
    return config_from_dict(settings)


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


# 2, 2 (at 4 samples: 4), 4, then 8 from sample 8
RAMPUP = dict(rampup_batch_size=[2, 2, 8], global_batch_size=8)


def test_rampup_training_matches_one_process_and_its_sample_order():
    (ref,) = run_ranks(_train, 1, _tiny(5, **RAMPUP))
    assert [m["global_batch_size"] for m in ref] == [2, 2, 4, 8, 8]
    assert [m["consumed_samples"] for m in ref] == [2, 4, 8, 16, 24]
    got = run_ranks(_train, 4, _tiny(5, dict(tensor_model_parallel_size=2, zero_stage=1), **RAMPUP))
    for key in ("loss", "grad_norm"):  # fp32 SGD under another layout: R_TRAIN (tolerance.py)
        assert [m[key] for m in got[0]] == pytest.approx([m[key] for m in ref], rel=R_TRAIN), key
    assert [m["lr"] for m in got[0]] == [m["lr"] for m in ref]
    # the ramp-up run's first four batches are samples 0..15 in order: its first iterations with a
    # constant batch of 2 take the same first 4 samples, so the same first two losses
    (const,) = run_ranks(_train, 1, _tiny(2, global_batch_size=2))
    assert [m["loss"] for m in const] == [m["loss"] for m in ref[:2]]


def test_micro_batches_of_a_schedule_cover_the_sample_order():
    from megazero.data import MockGPTData, micro_batches
    data = MockGPTData(100, 16, seed=3)
    s = rampup_schedule(2, 2, 8, 8)
    rows, consumed = [], 0
    for _ in range(4):
        g = batch_size_at(s, consumed)
        for rank in range(2):  # two data-parallel ranks, rank order
            rows += [b["tokens"] for b in micro_batches(data, None, g, 1, rank, 2, first=consumed)]
        consumed += g
    whole = data.get_tokens(list(range(consumed)), "train")[:, :-1]
    assert torch.equal(torch.cat(rows), whole)


def test_resuming_inside_a_rampup_continues_it(tmp_path):
    (whole,) = run_ranks(_train, 1, _tiny(5, **RAMPUP))
    run_ranks(_train, 1, _tiny(5, save=str(tmp_path), exit_interval=3, **RAMPUP))  # stops after iteration 3
    (rest,) = run_ranks(_train, 1, _tiny(5, save=str(tmp_path), load=str(tmp_path), **RAMPUP))
    assert [m["iteration"] for m in rest] == [4, 5]
    for key in ("loss", "lr", "consumed_samples", "global_batch_size"):
        assert [m[key] for m in rest] == [m[key] for m in whole[3:]], key


def test_exit_on_missing_checkpoint(tmp_path, capsys):
    from models.cli import pretrain_main
    argv = ["--mock-data", "--train-iters", "1", "--save", str(tmp_path), "--load", str(tmp_path)]
    assert pretrain_main(argv + ["--exit-on-missing-checkpoint"]) == 2
    assert "--exit-on-missing-checkpoint: no checkpoint in --load" in capsys.readouterr().err
    assert pretrain_main(argv) == 0  # without it: Megatron-LM's auto-resume pattern starts from scratch


# ---- decoupled learning rate ---------------------------------------------------------------
def test_decoupled_lr_moves_only_the_embedding_and_output_layer():
    """One SGD step with --decoupled-lr 0: the word embedding and output layer stay, the rest moves;
    and the same run with --decoupled-lr equal to --lr is the run without it."""
    def params_after(**extra):
        import models
        from megazero.data import build_data, micro_batches
        from megazero.mesh import ParallelMesh
        from megazero.config import validate
        from megazero.zero import build_optimizer
        cfg = validate(_tiny(1, untie_embeddings_and_output_weights=True, global_batch_size=2, **extra), 1)
        (model,) = models.build_chunks(cfg, ParallelMesh.single())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = build_optimizer([model], ParallelMesh.single(), cfg)
        for b in micro_batches(build_data(cfg), 0, 2, 1):
            opt.prepare_backward(0, True)
            (model(b["tokens"], labels=b["labels"]).mean() / 2).backward()
        opt.finish_grad_sync()
        opt.step(*lrs_at(cfg, 0))
        return before, {n: p.detach().clone() for n, p in model.named_parameters()}
    before, after = params_after(decoupled_lr=0.0)
    frozen = {"word_embeddings.weight", "output_layer.weight"}
    assert frozen <= set(after)
    for name in after:
        assert torch.equal(after[name], before[name]) == (name in frozen), name
    _, same = params_after(decoupled_lr=0.1)
    _, plain = params_after()
    assert all(torch.equal(same[n], plain[n]) for n in plain)


def test_decoupled_lr_under_tp_pp_zero_matches_one_process():
    extra = dict(decoupled_lr=0.3, decoupled_min_lr=0.01, lr_decay_style="cosine", global_batch_size=4)
    (ref,) = run_ranks(_train, 1, _tiny(3, **extra))
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, zero_stage=2)
    got = run_ranks(_train, 4, _tiny(3, layout, **extra))
    assert [m["loss"] for m in got[0]] == pytest.approx([m["loss"] for m in ref], rel=R_TRAIN)
    assert [m["decoupled_lr"] for m in ref] == [lrs_at(_validated(extra), 4 * i)[1] for i in range(3)]
    (plain,) = run_ranks(_train, 1, _tiny(3, global_batch_size=4, lr_decay_style="cosine"))
    assert [m["loss"] for m in plain][1:] != [m["loss"] for m in ref][1:]  # the embedding's rate matters


def _validated(extra):
    from megazero.config import validate
    return validate(_tiny(3, **extra), 1)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("decoupled", [[(3, 9), (20, 30)], [(0, 30)]])  # a slice partly, or only, decoupled
def test_flat_update_with_two_rates_is_torchs_with_two_param_groups(kind, decoupled):
    from megazero.zero.flat_optim import FlatAdamW, FlatSGD, _complement, _intersect
    n, decay, lr, lr2 = 30, [(0, 5), (12, 25)], 0.05, 0.2
    g = torch.Generator().manual_seed(0)
    master, grads = torch.randn(n, generator=g), [torch.randn(n, generator=g) for _ in range(3)]
    opt = FlatAdamW(weight_decay=0.1) if kind == "adam" else FlatSGD(momentum=0.9, weight_decay=0.1)
    state, flat = opt.init_state(master), master.clone()
    # the reference: torch's optimizer with one parameter per (rate, decayed) piece
    pieces = [(seg, rate, wd) for segs, rate in ((_complement(decoupled, n), lr), (decoupled, lr2))
              for part, wd in ((decay, 0.1), (_complement(decay, n), 0.0)) for seg in _intersect(part, segs)]
    params = [torch.nn.Parameter(master[a:b].clone()) for (a, b), _, _ in pieces]
    groups = [dict(params=[p], lr=rate, weight_decay=wd) for p, (_, rate, wd) in zip(params, pieces)]
    if kind == "adam":
        ref = torch.optim.AdamW(groups, foreach=False)
    else:
        ref = torch.optim.SGD(groups, momentum=0.9)
    for step, grad in enumerate(grads, 1):
        opt.update(flat, grad.clone(), state, decay, lr, step, decoupled=(decoupled, lr2))
        for p, ((a, b), _, _) in zip(params, pieces):
            p.grad = grad[a:b].clone()
        ref.step()
    want = flat.clone()
    for p, ((a, b), _, _) in zip(params, pieces):
        want[a:b] = p.detach()
    # the same fp32 operations on each element, perhaps fused differently: a few roundings of |p| <~ 3
    torch.testing.assert_close(flat, want, rtol=0, atol=16 * 2 ** -24 * 3)
    assert not torch.equal(flat, master)
