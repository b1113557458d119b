"""Mixture-of-experts training against the one-process oracle: losses, gradient norms, the
auxiliary and z losses, tokens per expert and dropped tokens of a tiny MoE GPT (8 experts, top-2,
a shared expert with its gate, one dense layer in two) under expert parallelism composed with TP,
SP, PP, CP, ZeRO 0-3, recomputation, capacity, checkpoints at another EP size, bf16 and NVMe offload.

Tolerances (tests/tolerance.py): fp32 SGD runs under another layout, R_TRAIN (1e-5 relative) for
the losses and gradient norms, observed <= 2e-7; the token counts (tokens per expert, dropped
tokens) are integers and must be equal.  Each run is a few seconds of 4 or 8 forked ranks: slow tier."""
import json

import pytest

from megazero.config import config_from_dict
from megazero.process.local_ranks import run_ranks
from tolerance import R_TRAIN, R_TRAIN_ADAM

LOSSES = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss")
COUNTS = ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max", "moe_dropped_tokens", "moe_imbalance")


def _cfg(iters=3, **extra):
    """The tiny MoE GPT on mock data; ``extra`` sets fields of any section by name."""
    settings = dict(mock_data=True, num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, global_batch_size=8, micro_batch_size=1, train_iters=iters,
                    lr_decay_iters=4,
                    optimizer="sgd", lr=0.1, sgd_momentum=0.0, log_interval=100, hidden_dropout=0.0,
                    attention_dropout=0.0, add_bias_linear=False, num_experts=8, moe_router_topk=2,
                    moe_layer_freq="([0]*1+[1]*1)*2", moe_ffn_hidden_size=24,
                    moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                    moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall")
    settings.update(extra)
    return config_from_dict(settings)


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _run(cfg, world):
    ranks = run_ranks(_train, world, cfg, timeout=300)
    for hist in ranks[1:]:  # every rank reports the same step
        assert [[m[k] for k in LOSSES + COUNTS] for m in hist] == [[m[k] for k in LOSSES + COUNTS]
                                                                   for m in ranks[0]]
    return ranks[0]


def _same(got, ref, rel=R_TRAIN):
    assert len(got) == len(ref) >= 2
    for key in LOSSES:
        assert [m[key] for m in got] == pytest.approx([m[key] for m in ref], rel=rel), key
    for key in COUNTS:
        assert [m[key] for m in got] == [m[key] for m in ref], key


@pytest.fixture(scope="module")
def one_process():
    return _train(_cfg())


@pytest.mark.slow
def test_ep2_tp2_pp2_zero3_matches_one_process(one_process):
    """EP 2 x TP 2 (sequence parallel, expert TP 2) x PP 2 with ZeRO-3 on 8 ranks (expert DP 1), the
    experts as one grouped product (--moe-grouped-gemm) against the one process's product per expert."""
    got = _run(_cfg(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
                    expert_model_parallel_size=2, zero_stage=3, moe_grouped_gemm=True), 8)
    _same(got, one_process)
    assert one_process[0]["moe_aux_loss"] > 0.9 and one_process[0]["moe_z_loss"] > 0  # the losses are on


@pytest.mark.slow
def test_ep4_dp2_zero1_matches_one_process(one_process):
    """EP 4 x expert DP 2 (dense DP 8) with ZeRO-1 on 8 ranks, the allgather dispatcher."""
    got = _run(_cfg(expert_model_parallel_size=4, zero_stage=1, moe_token_dispatcher_type="allgather"), 8)
    _same(got, one_process)


CAPACITY = {  # name: (settings of both runs, world, layout)
    # the micro-batch's tokens split over CP 2 x TP 2 (sequence parallel): decided in sequence order
    "probs-cp2-tp2-sp-ep2-zero2": (dict(moe_expert_capacity_factor=1.0), 4,
                                   dict(context_parallel_size=2, tensor_model_parallel_size=2,
                                        sequence_parallel=True, expert_model_parallel_size=2, zero_stage=2)),
    "position-padded-ep4-allgather": (dict(moe_expert_capacity_factor=0.8,
                                           moe_token_drop_policy="position",
                                           moe_pad_expert_input_to_capacity=True), 4,
                                      dict(expert_model_parallel_size=4,
                                           moe_token_dispatcher_type="allgather")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAPACITY))
def test_capacity_drops_the_same_tokens_as_one_process(name):
    """Capacity is per expert over the tokens of one micro-batch, whatever the split: the layouts drop
    the same token-expert pairs (the dropped counts, tokens per expert and losses equal)."""
    common, world, layout = CAPACITY[name]
    ref = _train(_cfg(**common))
    assert all(m["moe_dropped_tokens"] > 0 for m in ref)  # this capacity does drop
    _same(_run(_cfg(**common, **layout), world), ref)


COMPOSED = {  # name: (settings of both runs, layout on 4 ranks)
    # expert DP 2 (world 4 / EP 2) under ZeRO-3: expert buckets gathered and reduced over expert DP
    "cp2-full-recompute-ep2-zero3": (dict(), dict(context_parallel_size=2, expert_model_parallel_size=2,
                                                  recompute_granularity="full", zero_stage=3)),
    "seq-aux-expert-bias-etp2-ep2-zero3": (
        dict(moe_router_load_balancing_type="seq_aux_loss", moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05),
        dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2, zero_stage=3)),
    "gpipe-pp2-ep2-zero2": (dict(), dict(pipeline_model_parallel_size=2, pipeline_schedule="gpipe",
                                         expert_model_parallel_size=2, zero_stage=2)),
    "interleaved-pp2-tp2-etp1-ep2": (dict(), dict(pipeline_model_parallel_size=2,
                                                  tensor_model_parallel_size=2, sequence_parallel=True,
                                                  num_layers_per_virtual_pipeline_stage=1,
                                                  expert_model_parallel_size=2,
                                                  expert_tensor_parallel_size=1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_moe_composes_with_every_axis(name):
    common, layout = COMPOSED[name]
    _same(_run(_cfg(**common, **layout), 4), _train(_cfg(**common)))


@pytest.mark.slow
def test_checkpoint_saved_at_one_ep_size_loads_at_others(tmp_path):
    """Saved under EP 2 x expert TP 2, ZeRO-3 (Adam, the expert bias moving), resumed under EP 4 with
    ZeRO-1 and in one process: each equals the uninterrupted one-process run."""
    adam = dict(optimizer="adam", lr=3e-3, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05)
    ref = _train(_cfg(4, **adam))
    first = _run(_cfg(2, save=str(tmp_path), expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                      zero_stage=3, **adam), 4)
    names = json.load(open(tmp_path / "iter_0000002" / "metadata.json"))["params"]
    assert "decoder.1.mlp.experts.7.fc1_weight" in names and "decoder.1.mlp.experts.fc1_weight" not in names
    for world, layout in ((4, dict(expert_model_parallel_size=4, zero_stage=1)), (1, {})):
        second = _run(_cfg(4, load=str(tmp_path), **layout, **adam), world) if world > 1 else \
            _train(_cfg(4, load=str(tmp_path), **adam))
        assert [m["iteration"] for m in second] == [3, 4]
        _same(first + second, ref, rel=R_TRAIN_ADAM)


@pytest.mark.slow
def test_nvme_offload_and_metrics_files(tmp_path):
    """The optimizer state on NVMe under EP 2 changes nothing; the metrics file and TensorBoard get the
    routers' values of every iteration."""
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    metrics = tmp_path / "m.jsonl"
    (tmp_path / "swap").mkdir()
    got = _run(_cfg(expert_model_parallel_size=2, zero_stage=1, offload_optimizer_device="nvme",
                    nvme_path=str(tmp_path / "swap"), metrics_file=str(metrics),
                    tensorboard_dir=str(tmp_path / "tb")), 2)
    _same(got, _train(_cfg()))
    rows = [json.loads(line) for line in open(metrics)]
    for key in LOSSES[2:] + COUNTS:
        assert [r[key] for r in rows] == [m[key] for m in got], key
    acc = tb.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    for key in LOSSES[2:] + COUNTS:
        assert [e.value for e in acc.Scalars(key)] == pytest.approx([m[key] for m in got], rel=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_under_ep2_follows_one_process(dtype):
    """bf16 / fp16 (loss scaling: the aux losses' gradient is scaled with the loss's) under EP 2 x
    expert DP 2 with ZeRO-2 against one process in the same dtype: both are the fp32 computation
    plus half-precision rounding in other summation orders, so they differ by about the single run's
    own distance from fp32 (tests/test_mixed_precision.py's rule): at most three times it (Adam, 6
    steps, 2 layers)."""
    tiny = dict(optimizer="adam", lr=1e-2, lr_decay_style="constant", num_layers=2, moe_layer_freq="2",
                iters=6, clip_grad=1.0)
    half = {dtype: True, **({"initial_loss_scale": 2.0 ** 12} if dtype == "fp16" else {})}
    fp32 = [m["loss"] for m in _train(_cfg(**tiny))]
    single = _train(_cfg(**half, **tiny))
    rounding = max(abs(m["loss"] - b) for m, b in zip(single, fp32))
    assert rounding > 0 and not any(m["skipped"] for m in single)
    got = _run(_cfg(expert_model_parallel_size=2, zero_stage=2, **half, **tiny), 4)
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, single))
    print(dtype, "EP 2 vs single max |diff|", diff, "single vs fp32", rounding)
    assert diff <= 3 * rounding and [m["skipped"] for m in got] == [m["skipped"] for m in single]
