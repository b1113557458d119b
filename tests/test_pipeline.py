"""The pipeline executor against the single-process oracle: same losses, same gradients.

A toy chunk model (embedding, residual tanh-linear blocks, head + per-token cross-entropy) obeys
the chunk contract of docs/internals.md and is initialised by global layer index, so every
partition of it equals the whole model.  One ``run_ranks`` call per world size covers many
configurations.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.mesh import ParallelMesh
from megazero.pipeline.executor import PipelineTimer, _can_deallocate, run_forward_only, run_schedule
from megazero.pipeline.partition import stage_layers
from megazero.pipeline.schedules import ScheduleError
from megazero.process.local_ranks import run_ranks
from tolerance import C_FWD, C_FWD_BWD, U32, fp32_bound

V, H, S, B = 13, 8, 5, 2  # vocab, hidden, sequence, micro-batch
# The toy model runs in float64 (weights, activations, p2p messages); only the executor's masked
# mean of the per-token losses is fp32 (it calls per_token.float()), and the oracle takes the same
# fp32 mean, so the backward starts from the same fp32 numbers on both sides.
# Gradients: float64 sums of <= B * S * m = 90 tokens times H = 8 products, |terms| <= ~10:
# a different order moves them by <= n * U64 * sum|terms| ~ 1e-13; allow 1e-10 (observed <= 1e-15).
# Losses: the same fp32 mean of float64 per-token losses that agree to ~1e-15, so the fp32 casts and
# the sum agree; allow a few fp32 roundings of the mean: rel 2e-7 (observed: equal).
TOY_GRAD = dict(rtol=1e-10, atol=1e-10)
TOY_LOSS = dict(rel=2e-7, abs=0)


def _randn(shape, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.5).double()


class ToyChunk(torch.nn.Module):
    """One pipeline chunk of the toy model; ``shared`` marks the tied embedding copies."""

    def __init__(self, layers, pre_process, post_process, tied=True, shared=False):
        super().__init__()
        self.layers, self.pre_process, self.post_process, self.tied = layers, pre_process, post_process, tied
        if pre_process:
            self.embedding = torch.nn.Parameter(_randn((V, H), 7))
            self.embedding.shared_embedding = shared and tied
        self.blocks = torch.nn.ModuleDict()
        for i in layers:
            lin = torch.nn.Linear(H, H, dtype=torch.float64)
            with torch.no_grad():
                lin.weight.copy_(_randn((H, H), 100 + i))
                lin.bias.copy_(_randn((H,), 200 + i))
            self.blocks[str(i)] = lin
        if post_process and not (tied and pre_process):
            self.head = torch.nn.Parameter(_randn((V, H), 7 if tied else 8))
            self.head.shared_embedding = shared and tied

    def forward(self, x, labels=None, loss_mask=None):
        h = self.embedding[x].transpose(0, 1) if self.pre_process else x  # [s, b, h]
        for block in self.blocks.values():
            h = h + torch.tanh(block(h))
        if not self.post_process:
            return h
        w = self.embedding if (self.tied and self.pre_process) else self.head
        logits = (h @ w.t()).transpose(0, 1)  # [b, s, v]
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)


class _SaveOutput(torch.autograd.Function):
    """Identity whose backward keeps its own output (as ``tanh``/``exp`` do)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors  # noqa: B018 - the saved output must still be readable
        return g


class Tail(torch.nn.Module):
    """A chunk whose hidden output comes out of an identity ``op`` that defeats output deallocation:
    "view" (the output is a view) or "saved" (its producer saves it for backward)."""

    def __init__(self, inner, op):
        super().__init__()
        self.inner, self.op = inner, op
        self.pre_process, self.post_process = inner.pre_process, inner.post_process

    def forward(self, x, labels=None, loss_mask=None):
        out = self.inner(x, labels, loss_mask)
        if self.post_process:
            return out
        return out.view(out.shape) if self.op == "view" else _SaveOutput.apply(out)


def _names(chunk):
    """Global parameter names: the tied head copy is called "embedding" too."""
    out = {}
    for n, p in chunk.named_parameters():
        out["embedding" if n == "head" and chunk.tied else n] = p
    return out


def micro_batches(m, seed=0, b=B, s=S, v=V, drop=0.3):
    """``m`` random micro-batches with a random loss mask (about ``drop`` of the tokens masked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        mask = (torch.rand(b, s, generator=g) > drop).float()
        mask[0, 0] = 1.0
        out.append({"tokens": torch.randint(0, v, (b, s), generator=g),
                    "labels": torch.randint(0, v, (b, s), generator=g), "loss_mask": mask})
    return out


def oracle(case):
    model = ToyChunk(range(case["layers"]), True, True, tied=case["tied"])
    losses = []
    m = case["m"]
    for batch in micro_batches(m, case["seed"]):
        per_tok = model(batch["tokens"], labels=batch["labels"])
        loss = (per_tok.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()  # as the executor
        (loss / m).backward()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in _names(model).items()}


class RecordingSync:
    """A GradSync stand-in that records prepare_backward calls."""

    def __init__(self):
        self.calls = []

    def prepare_backward(self, chunk_index, is_last_microbatch):
        self.calls.append((chunk_index, is_last_microbatch))


def _run_case(mesh, case):
    pp, r = mesh.size("pp"), mesh.coord("pp")
    ranges = stage_layers(case["layers"], pp, r, case.get("vp_layers"), case.get("first"), case.get("last"))
    vp = len(ranges)
    chunks = [ToyChunk(rg, r == 0 and v == 0, r == pp - 1 and v == vp - 1, case["tied"], shared=pp * vp > 1)
              for v, rg in enumerate(ranges)]
    if case.get("tail"):
        chunks = [Tail(c, case["tail"]) for c in chunks]
    sync, timer = RecordingSync(), PipelineTimer()
    scale = case.get("loss_scale", 1.0)
    losses = run_schedule(chunks, mesh, micro_batches(case["m"], case["seed"]), schedule=case["schedule"],
                          num_micro_batches=case["m"], tensor_shape=(S, B, H), dtype=torch.float64,
                          grad_sync=sync, loss_scale=scale, timer=timer,
                          deallocate_outputs=case.get("deallocate", True))
    shared = [p for c in chunks for p in c.parameters() if getattr(p, "shared_embedding", False)]
    if pp > 1:  # what the optimizer does once per step
        for p in shared:
            dist.all_reduce(p.grad, group=mesh.group("embedding"))
    elif shared:  # one stage holding both the first and the last chunk
        total = sum(p.grad for p in shared)
        for p in shared:
            p.grad = total.clone()
    grads = {n: p.grad / scale for c in chunks for n, p in _names(getattr(c, "inner", c)).items()}
    eval_losses = run_forward_only(chunks, mesh, micro_batches(case["m"], case["seed"] + 1),
                                   num_micro_batches=case["m"], tensor_shape=(S, B, H), dtype=torch.float64)
    return {"losses": [x.item() for x in losses], "grads": grads, "calls": sync.calls,
            "timer": timer.as_dict(), "eval": [x.item() for x in eval_losses]}


def _worker(tp, pp, cases):
    mesh = ParallelMesh.build(tp=tp, pp=pp)
    return [_run_case(mesh, case) for case in cases]


def _check(case, results, pp):
    want_losses, want_grads = oracle(case)
    eval_losses = _oracle_eval(case)
    seen = set()
    for rank, res in enumerate(results):
        pp_rank = rank // (len(results) // pp)  # tp-dp-pp order, dp = 1
        if pp_rank == pp - 1:
            assert res["losses"] == pytest.approx(want_losses, **TOY_LOSS), case
            assert res["eval"] == pytest.approx(eval_losses, **TOY_LOSS), case
        else:
            assert res["losses"] == [] and res["eval"] == []
        for n, g in res["grads"].items():
            torch.testing.assert_close(g, want_grads[n], **TOY_GRAD, msg=lambda s: f"{case} {n}: {s}")
            seen.add(n)
        # one prepare_backward per micro-batch and chunk; "last" exactly on the chunk's last backward
        for v in {c for c, _ in res["calls"]}:
            flags = [last for c, last in res["calls"] if c == v]
            assert len(flags) == case["m"] and flags[-1] and not any(flags[:-1])
        t = res["timer"]
        assert t["total_s"] >= t["compute_s"] > 0 and 0 <= t["bubble"] < 1
    assert seen == set(want_grads), case  # every parameter lives somewhere


def _oracle_eval(case):
    model = ToyChunk(range(case["layers"]), True, True, tied=case["tied"])
    out = []
    with torch.no_grad():
        for batch in micro_batches(case["m"], case["seed"] + 1):
            per_tok = model(batch["tokens"], labels=batch["labels"])
            out.append(((per_tok.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).item())
    return out


def _cases(pp, layers, uneven):
    cases = []
    for i, m in enumerate(sorted({1, pp, 2 * pp + 1})):
        for j, sched in enumerate(("gpipe", "1f1b")):
            cases.append(dict(schedule=sched, m=m, layers=layers, tied=(i + j) % 2 == 0, seed=len(cases)))
    for m in (pp, 2 * pp):
        for tied in (True, False):
            cases.append(dict(schedule="interleaved", m=m, layers=layers, vp_layers=layers // (2 * pp),
                              tied=tied, seed=len(cases)))
    for first, last in uneven:
        for tied in (True, False):
            cases.append(dict(schedule="1f1b", m=pp + 1, layers=layers, first=first, last=last, tied=tied,
                              seed=len(cases), loss_scale=4.0))
    return cases


@pytest.mark.parametrize("tp,pp,layers,uneven", [
    (1, 2, 4, [(1, None), (None, 3)]),
    (1, 4, 8, [(1, 3), (2, None)]),
    (2, 4, 8, [(1, 3)]),  # 8 ranks: TP pairs of replicated toy chunks exchange with their own peers
])
def test_pipeline_matches_oracle(tp, pp, layers, uneven):
    cases = _cases(pp, layers, uneven)
    results = run_ranks(_worker, tp * pp, tp, pp, cases)
    for k, case in enumerate(cases):
        _check(case, [res[k] for res in results], pp)


@pytest.mark.parametrize("schedule,vp_layers,m",
                         [("1f1b", None, 3), ("gpipe", None, 1), ("interleaved", 1, 3)])
def test_single_stage_matches_oracle(schedule, vp_layers, m):
    """pp == 1 (no process group): the degenerate schedule; two chunks hand activations over locally."""
    case = dict(schedule=schedule, m=m, layers=2, vp_layers=vp_layers, tied=True, seed=5)
    res = _run_case(ParallelMesh.single(), case)
    _check(case, [res], 1)


def _dealloc_cases(pp, layers):
    cases = []
    for sched, m, vp_layers in (("gpipe", pp + 1, None), ("1f1b", 2 * pp + 1, None),
                                ("interleaved", 2 * pp, layers // (2 * pp))):
        for dealloc in (True, False):
            cases.append(dict(schedule=sched, m=m, layers=layers, vp_layers=vp_layers, tied=True,
                              seed=len(cases), deallocate=dealloc))
    for tail in ("view", "saved"):
        cases.append(dict(schedule="1f1b", m=pp + 1, layers=layers, tied=False, seed=len(cases), tail=tail))
    return cases


@pytest.mark.parametrize("pp,layers", [(2, 4), (4, 8)])
def test_sent_outputs_deallocated(pp, layers):
    """After its send, an output holds a one-element placeholder until its backward; losses and
    gradients still equal the oracle (every schedule, eval too).  Outputs that are views or that
    their producer saved are kept whole, and still right."""
    cases = _dealloc_cases(pp, layers)
    results = run_ranks(_worker, pp, 1, pp, cases)
    elem = 8  # bytes of one element: the toy's activations are float64
    act = S * B * H * elem  # bytes of one activation
    for k, case in enumerate(cases):
        _check(case, [res[k] for res in results], pp)
        vp = 1 if case.get("vp_layers") is None else layers // (case["vp_layers"] * pp)
        for rank, res in enumerate(results):
            t = res[k]["timer"]
            if rank == pp - 1 and vp == 1:  # the last stage sends nothing
                assert t["peak_sent_output_bytes"] == 0, case
            elif case.get("deallocate", True) and not case.get("tail"):
                # placeholders only: one element each, at most one per micro-batch and chunk
                assert 0 < t["peak_sent_output_bytes"] <= elem * case["m"] * vp, (rank, case, t)
                assert t["peak_output_bytes"] <= act + elem * case["m"] * vp, (rank, case, t)
            else:  # kept whole: the first stage holds several sent outputs at once when m > 1
                assert t["peak_sent_output_bytes"] >= (2 if rank == 0 else 1) * act, (rank, case, t)
            assert t["peak_input_bytes"] >= (act if rank > 0 else 0), (rank, case, t)


def test_can_deallocate_guard():
    w = torch.randn(H, H, requires_grad=True)
    h = torch.randn(S, H) @ w
    assert _can_deallocate(h + torch.tanh(h))  # residual add: backward saves nothing of the output
    assert _can_deallocate(h * 2.0)
    assert not _can_deallocate(torch.tanh(h))  # tanh's backward reads its output
    assert not _can_deallocate(h.exp())
    assert not _can_deallocate(_SaveOutput.apply(h))
    assert not _can_deallocate(h.t())  # a view
    assert not _can_deallocate(h[1:])
    assert not _can_deallocate(w)  # a leaf: no grad_fn
    assert not _can_deallocate(h.detach())


def test_errors():
    mesh = ParallelMesh.single()
    chunk = ToyChunk(range(2), True, True)
    kw = dict(num_micro_batches=2, tensor_shape=(S, B, H))
    with pytest.raises(ValueError, match="needs 2 micro-batches .* got 1"):
        run_schedule([chunk], mesh, micro_batches(1), **kw)
    with pytest.raises(ValueError, match="chunk 0 of 1: expected pre_process=True, post_process=True"):
        run_schedule([ToyChunk(range(2), False, True)], mesh, micro_batches(2), **kw)
    two = [ToyChunk(range(1), True, False), ToyChunk(range(1, 2), False, True)]
    with pytest.raises(ScheduleError, match="use the interleaved schedule"):
        run_schedule(two, mesh, micro_batches(2), schedule="1f1b", **kw)
    with pytest.raises(RuntimeError, match=r"does not match the configured p2p shape \(5, 2, 4\)"):
        run_schedule(two, mesh, micro_batches(2), schedule="interleaved", num_micro_batches=2,
                     tensor_shape=(S, B, 4))
    pp2 = ParallelMesh.single(torch.device("cpu"))
    pp2.world_size, pp2.sizes["pp"], pp2.groups[("pp",)] = 2, 2, (None, [0, 1])
    first = [ToyChunk(range(1), True, False), ToyChunk(range(2, 3), False, False)]
    with pytest.raises(ScheduleError, match="allowed counts: 2, 4, 6"):
        run_schedule(first, pp2, micro_batches(3), schedule="interleaved", num_micro_batches=3,
                     tensor_shape=(S, B, H))


# ---- the real GPT model (models.build_chunks) ------------------------------------------------
GPT = dict(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=40,
           make_vocab_size_divisible_by=8, micro_batch_size=2, mock_data=True, seed=11,
           hidden_dropout=0.0, attention_dropout=0.0)  # no dropout: the pipeline is compared with one process
LLAMA = dict(GPT, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
             position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False)


def _gpt_cfg(settings, m, tp=1, pp=1, dp=1):
    from megazero.config import config_from_dict, validate
    s = dict(settings, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
             global_batch_size=m * settings["micro_batch_size"] * dp)
    if pp == 1:
        for key in ("num_layers_per_virtual_pipeline_stage", "pipeline_schedule", "sequence_parallel",
                    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            s.pop(key, None)
    return validate(config_from_dict(s), tp * pp * dp)


def _gpt_batches(cfg, m, seed):
    return micro_batches(m, seed, cfg.training.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size,
                         drop=0.2)


def _gpt_worker(tp, pp, dp, cases):
    from megazero.pipeline.p2p import p2p_tensor_shape
    from megazero.optim.precision import compute_dtype
    from models import build_chunks, full_state_dict
    mesh = ParallelMesh.build(tp=tp, pp=pp)
    out = []
    for settings, m in cases:
        cfg = _gpt_cfg(settings, m, tp, pp, dp)
        chunks = build_chunks(cfg, mesh)
        losses = run_schedule(chunks, mesh, _gpt_batches(cfg, m, seed=mesh.coord("dp")),
                              schedule=cfg.parallel.pipeline_schedule, num_micro_batches=m,
                              tensor_shape=p2p_tensor_shape(cfg), dtype=compute_dtype(cfg))
        for c in chunks:
            for p in c.parameters():  # the optimizer's once-per-step reductions
                if getattr(p, "shared_embedding", False):
                    dist.all_reduce(p.grad, group=mesh.group("embedding"))
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=mesh.group("tp"))
        grads = {}
        for c in chunks:
            grads.update(full_state_dict(c, grads=True))
        out.append({"losses": [x.item() for x in losses], "grads": grads, "dp_rank": mesh.coord("dp"),
                    "last": mesh.is_last_stage})
    return out


def _gpt_oracle(settings, m, seed):
    from models import build_model
    cfg = _gpt_cfg(settings, m)
    model = build_model(cfg)
    losses = []
    for b in _gpt_batches(cfg, m, seed):
        loss = (model(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() / b["loss_mask"].sum()
        (loss / m).backward()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp,pp,dp,cases", [
    (2, 2, 1, [(dict(GPT), 3),
               (dict(GPT, untie_embeddings_and_output_weights=True,
                     num_layers_per_virtual_pipeline_stage=1), 2),
               (dict(GPT, sequence_parallel=True, pipeline_schedule="gpipe"), 2),
               (dict(LLAMA, untie_embeddings_and_output_weights=True,
                     decoder_first_pipeline_num_layers=1), 3)]),
    (2, 2, 2, [(dict(GPT, sequence_parallel=True), 3),
               (dict(GPT, num_layers_per_virtual_pipeline_stage=1), 2),
               (dict(GPT, decoder_last_pipeline_num_layers=1), 2)]),
])
def test_gpt_pipeline_matches_oracle(tp, pp, dp, cases):
    results = run_ranks(_gpt_worker, tp * pp * dp, tp, pp, dp, cases)
    for k, (settings, m) in enumerate(cases):
        oracles = {d: _gpt_oracle(settings, m, seed=d) for d in range(dp)}
        tied = not settings.get("untie_embeddings_and_output_weights", False)
        for rank, res in enumerate(results):
            want_losses, want_grads = oracles[res[k]["dp_rank"]]
            got = res[k]
            # the GPT model is fp32 only: scaled fp32 bounds (tolerance.py). Per-micro-batch losses
            # C_FWD * U32 relative (1.1e-5; observed 6.5e-8), gradients C_FWD_BWD * U32 * max|grad|
            # per tensor (was rtol 1e-4, atol 1e-5: 4% of the smallest gradients' scale; observed
            # <= 11 U32 * max|grad|)
            if got["last"]:
                assert got["losses"] == pytest.approx(want_losses, rel=C_FWD * U32), (rank, settings)
            for n, g in got["grads"].items():
                ref = want_grads["word_embeddings.weight" if (n == "output_layer.weight" and tied) else n]
                torch.testing.assert_close(g, ref, **fp32_bound(ref, C_FWD_BWD),
                                           msg=lambda s: f"{rank} {settings} {n}: {s}")


# ---- --delay-wgrad-compute: weight gradients after the input gradient's send ----------------
def _delay_worker(pp, cases):
    """Per case, with and without delayed weight gradients: this rank's gradient buffer after one
    step's schedule and the order of backwards, deferrals, posted gradient sends and deferred
    weight-gradient passes."""
    from megazero.pipeline import executor
    from megazero.pipeline.p2p import p2p_tensor_shape
    from megazero.zero import build_optimizer
    from models import build_chunks
    mesh = ParallelMesh.build(tp=1, pp=pp)
    events, out = [], []
    exchange, backward = executor.StageComm.exchange, executor._Stage.backward

    def logged_exchange(self, step, outgoing):
        events.extend(("send", a.microbatch, a.chunk) for a in outgoing if a.kind == "send_bwd")
        return exchange(self, step, outgoing)

    def logged_backward(self, mb, v):
        events.append(("bwd", mb, v))
        return backward(self, mb, v)
    executor.StageComm.exchange, executor._Stage.backward = logged_exchange, logged_backward
    try:
        for settings, m in cases:
            res = {}
            for delay in (False, True):
                cfg = _gpt_cfg(dict(settings, delay_wgrad_compute=delay), m, pp=pp, dp=mesh.size("dp"))
                chunks = build_chunks(cfg, mesh)
                opt = build_optimizer(chunks, mesh, cfg)
                defer, compute = opt.defer_weight_grads, opt.compute_deferred_weight_grads
                opt.defer_weight_grads = lambda: (events.append(("defer",)), defer())[1]
                opt.compute_deferred_weight_grads = lambda: (events.append(("wgrad",)), compute())[1]
                events.clear()
                opt.zero_grad()
                run_schedule(chunks, mesh, _gpt_batches(cfg, m, seed=mesh.coord("dp")),
                             schedule=cfg.parallel.pipeline_schedule, num_micro_batches=m,
                             tensor_shape=p2p_tensor_shape(cfg), grad_sync=opt, delay_wgrad=delay)
                opt.finish_grad_sync()
                res[delay] = (opt.reducer.storage.grads.clone(), list(events))
            out.append({"grads": (res[False][0], res[True][0]), "events": res[True][1],
                        "plain_events": res[False][1], "stage": mesh.coord("pp")})
    finally:
        executor.StageComm.exchange, executor._Stage.backward = exchange, backward
    return out


@pytest.mark.parametrize("pp,dp,cases", [
    (2, 1, [(dict(GPT, untie_embeddings_and_output_weights=True), 4),
            (dict(LLAMA, num_layers_per_virtual_pipeline_stage=1), 4)]),
    (2, 2, [(dict(GPT, zero_stage=1), 3), (dict(GPT, zero_stage=3), 2)]),
])
def test_delayed_weight_gradients_follow_the_send_and_change_no_bit(pp, dp, cases):
    results = run_ranks(_delay_worker, pp * dp, pp, cases)
    for rank, res in enumerate(results):
        for k, (settings, m) in enumerate(cases):
            got = res[k]
            plain, delayed = got["grads"]
            assert plain.numel() > 0 and torch.equal(plain, delayed), (rank, settings)  # same products, order
            assert not any(e[0] in ("defer", "wgrad") for e in got["plain_events"])
            events, last_bwd, queued = got["events"], None, False
            sent_since = set()
            for e in events:
                if e[0] == "bwd":
                    assert not queued, (rank, e)  # computed before the next backward
                    last_bwd = e[1:]
                elif e[0] == "defer":
                    queued, sent_since = True, set()
                elif e[0] == "send":
                    sent_since.add(e[1:])
                elif e[0] == "wgrad" and queued:
                    queued = False
                    interleaved = settings.get("num_layers_per_virtual_pipeline_stage")
                    assert interleaved or last_bwd in sent_since, (rank, e, events)  # 1F1B: after the send
            assert not queued
            # deferred exactly where a backward has an input gradient to send: every backward of
            # the second stage, and of the first stage's later chunk when interleaved
            vp = 2 if settings.get("num_layers_per_virtual_pipeline_stage") else 1
            deferring = m * vp if got["stage"] == 1 else m * (vp - 1)
            assert sum(e[0] == "defer" for e in events) == deferring, (rank, settings)
