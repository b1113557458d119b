"""The pieces of a step without host syncs and the GPU paths, where a CPU can check them: stage-only
micro-batches and their prefetch, cached schedules, AdamW's in-place scalars, bf16 weight gradients
into fp32 main gradients, SDPA's enable_gqa choice (and the memory model that follows it), --tf32,
ReduceOp.AVG's choice."""
import dataclasses

import pytest
import torch

from megazero.config import config_from_dict, validate
from megazero.data import MockGPTData, micro_batches, stage_keys
from megazero.data.loader import StepBatches
from megazero.process.local_ranks import run_ranks
from megazero.pipeline.schedules import build_schedule, stage_schedule, steps
from megazero.planning.activations import dims
from megazero.optim.precision import apply_tf32
from megazero.tensor_parallel.layers import linear
from megazero.zero.flat_optim import FlatAdamW
from models.layers import native_gqa
from models.saved_activations import _kernel, _qk_path, core_bytes
from tolerance import U32


# ---- data ----------------------------------------------------------------------------------
class _Chunk:
    def __init__(self, pre, post):
        self.pre_process, self.post_process = pre, post


class _NoReads:
    def get_tokens(self, indices, split="train"):
        raise AssertionError("a middle stage read samples")


def test_each_stage_builds_only_what_it_reads():
    data = MockGPTData(50, 8, seed=3)
    full = micro_batches(data, 1, 8, 2, 1, 2)
    assert stage_keys([_Chunk(True, False)]) == ("tokens",)
    assert stage_keys([_Chunk(False, True)]) == ("labels", "loss_mask")
    assert stage_keys([_Chunk(True, False), _Chunk(False, True)]) == ("tokens", "labels", "loss_mask")
    assert stage_keys([_Chunk(False, False)]) == ()
    for keys in (("tokens",), ("labels", "loss_mask")):
        part = micro_batches(data, 1, 8, 2, 1, 2, keys=keys)
        assert len(part) == len(full) == 2
        for a, b in zip(part, full):
            assert sorted(a) == sorted(keys) and all(torch.equal(a[k], b[k]) for k in keys)
    assert micro_batches(_NoReads(), 1, 8, 2, 1, 2, keys=()) == [{}, {}]


def test_prefetched_batches_are_the_ones_asked_for():
    data, keys = MockGPTData(50, 8, seed=3), ("tokens", "labels", "loss_mask")
    sizes = {0: 4, 4: 8, 12: 8}  # a batch-size ramp: the next size follows the samples consumed
    loader = StepBatches(data, 2, 0, 1, torch.device("cpu"), keys, sizes.get, prefetch=True)
    first = loader.get(0, 4)
    loader.ahead(4)
    second = loader.get(4, 8)
    assert loader.prefetched == 1
    loader.ahead(12)
    other = loader.get(20, 8)  # not what was prefetched (a resume elsewhere): loaded now
    assert loader.prefetched == 1 and loader.pending is None
    for got, first_sample, size in ((first, 0, 4), (second, 4, 8), (other, 20, 8)):
        want = micro_batches(data, None, size, 2, first=first_sample)
        assert len(got) == len(want)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(got, want) for k in keys)
    lazy = StepBatches(data, 2, 0, 1, torch.device("cpu"), keys, sizes.get)  # CPU: nothing ahead
    lazy.ahead(4)
    assert lazy.pending is None


# ---- schedules and optimizer scalars -------------------------------------------------------
def test_schedules_are_built_once_and_are_the_same_steps():
    a = stage_schedule("interleaved", 4, 8, 2, False, 1)
    assert a is stage_schedule("interleaved", 4, 8, 2, False, 1)
    assert list(a) == steps(build_schedule("interleaved", 4, 8, 2)[1])
    assert list(stage_schedule("1f1b", 2, 4, 1, True, 0)) == steps(build_schedule("1f1b", 2, 4, 1, True)[0])


def test_adamw_scalars_are_reused_and_refilled():
    """The fused kernel's step count and gradient scale are two tensors made once and refilled in
    place each step; the result is that of the unfused formula (torch.optim.AdamW's arithmetic)."""
    opt, plain = FlatAdamW(weight_decay=0.1), FlatAdamW(weight_decay=0.1)
    plain.fused_devices["cpu"] = False
    torch.manual_seed(0)
    master, grad = torch.randn(64), torch.randn(64)
    ref, state, ref_state = master.clone(), opt.init_state(master), plain.init_state(master)
    for step in (1, 2, 3):
        opt.update(master, grad.clone(), state, [(0, 40)], 1e-2, step, grad_mul=0.5)
        plain.update(ref, grad.clone(), ref_state, [(0, 40)], 1e-2, step, grad_mul=0.5)
        if step == 1:
            made = dict(opt.scalars)
    if opt.fused_devices.get("cpu") is not True:
        pytest.skip("this torch has no fused CPU AdamW")
    assert set(made) == {("cpu", "step"), ("cpu", "grad_scale")}
    assert all(opt.scalars[k] is made[k] for k in made)  # the same tensors, refilled
    assert opt.scalars[("cpu", "step")].item() == 3.0 and opt.scalars[("cpu", "grad_scale")].item() == 2.0
    # the same fp32 arithmetic in another order: each step may round the master differently, by
    # about an ulp of |p| (plus the update's own ulps): 3 steps x 2 roundings; a wrong step count
    # (bias correction) moves it by ~lr = 1e-2
    bound = 3 * 2 * U32 * float(ref.abs().max())
    assert float((master - ref).abs().max()) <= bound


# ---- bf16 weights, fp32 main gradients -------------------------------------------------------
@pytest.mark.parametrize("accumulate", [False, True])
def test_bf16_weight_gradient_lands_in_fp32_buffer_as_through_grad(accumulate):
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(6, 5).bfloat16())
    x = torch.randn(3, 4, 5).bfloat16().requires_grad_()
    start = torch.randn(30)
    buf = start.clone()
    calls = []

    def write_grad(write):
        calls.append(1)
        write(buf, accumulate)

    w.write_grad = write_grad
    linear(x, w).float().square().sum().backward()
    assert calls and w.grad is None  # no .grad: the product went into the fp32 buffer
    del w.write_grad
    ref = torch.nn.Parameter(w.detach().clone())
    torch.nn.functional.linear(x.detach(), ref).float().square().sum().backward()
    want = (start + ref.grad.float().reshape(-1)) if accumulate else ref.grad.float().reshape(-1)
    assert buf.dtype == torch.float32 and torch.equal(buf, want)


# ---- attention ---------------------------------------------------------------------------------
GQA = dict(mock_data=True, num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
           seq_length=128, vocab_size=64, position_embedding_type="rope", normalization="RMSNorm",
           activation="swiglu", bf16=True, micro_batch_size=1, global_batch_size=1)


def test_grouped_keys_are_repeated_except_on_cuda_flash_without_mask():
    q = torch.zeros(1, 8, 4, 8, dtype=torch.bfloat16)
    assert not native_gqa(q, None)  # CPU: the repeated form, whose numbers are those before
    cfg = validate(config_from_dict(GQA), 1)
    D = dims(cfg, "cuda")
    assert D.backend == "flash"
    _, qs, ks, vs = _qk_path(D)
    grouped = _kernel(D, qs, ks, vs)
    windowed = _kernel(dataclasses.replace(D, window=16), qs, ks, vs)
    on_cpu = _kernel(dataclasses.replace(D, device="cpu"), qs, ks, vs)
    heads = D.E * D.b * D.s * D.ap * D.d
    assert "k_repeated" not in grouped and "k_repeated" in windowed and "k_repeated" in on_cpu
    assert windowed["k_repeated"] == windowed["v_repeated"] == heads
    assert core_bytes(dataclasses.replace(D, window=16)) > core_bytes(D)


# ---- --tf32 ----------------------------------------------------------------------------------------
def test_tf32_flag_sets_cuda_matmul_only_when_asked():
    cfg = config_from_dict(dict(mock_data=True, tf32=True))
    assert cfg.precision.tf32 and not config_from_dict(dict(mock_data=True)).precision.tf32
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert not apply_tf32(cfg.precision, torch.device("cpu"))
        assert not apply_tf32(config_from_dict(dict(mock_data=True)).precision, torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert apply_tf32(cfg.precision, torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# ---- ReduceOp.AVG ----------------------------------------------------------------------------
def _avg_choice():
    import torch.distributed as dist
    from megazero.zero.comm import all_reduce_mean, averages_natively
    t = torch.full((4,), float(dist.get_rank() + 1))
    all_reduce_mean(t, None, 2).wait()
    return averages_natively(None, 2), t.tolist()


@pytest.mark.slow
def test_gloo_keeps_the_sum_then_divide():
    for native, values in run_ranks(_avg_choice, 2):
        assert native is False and values == [1.5] * 4
