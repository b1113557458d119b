"""Multi-latent attention (models/mla.py): the layer against Hugging Face's DeepSeek-V3 attention, every
parallel layout against one process, the estimator's parameter and FLOP counts against the model, the
latent cache of generation, and the flags.

Tolerances (tests/tolerance.py): the layer and every layout run in fp32 (the rotary tables and the
rotation are fp32 whatever the dtype), so comparisons use the scaled fp32 bounds: outputs, logits and
losses ``C_FWD * U32 * max|ref|``, gradients ``C_FWD_BWD * U32 * max|grad|`` per tensor, trainer
losses and gradient norms ``R_TRAIN`` relative."""
import math

import pytest
import torch
import torch.distributed as dist

from megazero.config import ConfigError, config_from_dict, parse_args, validate
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from tolerance import C_FWD, C_FWD_BWD, R_TRAIN, fp32_bound

# a DeepSeek-V3-shaped attention at toy size: both latents, value heads narrower than query heads,
# YaRN (factor 4 over an 8-token original context) with DeepSeek's mscale on the 16-token sequences
MLA = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
           make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0, mock_data=True,
           position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6, activation="swiglu",
           add_bias_linear=False, ffn_hidden_size=48, untie_embeddings_and_output_weights=True,
           multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4,
           v_head_dim=5, qk_layernorm=True, rotary_scaling_factor=4.0, mscale=0.707, mscale_all_dim=0.707,
           yarn_original_max_position_embeddings=8, seed=5)
STYLES = {"both-ranks": MLA, "no-q-rank": dict(MLA, q_lora_rank=None)}
# Megatron-LM's own MLA test model keeps the default learned positions: MLA's RoPE besides, no norms
LEARNED = {"learned-positions": dict(MLA, position_embedding_type="learned_absolute", qk_layernorm=False,
                                     untie_embeddings_and_output_weights=False)}


def make_cfg(style, world=1, **over):
    return validate(config_from_dict(dict({**STYLES, **LEARNED}[style], **over)), world)


# ---- the layer against Hugging Face's DeepSeek-V3 ------------------------------------------------
def _hf_attention(cfg, interleave=True):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)
    m = cfg.model
    hf = DeepseekV3Config(
        hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        max_position_embeddings=32, rms_norm_eps=m.norm_epsilon, attention_bias=False,
        rope_interleave=interleave,
        rope_parameters={"rope_type": "yarn", "rope_theta": m.rotary_base, "factor": m.rotary_scaling_factor,
                         "original_max_position_embeddings": m.yarn_original_max_position_embeddings,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": m.mscale,
                         "mscale_all_dim": m.mscale_all_dim})
    hf._attn_implementation = "eager"
    return DeepseekV3Attention(hf, 0).double(), DeepseekV3RotaryEmbedding(hf)


def _copy_to_hf(ours, hf):
    pairs = {"kv_a_proj_with_mqa": ours.kv_down, "kv_a_layernorm": ours.kv_norm, "kv_b_proj": ours.kv_up,
             "o_proj": ours.proj}
    if ours.rq:
        pairs.update(q_a_proj=ours.q_down, q_a_layernorm=ours.q_norm, q_b_proj=ours.q_up)
    else:
        pairs.update(q_proj=ours.q_proj)
    with torch.no_grad():
        for name, module in pairs.items():
            getattr(hf, name).weight.copy_(module.weight)


def _reference_mla(att, x, base):
    """MLA in float64 written out from DeepSeek-V2's equations: latents, norms, up-projections, RoPE on
    interleaved pairs at angles ``p base^(-2i/dr)`` computed here, causal softmax, output projection."""
    w = {n: p.detach().double() for n, p in att.named_parameters()}
    s, b, _ = x.shape
    n, dn, dr, dv = att.heads, att.dn, att.dr, att.dv

    def rms(t, g):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    def rot(t):  # [..., s, dr]: pairs (2i, 2i+1), output halves [x1', x2']
        angle = torch.arange(s, dtype=torch.float64)[:, None] * base ** (
            -torch.arange(0, dr, 2, dtype=torch.float64) / dr)
        x1, x2 = t[..., 0::2], t[..., 1::2]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)
    if att.rq:
        q = rms(x @ w["q_down.weight"].t(), w["q_norm.weight"]) @ w["q_up.weight"].t()
    else:
        q = x @ w["q_proj.weight"].t()
    q = q.view(s, b, n, dn + dr).permute(1, 2, 0, 3)
    c, k_pe = (x @ w["kv_down.weight"].t()).split([att.rkv, dr], -1)
    kv = (rms(c, w["kv_norm.weight"]) @ w["kv_up.weight"].t()).view(s, b, n, dn + dv).permute(1, 2, 0, 3)
    k_pe = rot(k_pe.permute(1, 0, 2))[:, None]  # [b, 1, s, dr]: one for every head
    scores = q[..., :dn] @ kv[..., :dn].transpose(-1, -2) + rot(q[..., dn:]) @ k_pe.transpose(-1, -2)
    scores = (scores * att.scale).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ kv[..., dn:]
    return out.permute(2, 0, 1, 3).reshape(s, b, n * dv) @ w["proj.weight"].t()


@pytest.mark.parametrize("style", list(STYLES))
def test_layer_equals_a_float64_reference(style):
    """One layer (plain RoPE, DeepSeek's mscale^2 score scale of --rotary-scaling-factor 40 and
    --mscale-all-dim 0.707) against the float64 equations above; a layer without the interleave (RoPE
    on halves) fails the same comparison."""
    import models
    import models.mla
    cfg = make_cfg(style, init_method_std=0.3, rope_type="rope", rotary_scaling_factor=40.0)
    model = models.build_model(cfg)
    att = model.decoder["0"].attention.double()
    x = torch.randn(16, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = model._rope(x)
    want = _reference_mla(att, x, cfg.model.rotary_base)
    got = att(x, (cos.double(), sin.double())).detach()
    torch.testing.assert_close(got, want, **fp32_bound(want, C_FWD))
    halves = models.mla.rope_interleaved
    try:
        models.mla.rope_interleaved = models.mla.apply_rope
        broken = att(x, (cos.double(), sin.double())).detach()
    finally:
        models.mla.rope_interleaved = halves
    assert (broken - want).abs().max() > 1e3 * fp32_bound(want, C_FWD)["atol"]


@pytest.mark.slow
@pytest.mark.parametrize("style", list(STYLES))
def test_layer_equals_hugging_face_deepseek_v3(style):
    """One MLA layer in float64 equals transformers' DeepseekV3Attention holding its weights (YaRN with
    mscale, interleaved rotary pairs, latent norms, the mscale^2 score scale); the same comparison with
    HF's rope_interleave off fails, so the rotary layout is checked too."""
    import models
    cfg = make_cfg(style, init_method_std=0.3)  # scores of order 1: positions matter
    model = models.build_model(cfg)
    ours = model.decoder["0"].attention.double()
    s, b, h = cfg.model.seq_length, 2, cfg.model.hidden_size
    x = torch.randn(s, b, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = model._rope(x)
    got = ours(x, (cos.double(), sin.double())).transpose(0, 1)
    causal = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    outs = {}
    for interleave in (True, False):
        hf, rotary = _hf_attention(cfg, interleave)
        _copy_to_hf(ours, hf)
        xs = x.transpose(0, 1).contiguous()
        emb = rotary(xs, torch.arange(s)[None].expand(b, s))
        outs[interleave] = hf(xs, emb, causal)[0].detach()
    ref = outs[True]
    torch.testing.assert_close(got.detach(), ref, **fp32_bound(ref, C_FWD))
    assert (outs[False] - ref).abs().max() > 1e3 * fp32_bound(ref, C_FWD)["atol"]


def test_layer_shapes_and_scale():
    import models
    from models.mla import mla_softmax_scale
    cfg = make_cfg("both-ranks")
    att = models.build_model(cfg).decoder["0"].attention
    m = cfg.model
    mscale = 0.1 * m.mscale_all_dim * math.log(m.rotary_scaling_factor) + 1
    assert att.scale == mla_softmax_scale(m) == pytest.approx(mscale ** 2 / math.sqrt(6 + 4), rel=1e-15)
    assert tuple(att.kv_down.weight.shape) == (8 + 4, 32)
    assert tuple(att.kv_up.weight.shape) == (4 * (6 + 5), 8)
    assert tuple(att.q_up.weight.shape) == (4 * 10, 12) and tuple(att.proj.weight.shape) == (32, 4 * 5)
    assert make_cfg("both-ranks", rope_type="rope") and not hasattr(
        models.build_model(make_cfg("no-q-rank")).decoder["0"].attention, "q_down")


# ---- tensor parallelism against one process, tensor by tensor --------------------------------------
def _batch(cfg, b=2):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _step(model, cfg):
    ids, labels = _batch(cfg)
    logits = model(ids).detach()
    loss = model(ids, labels)
    loss.mean().backward()
    for p in model.parameters():  # what the optimizer does for replicated parameters with partial grads
        if getattr(p, "sequence_parallel", False) and p.grad is not None and model.mesh.size("tp") > 1:
            dist.all_reduce(p.grad, group=model.mesh.group("tp"))
    return logits, loss.detach()


def _tp_run(style, tp, sp, break_latent_sync=False):
    import models
    import models.mla
    if break_latent_sync:  # the latents' gradient left partial: the check below must catch it
        models.mla.copy_to_tp = lambda x, mesh: x
    cfg = make_cfg(style, tp, tensor_model_parallel_size=tp, sequence_parallel=sp)
    model = models.build_model(cfg, ParallelMesh.build(tp=tp) if tp > 1 else None)
    weights = models.full_state_dict(model)
    logits, loss = _step(model, cfg)
    return dict(weights=weights, logits=logits, loss=loss, grads=models.full_state_dict(model, grads=True))


@pytest.fixture(scope="module")
def oracle():
    return {style: _tp_run(style, 1, False) for style in [*STYLES, *LEARNED]}


def _compare(got, ref):
    for name, w in ref["weights"].items():  # the same initial weights at every layout
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(got["logits"], ref["logits"], **fp32_bound(ref["logits"], C_FWD))
    torch.testing.assert_close(got["loss"], ref["loss"], **fp32_bound(ref["loss"], C_FWD))
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, **fp32_bound(g, C_FWD_BWD), msg=name)


@pytest.mark.parametrize("style", [*STYLES, pytest.param(*LEARNED, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_matches_one_process(oracle, style, sp):
    for got in run_ranks(_tp_run, 2, style, 2, sp):
        _compare(got, oracle[style])


def test_tensor_parallel_check_catches_partial_latent_gradients(oracle):
    """Without the all-reduce of the latents' gradient, the replicated down-projections' gradients are
    one rank's share: the comparison above fails."""
    got = run_ranks(_tp_run, 2, "both-ranks", 2, False, True)[0]
    with pytest.raises(AssertionError):
        _compare(got, oracle["both-ranks"])


# ---- the trainer at every layout against one process -----------------------------------------------
def _train(cfg):
    import models
    from megazero.training import train
    return [(h["loss"], h["grad_norm"]) for h in train(cfg, models.build_chunks)]


TRAIN = dict(global_batch_size=4, micro_batch_size=1, train_iters=2, lr_decay_iters=4, optimizer="sgd",
             lr=0.1, sgd_momentum=0.0, log_interval=100)
LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2-zero3": (2, dict(zero_stage=3)),
    "dp2-zero0": (2, dict(zero_stage=0)),
    "dp2-zero2": (2, dict(zero_stage=2)),
    "cp2-ring": (2, dict(context_parallel_size=2)),  # values padded to the query head size in the kernel
    "cp2-a2a": (2, dict(context_parallel_size=2, cp_comm_type="a2a")),
    "cp2-tp2-sp": (4, dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "tp2-sp-dp2-zero3-selective": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, zero_stage=3,
                                           recompute_granularity="selective")),
    "cp2-a2a-tp2-sp-pp2-zero1": (8, dict(context_parallel_size=2, cp_comm_type="a2a",
                                         tensor_model_parallel_size=2, sequence_parallel=True,
                                         pipeline_model_parallel_size=2, zero_stage=1)),
    "dp2-zero1-recompute-full": (2, dict(zero_stage=1, recompute_granularity="full",
                                         recompute_method="uniform", recompute_num_layers=1)),
    "tp2-recompute-selective": (2, dict(tensor_model_parallel_size=2, recompute_granularity="selective")),
}


@pytest.fixture(scope="module")
def one_process():
    return {style: _train(make_cfg(style, **TRAIN)) for style in STYLES}


@pytest.mark.slow
@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_at_each_layout_matches_one_process(one_process, style, layout):
    """Losses of two SGD steps and the first gradient norm (over every parameter, each counted once)."""
    world, over = LAYOUTS[layout]
    cfg = config_from_dict(dict(STYLES[style], **TRAIN, **over))
    got = run_ranks(_train, world, cfg, timeout=300)[0]
    ref = one_process[style]
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=R_TRAIN) and norm == pytest.approx(ref_norm, rel=R_TRAIN)


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_sp_pp2_resumes_in_one_process(tmp_path):
    """Saved at TP 2 (SP) x PP 2 after two Adam steps (the replicated down-projections and latent norms
    once, the up-projections joined from their TP shards), resumed in one process: losses and gradient
    norms equal the uninterrupted one-process run within Adam's bound."""
    from tolerance import R_TRAIN_ADAM
    adam = dict(MLA, **dict(TRAIN, optimizer="adam", lr=3e-3, train_iters=4))
    ref = _train(config_from_dict(adam))
    first = run_ranks(_train, 4, config_from_dict(dict(adam, train_iters=2, save=str(tmp_path),
                                                       tensor_model_parallel_size=2, sequence_parallel=True,
                                                       pipeline_model_parallel_size=2)), timeout=300)[-1]
    second = _train(config_from_dict(dict(adam, load=str(tmp_path))))
    assert len(first) == len(second) == 2
    for (loss, norm), (ref_loss, ref_norm) in zip(first + second, ref):
        assert loss == pytest.approx(ref_loss, rel=R_TRAIN_ADAM)
        assert norm == pytest.approx(ref_norm, rel=R_TRAIN_ADAM)


def test_checkpoint_records_the_mla_architecture(tmp_path):
    """A checkpoint records MLA's settings: --use-checkpoint-args takes them (and --rope-type), and a run
    without MLA is told which flag differs instead of failing on parameter names."""
    from megazero.checkpoint.errors import CheckpointError
    settings = dict(MLA, **dict(TRAIN, train_iters=1, save=str(tmp_path)), rope_type="rope")
    _train(config_from_dict(settings))
    args = parse_args(["--mock-data", "--load", str(tmp_path), "--finetune", "--use-checkpoint-args"],
                      world_size=1).model
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim, args.rope_type) == (True, 12, 8, 6, 4, 5, "rope")
    mla_keys = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim")
    plain = {k: v for k, v in MLA.items() if k not in mla_keys}
    differs = "--multi-latent-attention True in the checkpoint"
    with pytest.raises((CheckpointError, ConfigError), match=differs):
        _train(config_from_dict(dict(plain, **TRAIN, load=str(tmp_path), finetune=True)))


@pytest.mark.slow
def test_packed_documents_at_each_layout_match_one_process():
    """Packed documents (--reset-attention-mask, --reset-position-ids): MLA's keys see their own document
    at CP 2 ring and Ulysses (the kernels compare document ids, values padded) and TP 2 with SP as in one
    process; without the masks the losses move (the check sees the documents)."""
    docs = dict(MLA, **TRAIN, tokenizer_type="NullTokenizer", reset_attention_mask=True,
                reset_position_ids=True, vocab_size=16, seq_length=32)
    one = _train(config_from_dict(docs))
    for layout in (dict(context_parallel_size=2), dict(context_parallel_size=2, cp_comm_type="a2a"),
                   dict(tensor_model_parallel_size=2, sequence_parallel=True)):
        got = run_ranks(_train, 2, config_from_dict(dict(docs, **layout)), timeout=300)[0]
        for (loss, norm), (ref_loss, ref_norm) in zip(got, one):
            assert loss == pytest.approx(ref_loss, rel=R_TRAIN), layout
            assert norm == pytest.approx(ref_norm, rel=R_TRAIN), layout
    off = _train(config_from_dict(dict(docs, reset_attention_mask=False, reset_position_ids=False)))
    assert off[0][1] != pytest.approx(one[0][1], rel=1e-4)


# ---- a tiny DeepSeek-V3: MLA with both latents, grouped routing, a shared expert, MTP ------------------
DEEPSEEK = dict(MLA, num_layers=2, global_batch_size=8, micro_batch_size=1, train_iters=3, lr_decay_iters=4,
                optimizer="sgd", lr=0.1, sgd_momentum=0.0, log_interval=100, mtp_num_layers=1,
                mtp_loss_scaling_factor=0.3, num_experts=8, moe_router_topk=2, moe_layer_freq="[0,1]",
                moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=16,
                moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2)
DEEPSEEK_LAYOUTS = {
    "ep2-tp2-sp-pp2-distributed-optimizer": (8, dict(expert_model_parallel_size=2,
                                                     tensor_model_parallel_size=2, sequence_parallel=True,
                                                     pipeline_model_parallel_size=2, zero_stage=1)),
    "cp2-dp2-zero3-ep2": (4, dict(context_parallel_size=2, zero_stage=3, expert_model_parallel_size=2)),
}


def _train_metrics(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEEPSEEK_LAYOUTS))
def test_deepseek_v3_shaped_model_with_mla_matches_one_process(name):
    """A dense first layer and an MoE layer (8 experts, top-2 within 2 of 4 groups, sigmoid scores with the
    expert bias, a shared expert, the sequence aux loss), MTP depth 1, every attention MLA with both
    latents: losses, MTP loss, aux loss and gradient norms of three SGD steps within R_TRAIN of one
    process, the tokens per expert equal."""
    one = _train_metrics(config_from_dict(DEEPSEEK))
    world, layout = DEEPSEEK_LAYOUTS[name]
    for hist in run_ranks(_train_metrics, world, config_from_dict(dict(DEEPSEEK, **layout)), timeout=300):
        for key in ("loss", "grad_norm", "mtp_loss", "moe_aux_loss"):
            assert [m[key] for m in hist] == pytest.approx([m[key] for m in one], rel=R_TRAIN), key
        for key in ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max"):
            assert [m[key] for m in hist] == [m[key] for m in one], key


# ---- initial values at every layout (tests/test_init_equality.py's check, the "mla" family) ---------
INIT_LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2-virtual": (2, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)),
    "cp2-zero3": (2, dict(context_parallel_size=2, zero_stage=3)),
    "dp2-zero2": (2, dict(zero_stage=2)),
}


@pytest.mark.parametrize("layout", [n if n == "tp2-sp" else pytest.param(n, marks=pytest.mark.slow)
                                    for n in INIT_LAYOUTS])
def test_initial_values_equal_one_process_bitwise(tmp_path, layout):
    from megazero.checkpoint import read_weights
    from test_init_equality import _build_and_save, mismatches, one_process_init
    world, settings = INIT_LAYOUTS[layout]
    run_ranks(_build_and_save, world, ["mla"], settings, str(tmp_path), True, timeout=300)
    want, got = one_process_init("mla"), read_weights(str(tmp_path / "mla"))[3]
    assert any(".attention.kv_down." in n for n in want) and not mismatches(want, got), mismatches(want, got)


# ---- soft-capped scores: the blockwise kernel with padded values ------------------------------------
def test_soft_capped_scores_through_the_padded_kernel():
    """With --attn-logit-softcapping the core runs in the blockwise kernel, whose keys and values share a
    head size: values are padded to the query's and cut after; equal to the eager float64 formula."""
    import models
    cfg = make_cfg("both-ranks", attn_logit_softcapping=2.0, init_method_std=0.3)
    att = models.build_model(cfg).decoder["0"].attention
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 4, 16, 10, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 16, 5, generator=g)
    got = att.mla_core(q, k, v)
    scores = torch.tanh(q.double() @ k.double().transpose(-1, -2) * att.scale / 2.0) * 2.0
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    want = scores.softmax(-1) @ v.double()
    torch.testing.assert_close(got.double(), want, **fp32_bound(want, C_FWD))


# ---- the estimator -----------------------------------------------------------------------------------
def _shard_params(cfg, tp):
    """Parameters of TP rank 0's shard of the whole model, built on the meta device in one process."""
    import models
    mesh = ParallelMesh.single()
    mesh.size = lambda axis: tp if axis == "tp" else 1  # the shard shapes; no collective runs here
    with torch.device("meta"):
        return sum(p.numel() for p in models.GPTModel(cfg, mesh, range(cfg.model.num_layers), True, True,
                                                      None).parameters())


@pytest.mark.parametrize("style", list(STYLES))
def test_estimator_counts_the_parameters_as_built(style):
    """The estimator's parameter counts are the model's: the whole model (megazero/planning/estimate.py)
    and one TP rank's shard at TP 2 with SP (the per-rank figure of estimate_memory.py --json)."""
    import json
    import contextlib
    import io
    from megazero.planning.estimate import total_params
    from models.cli import estimate_memory_main
    assert total_params(make_cfg(style), padded=True) == _shard_params(make_cfg(style), 1)
    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--vocab-size", "100", "--make-vocab-size-divisible-by", "8", "--swiglu",
             "--disable-bias-linear",
             "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--kv-lora-rank", "8",
             "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5", "--qk-layernorm",
             "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    flags += ["--q-lora-rank", "12"] if STYLES[style]["q_lora_rank"] else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert estimate_memory_main(["--world-size", "2", "--json"] + flags) == 0
    stage = json.loads(out.getvalue())["stages"][0]
    cfg = make_cfg(style, 2, tensor_model_parallel_size=2, sequence_parallel=True)
    assert stage["params_per_rank"] == _shard_params(cfg, 2)


ACTIVATION_CASES = {  # name: (settings, world)
    "fp32": ({}, 1),
    "no-q-rank": (dict(q_lora_rank=None), 1),
    "no-latent-norms": (dict(qk_layernorm=False), 1),
    "selective": (dict(recompute_granularity="selective"), 1),
    "tp2-sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    "values-as-wide": (dict(v_head_dim=10), 1),
    "values-wider": (dict(v_head_dim=12), 1),
    "attention-dropout-math": (dict(attention_dropout=0.1), 1),
    "soft-capped": (dict(attn_logit_softcapping=5.0), 1),
    "selective-values-wider": (dict(recompute_granularity="selective", v_head_dim=12), 1),
    "full-recompute": (dict(recompute_granularity="full"), 1),
    "bf16": (dict(bf16=True), 1),
    "layernorm": (dict(normalization="LayerNorm"), 1),
    "tp2": (dict(tensor_model_parallel_size=2), 2),
    "tp2-sp-no-q-rank": (dict(tensor_model_parallel_size=2, sequence_parallel=True, q_lora_rank=None), 2),
    "cp2-ring": (dict(context_parallel_size=2), 2),
    "cp2-a2a": (dict(context_parallel_size=2, cp_comm_type="a2a"), 2),
}
FAST_ACTIVATIONS = ("fp32", "no-q-rank", "selective", "tp2-sp")


def _measured_activations(settings, world):
    import models
    from megazero.training.measure import measure_rank
    return measure_rank(validate(config_from_dict(settings), world), models.build_chunks,
                        iters=1)["activation_bytes"]


@pytest.mark.parametrize("name", [n if n in FAST_ACTIVATIONS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ACTIVATION_CASES])
def test_activation_estimate_equals_measurement(name):
    """The estimator's activation bytes (models/mla_saved.py, what each MLA layer keeps for backward)
    equal what autograd keeps in a training step, byte for byte: latent norms, the gathered latents,
    the padded values, each kernel, recomputation, sequence and context parallelism, bf16."""
    from megazero.planning.estimate import estimate_stages
    from models import saved_activations
    over, world = ACTIVATION_CASES[name]
    settings = dict(MLA, micro_batch_size=2, global_batch_size=2, train_iters=1, **over)
    cfg = validate(config_from_dict(settings), world)
    est = estimate_stages(cfg, device="cpu", backend="gloo", saved=saved_activations)[0]["activation_bytes"]
    got = (_measured_activations(settings, 1) if world == 1
           else run_ranks(_measured_activations, world, settings, world)[0])
    assert est == got


@pytest.mark.parametrize("v_head_dim", [10, 5], ids=["values-as-wide", "padded-values"])
def test_flops_count_the_layer_products(v_head_dim):
    """Model FLOPs of an MLA layer equal what torch's FLOP counter sees in its forward (SDPA's math
    kernel, whose products it counts: causal mask not discounted, Megatron-LM's rule).  Model FLOPs
    count the values' own ``dv`` channels; with values zero-padded to the query's width the kernel
    computes ``2 s n (dn + dr - dv)`` more a token, which the counter sees and the count leaves out."""
    import models
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from megazero.planning.flops import layer_forward_flops_per_token
    for style in STYLES:
        cfg = make_cfg(style, activation="gelu", ffn_hidden_size=40, v_head_dim=v_head_dim)
        model = models.build_model(cfg)
        x = torch.randn(cfg.model.seq_length, 2, cfg.model.hidden_size)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            model.decoder["0"](x, model._rope(x))
        m, per_token = cfg.model, layer_forward_flops_per_token(cfg)
        padding = 2 * m.seq_length * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim
                                                              - v_head_dim)
        want = (per_token["dense"] + per_token["attention"] + padding) * x.shape[0] * x.shape[1]
        assert counter.get_total_flops() == want, style


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_step_time_model_runs_the_counted_products(tp, sp):
    """The planner's GPU step-time model (megazero/planning/gpu_model.py) times MLA's products: one rank's
    matmuls, times the TP ranks, are the FLOP count's (the replicated down-projections on each rank's
    part of the sequence under SP)."""
    from megazero.planning.flops import layer_forward_flops_per_token
    from megazero.planning.gpu_model import layer_gemms
    cfg = make_cfg("both-ranks", tp, tensor_model_parallel_size=tp, sequence_parallel=sp,
                   activation="gelu", ffn_hidden_size=40)
    tokens = 32
    per_rank = sum(2 * m * n * k for m, n, k in layer_gemms(cfg, tokens))
    assert per_rank * tp == layer_forward_flops_per_token(cfg)["dense"] * tokens


@pytest.mark.parametrize("style", list(STYLES))
def test_cpu_matmul_products_are_the_models(style, monkeypatch):
    """--cpu-matmul auto measures the model's own products: for MLA its down- and up-projections and
    output (megazero/tensor_parallel/cpu_matmul.py), as a forward runs them."""
    import models
    import models.gpt
    import models.mla
    import megazero.tensor_parallel.layers as tp_layers
    from megazero.tensor_parallel.cpu_matmul import linear_products
    cfg = make_cfg(style, micro_batch_size=2)
    model = models.build_model(cfg)
    seen = {}
    real = tp_layers.linear

    def counting(x, weight, *args, **kwargs):
        key = (x.numel() // x.shape[-1], weight.shape[0], weight.shape[1])
        seen[key] = seen.get(key, 0) + 1
        return real(x, weight, *args, **kwargs)
    for module in (tp_layers, models.mla, models.gpt):
        monkeypatch.setattr(module, "linear", counting)
    with torch.no_grad():
        model(torch.zeros(2, cfg.model.seq_length, dtype=torch.long))
    assert {(p.rows, p.out, p.inp): p.count for p in linear_products(cfg, 1)} == seen


# ---- generation: the latent cache ----------------------------------------------------------------------
@pytest.mark.parametrize("style", list(STYLES))
def test_generation_caches_the_latent_and_matches_uncached(style):
    """The cache holds kv_lora_rank + qk_pos_emb_head_dim values a token and layer; decoding through it
    (absorbed up-projections) gives the full forward's logits within the fp32 bound, and greedy
    generation equals argmax over the full forward at every step."""
    import models
    from models.generate import generate
    from models.layers import KVCache
    cfg = make_cfg(style)
    model = models.build_model(cfg).eval()
    prompt = torch.randint(0, cfg.model.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = KVCache()
    with torch.no_grad():
        first = model.decode(prompt, cache)
        full = model(prompt)
    torch.testing.assert_close(first, full, **fp32_bound(full, C_FWD))
    m = cfg.model
    for layer in range(m.num_layers):
        assert cache.keys[layer].shape == (2, 1, 5, m.kv_lora_rank)
        assert cache.values[layer].shape == (2, 1, 5, m.qk_pos_emb_head_dim)
    out = generate(model, prompt, max_new_tokens=8)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)


def _tp_generate(style, tp):
    import models
    from models.generate import generate
    from models.layers import KVCache
    cfg = make_cfg(style, tp, tensor_model_parallel_size=tp)
    model = models.build_model(cfg, ParallelMesh.build(tp=tp) if tp > 1 else None).eval()
    prompt = torch.randint(0, cfg.model.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.decode(prompt, KVCache())
    return generate(model, prompt, max_new_tokens=6), logits


@pytest.mark.parametrize("style", list(STYLES))
def test_generation_under_tensor_parallelism_matches_one_process(style):
    """TP 2 (heads split, latents on every rank): the prompt's logits within the fp32 bound and the
    greedy tokens equal to one process's."""
    ids, logits = _tp_generate(style, 1)
    for got_ids, got_logits in run_ranks(_tp_generate, 2, style, 2):
        torch.testing.assert_close(got_logits, logits, **fp32_bound(logits, C_FWD))
        assert torch.equal(got_ids, ids)


def test_hugging_face_export_refuses_mla_by_name(tmp_path):
    """No transformers architecture megazero exports holds MLA: the export names the flag (it once
    picked LLaMA and failed on a missing QKV weight deep in the writer)."""
    import models
    from models.hf import to_hf
    cfg = make_cfg("both-ranks")
    with pytest.raises(ConfigError, match="multi-latent attention, --multi-latent-attention"):
        to_hf(models.build_model(cfg), str(tmp_path / "out"))


# ---- flags ------------------------------------------------------------------------------------------
def test_megatron_flags_build_the_model():
    cfg = parse_args(["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--seq-length", "16", "--position-embedding-type", "rope", "--multi-latent-attention",
                      "--q-lora-rank", "12", "--kv-lora-rank", "8", "--qk-head-dim", "6",
                      "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5", "--qk-layernorm",
                      "--rotary-scaling-factor", "40", "--mscale", "0.707", "--mscale-all-dim", "0.707",
                      "--rope-type", "yarn", "--cache-mla-latents", "--normalization", "RMSNorm"],
                     world_size=1)
    m = cfg.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.rope_type, m.mscale_all_dim) == (True, 12, 8, 6, 4, 5, "yarn", 0.707)
    assert any("--cache-mla-latents" in n for n in cfg.notes)
    defaults = parse_args(["--mock-data", "--multi-latent-attention"], world_size=1).model
    assert (defaults.q_lora_rank, defaults.kv_lora_rank, defaults.qk_head_dim, defaults.qk_pos_emb_head_dim,
            defaults.v_head_dim) == (None, 32, 128, 64, 128)  # Megatron-LM's defaults


@pytest.mark.parametrize("flags,needle", [
    (["--kv-lora-rank", "0"], "--kv-lora-rank must be a positive integer"),
    (["--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim 3: RoPE rotates pairs"),
    (["--group-query-attention", "--num-query-groups", "2"], "--num-query-groups 2 with --multi-latent"),
    (["--softmax-scale", "0.5"], "--softmax-scale does not apply to --multi-latent-attention"),
    (["--add-qkv-bias"], "--add-qkv-bias does not apply"),
    (["--position-embedding-type", "rope", "--use-rope-scaling"], "--use-rope-scaling does not apply"),
])
def test_refused_combinations_name_the_flag(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(["--mock-data", "--multi-latent-attention"] + flags, world_size=1)


def test_mla_sizes_without_mla_are_named_as_without_effect():
    notes = parse_args(["--mock-data", "--q-lora-rank", "12", "--v-head-dim", "4"], world_size=1).notes
    assert any(n.startswith("--q-lora-rank, --v-head-dim without --multi-latent-attention: no effect")
               for n in notes)
    quiet = parse_args(["--mock-data", "--kv-lora-rank", "32"], world_size=1).notes  # the default, as saved
    assert not any("--multi-latent-attention" in n for n in quiet)


def test_rope_type_yarn_needs_mla():
    with pytest.raises(ConfigError, match="--rope-type yarn: .*--multi-latent-attention"):
        parse_args(["--mock-data", "--rope-type", "yarn"], world_size=1)


@pytest.mark.slow
def test_bench_mla_quick_runs_and_the_cache_holds_the_latent():
    """scripts/bench_mla.py --quick: both attentions timed; the cache it reads holds, per token and
    layer, kv_lora_rank + qk_pos_emb_head_dim fp32 values for MLA (16 + 8) and 2 x heads x head
    width for standard attention (2 x 4 x 24)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "scripts/bench_mla.py", "--quick", "--json", "-"], cwd=root,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    assert {r["kind"] for r in rows} == {"MLA", "standard"}
    assert all(r["us_per_token"] > 0 and r["saved_bytes_per_token"] > 0 for r in rows)
    cache = {r["kind"]: r["cache_bytes_per_token"] for r in rows}
    assert cache == {"MLA": 4 * (16 + 8), "standard": 4 * 2 * 4 * (16 + 8)}
