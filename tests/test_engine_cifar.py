"""DeepSpeedExamples' cifar10 program, its ds_config as shipped (every key at its value, fp16 off) at
ZeRO-2 on 2 ranks, against the same training in plain one-process PyTorch: the example's CNN on
random 3x32x32 images (no download), 16 images a step, 8 per rank.  The reference writes out what the
config means: DeepSpeed's Adam with weight decay is AdamW (its adam_w_mode), the WarmupLR schedule's
log warm-up (DeepSpeed 0.19.8's lr_schedules.py: the rate is warmup_min_lr before the schedule's
first step and lr x log(i + 1) / log(1000) at its step i, so update t runs at lr x log(t) / log(1000):
0, 0, then rising), clipping at norm 1.0.

Tolerance: fp32 on both sides, the same products in another order (each rank's half-batch gradient
averaged over two ranks against the whole batch's): losses within 1e-6 and weights within
tolerance.R_TRAIN_ADAM of the largest weight, as tests/test_engine.py's comparisons."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.process.local_ranks import run_ranks
from test_ds_config_keys import cifar10_config
from tolerance import R_TRAIN_ADAM

STEPS, BATCH = 8, 16


class Net(nn.Module):
    """The example's network (conv 3->6->16, three linear layers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.pool, self.conv2 = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(x.view(-1, 16 * 5 * 5)))
        return self.fc3(F.relu(self.fc2(x)))


def _data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _plain():
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    losses = []
    for t, (x, y) in enumerate(_data()):
        for g in opt.param_groups:
            g["lr"] = 0.001 * math.log(t) / math.log(1000) if t else 0.0
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _engine_run():
    import torch.distributed as dist

    import megazero.deepspeed as deepspeed
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cifar10_config(2))
    rank, half = dist.get_rank(), BATCH // 2
    losses = []
    for x, y in _data():
        loss = F.cross_entropy(engine(x[rank * half:][:half]), y[rank * half:][:half])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / 2)
    from megazero.engine import GatheredParameters
    with GatheredParameters(list(net.parameters())):
        state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return losses, state


@pytest.mark.slow
def test_cifar10_config_at_zero2_dp2_equals_plain_pytorch():
    want_losses, want = _plain()
    got_losses, got = run_ranks(_engine_run, 2, timeout=300)[0]
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) <= 1e-6, (got_losses, want_losses)
    assert len(set(round(v, 4) for v in want_losses)) == STEPS  # it trained
    scale = max(float(v.abs().max()) for v in want.values())
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= R_TRAIN_ADAM * scale, worst
    moved = max(float((want[k] - Net().state_dict()[k]).abs().max()) for k in want)
    assert moved > 10 * R_TRAIN_ADAM * scale  # the updates are far above the bound
