"""The memory model: parameter counts, the exact model state, and estimate vs measurement.

The six-layout test runs each configuration on forked gloo ranks with the trainer's pieces
(megazero.training.measure) and checks the estimate per component: model state exact, activations (bytes
autograd keeps for backward, peak over the schedule) within 10%."""
import json
import os
import subprocess
import sys

import pytest

from megazero.planning.activations import Dims, dims
from megazero.config import config_from_dict, validate
from megazero.planning.estimate import estimate, estimate_rank, estimate_stages, stage_params, total_params
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from models import saved_activations
from models.saved_activations import core_bytes, layer_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300, seq_length=16,
            hidden_dropout=0.0, attention_dropout=0.0)  # dropout only where a layout asks for it
LLAMA = dict(GPT2, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False, num_query_groups=2, untie_embeddings_and_output_weights=True)

# today's dense models: Gemma 2's pieces (sandwich norms, GeGLU, embedding scale, soft-caps in the
# blockwise kernel, alternating windows), OLMo 2's (norms after the sublayers, q/k norms over all
# heads) and Qwen3's (per-head q/k norms) with a window and a layer without RoPE
GEMMA2 = dict(LLAMA, activation="geglu", norm_position="sandwich", scale_embedding=True, kv_channels=16,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, window_size=[5, 0],
              window_attn_skip_freq=2)
OLMO2 = dict(LLAMA, qk_layernorm=True, qk_layernorm_scope="all", norm_position="post")
QWEN3 = dict(LLAMA, qk_layernorm=True, window_size=[5, 0], no_rope_freq=2)

SAVED = saved_activations  # what the model declares it saves for backward
ARCHS = {"gpt2": GPT2, "llama": LLAMA, "gemma2": GEMMA2, "olmo2": OLMO2, "qwen3": QWEN3}
ARCH_PARAMS = [pytest.param(a, id=n, marks=[pytest.mark.slow] if n not in ("gpt2", "llama") else [])
               for n, a in ARCHS.items()]


def cfg_of(world=1, **kw):
    cfg = config_from_dict(dict(mock_data=True, **kw))
    return validate(cfg, world)


def _count(settings):
    import models
    cfg = cfg_of(4, **settings)
    par = cfg.parallel
    mesh = ParallelMesh.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size)
    chunks = models.build_chunks(cfg, mesh)
    return mesh.coord("pp"), sum(p.numel() for c in chunks for p in c.parameters())


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_stage_params_match_the_built_model(arch):
    settings = dict(arch, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    cfg = cfg_of(4, **settings)
    for pp_rank, n in run_ranks(_count, 4, settings):
        assert n == stage_params(cfg, pp_rank, saved=SAVED)


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_total_params_match_one_process(arch):
    import models
    cfg = cfg_of(1, **dict(arch, vocab_size=256, make_vocab_size_divisible_by=128))  # no padding
    assert sum(p.numel() for p in models.build_model(cfg).parameters()) == total_params(cfg)


def test_rank_never_holds_more_than_the_padded_model():
    cfg = cfg_of(8, **dict(GPT2, vocab_size=50257), tensor_model_parallel_size=2)
    assert total_params(cfg) < total_params(cfg, padded=True)
    assert estimate(cfg, saved=SAVED)[0]["params_per_rank"] <= total_params(cfg, padded=True)


def test_estimate_follows_the_zero_formula():
    # one bucket whose size is a multiple of DP: the layout formula holds exactly
    cfg = cfg_of(8, **GPT2, bf16=True, tensor_model_parallel_size=2)
    rows = estimate(cfg, saved=SAVED)
    n = 4
    psi = rows[0]["param_bytes"] // 2
    assert [r["param_bytes"] for r in rows] == [2 * psi, 2 * psi, 2 * psi, 2 * psi // n]
    assert [r["grad_bytes"] for r in rows] == [4 * psi, 4 * psi, 4 * psi // n, 4 * psi // n]
    assert [r["optim_bytes"] for r in rows] == [12 * psi, 12 * psi // n, 12 * psi // n, 12 * psi // n]
    assert [r["master_bytes"] for r in rows] == [4 * psi, 4 * psi // n, 4 * psi // n, 4 * psi // n]
    assert 0 <= psi - rows[0]["params_per_rank"] < n  # bucket padding only
    assert rows[0]["comm_bytes"] == 0 and rows[2]["comm_bytes"] > 0  # ZeRO-2 reduce-scatters via a bucket


def test_recomputation_orders_activations_and_full_beats_selective():
    base = dict(GPT2, bf16=True, tensor_model_parallel_size=2, hidden_dropout=0.1, attention_dropout=0.1)
    acts = [estimate_rank(cfg_of(8, **base, **extra), 0, saved=SAVED)["activation_bytes"]
            for extra in ({}, {"recompute_granularity": "selective"}, {"recompute_granularity": "full"})]
    assert acts[0] > acts[1] > acts[2] > 0
    # full recomputation stays below selective on a deep pipeline too (the bug the old rule had)
    deep = dict(LLAMA, num_layers=8, pipeline_model_parallel_size=8, global_batch_size=16, micro_batch_size=1)
    full, sel = (estimate_rank(cfg_of(8, **deep, recompute_granularity=g), 0, saved=SAVED)["activation_bytes"]
                 for g in ("full", "selective"))
    assert full < sel


def test_flash_attention_keeps_no_seq_squared_term():
    cfg = cfg_of(1, **dict(LLAMA, seq_length=512, hidden_size=64), bf16=True, micro_batch_size=1)
    D = dims(cfg, "cuda")
    assert D.backend == "flash"
    doubled = dims(cfg_of(1, **dict(LLAMA, seq_length=1024, hidden_size=64), bf16=True,
                          micro_batch_size=1), "cuda")
    assert core_bytes(doubled) == 2 * core_bytes(D)  # linear in s: no a*s^2 scores kept
    math = Dims(**dict(D.__dict__, backend="math", attention_dropout=True))
    math2 = Dims(**dict(math.__dict__, s=2 * math.s))
    s2 = math.b * math.ap * math.s * math.s  # probabilities, dropout mask, dropped probabilities
    assert core_bytes(math2) - 2 * core_bytes(math) == 2 * s2 * (2 * math.E + math.M)


def _measure_one(settings):
    import models
    from megazero.training.measure import measure_rank
    return measure_rank(cfg_of(1, **settings), models.build_chunks, iters=1)["activation_bytes"]


@pytest.mark.slow
def test_a_window_costs_one_mask_per_chunk_measured_and_estimated():
    """Four layers attending within 6 of 32 positions: SDPA keeps the chunk's one additive fp32 mask
    (4 s^2 bytes), not one per layer; the estimate says the same, and both whole figures agree."""
    base = dict(LLAMA, seq_length=32, micro_batch_size=2)
    sizes = {}
    for name, extra in (("full", {}), ("window", dict(window_size=[5, 0])),
                        ("two-windows", dict(window_size=[5, 0], window_attn_skip_freq=[1, 0, 1, 0]))):
        settings = dict(base, **extra)
        (est,) = estimate_stages(cfg_of(1, **settings), device="cpu", backend="gloo", saved=SAVED)
        sizes[name] = (est["activation_bytes"], _measure_one(settings))
        assert sizes[name][0] == sizes[name][1], (name, sizes[name])
    mask = 4 * 32 * 32  # one micro-batch in flight, whatever its size
    for name in ("window", "two-windows"):
        assert sizes[name][1] - sizes["full"][1] == mask, sizes


@pytest.mark.slow
def test_packed_documents_cost_one_batch_mask_per_window_measured_and_estimated():
    """--reset-attention-mask: SDPA keeps one [b, 1, s, s] fp32 mask per distinct window (the window
    folded in), E b s^2 bytes; measured and estimated alike, and the window's own s^2 mask is gone."""
    base = dict(LLAMA, seq_length=32, micro_batch_size=2, tokenizer_type="NullTokenizer", vocab_size=299)
    sizes = {}
    for name, extra in (("plain", {}), ("documents", dict(reset_attention_mask=True)),
                        ("documents-window", dict(reset_attention_mask=True, window_size=[5, 0])),
                        ("documents-two-windows", dict(reset_attention_mask=True, window_size=[5, 0],
                                                       window_attn_skip_freq=[1, 0, 1, 0]))):
        settings = dict(base, **extra)
        (est,) = estimate_stages(cfg_of(1, **settings), device="cpu", backend="gloo", saved=SAVED)
        sizes[name] = (est["activation_bytes"], _measure_one(settings))
        assert sizes[name][0] == sizes[name][1], (name, sizes[name])
    mask = 4 * 2 * 32 * 32
    assert sizes["documents"][1] - sizes["plain"][1] == mask
    assert sizes["documents-window"][1] - sizes["plain"][1] == mask
    assert sizes["documents-two-windows"][1] - sizes["plain"][1] == 2 * mask, sizes


def test_layer_bytes_by_hand_gpt2_fp32():
    """One GPT-2 layer on CPU, fp32, TP 1, no dropout: every saved tensor by hand."""
    cfg = cfg_of(1, **GPT2, micro_batch_size=2)
    s, b, h, a, f = 16, 2, 32, 4, 128
    T = s * b
    norm = 4 * T * h + 2 * 4 * T                            # fp32 input, mean, rstd
    attention = 4 * T * 3 * h + 4 * T * h + 4 * b * a * s  # qkv (q, k, v are views of it), out, lse
    mlp = 4 * T * h + 2 * 4 * T * f                          # input, gelu in and out
    assert layer_bytes(dims(cfg, "cpu")) == 2 * norm + 4 * T * h + attention + mlp


def test_pipeline_schedule_counts_in_flight_micro_batches():
    base = dict(GPT2, num_layers=4, pipeline_model_parallel_size=4, global_batch_size=16, micro_batch_size=2)
    one_f = estimate_stages(cfg_of(4, **base), saved=SAVED)
    gpipe = estimate_stages(cfg_of(4, **base, pipeline_schedule="gpipe"), saved=SAVED)
    assert [r["in_flight_micro_batches"] for r in one_f] == [4, 3, 2, 1]
    assert [r["in_flight_micro_batches"] for r in gpipe] == [8, 8, 8, 8]
    assert gpipe[1]["activation_bytes"] == 8 * one_f[1]["activation_bytes"] // 3


def test_offload_moves_optimizer_bytes_to_the_host():
    on = estimate(cfg_of(2, **GPT2, zero_stage=2, offload_optimizer=True), device="cpu", saved=SAVED)
    off = estimate(cfg_of(2, **GPT2, zero_stage=2), device="cpu", saved=SAVED)
    assert on[2]["optim_on_cpu"] and not on[0]["optim_on_cpu"]
    assert on[2]["total_bytes"] == off[2]["total_bytes"] - off[2]["optim_bytes"]
    # fp32 params offloaded need a separate fp32 master copy on the host: 4 + 8 bytes per param
    assert on[2]["optim_bytes"] == 12 * on[2]["param_bytes"] // 4 // 2
    assert on[2]["host_bytes"] == on[2]["optim_bytes"] and off[2]["host_bytes"] == 0


def test_estimate_memory_script_json():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "estimate_memory.py"), "--json",
                          "--model", "gpt2-small", "--world-size", "8", "--tensor-model-parallel-size", "2",
                          # 2 in flight: ZeRO-2 can exceed ZeRO-1
                          "--bf16", "--max-reductions-in-flight", "1"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert data["data_parallel_size"] == 4 and len(data["stages"]) == 4
    keys = {"param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "total_bytes", "comm_bytes",
            "gathered_param_bytes", "temporary_bytes", "host_bytes"}
    assert all(set(s) >= keys for s in data["stages"])
    totals = [s["total_bytes"] for s in data["stages"]]
    assert totals[0] > totals[1] > totals[2]
    assert data["stages"][3]["param_bytes"] * 4 == data["stages"][2]["param_bytes"]


def test_estimate_memory_script_bad_flag_exits_2():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "estimate_memory.py"), "--model",
                          "gpt2-small", "--world-size", "3", "--tensor-model-parallel-size", "2"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--tensor-model-parallel-size" in res.stderr


# ---- estimate vs measurement ----------------------------------------------------------------
LAYOUTS = {
    "tp2-dp2-zero1-bf16-selective-dropout": dict(GPT2, tensor_model_parallel_size=2, zero_stage=1, bf16=True,
                                                 recompute_granularity="selective", hidden_dropout=0.1,
                                                 attention_dropout=0.1),
    "tp2sp-pp2-1f1b-full-llama": dict(LLAMA, tensor_model_parallel_size=2, sequence_parallel=True,
                                      pipeline_model_parallel_size=2, recompute_granularity="full",
                                      global_batch_size=8),
    "pp2-interleaved-dp2-zero2": dict(GPT2, pipeline_model_parallel_size=2, zero_stage=2,
                                      num_layers_per_virtual_pipeline_stage=1, global_batch_size=16,
                                      ddp_bucket_size=5000),
    "pp4-gpipe-bf16-llama": dict(LLAMA, pipeline_model_parallel_size=4, pipeline_schedule="gpipe", bf16=True,
                                 global_batch_size=8),
    "dp4-zero3-block-llama": dict(LLAMA, zero_stage=3, recompute_granularity="full", recompute_method="block",
                                  recompute_num_layers=2, global_batch_size=16),
    "tp4sp-zero2-offload-bf16": dict(LLAMA, num_query_groups=4, tensor_model_parallel_size=4,
                                     sequence_parallel=True, bf16=True, zero_stage=2, offload_optimizer=True),
    "pp2-dp2-zero3-bf16": dict(GPT2, pipeline_model_parallel_size=2, zero_stage=3, bf16=True,
                               global_batch_size=16),
    # sliding windows of 6 positions in 16-token sequences: one additive mask per chunk, shared
    "tp2-pp2-window-alternating": dict(LLAMA, window_size=[5, 0], window_attn_skip_freq=2,
                                       tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                       global_batch_size=8),
    "pp2-dp2-gemma2-bf16-zero1": dict(GEMMA2, pipeline_model_parallel_size=2, bf16=True, zero_stage=1,
                                      global_batch_size=8),
    "tp2sp-dp2-olmo2-selective": dict(OLMO2, tensor_model_parallel_size=2, sequence_parallel=True,
                                      recompute_granularity="selective"),
    "dp4-qwen3-window-nope-full": dict(QWEN3, recompute_granularity="full", recompute_num_layers=2,
                                       global_batch_size=16),
}


def _measure(settings):
    import models
    from megazero.training.measure import measure_rank
    return measure_rank(cfg_of(4, **settings), models.build_chunks, iters=1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_estimate_matches_measurement(name):
    settings = dict(LAYOUTS[name], micro_batch_size=2)
    cfg = cfg_of(4, **settings)
    est = {r["pp_rank"]: r for r in estimate_stages(cfg, device="cpu", backend="gloo", saved=SAVED)}
    for m in run_ranks(_measure, 4, settings):
        e = est[m["pp_rank"]]
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert e[key] == m[key], (name, m["rank"], key)
        assert m["activation_bytes"] > 0
        assert abs(e["activation_bytes"] - m["activation_bytes"]) <= 0.10 * m["activation_bytes"], (name, m)
        assert m["grad_bytes"] <= m["peak_grad_bytes"] <= 1.05 * e["peak_grad_bytes"], (name, m)
        # autograd's views of ZeRO-3's gathered weights hold nothing once a bucket is freed (its
        # storage is resized to 0); with the bucket dropped instead they held 50-123 KB here
        assert m["saved_param_bytes"] == 0, (name, m)
        assert e["pipeline_input_bytes"] == m["pipeline_input_bytes"], (name, m)


@pytest.mark.slow
def test_measure_script_json():
    args = [sys.executable, os.path.join(ROOT, "scripts", "estimate_memory.py"), "--measure", "--json",
            "--world-size", "4", "--iters", "1", "--num-layers", "4", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "300",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=300).stdout
    data = json.loads(out)
    assert [s["pp_rank"] for s in data["stages"]] == [0, 1]
    for stage in data["stages"]:
        comps = stage["components"]
        assert comps["param_bytes"]["estimate"] == comps["param_bytes"]["measured"] > 0
        act = comps["activation_bytes"]
        assert abs(act["estimate"] - act["measured"]) <= 0.1 * act["measured"]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "mem.png"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "estimate_memory.py"), "--plot", str(path),
                    "--model", "gpt2-small", "--world-size", "8", "--bf16"], check=True, capture_output=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- one bucket plan for the optimizer and the estimator --------------------------------------
def _optimizer_buckets(settings):
    import models
    from megazero.zero import build_optimizer
    cfg = cfg_of(2, **settings)
    par = cfg.parallel
    mesh = ParallelMesh.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size)
    opt = build_optimizer(models.build_chunks(cfg, mesh), mesh, cfg)
    return mesh.coord("pp"), [(b.chunk, b.unit, b.kind, b.numel) for b in opt.buckets]


def _estimated_buckets(settings, pp_rank):
    from megazero.planning.model_state import plan_buckets, rank_chunks
    cfg = cfg_of(2, **settings)
    return [(b.chunk, b.unit, b.kind, b.numel)
            for b in plan_buckets(cfg, rank_chunks(cfg, pp_rank, SAVED), cfg.parallel.zero_stage)]


@pytest.mark.parametrize("settings", [dict(GPT2, zero_stage=2),
                                      dict(LLAMA, pipeline_model_parallel_size=2, zero_stage=1),
                                      dict(GPT2, zero_stage=3)], ids=["dp2-zero2", "pp2-zero1", "dp2-zero3"])
def test_bucket_plan_has_one_owner(settings, monkeypatch):
    """The estimator cuts buckets with the optimizer's own rule: changing the default bucket-size
    bound in megazero.zero.buckets changes the optimizer's and the estimator's plans alike."""
    from megazero.zero import buckets

    def plans():
        got = {}
        for pp_rank, built in run_ranks(_optimizer_buckets, 2, settings):
            assert _estimated_buckets(settings, pp_rank) == built
            got[pp_rank] = len(built)
        return got

    default = plans()
    monkeypatch.setattr(buckets, "MIN_BUCKET", 4000)  # below a layer of these models
    monkeypatch.setattr(buckets, "MAX_BUCKET", 4000)
    smaller = plans()
    assert all(smaller[r] > default[r] for r in default)  # ZeRO-3 units too: cut at the same bound


# ---- context parallelism: activation bytes per rank ----------------------------------------------
CP_LONG = dict(LLAMA, num_layers=2, seq_length=256, global_batch_size=4, micro_batch_size=1)


@pytest.mark.slow
def test_context_parallel_activations_estimate_and_cp1():
    """CP 4 holds a quarter of the sequence: its measured activation bytes are within 10% of the
    estimate and at most 0.3x CP 1's at the same sequence length (CP 1's also within 10%)."""
    results = {}
    for cp in (1, 4):
        settings = dict(CP_LONG, context_parallel_size=cp)
        cfg = cfg_of(4, **settings)
        (est,) = estimate_stages(cfg, device="cpu", backend="gloo", saved=SAVED)
        measured = run_ranks(_measure, 4, settings)
        for m in measured:
            error = abs(est["activation_bytes"] - m["activation_bytes"])
            assert error <= 0.10 * m["activation_bytes"], (cp, m)
            for key in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert est[key] == m[key], (cp, key)
        results[cp] = max(m["activation_bytes"] for m in measured)
    assert results[4] <= 0.3 * results[1], results
