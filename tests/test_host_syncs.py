"""Host syncs of one training iteration: a small, fixed number, whatever the buckets, micro-batches
and layers (MoE models: one more per MoE layer and forward, and one for the MoE metrics).

Every way a tensor's value reaches Python (``.item()``, ``float()``/``int()``/``bool()``/
``operator.index`` of a tensor, ``.tolist()``), every blocking copy between devices (``.to()``,
``.cpu()``, ``.copy_()`` without ``non_blocking``) and every op whose output size depends on values
(``nonzero``, ``bincount``, ...) is counted by patching ``torch`` while the trainer runs; the
iteration counted is the whole loop body of iteration 2 (step, logging, checks, the stop agreement),
from one ``RunGuard.begin`` to the next.  On a CPU the copies are never between devices (the counter
would see them on an accelerator); the value reads are the syncs that stall a GPU's launch queue.
What remains, per docs/internals.md ("What a step waits for"): the gradient norm and overflow flag
(one read: the skip decision and the logged norm), the loss (one read after its all-reduce), when a
stop condition is configured over several ranks, the stop agreement, and with MoE layers each
layer's token counts (one read per forward) and the step's MoE metrics (one read).
"""
import collections
import contextlib
import traceback

import pytest
import torch

from megazero.config import config_from_dict
from megazero.process.local_ranks import run_ranks

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")
# ops whose output's size depends on the values: on a GPU each waits for them (repeat_interleave only
# with tensor repeats and no output_size)
SIZED_BY_VALUES = ("nonzero", "bincount", "masked_select", "unique", "repeat_interleave")


def _sized_by_values(name, args, kwargs) -> bool:
    if name != "repeat_interleave":
        return True
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None


class SyncCounter:
    """Counts host syncs while :meth:`patched` is active and :attr:`on` is True; ``events`` holds
    ``(kind, "file:line")`` of each (the first frame in megazero, else the caller)."""

    def __init__(self):
        self.on = False
        self.events = []

    def _record(self, kind):
        if not self.on:
            return
        frames = traceback.extract_stack()[:-2]
        ours = [f for f in frames if "/megazero/" in f.filename] or frames
        self.events.append((kind, f"{ours[-1].filename.split('/megazero/')[-1]}:{ours[-1].lineno}"))

    @contextlib.contextmanager
    def patched(self):
        originals = {name: getattr(torch.Tensor, name) for name in READS + ("to", "cpu", "copy_")}
        sized = {(owner, name): getattr(owner, name) for owner in (torch, torch.Tensor)
                 for name in SIZED_BY_VALUES if hasattr(owner, name)}

        def sized_op(name, fn):
            def counted(*args, **kwargs):
                if _sized_by_values(name, args, kwargs):
                    self._record(name)
                return fn(*args, **kwargs)
            return counted

        def read(name):
            def counted(t, *args, **kwargs):
                self._record(name)
                return originals[name](t, *args, **kwargs)
            return counted

        def to(t, *args, **kwargs):
            out = originals["to"](t, *args, **kwargs)
            if out.device != t.device and not kwargs.get("non_blocking", False) and not (
                    len(args) > 1 and isinstance(args[1], bool) and args[1]):
                self._record("blocking .to()")
            return out

        def cpu(t, *args, **kwargs):
            if t.device.type != "cpu":
                self._record("blocking .cpu()")
            return originals["cpu"](t, *args, **kwargs)

        def copy_(t, src, non_blocking=False):
            if src.device != t.device and not non_blocking:
                self._record("blocking .copy_()")
            return originals["copy_"](t, src, non_blocking)

        for name in READS:
            setattr(torch.Tensor, name, read(name))
        torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_ = to, cpu, copy_
        for (owner, name), fn in sized.items():
            setattr(owner, name, sized_op(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            for (owner, name), fn in sized.items():
                setattr(owner, name, fn)


def _settings(grown: bool, **extra):
    """A tiny GPT; ``grown``: three times the layers, four times the micro-batches and buckets of a
    few hundred elements (about one per parameter) instead of one bucket."""
    base = dict(mock_data=True, num_layers=3 if grown else 1, hidden_size=16, num_attention_heads=2,
                seq_length=8, vocab_size=64, micro_batch_size=1, global_batch_size=8 if grown else 2,
                train_iters=3, eval_interval=0, optimizer="adam", lr=1e-3, log_interval=1,
                hidden_dropout=0.0, attention_dropout=0.0, ddp_bucket_size=300 if grown else None)
    return dict(base, **extra)


def _count_iteration(settings):
    """``(sync events of iteration 2, buckets, micro-batches)`` on this rank."""
    import models
    from megazero.resilience import RunGuard
    from megazero.training import train
    from megazero.zero.optimizer import ZeroOptimizer
    counter, seen = SyncCounter(), {}
    begin, zero_grad = RunGuard.begin, ZeroOptimizer.zero_grad

    def counting_begin(guard, iteration):
        counter.on = iteration == 2
        return begin(guard, iteration)

    def recording_zero_grad(opt, *args, **kwargs):
        seen["buckets"] = len(opt.buckets)
        return zero_grad(opt, *args, **kwargs)

    RunGuard.begin, ZeroOptimizer.zero_grad = counting_begin, recording_zero_grad
    try:
        with counter.patched():
            train(config_from_dict(settings), models.build_chunks, stream=None)
    finally:
        RunGuard.begin, ZeroOptimizer.zero_grad = begin, zero_grad
    return counter.events, seen["buckets"]


def _host_only(events):
    """``(events, n)``: the events less the ``n`` reads inside :func:`megazero.zero.comm.reduce_rows`,
    which runs only where the gradients live on the host (the reducer gives the lookup a sparse
    gradient only there), so no accelerator ever waits on them."""
    import inspect

    from megazero.zero import comm
    lines, first = inspect.getsourcelines(comm.reduce_rows)
    inside = {f"zero/comm.py:{n}" for n in range(first, first + len(lines))}
    return [e for e in events if e[1] not in inside], sum(e[1] in inside for e in events)


def _kinds(events):
    return collections.Counter(kind for kind, _ in events)


def test_the_counter_sees_each_kind_of_read():
    counter = SyncCounter()
    t = torch.tensor([1.5, 2.0])
    with counter.patched():
        counter.on = True
        t[0].item(), float(t[0]), int(t[1]), bool(t[1]), t.tolist(), [0, 1, 2][t[1].long()]
        t.to(torch.float64)  # no device change: no copy
    assert _kinds(counter.events) == {"item": 1, "__float__": 1, "__int__": 1, "__bool__": 1, "tolist": 1,
                                      "__index__": 1}
    assert float(t[0]) == 1.5 and torch.Tensor.item is not SyncCounter  # restored


def test_the_counter_sees_ops_sized_by_values():
    counter = SyncCounter()
    m, r = torch.tensor([True, False, True]), torch.tensor([1, 0, 2])
    with counter.patched():
        counter.on = True
        m.nonzero(), torch.nonzero(m), torch.bincount(r), torch.masked_select(r, m), torch.unique(r)
        torch.repeat_interleave(r, r), r.repeat_interleave(r)
        torch.repeat_interleave(r, r, output_size=3), r.repeat_interleave(2)  # sizes known: no wait
    assert _kinds(counter.events) == {"nonzero": 2, "bincount": 1, "masked_select": 1, "unique": 1,
                                      "repeat_interleave": 2}
    assert torch.nonzero is not None and m.nonzero().shape == (2, 1)


def test_one_process_step_syncs_are_fixed(capsys):
    """Two reads, the gradient norm with the overflow flag and the loss, with 1 or ~30 buckets, 2 or
    8 micro-batches, 1 or 3 layers."""
    small, small_buckets = _count_iteration(_settings(False))
    big, big_buckets = _count_iteration(_settings(True))
    assert small_buckets == 1 and big_buckets >= 10
    assert len(small) == len(big) == 2, (small, big)
    assert sorted(where for _, where in small) == sorted(where for _, where in big)
    assert _kinds(big) == {"tolist": 1, "item": 1}


def _ranks(settings_list):
    return [_count_iteration(s) for s in settings_list]  # [(events, buckets)] on this rank


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2-zero2", "pp2", "dp2-zero3-stop-agreement"])
def test_two_rank_step_syncs_are_fixed(layout):
    """Every rank syncs as often under DP 2 (ZeRO-2/3) or PP 2, small or grown; a configured stop
    condition (here --exit-duration-in-mins) adds its one agreement read."""
    extra = {"dp2-zero2": dict(zero_stage=2), "pp2": dict(pipeline_model_parallel_size=2),
             "dp2-zero3-stop-agreement": dict(zero_stage=3, exit_duration_in_mins=1000.0)}[layout]
    layers = (2, 4) if layout == "pp2" else (1, 3)  # every stage needs a layer
    results = run_ranks(_ranks, 2, [_settings(False, **extra, num_layers=layers[0]),
                                    _settings(True, **extra, num_layers=layers[1])])
    expected = 3 if "stop" in layout else 2
    for (small, small_buckets), (big, big_buckets) in results:
        assert big_buckets > small_buckets
        small, small_rows = _host_only(small)
        big, big_rows = _host_only(big)
        # ZeRO-2/3 over 2 ranks, the tied embedding alone in its bucket (grown): its lookup's rows
        # are reduced on the host, one count read per micro-batch (4 a rank), never on an accelerator
        assert small_rows == 0 and big_rows == (4 if "dp2" in layout else 0), (small_rows, big_rows)
        assert len(small) == len(big) == expected, (small, big)
        assert sorted(w for _, w in small) == sorted(w for _, w in big)


# ---- mixture of experts --------------------------------------------------------------------------
def _moe(grown: bool, bias: bool = False, **extra):
    """The tiny GPT with every layer an MoE layer (4 experts, top 2, auxiliary and z losses)."""
    return _settings(grown, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=1,
                     add_bias_linear=bias, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, **extra)


def _check_moe(events, layers: int, micro_batches: int):
    """The dense step's two reads, the MoE metrics' one and one per MoE layer and forward, all of
    those at one line of the dispatcher (its token counts)."""
    where = collections.Counter(w for _, w in events)
    per_layer = [n for w, n in where.items() if w.startswith("moe/dispatcher.py")]
    assert len(events) == 3 + layers * micro_batches, events
    assert per_layer == [layers * micro_batches], where
    assert _kinds(events) == {"tolist": 2 + layers * micro_batches, "item": 1}, events


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_one_process_moe_step_syncs(kind):
    """One host read per MoE layer and forward (the token counts), one for the step's MoE metrics:
    5 with 1 layer and 2 micro-batches, 27 with 3 layers and 8 micro-batches."""
    small, _ = _count_iteration(_moe(False, moe_token_dispatcher_type=kind))
    big, _ = _count_iteration(_moe(True, moe_token_dispatcher_type=kind))
    _check_moe(small, 1, 2)
    _check_moe(big, 3, 8)


def test_expert_biases_add_no_host_sync():
    """Experts with biases: each row's expert index is expanded with its output size given (the counts
    are on the host already), so the step reads no more than without them."""
    small, _ = _count_iteration(_moe(False, bias=True, moe_token_dispatcher_type="alltoall"))
    _check_moe(small, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2-alltoall", "etp2-alltoall"])
def test_two_rank_moe_step_syncs(layout):
    """EP 2 (the counts' all-to-all) or expert TP 2 (their all-gather) on 2 ranks: still one read per
    MoE layer and forward on every rank (1 or 4 micro-batches a rank)."""
    extra = dict(expert_model_parallel_size=2) if layout.startswith("ep2") else \
        dict(expert_tensor_parallel_size=2)
    results = run_ranks(_ranks, 2, [_moe(False, moe_token_dispatcher_type="alltoall", **extra),
                                    _moe(True, moe_token_dispatcher_type="alltoall", **extra)])
    for (small, _), (big, _) in results:
        _check_moe(small, 1, 1)
        _check_moe(big, 3, 4)


def test_document_masks_add_no_host_sync():
    """--reset-attention-mask, --reset-position-ids and --eod-mask-loss (packed documents): the masks and
    positions are built on the device from the tokens, so the step still reads two values."""
    plain, _ = _count_iteration(_settings(False))
    docs = dict(tokenizer_type="NullTokenizer", reset_attention_mask=True, reset_position_ids=True,
                eod_mask_loss=True, position_embedding_type="rope")
    packed, _ = _count_iteration(_settings(True, **docs))
    assert len(packed) == len(plain) == 2, (plain, packed)
    assert sorted(w for _, w in packed) == sorted(w for _, w in plain)
