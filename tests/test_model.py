"""The GPT model at every TP layout (with and without sequence parallelism), pipeline chunks and
recomputation, each checked against the one-process model."""
import pytest
import torch
import torch.distributed as dist

from megazero.config import ConfigError, config_from_dict, validate
from megazero.mesh import ParallelMesh
from models import PRESETS, build_chunks, build_model, full_state_dict, get_preset
from tolerance import C_FWD, C_FWD_BWD, fp32_bound

# The model runs in fp32 only (norms, RoPE and the cross-entropy upcast to fp32 whatever the
# parameter dtype), so layouts are compared with the scaled fp32 bounds of tolerance.py:
# logits and losses C_FWD * U32 * max|ref|, gradients C_FWD_BWD * U32 * max|grad| per tensor.
# Observed at TP 2/4 with and without sequence parallelism: logits/losses <= 3 U32 * max,
# gradients <= 15 U32 * max (llama input_norm.weight).
STYLES = {  # without dropout unless a test asks for it
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                 make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0),
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                  seq_length=16, vocab_size=100, make_vocab_size_divisible_by=8,
                  position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  untie_embeddings_and_output_weights=True),
}
# today's dense models, by their pieces: Gemma 2 (sandwich norms, GeGLU, embedding scale, soft-caps,
# alternating windows, its own score scale, head_dim apart from hidden / heads), Qwen3 (per-head q/k
# norms, a window on every layer, a layer without RoPE), OLMo 2 (norms after the sublayers, q/k norms
# over all heads: a sum of squares over the TP ranks); windows of 6 in 16-token sequences
DENSE = {
    "gemma2": dict(STYLES["llama"], activation="geglu", norm_position="sandwich", scale_embedding=True,
                   kv_channels=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, softmax_scale=0.3,
                   window_size=[5, 0], window_attn_skip_freq=2, untie_embeddings_and_output_weights=False),
    "qwen3": dict(STYLES["llama"], qk_layernorm=True, window_size=[5, 0], no_rope_freq=2),
    "olmo2": dict(STYLES["llama"], qk_layernorm=True, qk_layernorm_scope="all", norm_position="post"),
}
ALL = {**STYLES, **DENSE}  # the layout tests run over all of them, the dense models in the slow tier
ALL_PARAMS = list(STYLES) + [pytest.param(style, marks=pytest.mark.slow) for style in DENSE]


def make_cfg(style, tp=1, pp=1, sp=False, world=None, **over):
    settings = dict(ALL[style], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    sequence_parallel=sp, mock_data=True, seed=7, **over)
    return validate(config_from_dict(settings), world or tp * pp)


def batch(cfg, b=2):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def step(model, ids, labels):
    """Logits, mean loss and backward (the executor's loss, one micro-batch, full mask)."""
    logits = model(ids)
    loss = model(ids, labels)
    assert logits.shape == (*ids.shape, model.cfg.model.vocab_size) and loss.shape == ids.shape
    assert loss.dtype == torch.float32
    loss.mean().backward()
    return logits.detach(), loss.detach()


def sum_sequence_parallel_grads(model):
    """What the optimizer's finish_grad_sync does for sequence-parallel parameters."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=model.mesh.group("tp"))


def _tp_rank_run(style, tp, sp):
    cfg = make_cfg(style, tp, sp=sp)
    mesh = ParallelMesh.build(tp=tp)
    model = build_model(cfg, mesh)
    weights = full_state_dict(model)
    logits, loss = step(model, *batch(cfg))
    sum_sequence_parallel_grads(model)
    grads = full_state_dict(model, grads=True)
    if mesh.coord("tp") != 0:
        return dict(loss=loss)
    return dict(weights=weights, logits=logits, loss=loss, grads=grads)


@pytest.fixture(scope="module")
def oracle():
    """One-process reference per style: initial weights, logits, loss and gradients."""
    out = {}
    for style in ALL:
        cfg = make_cfg(style)
        model = build_model(cfg)
        weights = full_state_dict(model)
        logits, loss = step(model, *batch(cfg))
        out[style] = dict(weights=weights, logits=logits, loss=loss, grads=full_state_dict(model, grads=True))
    return out


@pytest.mark.parametrize("style", ALL_PARAMS)
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_matches_one_process(oracle, style, tp, sp):
    from megazero.process.local_ranks import run_ranks
    res = run_ranks(_tp_rank_run, tp, style, tp, sp)
    ref, got = oracle[style], res[0]
    assert got["weights"].keys() == ref["weights"].keys()
    for name, w in ref["weights"].items():  # same initial weights at every layout
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(got["logits"], ref["logits"], **fp32_bound(ref["logits"], C_FWD))
    for r in res:
        torch.testing.assert_close(r["loss"], ref["loss"], **fp32_bound(ref["loss"], C_FWD))
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, **fp32_bound(g, C_FWD_BWD), msg=name)


def test_parameter_attributes():
    cfg = make_cfg("gpt2")
    model = build_model(cfg)
    p = dict(model.named_parameters())
    assert p["decoder.0.attention.qkv.weight"].partition_dim == 0
    assert p["decoder.0.attention.proj.weight"].partition_dim == 1
    assert p["word_embeddings.weight"].tensor_model_parallel and p["word_embeddings.weight"].vocab_parallel
    assert not getattr(p["decoder.0.attention.proj.bias"], "tensor_model_parallel", False)
    assert "output_layer.weight" not in p  # tied, one chunk: the head uses the embedding itself
    assert p["word_embeddings.weight"][cfg.model.vocab_size:].abs().sum() == 0  # padded rows are zero
    assert model.layers == range(2) and model.pre_process and model.post_process


def _pipeline_rank(style):
    """pp = 2 by hand: stage 0 sends hidden states, stage 1 returns the loss, grads flow back."""
    cfg = make_cfg(style, pp=2)
    mesh = ParallelMesh.build(pp=2)
    (chunk,) = build_chunks(cfg, mesh)
    ids, labels = batch(cfg)
    shape = (cfg.model.seq_length, ids.shape[0], cfg.model.hidden_size)
    if mesh.is_first_stage:
        h = chunk(ids)
        dist.send(h.detach(), 1)
        g = torch.empty(shape)
        dist.recv(g, 1)
        h.backward(g)
        loss = None
    else:
        h = torch.empty(shape)
        dist.recv(h, 0)
        h.requires_grad_()
        loss = chunk(h, labels)
        loss.mean().backward()
        dist.send(h.grad, 0)
    attrs = {n: (getattr(p, "shared_embedding", False), getattr(p, "tied_copy", False))
             for n, p in chunk.named_parameters()}
    return dict(loss=loss, grads=full_state_dict(chunk, grads=True), weights=full_state_dict(chunk),
                attrs=attrs, layers=chunk.layers)


@pytest.mark.parametrize("style", ALL_PARAMS)
def test_pipeline_chunks_and_tied_embedding(oracle, style):
    from megazero.process.local_ranks import run_ranks
    first, last = run_ranks(_pipeline_rank, 2, style)
    ref = oracle[style]
    assert first["layers"] == range(0, 1) and last["layers"] == range(1, 2)
    torch.testing.assert_close(last["loss"], ref["loss"], **fp32_bound(ref["loss"], C_FWD))
    grads = {**first["grads"], **last["grads"]}
    tied = not ALL[style].get("untie_embeddings_and_output_weights", False)
    if tied:  # the last stage's copy starts equal to the embedding; their grads sum to the tied grad
        torch.testing.assert_close(last["weights"]["output_layer.weight"],
                                   first["weights"]["word_embeddings.weight"], rtol=0, atol=0)
        assert first["attrs"]["word_embeddings.weight"] == (True, False)
        assert last["attrs"]["output_layer.weight"] == (True, True)
        grads["word_embeddings.weight"] = grads["word_embeddings.weight"] + grads.pop("output_layer.weight")
    else:
        assert not any(a for pair in first["attrs"].values() for a in pair)
        assert not any(a for pair in last["attrs"].values() for a in pair)
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(grads[name], g, **fp32_bound(g, C_FWD_BWD), msg=name)


RECOMPUTE = [dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
             dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
             dict(recompute_granularity="selective")]


RECOMPUTE_CALLS = [0, 2, 3, 1, 3]  # recomputed segments per forward of 3 layers, per mode above


def _recompute_runs(style, tp, sp):
    import models.gpt
    import models.layers
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else None
    calls, real = [], models.gpt.recompute

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    models.gpt.recompute = models.layers.recompute = counting
    out = []
    try:
        for over, expected in zip([{}] + RECOMPUTE, RECOMPUTE_CALLS):
            cfg = make_cfg(style, tp, sp=sp, hidden_dropout=0.2, attention_dropout=0.2, num_layers=3, **over)
            model = build_model(cfg, mesh)  # reseeds the default generator: the same dropout masks
            ids, labels = batch(cfg)
            calls.clear()
            loss = model(ids, labels)
            assert len(calls) == expected, (over, len(calls))
            loss.mean().backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    finally:
        models.gpt.recompute = models.layers.recompute = real
    model.eval()
    with torch.no_grad():
        eval_loss = model(ids, labels)
    return out, eval_loss


def _check_recompute(out, eval_loss):
    (ref_loss, ref_grads), rest = out[0], out[1:]
    assert not torch.allclose(ref_loss, eval_loss)  # dropout is really on
    for loss, grads in rest:
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        # the same operations on the same data: bit-exact on this machine; the gradients keep a
        # one-rounding allowance (1e-7 ~ U32 * max|grad|, grads <= 0.4) for BLAS kernels that may
        # pick another code path for the recomputed tensors' memory alignment
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("style", list(STYLES))
def test_recompute_modes_equal_no_recompute_with_dropout(style):
    _check_recompute(*_recompute_runs(style, 1, False))


def test_recompute_with_tensor_and_sequence_parallel():
    from megazero.process.local_ranks import run_ranks
    for out, eval_loss in run_ranks(_recompute_runs, 2, "llama", 2, True):
        _check_recompute(out, eval_loss)


def test_bf16_forward_is_close_to_fp32():
    cfg = make_cfg("llama")
    model = build_model(cfg)
    ids, labels = batch(cfg)
    ref = model(ids, labels).detach()
    model.to(torch.bfloat16)
    loss = model(ids, labels)
    assert loss.dtype == torch.float32
    loss.mean().backward()
    # bf16 keeps 8 significant bits: unit roundoff 2^-8 = 3.9e-3. The per-token loss is computed in
    # fp32 from bf16 logits, so it moves by a fraction of a bf16 rounding of the logits; allow one
    # unit roundoff relative to the loss (0.019 at loss 4.8). Observed 2.9e-4 relative (1.3e-3).
    torch.testing.assert_close(loss.detach(), ref, rtol=2.0 ** -8, atol=0)


@pytest.mark.parametrize("over,flag", [
    (dict(num_attention_heads=6), "--num-attention-heads 6"),
    (dict(num_attention_heads=8, num_query_groups=2), "--num-query-groups 2")])
def test_heads_or_groups_not_divisible_by_tp(over, flag):
    with pytest.raises(ConfigError, match=flag):
        make_cfg("llama", tp=4, **{**over, "hidden_size": 48})


def test_presets():
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'.*gpt2-small.*tiny"):
        get_preset("gpt5")
    with pytest.raises(ConfigError, match="gpt2-small"):
        config_from_dict({"model_preset": "nope", "mock_data": True}, PRESETS)
    for name in ("tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama2-7b", "llama3-8b",
                 "tiny-llama"):
        cfg = validate(config_from_dict({"model_preset": name, "mock_data": True}, PRESETS), 1)
        assert cfg.model.num_layers == PRESETS[name]["num_layers"]
    small = validate(config_from_dict({"model_preset": "gpt2-small", "mock_data": True}, PRESETS), 1).model
    assert (small.hidden_size, small.num_attention_heads, small.ffn_hidden_size) == (768, 12, 3072)
    l3 = validate(config_from_dict({"model_preset": "llama3-8b", "mock_data": True}, PRESETS), 1).model
    assert (l3.num_query_groups, l3.kv_channels, l3.rotary_base) == (8, 128, 500000.0)
    tiny = validate(config_from_dict({"model_preset": "tiny", "mock_data": True, "seq_length": 8}, PRESETS),
                    1)
    assert build_model(tiny)(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 512)
