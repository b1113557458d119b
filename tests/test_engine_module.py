"""The engine is an ``nn.Module`` as DeepSpeed's is, with the queries DeepSpeedExamples' programs
make (HelloDeepSpeed's ``train_bert_ds.py`` and ``cifar10_deepspeed.py``): ``parameters()``,
``named_parameters()``, ``train()``/``eval()``, ``state_dict()``, ``fp16_enabled()``,
``bfloat16_enabled()``, ``local_rank``, attributes passed through to the model, and a name neither
has as one line naming it.  One process over a tiny MLP; the loop at the end is the programs' own
(``engine(**batch)``, ``engine.backward``, ``engine.step``) and must lower the loss."""
import pytest
import torch

import megazero.deepspeed as deepspeed
from megazero.errors import ConfigError
from megazero.deepspeed.accelerator import get_accelerator


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.label_names = ("y",)  # an attribute of the model only

    def forward(self, x, y):
        self.calls += 1
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def _engine(**config):
    net = Net()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **config}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return net, engine


def test_the_engine_is_a_module_over_the_users():
    net, engine = _engine()
    assert isinstance(engine, torch.nn.Module) and engine.module is net
    assert [id(p) for p in engine.parameters()] == [id(p) for p in net.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in net.named_parameters()]
    assert list(engine.state_dict()) == [f"module.{k}" for k in net.state_dict()]
    assert list(engine.module_state_dict()) == list(net.state_dict())
    assert engine.eval() is engine and not engine.training and not net.training
    assert engine.train() is engine and engine.training and net.training
    assert engine.label_names == ("y",)  # passed through to the model, as DeepSpeed's engine does
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.zero_optimization_stage() == 0 and engine.local_rank == 0


def test_half_precision_queries():
    assert _engine(bf16={"enabled": True})[1].bfloat16_enabled()
    assert _engine(fp16={"enabled": True})[1].fp16_enabled()


def test_a_name_neither_has_is_one_line():
    with pytest.raises(AttributeError) as err:
        _engine()[1].no_such_method()
    assert "\n" not in str(err.value) and "'no_such_method'" in str(err.value) and "Net" in str(err.value)


@pytest.mark.parametrize("stage", [0, 2])
def test_the_examples_loop_trains(stage):
    """HelloDeepSpeed's loop: batches moved to the accelerator's device, engine(**batch), backward, step."""
    net, engine = _engine(zero_optimization={"stage": stage})
    device = torch.device(get_accelerator().device_name(engine.local_rank))
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 4, generator=g)}
    engine.train()
    losses = []
    for _ in range(20):
        loss = engine(**{k: v.to(device) for k, v in batch.items()})
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0] and int(net.calls) == 20
    with torch.no_grad():  # cifar10's evaluation: the user's own module after training
        assert float(net(**batch)) < losses[0]


def _two_groups(net):
    return torch.optim.SGD([{"params": net.fc1.parameters()}, {"params": net.fc2.parameters()}], lr=0.1)


@pytest.mark.parametrize("make, refused", [
    (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5 ** s]), "lr_lambdas"),
    (lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[0.0, 0.05]), "min_lrs"),
    (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2), None),
])
def test_a_scheduler_that_splits_the_groups_rates_is_refused_at_initialize(make, refused):
    """Per-group schedules would give the groups different rates from the second step on; the engine
    applies one rate, so initialize refuses them (it used to fail at that step); a shared one trains."""
    net = Net()
    opt = _two_groups(net)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6}
    if refused:
        with pytest.raises(ConfigError, match=f"{refused} differs between groups.*one learning rate"):
            deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=make(opt), config=config)
        return
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=make(opt), config=config)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(4):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.get_lr() == [0.1 * 0.1 ** 2] * 2
