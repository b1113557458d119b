"""Context parallelism wired into the GPT model and the trainer, against the one-process oracle.

- The model (every gradient): CP 2 and CP 4 (ring, p2p) and CP 2 Ulysses (a2a), alone and with
  TP 2 + sequence parallelism, GPT-2 style (learned positions, tied embedding), LLaMA style (RoPE,
  GQA, SwiGLU) and today's dense models (tests/test_model.py's DENSE: Gemma 2's alternating windows
  and soft-caps, Qwen3's window on every layer with q/k norms and a layer without RoPE, OLMo 2's
  norms): the whole-sequence logits, the per-token loss and every parameter's gradient.
- The trainer (loss, gradient norm and eval loss of every step): CP 2 x TP 2 (SP) x PP 2 with ZeRO-3,
  GQA, RoPE and selective recomputation on 8 ranks; CP 2 x DP 2 with the interleaved schedule.
- A checkpoint saved at CP 4 resumes at CP 1 and one saved at CP 1 resumes at CP 4, both following
  the uninterrupted one-process run.
- Refusals: a sequence CP cannot split, an unknown --cp-comm-type, Ulysses with heads CP does not
  divide.

Tolerances are those of the other layouts (tolerance.py): the model is fp32, the ring merges
partial softmaxes with the log-sum-exp rule, which reorders the sums of one forward + backward
(C_FWD / C_FWD_BWD U32 of the largest entry); training runs under R_TRAIN. Checked by hand that
these tests fail when the math is broken: positions of the contiguous instead of the load-balanced
split (RoPE and learned) and the loss gather's backward without the factor CP each fail the model
test; stage 1's gradient reduce-scatter over dp instead of dp x cp fails the interleaved trainer test.
"""
import pytest
import torch
import torch.distributed as dist

from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from megazero.mesh import ParallelMesh
from models import build_model, full_state_dict
from tolerance import C_FWD, C_FWD_BWD, R_TRAIN, fp32_bound
from test_model import ALL, ALL_PARAMS, STYLES, batch, step, sum_sequence_parallel_grads


def make_cfg(style, cp=1, tp=1, sp=False, comm="p2p"):
    settings = dict(ALL[style], tensor_model_parallel_size=tp, context_parallel_size=cp,
                    cp_comm_type=comm, sequence_parallel=sp, mock_data=True, seed=7)
    return validate(config_from_dict(settings), tp * cp)


def _rank_run(style, cp, tp, sp, comm):
    cfg = make_cfg(style, cp, tp, sp, comm)
    mesh = ParallelMesh.build(tp=tp, cp=cp)
    model = build_model(cfg, mesh)
    logits, loss = step(model, *batch(cfg))
    sum_sequence_parallel_grads(model)
    for p in model.parameters():  # what the optimizer's dp x cp average does (dp = 1)
        dist.all_reduce(p.grad, group=mesh.group("cp"))
        p.grad.div_(cp)
    grads = full_state_dict(model, grads=True)
    return dict(logits=logits, loss=loss, grads=grads if mesh.coord("tp") == 0 else None)


@pytest.fixture(scope="module")
def oracle():
    out = {}
    for style in ALL:
        model = build_model(make_cfg(style))
        logits, loss = step(model, *batch(model.cfg))
        out[style] = dict(logits=logits, loss=loss, grads=full_state_dict(model, grads=True))
    return out


@pytest.mark.parametrize("style", ALL_PARAMS)
@pytest.mark.parametrize("cp,tp,sp,comm", [(2, 1, False, "p2p"), (4, 1, False, "p2p"), (2, 1, False, "a2a"),
                                           (2, 2, True, "p2p")])
def test_context_parallel_model_matches_one_process(oracle, style, cp, tp, sp, comm):
    ref = oracle[style]
    res = run_ranks(_rank_run, cp * tp, style, cp, tp, sp, comm)
    for r in res:  # every rank: the whole sequence's logits and per-token loss
        torch.testing.assert_close(r["logits"], ref["logits"], **fp32_bound(ref["logits"], C_FWD))
        torch.testing.assert_close(r["loss"], ref["loss"], **fp32_bound(ref["loss"], C_FWD))
    for r in res:
        if r["grads"] is None:
            continue
        assert r["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, **fp32_bound(g, C_FWD_BWD), msg=name)


# ---- the trainer ---------------------------------------------------------------------------------
LLAMA = dict(num_query_groups=2, ffn_hidden_size=64, position_embedding_type="rope", normalization="RMSNorm",
             activation="swiglu", add_bias_linear=False)
TRAIN_LAYOUTS = {  # name: (world, model extras shared with the oracle, layout changes)
    "cp2-tp2-sp-pp2-zero3-gqa-rope-selective": (
        8, LLAMA, dict(context_parallel_size=2, tp=2, pp=2, zero=3, sequence_parallel=True,
                       recompute_granularity="selective")),
    "cp2-dp2-pp2-interleaved-zero1": (
        8, {}, dict(context_parallel_size=2, pp=2, zero=1, num_layers_per_virtual_pipeline_stage=1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAIN_LAYOUTS))
def test_context_parallel_training_matches_one_process(name):
    from test_checkpoint import _cfg, _run
    world, model, changes = TRAIN_LAYOUTS[name]
    ref = _run(_cfg(eval_interval=2, eval_iters=1, **model))
    got = _run(_cfg(eval_interval=2, eval_iters=1, **model, **changes), world)
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [m[key] for m in ref if key in m], [m[key] for m in got if key in m]
        assert len(a) == len(b) >= 2 and b == pytest.approx(a, rel=R_TRAIN), key


@pytest.mark.slow
def test_resume_between_cp4_and_cp1(tmp_path):
    from test_checkpoint import K, N, _cfg, _losses, _run
    ref = _run(_cfg(**LLAMA))
    cp4, cp1 = str(tmp_path / "cp4"), str(tmp_path / "cp1")
    first = _run(_cfg(K, save=cp4, context_parallel_size=4, zero=1, **LLAMA), 4)
    second = _run(_cfg(load=cp4, **LLAMA))  # saved at CP 4, resumed in one process
    assert [m["iteration"] for m in second] == list(range(K + 1, N + 1))
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=R_TRAIN)
    first = _run(_cfg(K, save=cp1, **LLAMA))
    # saved at CP 1, resumed at CP 4
    second = _run(_cfg(load=cp1, context_parallel_size=4, zero=2, **LLAMA), 4)
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=R_TRAIN)
    assert [m["grad_norm"] for m in second] == pytest.approx([m["grad_norm"] for m in ref[K:]], rel=R_TRAIN)


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,needle", [
    (dict(seq_length=18, context_parallel_size=2),
     "--seq-length 18 cannot be split for --context-parallel-size 2"),
    (dict(context_parallel_size=2, cp_comm_type="all_gather"),
     "--cp-comm-type 'all_gather' is not implemented"),
    (dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=2, hidden_size=32),
     "--cp-comm-type a2a splits the 2 attention heads"),
    (dict(context_parallel_size=2, attention_dropout=0.1),
     "--attention-dropout 0.1 with --context-parallel-size"),
    (dict(context_parallel_size=3),
     "not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 3"),
    (dict(context_parallel_size=2, rank_order="tp-dp-pp"), "does not name axis 'cp', whose size is 2"),
])
def test_context_parallel_refusals(over, needle):
    settings = dict(STYLES["gpt2"], mock_data=True)
    settings.update(over)
    with pytest.raises(ConfigError, match=needle):
        validate(config_from_dict(settings), 8)


def test_startup_line_shows_cp_and_the_chunk_split():
    from megazero.training.summary import context_parallel_line
    settings = dict(STYLES["gpt2"], mock_data=True)
    assert context_parallel_line(validate(config_from_dict(settings), 1)) is None
    line = context_parallel_line(validate(config_from_dict(dict(settings, context_parallel_size=4)), 4))
    assert line == ("context parallel: CP 4 | --seq-length 16 in 8 chunks of 2 tokens; CP rank i holds "
                    "chunks i and 7-i (4 tokens per rank) | ring attention (p2p)")


@pytest.mark.slow
def test_half_precision_under_cp2_follows_fp32():
    """bf16 and fp16 at CP 2 follow the one-process fp32 curve within the documented half-precision
    tolerances of test_mixed_precision.py (ring attention computes in fp32 from half inputs)."""
    from test_mixed_precision import TOL, _tiny
    from test_training import _train_history
    fp32 = [m["loss"] for m in _train_history(_tiny())]
    for dtype, extra in (("bf16", {}), ("fp16", {"initial_loss_scale": 2.0 ** 12})):
        ranks = run_ranks(_train_history, 2, _tiny(context_parallel_size=2, **{dtype: True}, **extra))
        curve = [m["loss"] for m in ranks[0]]
        assert all(m["skipped"] == 0 for m in ranks[0])
        diffs = [abs(a - b) for a, b in zip(curve, fp32)]
        assert 0 < max(diffs) < TOL[dtype], (dtype, diffs)
