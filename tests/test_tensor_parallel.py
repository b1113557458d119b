"""Tensor-parallel mappings, layers and the vocab-parallel cross-entropy against one process."""
import pytest
import torch
import torch.nn.functional as F

from megazero.mesh import ParallelMesh
from megazero.tensor_parallel import layers as tp_layers
from megazero.tensor_parallel import mappings as M
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             init_full, linear, normal_init, onednn_linear_available,
                                             pad_rows)
from megazero.tensor_parallel.cpu_matmul import resolve_cpu_matmul
from megazero.process.local_ranks import run_ranks
from tolerance import U32

# The mappings move float64 data; the only arithmetic is a sum over <= 4 ranks of values
# <= 2e2, so the error is a few ulp: <= 4 * eps64 * 2e2 ~ 2e-13 (observed 1.4e-14 at TP 4).
MAP64 = dict(rtol=1e-12, atol=1e-12)
# Vocab-parallel cross-entropy is fp32 by design (the library upcasts any logits dtype to fp32,
# float64 included), against F.cross_entropy in fp32. Rule, with u = 2^-24 (fp32 rounding):
# loss = log(sum of V <= 64 exps in (0, 1]) - shifted target logit; each side's error is
# <= u * (V + |log Z| + |x_t - max|) ~ u * (V + 2|loss|), so the difference is
# <= 2u * V + 4u * |loss| ~ 7.6e-6 + 2.4e-7 * |loss|  ->  atol 1e-5, rtol 1e-5 (observed <= 1e-6,
# |loss| <= 16). The gradient (softmax - onehot) / N, |grad| <= 0.11, has relative error
# <= (V + |x - max| + 2) * u ~ 5e-6 per side: atol 1e-6 (floor for tiny softmax entries),
# rtol 1e-5 (observed <= 2.3e-8 absolute).
CE_LOSS = dict(rtol=1e-5, atol=1e-5)
CE_GRAD = dict(rtol=1e-5, atol=1e-6)
# Parallel layout vs one process, computed in float64 on both sides (the fp32 init upcast).
# Rule: a different summation order moves a float64 sum of n products by at most
# n * eps64 * sum|x_i * w_i| (eps64 = 1.1e-16). The largest gradients here (row_w, ~1.2e4) sum
# n <= s * b * f = 256 products, so worst case 256 * 1.1e-16 * 1.2e4 ~ 3e-10 < 1e-9; observed
# <= 2e-12 (TP 4 + sequence parallel). In fp32 the same case differs by up to 1e-3 absolute.
F64 = dict(rtol=1e-9, atol=1e-9)


def _mappings(tp):
    mesh = ParallelMesh.build(tp=tp)
    r = mesh.coord("tp")
    full = torch.arange(12 * tp * tp, dtype=torch.float64).reshape(2 * tp, 2, 3 * tp) / 10
    mine_last = full.chunk(tp, -1)[r]
    mine_seq = full.chunk(tp, 0)[r]
    out = {}
    cases = {  # name: (input, upstream grad)
        "copy_to_tp": (full, full * (r + 1)),
        "reduce_from_tp": (full * (r + 1), full),
        "scatter_to_tp": (full, mine_last * (r + 1)),
        "gather_from_tp": (mine_last, full * (r + 1)),
        "scatter_to_sp": (full, mine_seq * (r + 1)),
        "gather_from_sp": (mine_seq, full * (r + 1)),
        "reduce_scatter_to_sp": (full * (r + 1), mine_seq * (r + 1)),
    }
    for name, (x, g) in cases.items():
        x = x.clone().requires_grad_()
        y = getattr(M, name)(x, mesh)
        y.backward(g)
        out[name] = (y.detach(), x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_and_backward(tp):
    res = run_ranks(_mappings, tp, tp)
    full = torch.arange(12 * tp * tp, dtype=torch.float64).reshape(2 * tp, 2, 3 * tp) / 10
    s = sum(range(1, tp + 1))  # sum over ranks of (r + 1)
    # the gathered upstream gradient when rank i sends its slice scaled by (i + 1)
    scaled_last = torch.cat([c * (i + 1) for i, c in enumerate(full.chunk(tp, -1))], -1)
    scaled_seq = torch.cat([c * (i + 1) for i, c in enumerate(full.chunk(tp, 0))], 0)
    for r, out in enumerate(res):
        last, seq = full.chunk(tp, -1)[r], full.chunk(tp, 0)[r]
        expect = {  # name: (forward output, input gradient)
            "copy_to_tp": (full, full * s),
            "reduce_from_tp": (full * s, full),
            "scatter_to_tp": (last, scaled_last),
            "gather_from_tp": (full, last * (r + 1)),
            "scatter_to_sp": (seq, scaled_seq),
            "gather_from_sp": (full, seq * s),
            "reduce_scatter_to_sp": (seq * s, scaled_seq),
        }
        for name, (y, g) in expect.items():
            torch.testing.assert_close(out[name][0], y, **MAP64, msg=f"{name} forward, rank {r}")
            torch.testing.assert_close(out[name][1], g, **MAP64, msg=f"{name} backward, rank {r}")


def test_mappings_are_identity_on_one_rank():
    mesh = ParallelMesh.single()
    x = torch.randn(4, 3, requires_grad=True)
    for name in ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp",
                 "gather_from_sp", "reduce_scatter_to_sp"):
        assert getattr(M, name)(x, mesh) is x


def test_init_full_is_deterministic_and_keyed():
    a = init_full((8, 4), 1, 3, "qkv.weight", 0.02)
    torch.testing.assert_close(a, init_full((8, 4), 1, 3, "qkv.weight", 0.02), rtol=0, atol=0)
    assert not torch.equal(a, init_full((8, 4), 1, 4, "qkv.weight", 0.02))
    assert not torch.equal(a, init_full((8, 4), 2, 3, "qkv.weight", 0.02))
    assert not torch.equal(a, init_full((8, 4), 1, 3, "proj.weight", 0.02))
    assert abs(a.std().item() - 0.02) < 0.01  # a sample std of 32 fixed draws, not a precision check


def _layers(tp, sp):
    torch.manual_seed(0)
    mesh = ParallelMesh.build(tp=tp)
    s, b, h, f, vocab, padded = 8, 2, 6, 4 * tp, 13, 16
    x = torch.randn(s, b, h).double()
    ids = torch.randint(0, vocab, (s, b))
    col = ColumnParallelLinear(h, f, mesh, sequence_parallel=sp, init=normal_init(1, 0, "c", 0.5))
    row = RowParallelLinear(f, h, mesh, sequence_parallel=sp, init=normal_init(1, 0, "r", 0.5))
    emb = VocabParallelEmbedding(vocab, padded, h, mesh, reduce_scatter=sp, init=normal_init(1, 0, "e", 1.0))
    col, row, emb = col.double(), row.double(), emb.double()  # float64 end to end: see F64
    with torch.no_grad():
        col.bias.copy_(torch.arange(f).float().chunk(tp)[mesh.coord("tp")])
        row.bias.fill_(0.5)
    xin = (x.chunk(tp)[mesh.coord("tp")] if sp else x).clone().requires_grad_()
    y = row(col(xin)) + emb(ids)
    (y * y).sum().backward()
    return dict(y=y.detach(), xgrad=xin.grad, col_w=col.weight.grad, row_w=row.weight.grad,
                row_b=row.bias.grad, emb=emb.weight.grad, col_b=col.bias.grad,
                seq_attr=getattr(row.bias, "sequence_parallel", False))


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, True)])
def test_parallel_layers_match_single_process(tp, sp):
    res = run_ranks(_layers, tp, tp, sp)
    torch.manual_seed(0)
    s, b, h, f, vocab, padded = 8, 2, 6, 4 * tp, 13, 16
    x = torch.randn(s, b, h).double().requires_grad_()
    ids = torch.randint(0, vocab, (s, b))
    cw = init_full((f, h), 1, 0, "c", 0.5).double().requires_grad_()
    rw = init_full((h, f), 1, 0, "r", 0.5).double().requires_grad_()
    ew = pad_rows(init_full((vocab, h), 1, 0, "e", 1.0), padded).double().requires_grad_()
    cb = torch.arange(f).double().requires_grad_()
    rb = torch.full((h,), 0.5, dtype=torch.float64, requires_grad=True)
    y = F.linear(F.linear(x, cw, cb), rw, rb) + F.embedding(ids, ew)
    (y * y).sum().backward()
    cat = lambda key, dim: torch.cat([r[key] for r in res], dim)  # noqa: E731
    if sp:
        torch.testing.assert_close(cat("y", 0), y.detach(), **F64)
        torch.testing.assert_close(cat("xgrad", 0), x.grad, **F64)
        torch.testing.assert_close(sum(r["row_b"] for r in res), rb.grad, **F64)  # partial grads sum
        assert all(r["seq_attr"] for r in res)
    else:
        for r in res:
            torch.testing.assert_close(r["y"], y.detach(), **F64)
            torch.testing.assert_close(r["xgrad"], x.grad, **F64)
            torch.testing.assert_close(r["row_b"], rb.grad, **F64)
    torch.testing.assert_close(cat("col_w", 0), cw.grad, **F64)
    torch.testing.assert_close(cat("col_b", 0), cb.grad, **F64)
    torch.testing.assert_close(cat("row_w", 1), rw.grad, **F64)
    torch.testing.assert_close(cat("emb", 0), ew.grad, **F64)
    assert cat("emb", 0)[vocab:].abs().sum() == 0


def _ce_case(vocab, padded, smoothing):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 5, padded, generator=g) * 3
    labels = torch.randint(0, vocab, (3, 5), generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    return logits, labels, mask


def _ce_rank(tp, vocab, padded, smoothing):
    mesh = ParallelMesh.build(tp=tp)
    logits, labels, mask = _ce_case(vocab, padded, smoothing)
    shard = logits.chunk(tp, -1)[mesh.coord("tp")].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, mesh, vocab, smoothing)
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("tp,vocab,padded,smoothing", [(1, 50, 64, 0.0), (2, 50, 64, 0.1), (4, 37, 64, 0.0),
                                                       (4, 30, 64, 0.2)])
def test_vocab_parallel_cross_entropy(tp, vocab, padded, smoothing):
    logits, labels, mask = _ce_case(vocab, padded, smoothing)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :vocab].reshape(-1, vocab), labels.reshape(-1), reduction="none",
                          label_smoothing=smoothing).reshape(3, 5)
    ((ref * mask).sum() / mask.sum()).backward()
    if tp == 1:
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, labels, None, vocab, smoothing)
        ((loss * mask).sum() / mask.sum()).backward()
        res = [(loss.detach(), x.grad)]
    else:
        res = run_ranks(_ce_rank, tp, tp, vocab, padded, smoothing)
    for loss, _ in res:
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref.detach(), **CE_LOSS)
    grad = torch.cat([g for _, g in res], -1)
    torch.testing.assert_close(grad, ref_in.grad, **CE_GRAD)
    assert grad[..., vocab:].abs().sum() == 0  # padded columns get no gradient


def test_cross_entropy_bf16_logits_upcast():
    logits, labels, _ = _ce_case(50, 64, 0.0)
    x = logits.bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels, None, 50)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.bfloat16().float()[..., :50].reshape(-1, 50), labels.reshape(-1),
                          reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, **CE_LOSS)


# ---- linear(): oneDNN products and gradients written into a buffer -------------------------
ONEDNN = [False] + ([True] if onednn_linear_available() else [])


@pytest.mark.parametrize("onednn", ONEDNN)
@pytest.mark.parametrize("into_buffer", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(onednn, into_buffer, bias, monkeypatch):
    monkeypatch.setattr(tp_layers, "ONEDNN_MIN_MACS", 0)  # oneDNN even for this small product
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, 20, generator=g).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(12, 20, generator=g))
    b = torch.nn.Parameter(torch.randn(12, generator=g)) if bias else None
    grad_out = torch.randn(3, 6, 12, generator=g).transpose(0, 1)  # a non-contiguous incoming gradient
    buffer, calls = torch.full((2 * 12 * 20,), float("nan")), []
    if into_buffer:  # twice, as over two micro-batches: the first overwrites, the second adds
        weight.write_grad = lambda write: (calls.append(1), write(buffer[7:7 + 240], len(calls) > 1))
    for _ in range(2 if into_buffer else 1):
        y = linear(x, weight, b, onednn=onednn)
        y.backward(grad_out)
    x64, w64, g64 = x.detach().double(), weight.detach().double(), grad_out.double()
    n = 2 if into_buffer else 1
    b64 = torch.zeros(12, dtype=torch.float64) if b is None else b.detach().double()
    want = {"y": (F.linear(x64, w64, b64), x64.abs() @ w64.abs().t() + b64.abs(), 21),
            "grad x": (n * g64 @ w64, n * g64.abs() @ w64.abs(), 12 * n),
            "grad w": (n * g64.reshape(-1, 12).t() @ x64.reshape(-1, 20), n * g64.reshape(-1, 12).abs().t()
                       @ x64.reshape(-1, 20).abs(), 18 * n)}
    got = {"y": y, "grad x": x.grad,
           "grad w": buffer[7:7 + 240].view(12, 20) if into_buffer else weight.grad}
    for key, (ref, magnitude, terms) in want.items():
        # a sum of `terms` terms rounds by at most terms * U32 * sum|terms| (and once more on output)
        bound = terms * U32 * magnitude + U32 * ref.abs()
        assert ((got[key].double() - ref).abs() <= bound).all(), key
    assert (weight.grad is None) == into_buffer and len(calls) == (2 if into_buffer else 0)
    if bias:
        # a sum of 18 terms per micro-batch: 18 * n * U32 * sum|terms| bounds it, 40 * n is looser only by 2x
        bound = 40 * n * U32 * float(g64.abs().sum())
        assert torch.allclose(b.grad.double(), n * g64.sum((0, 1)), rtol=0, atol=bound)
    assert torch.isnan(buffer[:7]).all() and torch.isnan(buffer[247:]).all()  # nothing written outside


def test_linear_keeps_plain_f_linear_outside_fp32_cpu_training():
    small_x, small_w = torch.randn(4, 8), torch.randn(5, 8)  # under ONEDNN_MIN_MACS: F.linear's own result
    assert torch.equal(linear(small_x, small_w, onednn=True), F.linear(small_x, small_w))
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, onednn=True), F.linear(x, w))  # bf16: PyTorch's own (oneDNN) path
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype, as for F.linear
        x32, w32 = x.float(), w.float()
        assert linear(x32, w32, onednn=True).dtype == torch.bfloat16
        assert torch.equal(linear(x32, w32, onednn=True), F.linear(x32, w32))
    w32 = torch.nn.Parameter(torch.randn(5, 8))
    w32.write_grad = lambda write: pytest.fail("no gradient without autograd")
    with torch.no_grad():
        linear(torch.randn(4, 8), w32)
    y = linear(torch.randn(4, 8), w32)
    assert type(y.grad_fn).__name__ == "_LinearBackward"


def test_cpu_matmul_flag(monkeypatch):
    from megazero.config import ConfigError, MegazeroConfig, validate
    cfg = MegazeroConfig()
    cfg.data.mock_data, cfg.precision.cpu_matmul = True, "torch"
    assert not resolve_cpu_matmul("torch")
    validate(cfg, 1)
    monkeypatch.setattr(tp_layers, "onednn_linear_available", lambda: False)
    assert not resolve_cpu_matmul("auto")
    cfg.precision.cpu_matmul = "onednn"
    with pytest.raises(ConfigError, match="--cpu-matmul onednn needs .*use --cpu-matmul torch or auto"):
        validate(cfg, 1)
