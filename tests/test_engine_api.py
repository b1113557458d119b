"""The engine's smaller promises, on one-process engines (world 1) over a tiny MLP: modes and queries,
a client optimizer and LR scheduler, the ds_config's SGD and WarmupCosineLR, the progress lines of
``steps_per_print`` / ``wall_clock_breakdown``, and ``save_16bit_model``.

The references are plain PyTorch loops (``torch.optim.SGD`` / ``AdamW`` and the same torch scheduler,
``loss / gradient_accumulation_steps`` accumulated) or DeepSpeed's formulas.  One process, the same
forward and backward as the reference (the same weights, the same micro-batches in the same order):
only the optimizer's arithmetic differs (megazero's flat update against torch's per-tensor one), so
the weights after a few steps agree within test_zero.py's bounds (docs/testing.md): SGD 1e-6, Adam
1e-5 absolute, on weights of magnitude <= 1 moved by lr <= 0.1.  A rate taken one step late, a group's
weight decay lost or momentum dropped moves them by 1e-4 or more.  Rates compare exactly (the same
Python float arithmetic) or rel 1e-12 against the formula.
"""
import math
import os
import re
import warnings

import pytest
import torch

import megazero.engine  # noqa: F401
import torch._dynamo  # noqa: F401  (the first torch optimizer imports it, ~2 s: paid at collection)
from megazero.process.local_ranks import run_ranks

SGD_TOL, ADAM_TOL = 1e-6, 1e-5
MB, GA = 4, 2


class Net(torch.nn.Module):
    """8 -> 16 -> 4 with tanh and dropout; the loss is the mean squared error."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(dropout)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        x, y = x.to(self.a.weight.dtype), y.to(self.a.weight.dtype)  # the engine's bf16 runs
        return torch.nn.functional.mse_loss(self.b(self.drop(torch.tanh(self.a(x)))), y)


def _data(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(MB, 8, generator=g), torch.randn(MB, 4, generator=g)) for _ in range(n)]


def _config(**extra):
    """No clipping unless asked (DeepSpeed's default clips at 1.0): the plain loops here do not clip."""
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA,
            "steps_per_print": 10 ** 6, "gradient_clipping": 0.0, **extra}


def _initialize(model, config, **kw):
    import megazero
    return megazero.initialize(model=model, config=config, **kw)


def _plain(model, opt, sched, steps, rates=None):
    """The reference: plain PyTorch, ``GA`` micro-batches a step (``rates``: the rate of each update,
    else the optimizer's, stepped by ``sched``); returns the rates each update used."""
    data, given, rates = _data(steps * GA), rates, []
    for s in range(steps):
        if given is not None:
            opt.param_groups[0]["lr"] = given[s]
        opt.zero_grad()
        for x, y in data[s * GA:(s + 1) * GA]:
            (model(x, y) / GA).backward()
        rates.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
    return rates


def _engine_loop(engine, steps):
    """DeepSpeed's loop over the same micro-batches; returns the rates each update used (read before
    the boundary's ``step()``) and asserts no warning (torch's "scheduler stepped before optimizer")."""
    data, rates = _data(steps * GA), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(data):
            if engine.is_gradient_accumulation_boundary():
                rates.append(engine.get_lr())
            engine.backward(engine(x, y))
            engine.step()
            assert engine.micro_steps == i + 1 and engine.global_steps == (i + 1) // GA
    return rates


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


# ---- modes and queries -----------------------------------------------------------------------
def test_train_and_eval_switch_the_module_mode_and_dropout():
    model = Net(dropout=0.5)
    engine, *_ = _initialize(model, _config(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    x, y = _data(1)[0]
    assert engine.train() is engine and model.training and model.drop.training
    a, b = engine(x, y).item(), engine(x, y).item()
    assert a != b  # dropout draws another mask each call
    assert engine.eval() is engine and not engine.training
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        outs = {float(engine(x, y)) for _ in range(3)}
        plain = Net(dropout=0.0)(x, y)  # the same initial weights (seed 0), no dropout
    assert outs == {float(plain)}  # deterministic, and dropout is the identity
    engine.train()
    assert all(m.training for m in model.modules())
    assert engine.train(False) is engine and not model.training


def test_ranks_and_batch_queries_of_a_one_process_engine():
    engine, *_ = _initialize(Net(), {"train_batch_size": 12, "gradient_accumulation_steps": 3,
                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 0, 1, 1)
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.gradient_accumulation_steps() == 3
    assert engine.train_batch_size() == 12


def _queries():
    engine, *_ = _initialize(Net(), {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size,
            engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())


@pytest.mark.slow
def test_ranks_and_batch_queries_at_dp2():
    # 16 = 2 x accumulation x 2 ranks: the accumulation derived from the data-parallel size
    assert run_ranks(_queries, 2) == [(0, 0, 2, 2, 2, 4), (1, 1, 2, 2, 2, 4)]


# ---- a client optimizer and LR scheduler -----------------------------------------------------
def test_a_torch_optimizer_and_scheduler_object_equal_a_plain_pytorch_loop():
    """torch SGD (momentum, coupled weight decay) and a StepLR built on it, given to initialize."""
    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref = Net()
    want = _plain(ref, *make(ref), 5)
    model = Net()
    opt, sched = make(model)
    engine, returned, _, got_sched = _initialize(model, _config(), optimizer=opt, lr_scheduler=sched)
    assert got_sched is sched and engine.lr_scheduler is sched and returned.param_groups is opt.param_groups
    got = _engine_loop(engine, 5)
    assert got == want == [[0.1], [0.1], [0.05], [0.05], [0.025]]
    assert sched.last_epoch == 5 and opt.param_groups[0]["lr"] == 0.025
    assert _max_diff(model, ref) <= SGD_TOL


def test_param_groups_of_a_torch_adamw_and_a_callable_scheduler_equal_a_plain_pytorch_loop():
    """AdamW with two groups (decay 0.1 on the matrices, none on the biases) and a callable that builds
    a LambdaLR on the optimizer initialize returns (DeepSpeed's callable form)."""
    def groups(model):
        return [{"params": [model.a.weight, model.b.weight], "weight_decay": 0.1},
                {"params": [model.a.bias, model.b.bias], "weight_decay": 0.0}]

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref = Net()
    ref_opt = torch.optim.AdamW(groups(ref), lr=0.02, betas=(0.8, 0.9), eps=1e-6)
    want = _plain(ref, ref_opt, schedule(ref_opt), 4)
    model = Net()
    opt = torch.optim.AdamW(groups(model), lr=0.02, betas=(0.8, 0.9), eps=1e-6)
    engine, returned, _, sched = _initialize(model, _config(), optimizer=opt, lr_scheduler=schedule)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.optimizer is returned
    got = _engine_loop(engine, 4)
    assert got == want and got[-1] == [0.02 / 4] * 2
    assert [p.apply_weight_decay for p in model.parameters()] == [True, False, True, False]
    assert _max_diff(model, ref) <= ADAM_TOL
    assert _max_diff(model, Net()) > 1e-2  # it trained


# ---- the ds_config's SGD and WarmupCosineLR --------------------------------------------------
def _cosine(n, warmup=3, total=8, lo=0.1, floor=0.01):
    """DeepSpeed's WarmupCosineLR ratio after ``n`` schedule steps (linear warm-up); 0 before any."""
    if n < 0:
        return 0.0
    if n < warmup:
        return lo + (1 - lo) * n / warmup
    p = min(1.0, (n - warmup + 1) / (total - warmup))
    return max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * p)) / 2)


def test_ds_config_sgd_with_momentum_and_warmup_cosine_equal_a_plain_pytorch_loop():
    steps, lr = 7, 0.1
    cfg = _config(optimizer={"type": "SGD", "params": {"lr": lr, "momentum": 0.9, "weight_decay": 0.01}},
                  scheduler={"type": "WarmupCosineLR", "params": {
                      "total_num_steps": 8, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                      "cos_min_ratio": 0.01, "warmup_type": "linear"}})
    model = Net()
    engine, opt, _, sched = _initialize(model, cfg)
    got = _engine_loop(engine, steps)
    # the n-th update runs at the schedule's value after n - 1 steps: the first at 0 (DeepSpeed's)
    want = [lr * _cosine(n - 1) for n in range(steps)]
    assert [r[0] for r in got] == pytest.approx(want, rel=1e-12, abs=0) and got[0] == [0.0]
    assert sched.last_batch_iteration == steps - 1
    ref = Net()
    _plain(ref, torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, weight_decay=0.01), None, steps,
           rates=want)
    assert _max_diff(model, ref) <= SGD_TOL
    bare = Net()  # momentum matters: without it the weights end elsewhere
    _plain(bare, torch.optim.SGD(bare.parameters(), lr=lr, weight_decay=0.01), None, steps, rates=want)
    assert _max_diff(model, bare) > 1e-3


# ---- steps_per_print and wall_clock_breakdown -------------------------------------------------
STEP_LINE = re.compile(r"\[megazero\] step=(\d+), skipped=0, lr=\[([0-9.e-]+)\], loss_scale=1, "
                       r"grad_norm=([0-9.e+-]+)$")
TIME_LINE = re.compile(r"\[megazero\] time per step \(average of (\d+)\): forward: ([0-9.]+) ms, "
                       r"backward: ([0-9.]+) ms, step: ([0-9.]+) ms$")


@pytest.mark.parametrize("breakdown", [False, True])
def test_steps_per_print_prints_every_n_optimizer_steps(capsys, breakdown):
    cfg = _config(steps_per_print=2, wall_clock_breakdown=breakdown, gradient_clipping=1.0,
                  optimizer={"type": "SGD", "params": {"lr": 0.1}},
                  scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                            "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, *_ = _initialize(Net(), cfg)
    capsys.readouterr()
    printed, norms = [], []
    for x, y in _data(5 * GA):  # 5 optimizer steps, 10 micro-batches
        engine.backward(engine(x, y))
        engine.step()
        out = capsys.readouterr().out.splitlines()
        if out:
            printed.append((engine.micro_steps, out))
            norms.append(engine.get_global_grad_norm())
    assert [m for m, _ in printed] == [4, 8]  # after optimizer steps 2 and 4, not in between
    for (_, lines), step, norm in zip(printed, (2, 4), norms):
        assert len(lines) == (2 if breakdown else 1), lines
        m = STEP_LINE.match(lines[0])
        assert m and int(m.group(1)) == step, lines[0]
        # the rate of the next update: the schedule has stepped ``step`` times, n = step - 1
        assert float(m.group(2)) == pytest.approx(0.1 * min(1.0, (step - 1) / 4), rel=1e-12)
        assert float(m.group(3)) == pytest.approx(norm, rel=1e-5)  # printed with 6 digits
        if breakdown:
            t = TIME_LINE.match(lines[1])
            assert t and t.group(1) == "2", lines[1]
            assert all(float(v) >= 0.0 for v in t.groups()[1:])


# ---- save_16bit_model -----------------------------------------------------------------------
def test_save_16bit_model_without_zero3_writes_the_module_state_in_its_dtype(tmp_path):
    """ZeRO-1, fp32: the module's own ``state_dict`` (fp32: no 16-bit compute dtype, as DeepSpeed);
    ``exclude_frozen_parameters`` leaves out what does not train."""
    model = Net()
    model.a.bias.requires_grad_(False)
    engine, *_ = _initialize(model, _config(optimizer={"type": "SGD", "params": {"lr": 0.1}},
                                            zero_optimization={"stage": 1}))
    _engine_loop(engine, 2)
    assert engine.save_16bit_model(str(tmp_path)) is True
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert list(state) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert all(v.dtype == torch.float32 and torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(state["a.bias"], Net().a.bias) and not torch.equal(state["a.weight"], Net().a.weight)
    assert engine.save_16bit_model(str(tmp_path), "trained.bin", exclude_frozen_parameters=True)
    assert list(torch.load(tmp_path / "trained.bin", weights_only=True)) == ["a.weight", "b.weight", "b.bias"]


def _zero3_bf16(gather):
    cfg = _config(bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": 0.1}},
                  zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "stage3_gather_16bit_weights_on_model_save": gather})
    model = Net()
    engine, *_ = _initialize(model, cfg)
    _engine_loop(engine, 2)
    return engine, model


@pytest.mark.slow
def test_save_16bit_model_under_zero3_writes_the_gathered_weights_rounded(tmp_path):
    import megazero
    from megazero.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    engine, model = _zero3_bf16(gather=False)
    assert engine.save_16bit_model(str(tmp_path / "no")) is False  # DeepSpeed's rule: nothing saved
    assert not os.path.exists(tmp_path / "no" / "pytorch_model.bin")
    engine, model = _zero3_bf16(gather=True)
    assert all(p.numel() == 0 for p in model.parameters())  # sharded between uses
    assert engine.save_16bit_model(str(tmp_path / "out"), "model16.bin") is True
    state = torch.load(tmp_path / "out" / "model16.bin", weights_only=True)
    assert sorted(state) == sorted(n for n, _ in model.named_parameters())
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    with megazero.zero.GatheredParameters(list(model.parameters())):
        gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    master = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    for name, value in state.items():
        assert torch.equal(value, gathered[name])
        assert torch.equal(value, master[name].to(torch.bfloat16))  # the fp32 masters, rounded
    assert not torch.equal(state["a.weight"], Net().a.weight.to(torch.bfloat16))  # it trained
    fresh = Net().to(torch.bfloat16)
    fresh.load_state_dict(state, strict=True)
    x, y = _data(1)[0]
    with torch.no_grad():
        engine.eval()
        assert torch.equal(fresh(x, y), engine(x, y))


# ---- a schedule across save_checkpoint / load_checkpoint --------------------------------------
def _scheduled(kind, model):
    if kind == "ds_config":
        warmup = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}
        cfg = _config(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                      scheduler={"type": "WarmupLR", "params": warmup})
        return _initialize(model, cfg)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # chainable: reads the group's lr
    return _initialize(model, _config(), optimizer=opt, lr_scheduler=sched)[0]


@pytest.mark.parametrize("kind", ["ds_config", pytest.param("torch", marks=pytest.mark.slow)])
def test_a_resumed_schedule_continues_at_the_saved_rate(tmp_path, kind):
    """Saved after 3 of 5 steps and loaded into a fresh engine: the rates of the last 2 updates and
    the weights equal the uninterrupted run's (DeepSpeed restores the rate with the optimizer's
    param groups; a fresh schedule's initial rate must not be used for the first resumed update)."""
    full = Net()
    rates = _engine_loop(_scheduled(kind, full), 5)
    first = _scheduled(kind, Net())
    _engine_loop(first, 3)
    first.save_checkpoint(str(tmp_path))
    model = Net()
    engine = _scheduled(kind, model)
    engine.load_checkpoint(str(tmp_path))
    data = _data(5 * GA)[3 * GA:]
    resumed = []
    for x, y in data:
        if engine.is_gradient_accumulation_boundary():
            resumed.append(engine.get_lr())
        engine.backward(engine(x, y))
        engine.step()
    assert resumed == rates[3:], (resumed, rates)
    assert _max_diff(model, full) == 0.0  # bitwise: the same operations in the same order
