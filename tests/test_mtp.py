"""Multi-token prediction (``--mtp-num-layers``, models/mtp.py): the loss math against a float64 reference
written here, and training under PP 2 (tied and untied embeddings) and TP 2 with sequence parallelism
against one process.

Tolerances: the reference check is float64 on both sides (1e-10); the training runs are fp32 SGD under
another layout (tests/tolerance.py R_TRAIN) for the loss, the MTP loss and the gradient norm."""
import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from tolerance import R_TRAIN, R_TRAIN_ADAM

BASE = dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
            vocab_size=100, global_batch_size=4, micro_batch_size=1, train_iters=3, lr_decay_iters=4,
            optimizer="sgd", lr=0.1, sgd_momentum=0.0, log_interval=100, hidden_dropout=0.0,
            attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
            mtp_num_layers=2, mtp_loss_scaling_factor=0.3)


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ce64(logits, labels, mesh, vocab):
    """The vocabulary-parallel cross-entropy of one rank in the logits' own dtype (megazero's runs in fp32
    whatever the dtype): the float64 check is then float64 throughout."""
    return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), labels.reshape(-1),
                           reduction="none").view(labels.shape)


def test_mtp_loss_and_gradients_match_a_float64_reference(monkeypatch):
    """Depth k sees the embedding of token t+k+1 beside the previous depth's state and predicts token
    t+k+2; its loss is the mean over the rolled mask; factor / N times their sum is what backward adds."""
    import models
    import models.mtp
    monkeypatch.setattr(models.mtp, "vocab_parallel_cross_entropy", _ce64)
    cfg = validate(config_from_dict(dict(BASE, untie_embeddings_and_output_weights=True)), world_size=1,
                   check_data=False)
    model = models.build_model(cfg).double().train()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 17), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.ones(2, 16, dtype=torch.float64)
    mask[0, 5] = mask[1, 12] = 0.0
    model.mtp.stats.backward_scale = 1.0
    per_token = model(ids, labels=labels, loss_mask=mask)
    main = (per_token * mask).sum() / mask.sum()
    main.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    recorded = model.mtp.stats.losses.clone()

    model.zero_grad()
    eps, emb, head = cfg.model.norm_epsilon, model.word_embeddings.weight, model.output_layer.weight
    x = model.final_norm(model.run_layers(model.embed(ids)))
    ref_main = F.cross_entropy((x @ head.t()).transpose(0, 1)[..., :100].reshape(-1, 100), labels.reshape(-1),
                               reduction="none").view(2, 16)
    torch.testing.assert_close(per_token, ref_main, rtol=1e-10, atol=1e-10)
    h, total, s = x, 0.0, 16
    for k, depth in enumerate(model.mtp.depths()):
        nxt = torch.zeros_like(labels)  # token t+k+1 at position t (labels are tokens shifted by one)
        nxt[:, :s - k] = labels[:, k:]
        e = emb[nxt.t()]
        cat = torch.cat([_rms(e, depth.enorm.weight, eps), _rms(h, depth.hnorm.weight, eps)], dim=-1)
        h = _rms(depth.layer(cat @ depth.eh_proj.weight.t(), model._rope(cat)), depth.final_norm.weight, eps)
        target = torch.zeros_like(labels)
        target[:, :s - k - 1] = labels[:, k + 1:]
        m = torch.zeros_like(mask)
        m[:, :s - k - 1] = mask[:, k + 1:]
        ce = F.cross_entropy((h @ head.t()).transpose(0, 1)[..., :100].reshape(-1, 100), target.reshape(-1),
                             reduction="none").view(2, 16)
        depth_loss = (ce * m).sum() / m.sum()
        assert float(recorded[k]) == pytest.approx(float(depth_loss.detach()), rel=1e-10)
        total = total + depth_loss
    ((ref_main * mask).sum() / mask.sum() + 0.3 / 2 * total).backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ref) == set(got) and any("mtp." in n for n in got)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)
    assert float(got["mtp.3.eh_proj.weight"].abs().max()) > 1e-4  # the MTP loss reaches its weights


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


KEYS = ("loss", "grad_norm", "mtp_loss", "mtp_1_loss", "mtp_2_loss")
UNTIED = dict(untie_embeddings_and_output_weights=True)
LAYOUTS = {  # name: (settings of both runs, world, layout)
    # the last stage's own copy of the word embedding, summed with the first stage's
    "pp2-untied": (UNTIED, 2, dict(pipeline_model_parallel_size=2)),
    # the head's weight (the embedding's tied copy) looked up too
    "pp2-tied": (dict(), 2, dict(pipeline_model_parallel_size=2)),
    "tp2-sp": (UNTIED, 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "tp2-tied-zero1": (dict(), 2, dict(tensor_model_parallel_size=2, zero_stage=1)),
    # uneven stages: the last holds one layer besides the depths; interleaved with virtual stages
    "pp2-uneven": (dict(UNTIED, num_layers=3), 2, dict(pipeline_model_parallel_size=2,
                                                       decoder_first_pipeline_num_layers=2)),
    "pp2-vpp2-tied": (dict(num_layers=4, global_batch_size=8), 2,
                      dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)),
    # the rolled tokens split like the sequence; the depths in ZeRO-3's root unit
    "cp2-dp2-zero3": (dict(UNTIED, global_batch_size=8), 4, dict(context_parallel_size=2, zero_stage=3)),
    "tp2-sp-cp2-a2a": (dict(UNTIED, global_batch_size=8), 4,
                       dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                            cp_comm_type="a2a")),
    "pp2-dp2-zero3-tied-recompute": (dict(global_batch_size=8), 4,
                                     dict(pipeline_model_parallel_size=2, zero_stage=3,
                                          recompute_granularity="full", recompute_method="uniform",
                                          recompute_num_layers=1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_mtp_under_a_layout_matches_one_process(name):
    both, world, layout = LAYOUTS[name]
    one = _train(config_from_dict(dict(BASE, **both)))
    ranks = run_ranks(_train, world, config_from_dict(dict(BASE, **both, **layout)), timeout=300)
    for hist in ranks:
        for key in KEYS:
            assert [m[key] for m in hist] == pytest.approx([m[key] for m in one], rel=R_TRAIN), key
    off = _train(config_from_dict(dict(BASE, **both, mtp_loss_scaling_factor=0.0)))
    assert off[0]["loss"] == one[0]["loss"]  # the first step's loss is the main model's alone
    assert off[1]["loss"] != pytest.approx(one[1]["loss"], rel=1e-6)  # the MTP loss trained the model


@pytest.mark.parametrize("bad, words", [
    (dict(mtp_num_layers=0), "--mtp-num-layers must be a positive integer"),
    (dict(position_embedding_type="learned_absolute"), "--mtp-num-layers with --position-embedding-type"),
    (dict(mtp_loss_scaling_factor=-1.0), "--mtp-loss-scaling-factor must be >= 0"),
    (dict(hybrid_layer_pattern="M*", mamba_num_groups=1, mamba_head_dim=16, mamba_state_dim=8),
     "--mtp-num-layers with --hybrid-layer-pattern"),
])
def test_bad_mtp_settings_are_refused_by_name(bad, words):
    with pytest.raises(ConfigError, match=words):
        validate(config_from_dict(dict(BASE, **bad)), world_size=1)


@pytest.mark.slow
def test_checkpoint_saved_under_pp2_resumes_in_one_process(tmp_path):
    """Saved under PP 2 (untied: the last stage's embedding copy is not stored; Adam), resumed in one
    process: equal to the uninterrupted one-process run; the depths' names are DeepSeek-V3's indices."""
    import json
    adam = dict(UNTIED, optimizer="adam", lr=3e-3, train_iters=4)
    ref = _train(config_from_dict(dict(BASE, **adam)))
    first = run_ranks(_train, 2, config_from_dict(dict(BASE, **dict(adam, train_iters=2), save=str(tmp_path),
                                                       pipeline_model_parallel_size=2)), timeout=300)[0]
    names = json.load(open(tmp_path / "iter_0000002" / "metadata.json"))["params"]
    assert {"mtp.2.eh_proj.weight", "mtp.3.layer.attention.qkv.weight",
            "mtp.3.final_norm.weight"} <= set(names)
    assert not any(n.startswith("mtp.word_embeddings") for n in names)
    second = _train(config_from_dict(dict(BASE, **adam, load=str(tmp_path))))
    assert [m["iteration"] for m in second] == [3, 4]
    for key in KEYS:
        assert [m[key] for m in first + second] == pytest.approx([m[key] for m in ref], rel=R_TRAIN_ADAM), key


DEEPSEEK = dict(BASE, untie_embeddings_and_output_weights=True, global_batch_size=8, mtp_num_layers=1,
                add_bias_linear=False, activation="swiglu", num_experts=8, moe_router_topk=2,
                moe_layer_freq="[0,1]", moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=16,
                moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
                moe_router_group_score_topk=2)
DEEPSEEK_KEYS = ("loss", "grad_norm", "mtp_loss", "moe_aux_loss")
DEEPSEEK_COUNTS = ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max", "moe_imbalance")
DEEPSEEK_LAYOUTS = {
    "ep2-tp2-sp-pp2-distributed-optimizer": (8, dict(expert_model_parallel_size=2,
                                                     tensor_model_parallel_size=2, sequence_parallel=True,
                                                     pipeline_model_parallel_size=2, zero_stage=1)),
    "cp2-dp2-zero3-ep2": (4, dict(context_parallel_size=2, zero_stage=3, expert_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def deepseek_one_process():
    return _train(config_from_dict(DEEPSEEK))


def test_mtp_layer_after_an_moe_layer_is_an_moe_layer():
    """The MTP layer takes the last decoder layer's kind (Megatron-core's spec): an MoE layer here, its
    router beside the decoder's (the expert bias moves with them)."""
    import models
    cfg = validate(config_from_dict(DEEPSEEK), world_size=1)
    names = dict(models.build_model(cfg).named_parameters())
    assert "mtp.2.layer.mlp.experts.fc1_weight" in names and "mtp.2.layer.mlp.router.expert_bias" in names
    assert "mtp.2.layer.mlp.shared_experts.fc1.weight" in names
    dense = validate(config_from_dict(dict(DEEPSEEK, moe_layer_freq="[1,0]")), world_size=1)
    assert not any(n.startswith("mtp.2.layer.mlp.experts") for n, _ in
                   models.build_model(dense).named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEEPSEEK_LAYOUTS))
def test_deepseek_v3_shaped_model_matches_one_process(name, deepseek_one_process):
    """A tiny DeepSeek-V3-shaped model (a dense first layer, 8 experts of which top-2 within 2 of 4 groups,
    sigmoid scores with the expert bias, a shared expert, the sequence aux loss, MTP depth 1 with an MoE
    layer) under expert, tensor, pipeline, context and data parallelism against one process."""
    world, layout = DEEPSEEK_LAYOUTS[name]
    ranks = run_ranks(_train, world, config_from_dict(dict(DEEPSEEK, **layout)), timeout=300)
    for hist in ranks:
        for key in DEEPSEEK_KEYS:
            assert [m[key] for m in hist] == pytest.approx([m[key] for m in deepseek_one_process],
                                                           rel=R_TRAIN), key
        for key in DEEPSEEK_COUNTS:
            assert [m[key] for m in hist] == [m[key] for m in deepseek_one_process], key


def test_export_to_an_architecture_without_mtp_is_refused_by_name():
    """No transformers architecture megazero exports to has MTP layers: the export names the flag."""
    from models.hf_export import arch_of
    cfg = validate(config_from_dict(dict(BASE, hf_model_type="llama")), world_size=1)
    with pytest.raises(ConfigError, match=r"--hf-model-type llama cannot hold this model: multi-token "
                                          r"prediction, --mtp-num-layers \(llama has none\)"):
        arch_of(cfg.model, cfg.moe)
    with pytest.raises(ConfigError, match="multi-token prediction"):
        arch_of(validate(config_from_dict(BASE), world_size=1).model)


@pytest.mark.parametrize("settings", ["dense", "deepseek"])
def test_parameter_and_flop_counts_include_the_depths(settings):
    """The start-up summary's parameter count (planning.estimate.total_params) is the model's own, and the
    FLOPs the depths add to a forward (their matmuls, counted by torch's FlopCounterMode, which does not
    count the CPU attention kernel) are the formula's with attention left out."""
    import models
    from torch.utils.flop_counter import FlopCounterMode
    from megazero.planning.estimate import total_params
    from megazero.planning.flops import mtp_forward_flops_per_token
    base = dict(BASE, untie_embeddings_and_output_weights=True) if settings == "dense" else DEEPSEEK
    cfg = validate(config_from_dict(base), world_size=1)
    model = models.build_model(cfg)
    assert total_params(cfg, padded=True) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids, labels = torch.randint(0, 100, (1, 16)), torch.randint(0, 100, (1, 16))
    counts = []
    for kw in (dict(labels=labels, loss_mask=torch.ones(1, 16)), {}):  # without labels: no MTP
        with FlopCounterMode(display=False) as fc:
            model(ids, **kw)
        counts.append(fc.get_total_flops())
    m = cfg.model
    attention = 4 * m.seq_length * m.num_attention_heads * m.kv_channels * m.mtp_num_layers
    assert (counts[0] - counts[1]) / 16 == mtp_forward_flops_per_token(cfg) - attention > 0


def test_other_mtp_flags_are_refused_with_what_megazero_has():
    from megazero.config import parse_args
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--vocab-size", "100", "--micro-batch-size", "1",
            "--train-iters", "1", "--mock-data", "--position-embedding-type", "rope", "--mtp-num-layers", "1"]
    assert parse_args(argv).model.mtp_num_layers == 1
    with pytest.raises(ConfigError, match="--mtp-standalone: this multi-token prediction option is not "
                                          "implemented"):
        parse_args(argv + ["--mtp-standalone"])


def test_iteration_line_reports_the_mtp_loss_apart():
    from megazero.training.log import format_line
    m = dict(iteration=3, loss=4.5, mtp_loss=4.61234, lr=1e-3, grad_norm=1.0, loss_scale=1.0, skipped=0,
             iteration_time=0.01, tokens_per_sec=100.0)
    assert "| loss 4.5000 | mtp loss 4.6123 | lr" in format_line(m, 10)
    assert "mtp loss" not in format_line(dict(m, mtp_loss=None), 10)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_under_pp2_follows_one_process(dtype):
    """bf16 / fp16 (the MTP loss's gradient carries the loss scale too) under PP 2 with tied embeddings
    (the head's weight looked up as well) and ZeRO-2 against one process in the same dtype: both are
    the fp32 run plus half-precision rounding in other orders, so they differ by about one run's own
    distance from fp32 (tests/test_mixed_precision.py's rule): at most three times it, for the loss and
    the MTP loss (Adam, 5 steps)."""
    tiny = dict(BASE, optimizer="adam", lr=1e-2, lr_decay_style="constant", train_iters=5, clip_grad=1.0,
                global_batch_size=8)
    half = {dtype: True, **({"initial_loss_scale": 2.0 ** 12} if dtype == "fp16" else {})}
    fp32 = _train(config_from_dict(tiny))
    single = _train(config_from_dict(dict(tiny, **half)))
    got = run_ranks(_train, 2, config_from_dict(dict(tiny, **half, pipeline_model_parallel_size=2,
                                                     zero_stage=2)), timeout=300)[1]
    for key in ("loss", "mtp_loss"):
        rounding = max(abs(a[key] - b[key]) for a, b in zip(single, fp32))
        diff = max(abs(a[key] - b[key]) for a, b in zip(got, single))
        print(dtype, key, "PP 2 vs single max |diff|", diff, "single vs fp32", rounding)
        assert 0 < rounding and diff <= 3 * rounding, (key, diff, rounding)
    assert not any(m["skipped"] for m in single) and [m["skipped"] for m in got] == [0] * 5


def test_the_depths_embedding_has_the_models_dropout():
    """Megatron-core embeds the shifted tokens with the model's embedding, dropout included."""
    import models
    cfg = validate(config_from_dict(dict(BASE, hidden_dropout=0.5)), world_size=1)
    model = models.build_model(cfg)
    ids = torch.randint(0, 100, (2, 16))
    weight = model.mtp.embedding_weight(model)
    zeros = float((model.train().mtp.embed(ids, weight, model) == 0).float().mean())
    assert 0.4 < zeros < 0.6
    assert not (model.eval().mtp.embed(ids, weight, model) == 0).any()


LLAMA_MTP = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300, seq_length=16,
                 hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                 normalization="RMSNorm", activation="swiglu", add_bias_linear=False, num_query_groups=2,
                 untie_embeddings_and_output_weights=True, mtp_num_layers=1, micro_batch_size=2,
                 mock_data=True)
MEMORY = {  # name: (world, settings): the activation estimate equals what autograd keeps, byte for byte
    "two-depths-selective-dropout": (1, dict(LLAMA_MTP, mtp_num_layers=2, recompute_granularity="selective",
                                             hidden_dropout=0.1)),
    "full-recompute-bf16": (1, dict(LLAMA_MTP, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1, bf16=True)),
    "tp2-sp-layernorm": (2, dict(LLAMA_MTP, tensor_model_parallel_size=2, sequence_parallel=True,
                                 normalization="LayerNorm")),
    "pp2-tied": (2, dict(LLAMA_MTP, pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=False,
                         global_batch_size=8)),
    "cp2": (2, dict(LLAMA_MTP, context_parallel_size=2)),
    "pp2-untied-deepseek-moe": (2, dict(DEEPSEEK, pipeline_model_parallel_size=2, micro_batch_size=2,
                                        mock_data=True, global_batch_size=8)),
}


def _measure_activations(world, settings):
    import models
    from megazero.training.measure import measure_rank
    return measure_rank(validate(config_from_dict(settings), world), models.build_chunks, iters=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MEMORY))
def test_activation_estimate_counts_the_depths(name):
    """models/mtp_saved.py's figures, walked by the estimator over the schedule, equal the bytes autograd
    keeps on every rank (a depth is ~40% of this model's activations: the estimate without it is short
    by that much); the model-state bytes count the depths' weights (planning/model_state.py)."""
    import models.saved_activations as saved
    from megazero.planning.estimate import estimate_stages
    world, settings = MEMORY[name]
    rows = {r["pp_rank"]: r for r in estimate_stages(
        validate(config_from_dict(settings), world), device="cpu", backend="gloo", saved=saved)}
    est = {k: r["activation_bytes"] for k, r in rows.items()}
    ranks = run_ranks(_measure_activations, world, world, settings) if world > 1 else \
        [_measure_activations(1, settings)]
    for m in ranks:
        if "moe" in name:  # the MoE layers' estimate assumes balanced routing (tests/test_memory_moe.py)
            assert abs(est[m["pp_rank"]] - m["activation_bytes"]) <= 0.1 * m["activation_bytes"]
        else:
            assert est[m["pp_rank"]] == m["activation_bytes"], (m["pp_rank"], est, m["activation_bytes"])
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):  # the depths' weights counted too
            assert rows[m["pp_rank"]][key] == m[key], (key, m["pp_rank"])
    last = max(est)
    without = {r["pp_rank"]: r["activation_bytes"] for r in estimate_stages(
        validate(config_from_dict(dict(settings, mtp_num_layers=None)), world), device="cpu", backend="gloo",
        saved=saved)}
    assert est[last] > 1.2 * without[last]
