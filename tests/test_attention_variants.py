"""Attention and activation variants of gpt-oss, Llama 4, Gemma 3 and GLM-4.5 (docs/attention.md).

- Attention sinks (``--softmax-type learnable`` / ``off-by-one``) and chunked attention
  (``--attention-chunk-size``), with windows, soft-caps, packed documents and GQA, in every kernel: the
  blockwise kernel, SDPA (the sink as one more key), the eager kernel of generation, ring (p2p) and
  Ulysses (a2a) context parallelism; each against a float64 softmax written here (and that reference
  against transformers' gpt-oss attention), forward and gradients (the sink logits' included).
- The clamped SwiGLU of gpt-oss (``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7``)
  against transformers' gpt-oss experts, in float64.
- Llama 4's L2 q/k norm and attention temperature, Gemma 3's local RoPE base on windowed layers, partial
  rotary (``--rotary-percent``) against transformers' GLM-4.5 rotation.
- A model holding all of them at once: TP 2 with sequence parallelism, CP 2 (ring and Ulysses) and
  selective recomputation against one process; generation with the KV cache against the full forward.

Float64 comparisons allow 1e-10 relative to the largest entry (sums of <= 32 terms move by ~1e-15); the
fp32 model comparisons use tolerance.py's bounds.  Checked by hand that these fail when the math is
broken: the sink's sigmoid dropped from the ring kernel (forward), ``delta`` without ``dlse`` (sink and
q/k/v gradients), the chunk test of the tile loop removed (kernel and CP tests), Ulysses slicing the
sinks of rank 0 on every rank, the temperature from local instead of global positions (CP test), the
clamp of the linear part dropped (activation test).
"""
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.config import ConfigError, config_from_dict, parse_args, validate
from megazero.config.patterns import windowed_layers
from megazero.context_parallel import blockwise_attention, cp_positions, ring_attention
from megazero.context_parallel.blockwise import Tiles, Visibility, tile_pairs
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from megazero.tensor_parallel.activations import Activation
from models import build_model, full_state_dict
from models.attention_ops import causal_mask, eager_attention, l2_norm, sink_sdpa, temperature_scales
from models.layers import KVCache
from models.rope import RopeTables, apply_rope, rope_cos_sin, rope_tables
from tolerance import C_FWD, C_FWD_BWD, fp32_bound
from test_model import STYLES, batch, step, sum_sequence_parallel_grads


def reference(q, k, v, scale=None, window=None, chunk=None, softcap=None, sinks=None, docs=None,
              qpos=None, kpos=None):
    """softmax over explicit float64 scores (and one sink column per head), GQA by repetition."""
    b, h, s, d = q.shape
    n = h // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    scores = q @ k.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qp = torch.arange(s) if qpos is None else qpos
    kp = torch.arange(k.shape[2]) if kpos is None else kpos
    hidden = kp[None, :] > qp[:, None]
    if window is not None:
        hidden = hidden | (qp[:, None] - kp[None, :] > window)
    if chunk is not None:
        hidden = hidden | (qp[:, None] // chunk != kp[None, :] // chunk)
    hidden = hidden.expand(b, 1, s, k.shape[2])
    if docs is not None:
        hidden = hidden | (docs[:, None, :, None] != docs[:, None, None, :])
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, h, s, 1)], dim=-1)
        return scores.softmax(-1)[..., :-1] @ v
    return scores.softmax(-1) @ v


def _inputs(b=2, h=4, g=2, s=23, d=8, seed=0, sinks=True):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, g, g))
    sink = torch.randn(h, generator=gen, dtype=torch.float64) if sinks else None
    dout = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    return q, k, v, sink, dout


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def _close64(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-10 * float(want.abs().max()), msg=what)


def test_reference_sinks_equal_transformers_gpt_oss():
    """The float64 reference with sinks is transformers' gpt-oss eager attention."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    q, k, v, sinks, _ = _inputs(s=9)
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=2, training=False)
    mask = causal_mask(9, torch.float64, "cpu", window=3)
    theirs, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3)
    _close64(reference(q, k, v, scale=0.3, window=3, sinks=sinks), theirs.transpose(1, 2))


CASES = {"sinks": dict(sinks=True), "chunk": dict(chunk=5), "sinks-chunk-window": dict(sinks=True, chunk=7,
         window=4), "sinks-softcap-chunk": dict(sinks=True, softcap=1.5, chunk=6), "sinks-documents":
         dict(sinks=True, docs=True)}


def _case(name):
    c = dict(CASES[name])
    q, k, v, sinks, dout = _inputs(sinks=c.pop("sinks", False))
    docs = None
    if c.pop("docs", False):
        docs = torch.zeros(2, 23, dtype=torch.long)
        docs[0, 9:], docs[0, 15:], docs[1, 4:] = 1, 2, 1
    return q, k, v, sinks, dout, docs, c


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_kernel_matches_float64(name):
    q, k, v, sinks, dout, docs, kw = _case(name)
    want, wgrads = _grads(lambda q, k, v, s: reference(q, k, v, sinks=s, docs=docs, **kw),
                          (q, k, v, sinks), dout)
    got, ggrads = _grads(lambda q, k, v, s: blockwise_attention(
        q, k, v, block_size=4, sinks=s, q_documents=docs, k_documents=docs, **kw)[0], (q, k, v, sinks), dout)
    _close64(got, want, "out")
    for what, g, w in zip("qkvs", ggrads, wgrads):
        if w is not None:
            _close64(g, w, what)


def test_chunks_skip_tile_pairs():
    """32 tokens in tiles of 4 and chunks of 8: 3 causal tile pairs per chunk, 12 of the 36."""
    tiles = Tiles(torch.arange(32), 4, "cpu")
    assert tile_pairs(tiles, tiles, Visibility()) == 36
    assert tile_pairs(tiles, tiles, Visibility(chunk=8)) == 12
    # chunks of 6: a tile straddling a chunk edge still meets the previous tile (worked out by hand)
    assert tile_pairs(tiles, tiles, Visibility(chunk=6)) == 13


@pytest.mark.parametrize("name", [n for n in CASES if "softcap" not in CASES[n]])  # soft-caps: blockwise
def test_sdpa_with_sinks_matches_float64(name):
    """The one-rank path: SDPA with the sink as an extra key and the additive window/chunk/document mask."""
    q, k, v, sinks, dout, docs, kw = _case(name)
    if sinks is None:
        sinks = torch.zeros(4, dtype=torch.float64)  # off-by-one
    mask = causal_mask(23, torch.float64, "cpu", kw.get("window"), kw.get("chunk"))
    if docs is not None:  # the model's [b, 1, s, s] mask of packed documents
        other = docs[:, None, :, None] != docs[:, None, None, :]
        mask = mask + torch.zeros(other.shape, dtype=torch.float64).masked_fill(other, float("-inf"))
    want, wgrads = _grads(lambda q, k, v, s: reference(q, k, v, sinks=s, docs=docs, **kw),
                          (q, k, v, sinks), dout)
    got, ggrads = _grads(lambda q, k, v, s: sink_sdpa(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), s, mask, None), (q, k, v, sinks), dout)
    _close64(got, want, "out")
    for what, g, w in zip("qkvs", ggrads, wgrads):
        _close64(g, w, what)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_eager_kernel_of_generation_matches_float64(softcap):
    """Generation's explicit-score kernel: the last 5 queries over all 23 keys, chunked and windowed."""
    q, k, v, sinks, _, _, _ = _case("sinks")
    seen = (causal_mask(23, torch.float64, "cpu", window=6, chunk=8) == 0)[-5:]
    got = eager_attention(q[:, :, -5:], k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), seen, 0.4,
                          softcap, sinks)
    want = reference(q, k, v, scale=0.4, window=6, chunk=8, softcap=softcap, sinks=sinks)[:, :, -5:]
    _close64(got, want)


def _cp_kernel_rank(comm, kw, q, k, v, sinks, dout, docs):
    cp, r = dist.get_world_size(), dist.get_rank()
    s = q.shape[2]
    pos = [cp_positions(s, cp, i) for i in range(cp)]
    mine = pos[r]
    ql, kl, vl = (t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v))
    sl = sinks.clone().requires_grad_(True) if sinks is not None else None
    documents = [docs[:, p] for p in pos] if docs is not None else None
    out = ring_attention(ql, kl, vl, None, pos, comm_type=comm, block_size=3, sinks=sl, documents=documents,
                         **kw)
    out.backward(dout[:, :, mine])
    if sl is not None:
        dist.all_reduce(sl.grad)
    return dict(pos=mine, out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
                ds=sl.grad if sl is not None else None)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("name", ["sinks-chunk-window", "sinks-softcap-chunk", "sinks-documents"])
def test_ring_and_ulysses_match_float64(comm, name):
    q, k, v, sinks, dout, docs, kw = _case(name)
    q, k, v, dout = (t[:, :, :20] for t in (q, k, v, dout))  # CP 2 splits 20 tokens into 4 chunks of 5
    docs = docs[:, :20] if docs is not None else None
    want, (dq, dk, dv, ds) = _grads(lambda q, k, v, s: reference(q, k, v, sinks=s, docs=docs, **kw),
                                    (q, k, v, sinks), dout)
    res = run_ranks(_cp_kernel_rank, 2, comm, kw, q, k, v, sinks, dout, docs)
    for r in res:
        p = r["pos"]
        _close64(r["out"], want[:, :, p], "out")
        _close64(r["dq"], dq[:, :, p], "dq")
        _close64(r["dk"], dk[:, :, p], "dk")
        _close64(r["dv"], dv[:, :, p], "dv")
        _close64(r["ds"], ds, "dsinks")


# ---- activation, norms, temperature, RoPE --------------------------------------------------------------
def test_clamped_swiglu_matches_transformers_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(64, 16, generator=gen, dtype=torch.float64) * 6 for _ in range(2))  # past +-7
    assert (gate > 7).any() and (up < -7).any()
    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)  # gpt-oss's gate_up layout
    want = GptOssExperts._apply_gate(types.SimpleNamespace(limit=7.0, alpha=1.702), interleaved)
    m = types.SimpleNamespace(activation="quick_geglu", glu_linear_offset=1.0,
                              activation_func_clamp_value=7.0)
    torch.testing.assert_close(Activation(m)(up, gate), want, rtol=1e-15, atol=0)
    # the defaults stay what they were, bit for bit
    swiglu = types.SimpleNamespace(activation="swiglu", glu_linear_offset=0.0,
                                   activation_func_clamp_value=None)
    assert torch.equal(Activation(swiglu)(up, gate), F.silu(gate) * up)


def test_l2_norm_and_temperature_match_transformers_llama4():
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(l2_norm(x, 1e-5), Llama4TextL2Norm(1e-5)(x), rtol=1e-15, atol=0)
    pos = torch.arange(40)
    want = torch.tensor([1 + 0.1 * __import__("math").log(1 + (p + 1) // 8) for p in range(40)])
    torch.testing.assert_close(temperature_scales(pos, 8.0, 0.1).flatten(), want.float())
    assert temperature_scales(pos[None].expand(3, -1), 8.0, 0.1).shape == (3, 1, 40, 1)


def test_partial_rotary_matches_transformers_glm4_moe():
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb
    q, k = torch.randn(2, 4, 11, 16), torch.randn(2, 2, 11, 16)  # fp32: RoPE is computed in fp32
    cos, sin = rope_cos_sin(11, 8, 10000.0, "cpu")
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), want_q, **fp32_bound(want_q, 2))
    torch.testing.assert_close(apply_rope(k, cos, sin), want_k, **fp32_bound(want_k, 2))
    assert torch.equal(apply_rope(q, cos, sin)[..., 8:], q[..., 8:])


def _cfg(tp=1, cp=1, sp=False, comm="p2p", **over):
    settings = dict(VARIANTS, tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm,
                    sequence_parallel=sp, mock_data=True, seed=7)
    settings.update(over)
    return validate(config_from_dict(settings), tp * cp)


# every variant at once, on 4 layers of 16 tokens: sinks; chunks of 6 on the RoPE layers (0-2), layer 3
# without RoPE and with the temperature (floor scale 4: it changes every 4 positions); L2 q/k norm on the
# RoPE layers; windows of 5 on layers 0 and 2 with a local RoPE base; RoPE on half of each head; gpt-oss's
# activation, clamped at 0.05 so that the clamp acts on these small activations
VARIANTS = dict(STYLES["llama"], num_layers=4, kv_channels=8, softmax_type="learnable",
                attention_chunk_size=6, no_rope_freq=4, attn_temperature_tuning=True,
                attn_temperature_floor_scale=4.0, attn_temperature_scale=0.5, qk_l2_norm=True,
                qk_l2_norm_scope="rope", window_size=[4, 0], window_attn_skip_freq=2, rotary_base_local=100.0,
                rotary_percent=0.5, activation="quick_geglu", glu_linear_offset=1.0,
                activation_func_clamp_value=0.05, add_bias_linear=True)


def test_gemma3_local_base_on_windowed_layers():
    """The 5:1 pattern (--window-attn-skip-freq 6) and the local base: a windowed layer rotates with the
    local tables, a full one with the global (scaled) tables."""
    m = _cfg(num_layers=6, window_attn_skip_freq=6, no_rope_freq=None, attn_temperature_tuning=False,
             attention_chunk_size=None, use_rope_scaling=True).model
    assert windowed_layers(m) == [True] * 5 + [False]
    tables = rope_tables(m, 16, "cpu", lambda t: t)
    assert isinstance(tables, RopeTables)
    plain = rope_cos_sin(16, 4, 100.0, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(tables.local, plain))
    scaled = rope_cos_sin(16, 4, m.rotary_base, "cpu", dict(llama3=8.0, low=1.0, high=4.0, original=8192))
    assert all(torch.equal(a, b) for a, b in zip(tables, scaled))
    model = build_model(_cfg(num_layers=6, window_attn_skip_freq=6, no_rope_freq=None,
                             attn_temperature_tuning=False))
    x = torch.randn(16, 2, 32)
    local, full = model.decoder["0"].attention, model.decoder["5"].attention
    assert local.local_rope and not full.local_rope
    out = local(x, tables)
    local.local_rope = False
    assert torch.equal(out, local(x, tables.local)) and not torch.equal(out, local(x, tables))
    assert torch.equal(full(x, tables), full(x, tuple(tables)))


# ---- the model: layouts against one process -------------------------------------------------------------
def _model_rank(tp, cp, sp, comm, recompute=None, **over):
    if recompute:
        over["recompute_granularity"] = recompute
    cfg = _cfg(tp, cp, sp, comm, **over)
    mesh = ParallelMesh.build(tp=tp, cp=cp) if tp * cp > 1 else None
    model = build_model(cfg, mesh)
    logits, loss = step(model, *batch(cfg))
    if tp * cp > 1:
        sum_sequence_parallel_grads(model)
        for p in model.parameters():  # the optimizer's dp x cp average (dp = 1)
            dist.all_reduce(p.grad, group=model.mesh.group("cp"))
            p.grad.div_(cp)
    grads = full_state_dict(model, grads=True)
    return dict(logits=logits, loss=loss, grads=grads)


@pytest.fixture(scope="module")
def oracle():
    return _model_rank(1, 1, False, "p2p")


def _check_model(got, ref):
    torch.testing.assert_close(got["logits"], ref["logits"], **fp32_bound(ref["logits"], C_FWD))
    torch.testing.assert_close(got["loss"], ref["loss"], **fp32_bound(ref["loss"], C_FWD))
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, **fp32_bound(g, C_FWD_BWD), msg=name)


def test_one_process_model_has_every_variant(oracle):
    model = build_model(_cfg())
    names = dict(model.named_parameters())
    assert names["decoder.0.attention.sinks"].shape == (8,)
    assert oracle["grads"]["decoder.3.attention.sinks"].abs().sum() > 0
    att = [model.decoder[str(i)].attention for i in range(4)]
    assert [a.chunk for a in att] == [6, 6, 6, None]
    assert [a.temperature is not None for a in att] == [False, False, False, True]
    assert [a.local_rope for a in att] == [True, False, True, False]
    assert [a.l2_eps is not None for a in att] == [True, True, True, False]
    from megazero.planning.estimate import total_params
    assert total_params(model.cfg, padded=True) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tp,cp,sp,comm", [(2, 1, True, "p2p"), (1, 2, False, "p2p"), (1, 2, False, "a2a")])
def test_layouts_match_one_process(oracle, tp, cp, sp, comm):
    for got in run_ranks(_model_rank, tp * cp, tp, cp, sp, comm):
        _check_model(got, oracle)


def test_selective_recompute_matches(oracle):
    _check_model(_model_rank(1, 1, False, "p2p", recompute="selective"), oracle)


# gpt-oss's mixture of experts on layers 1 and 3: biased experts (--add-bias-linear) with the clamped
# SwiGLU, and a router bias
GPT_OSS_MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq="[0,1,0,1]",
                   moe_router_bias=True)


def test_gpt_oss_experts_and_router_biases_under_tp2_sp_ep2_match_one_process():
    ref = _model_rank(1, 1, False, "p2p", **GPT_OSS_MOE)
    for name in ("decoder.1.mlp.router.bias", "decoder.3.mlp.experts.1.fc1_bias"):
        assert ref["grads"][name].abs().sum() > 0, name
    # biased experts take expert TP 1 (Megatron-LM's rule): EP 2 across the two TP ranks
    for got in run_ranks(_model_rank, 2, 2, 1, True, "p2p", expert_tensor_parallel_size=1,
                         expert_model_parallel_size=2, **GPT_OSS_MOE):
        _check_model(got, ref)
    model = build_model(_cfg(**GPT_OSS_MOE))
    from megazero.planning.estimate import total_params
    assert total_params(model.cfg, padded=True) == sum(p.numel() for p in model.parameters())


def test_generation_cache_matches_full_forward():
    """Token-by-token decoding through the eager kernel equals the full forward's logits (sinks, chunks,
    windows, the temperature from the cache's positions)."""
    model = build_model(_cfg()).eval()
    ids = batch(model.cfg)[0]
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model.decode(ids[:, :5], cache)]
        steps += [model.decode(ids[:, i:i + 1], cache) for i in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **fp32_bound(full, C_FWD))


# ---- flags ------------------------------------------------------------------------------------------------
def test_megatron_flags_reach_the_config():
    cfg = parse_args(["--mock-data", "--position-embedding-type", "rope", "--softmax-type", "learnable",
                      "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
                      "--qk-l2-norm", "--rotary-percent", "0.5", "--attention-chunk-size", "8"], world_size=1)
    m = cfg.model
    assert (m.softmax_type, m.activation, m.glu_linear_offset, m.activation_func_clamp_value) == \
        ("learnable", "quick_geglu", 1.0, 7.0)
    assert m.qk_l2_norm and m.rotary_percent == 0.5 and m.attention_chunk_size == 8


@pytest.mark.parametrize("over,needle", [
    (dict(position_embedding_type="learned_absolute", no_rope_freq=None, rotary_base_local=None,
          rotary_percent=1.0), "--attention-chunk-size acts on"),
    (dict(no_rope_freq=None), "--attn-temperature-tuning acts on the layers without RoPE"),
    (dict(activation="gelu"), "--glu-linear-offset and --activation-func-clamp-value act on gated"),
    (dict(rotary_percent=0.4), "--rotary-percent 0.4 of --kv-channels 8 gives 3"),
    (dict(rotary_percent=0.1), "gives 0 rotary channels"),
    (dict(window_size=None, window_attn_skip_freq=None), "--rotary-base-local is the RoPE base of"),
    (dict(qk_layernorm=True), "--qk-l2-norm and --qk-layernorm are two query/key norms"),
    (dict(attention_chunk_size=0), "--attention-chunk-size must be a positive integer"),
])
def test_bad_settings_are_refused_in_one_line(over, needle):
    with pytest.raises(ConfigError) as err:
        _cfg(**over)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_flops_count_the_keys_a_chunk_lets_a_query_see():
    """Keys per query of VARIANTS' layers (16 tokens): window 4 and chunk 6 -> 5, chunk 6 -> 6, window
    4 and chunk 6 -> 5, no RoPE -> 16; mean 8, times 4 q (scores and values, q = 8 heads x 8)."""
    from megazero.planning.flops import layer_forward_flops_per_token
    assert layer_forward_flops_per_token(_cfg())["attention"] == 4 * 8 * 64
    assert layer_forward_flops_per_token(_cfg(attention_chunk_size=None))["attention"] == 4 * 10.5 * 64


def gpt_oss_flags():
    """The model and MoE flags of Megatron-LM's examples/gptoss/02_train.sh, sizes scaled down."""
    return ["--no-masked-softmax-fusion", "--transformer-impl", "transformer_engine", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--no-rope-fusion", "--normalization", "RMSNorm",
            "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
            "8", "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
            "--max-position-embeddings", "32", "--use-mcore-models", "--rotary-percent", "1.0", "--rope-type",
            "rope", "--position-embedding-type", "rope", "--rotary-base", "10000", "--no-bias-gelu-fusion",
            "--export-force-local-attention", "--no-bias-dropout-fusion", "--quick-geglu",
            "--glu-linear-offset", "1.0", "--softmax-type", "learnable", "--window-attn-skip-freq", "2",
            "--activation-func-clamp-value", "7.0", "--window-size", "7,0", "--enable-gpt-oss",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
            "--moe-ffn-hidden-size", "64", "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3"]


def test_megatrons_gpt_oss_example_flags_build_gpt_oss():
    rest = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--micro-batch-size",
            "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    cfg = parse_args(gpt_oss_flags() + rest, world_size=1)
    m = cfg.model
    assert (m.softmax_type, m.activation, m.glu_linear_offset, m.activation_func_clamp_value) == \
        ("learnable", "quick_geglu", 1.0, 7.0)
    assert (m.position_embedding_type, m.rotary_scaling_factor, m.yarn_correction_range_round_to_int) == \
        ("yarn", 32.0, False)
    assert windowed_layers(m) == [True, False] and m.window_size == [7, 0]
    model = build_model(cfg)
    logits, loss = step(model, *batch(cfg))
    assert torch.isfinite(loss).all() and model.decoder["0"].attention.sinks.grad.abs().sum() > 0


# ---- the trainer ---------------------------------------------------------------------------------------
def _train_history(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _train_cfg(**layout):
    settings = dict(VARIANTS, mock_data=True, global_batch_size=8, micro_batch_size=1, train_iters=3,
                    optimizer="sgd", lr=0.1, log_interval=100, seed=7, **GPT_OSS_MOE)
    return config_from_dict(dict(settings, **layout))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True, zero_stage=1,
         expert_tensor_parallel_size=1),
    dict(pipeline_model_parallel_size=2, context_parallel_size=2, zero_stage=3, cp_comm_type="a2a"),
], ids=["tp2-sp-pp2-zero1", "pp2-cp2-a2a-zero3"])
def test_trainer_under_a_layout_matches_one_process(layout):
    """Every variant with gpt-oss's MoE: loss and gradient norm of 3 SGD steps at TP 2 (SP) x PP 2 with
    the distributed optimizer and at PP 2 x CP 2 (Ulysses) with ZeRO-3, against one process."""
    from tolerance import R_TRAIN
    (ref,) = run_ranks(_train_history, 1, _train_cfg())
    got = run_ranks(_train_history, 4, _train_cfg(**layout))[0]
    for key in ("loss", "grad_norm"):
        a, b = [m[key] for m in ref], [m[key] for m in got]
        assert len(a) == len(b) == 3 and b == pytest.approx(a, rel=R_TRAIN), key


@pytest.mark.parametrize("over", [dict(softmax_type="learnable"), dict(rotary_percent=0.5),
                                  dict(activation="quick_geglu"), dict(glu_linear_offset=1.0),
                                  dict(no_rope_freq=2, attn_temperature_tuning=True,
                                       attn_temperature_floor_scale=8.5)])
def test_an_export_never_drops_a_variant(over):
    """No transformers architecture megazero writes holds these dense models: the export names the flag
    instead of writing a model without it (chunks and the L2 norm go to Llama 4, the local base to Gemma 3:
    tests/test_hf_models.py)."""
    from models.hf_export import arch_of
    base = dict(STYLES["llama"], mock_data=True)
    assert arch_of(validate(config_from_dict(base), 1).model) == "llama"  # the plain model exports
    assert arch_of(validate(config_from_dict(dict(base, qk_l2_norm=True)), 1).model) == "llama4_text"
    m = validate(config_from_dict(dict(base, **over)), 1).model
    with pytest.raises(ConfigError, match="no transformers architecture holds this model"):
        arch_of(m)


def gpt_oss_script(tmp):
    """Megatron-LM's examples/gptoss/02_train.sh (d98e8a6) with mock data: every flag of its MODEL_ARGS,
    MOE_ARGS, data (mock branch), TRAINING_ARGS, MODEL_PARALLEL_ARGS and LOGGING_ARGS, sizes scaled down
    (12 layers of 512 -> 2 of 64, 8192 tokens -> 32, batch 128 -> 4, samples -> 2 iterations, vocabulary
    128256 -> 127), PP = world size 2 as the script sets it; its FP8 flags apart."""
    model = gpt_oss_flags()
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--data-cache-path",
            f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1.0e-5", "--train-samples",
                "8", "--lr-decay-samples", "6", "--lr-decay-style", "cosine", "--min-lr", "1.0e-6",
                "--weight-decay", "0.1", "--lr-warmup-fraction", "0.05", "--clip-grad", "1.0", "--bf16",
                "--use-flash-attn", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
                "--disable-bf16-reduced-precision-matmul", "--recompute-activations"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                "--expert-model-parallel-size", "1", "--sequence-parallel", "--context-parallel-size", "1",
                "--use-distributed-optimizer"]
    logging = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "50000000",
               "--eval-iters", "0", "--save", f"{tmp}/ckpt", "--tensorboard-dir", f"{tmp}/ckpt/tensorboard",
               "--moe-per-layer-logging", "--no-load-optim", "--no-load-rng", "--log-throughput"]
    return model + data + training + parallel + logging


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


@pytest.mark.slow
def test_megatrons_gpt_oss_script_trains(tmp_path):
    """The script's flags as they are (FP8 apart: refused by name) train gpt-oss on 2 pipeline stages."""
    import json
    argv = gpt_oss_script(tmp_path)
    fp8 = ["--fp8-format", "hybrid", "--fp8-param-gather", "--fp8-amax-compute-algo", "max",
           "--fp8-amax-history-len", "1024"]
    with pytest.raises(ConfigError, match="--fp8-format: FP8/FP4 training is not implemented"):
        parse_args(argv + fp8, world_size=2)
    m = parse_args(argv, world_size=2).model
    assert (m.softmax_type, m.activation, m.position_embedding_type) == ("learnable", "quick_geglu", "yarn")
    argv += ["--metrics-file", str(tmp_path / "m.jsonl")]
    assert run_ranks(_pretrain, 2, argv, timeout=300) == [0, 0]
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.slow
def test_estimate_of_the_variants_equals_measurement():
    """What autograd keeps, measured, equals the estimate for chunked layers (their own masks), a local
    RoPE base (a second pair of tables), the temperature of the NoPE layers and gpt-oss's clamped
    quick-GeGLU (three more MLP intermediates than SwiGLU)."""
    from megazero.planning.estimate import estimate_stages
    from test_memory import LLAMA, SAVED, _measure_one, cfg_of
    settings = dict(LLAMA, seq_length=32, micro_batch_size=2, num_layers=4, attention_chunk_size=8,
                    no_rope_freq=4, attn_temperature_tuning=True, window_size=[5, 0], window_attn_skip_freq=2,
                    rotary_base_local=100.0, activation="quick_geglu", glu_linear_offset=1.0,
                    activation_func_clamp_value=7.0)
    (est,) = estimate_stages(cfg_of(1, **settings), device="cpu", backend="gloo", saved=SAVED)
    plain = dict(LLAMA, seq_length=32, micro_batch_size=2, num_layers=4)
    (est_plain,) = estimate_stages(cfg_of(1, **plain), device="cpu", backend="gloo", saved=SAVED)
    assert est["activation_bytes"] > est_plain["activation_bytes"]
    assert est["activation_bytes"] == _measure_one(settings)
