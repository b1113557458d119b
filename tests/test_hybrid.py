"""Hybrid layer stacks (--hybrid-layer-pattern): Megatron-LM's flags, one-line refusals, training under
tensor parallelism (with SP and full recompute) against one process, and generation that carries each
recurrent layer's state (token by token equals the whole-sequence forward)."""
import json
import re

import pytest
import torch

import megazero_models as models
from megazero.config import ConfigError, config_from_dict, validate
from megazero.config.parsing import parse_args
from megazero.process.local_ranks import run_ranks
from megazero_models.layers import KVCache
from test_megatron_scripts import sp_model  # noqa: F401 - the fixture
from tolerance import R_TRAIN, U32

# the tiny hybrid: M*M-M*M-, 8 Mamba heads in 2 groups
HYBRID = dict(hybrid_layer_pattern="M*M-M*M-", num_layers=8, mamba_num_heads=8, mamba_head_dim=8,
              mamba_num_groups=2, mamba_state_dim=8, mamba_chunk_size=8, position_embedding_type="none",
              normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True,
              activation="squared_relu", num_query_groups=2)  # Nemotron-H's MLP: relu(x)^2
NEMOTRON_H_MOE_LIKE = dict(HYBRID, hybrid_layer_pattern="ME*E", num_layers=4, num_experts=4,
                           moe_router_topk=2, moe_ffn_hidden_size=16)
QWEN3_NEXT_LIKE = dict(hybrid_layer_pattern="G-G-*-", num_layers=6, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_chunk_size=8, position_embedding_type="rope", normalization="RMSNorm",
                       add_bias_linear=False, activation="swiglu", num_query_groups=2,
                       attention_output_gate=True, qk_layernorm=True)  # Qwen3-Next's gated attention


def _cfg(model, tp=1, pp=1, zero=0, iters=3, **extra):
    settings = dict(mock_data=True, hidden_size=32, num_attention_heads=4, seq_length=20, vocab_size=100,
                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, zero_stage=zero,
                    global_batch_size=4, micro_batch_size=1, train_iters=iters, eval_interval=2, eval_iters=1,
                    optimizer="sgd", lr=0.1, log_interval=100, hidden_dropout=0.0, attention_dropout=0.0)
    return config_from_dict(dict(settings, **model, **extra))


def _train_history(cfg):
    from megazero.training import train
    return train(cfg, models.build_chunks)


def test_megatron_flags_build_the_pattern():
    cfg = parse_args(["--mock-data", "--hybrid-override-pattern", "M*M-", "--num-layers", "4",
                      "--mamba-num-heads", "8", "--mamba-head-dim", "16", "--mamba-state-dim", "8",
                      "--mamba-num-groups", "2", "--is-hybrid-model", "--position-embedding-type", "none"],
                     world_size=1)
    m = cfg.model
    assert (m.hybrid_layer_pattern, m.mamba_num_heads, m.mamba_head_dim, m.mamba_state_dim,
            m.mamba_num_groups, m.position_embedding_type) == ("M*M-", 8, 16, 8, 2, "none")
    model = models.build_model(cfg)
    kinds = [type(getattr(layer, "mixer", getattr(layer, "attention", getattr(layer, "mlp", None)))).__name__
             for layer in model.decoder.values()]
    assert kinds == ["MambaMixer", "Attention", "MambaMixer", "MLP"]
    moe = models.build_model(validate(_cfg(NEMOTRON_H_MOE_LIKE), 1))  # the E layers are the MoE layers
    mlps = [type(layer.mlp).__name__ for layer in moe.decoder.values() if hasattr(layer, "mlp")]
    assert mlps == ["MoELayer"] * 2
    # Megatron-LM's default head count: 2 x hidden / head dim
    # Megatron-LM's default head count, 2 x hidden / head dim; the pattern's length without --num-layers
    cfg = parse_args(["--mock-data", "--hybrid-layer-pattern", "M-M", "--mamba-head-dim", "16",
                      "--mamba-num-groups", "2"], world_size=1)
    assert cfg.model.num_layers == 3 and models.build_model(cfg).decoder["0"].mixer.heads == 2 * 64 // 16


@pytest.mark.parametrize("flags,world,needle", [
    (["--hybrid-layer-pattern", "M*X-", "--num-layers", "4"], 1, "'X' is not a layer symbol"),
    (["--hybrid-layer-pattern", "M*M-", "--num-layers", "2"], 1,
     "has 4 layers but --num-layers is 2; set --num-layers 4"),
    (["--hybrid-layer-pattern", "M*/M", "--num-layers", "2"], 1, "multi-token prediction"),
    (["--hybrid-layer-pattern", "M*E-", "--num-layers", "4"], 1, "add --num-experts"),
    (["--hybrid-layer-pattern", "M*", "--context-parallel-size", "2", "--seq-length", "8",
      "--mamba-num-groups", "1"], 2, "chunks of 2 tokens, fewer than the 3 past inputs of the Mamba-2 conv"),
    (["--hybrid-layer-pattern", "G*", "--context-parallel-size", "2", "--seq-length", "8",
      "--linear-conv-kernel-dim", "4"], 2, "fewer than the 3 past inputs of the Gated DeltaNet conv"),
    (["--hybrid-layer-pattern", "M*", "--num-layers", "2", "--mamba-num-groups", "3",
      "--mamba-num-heads", "6", "--tensor-model-parallel-size", "2"], 2,
     "--mamba-num-groups 3 is not divisible by --tensor-model"),
    (["--hybrid-layer-pattern", "M*", "--num-layers", "2", "--mamba-num-heads", "6"], 1,
     "--mamba-num-heads 6 is not divisible by --mamba-num-groups 8"),
    (["--hybrid-layer-pattern", "G*", "--num-layers", "2", "--linear-num-value-heads", "6"], 1,
     "--linear-num-value-heads 6 is not divisible by --linear-num-key-heads 16"),
    (["--mamba-inference-ssm-states-dtype", "fp32"], 1, "--mamba-inference-ssm-states-dtype: this Mamba"),
    (["--hybrid-layer-pattern", "G*", "--reset-attention-mask"], 1,
     "--reset-attention-mask with Gated DeltaNet layers"),
    (["--hybrid-layer-pattern", "G*", "--num-layers", "2", "--mtp-num-layers", "1"], 1,
     "--mtp-num-layers with --hybrid-layer-pattern"),
])
def test_bad_settings_get_one_line_naming_the_flag(flags, world, needle):
    with pytest.raises(ConfigError) as err:
        parse_args(["--mock-data"] + flags, world_size=world)
    assert needle in str(err.value) and "\n" not in str(err.value)


# every kind of layer: M, G, attention, MLP, MoE
ALL_KINDS = dict(HYBRID, hybrid_layer_pattern="MG*-E-", num_layers=6, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_chunk_size=8, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
SLOW = pytest.mark.slow


@pytest.mark.parametrize("model,recompute", [
    pytest.param(HYBRID, "full", id="M*M-M*M-"),
    pytest.param(HYBRID, "selective", id="M*M-M*M--selective", marks=SLOW),
    pytest.param(QWEN3_NEXT_LIKE, "full", id="G-G-*-", marks=SLOW),
    pytest.param(QWEN3_NEXT_LIKE, "selective", id="G-G-*--selective"),
    pytest.param(NEMOTRON_H_MOE_LIKE, "full", id="ME*E", marks=SLOW)])
def test_tp2_sequence_parallel_recompute_matches_one_process(model, recompute):
    """TP 2 with SP and full recomputation, or selective (the mixers replay conv, scan and norm)."""
    (ref,) = run_ranks(_train_history, 1, _cfg(model))
    layout = dict(tp=2, sequence_parallel=True, recompute_granularity=recompute)
    got = run_ranks(_train_history, 2, _cfg(model, **layout))
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [m[key] for m in ref if key in m], [m[key] for m in got[0] if key in m]
        # fp32 SGD training under another layout (tolerance.py)
        assert len(a) == len(b) >= 2 and b == pytest.approx(a, rel=R_TRAIN), key
    assert ref[-1]["loss"] < ref[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("world,layout,model", [
    pytest.param(8, dict(tp=2, pp=2, zero=2), HYBRID, id="tp2-pp2-dp2-zero2"),
    pytest.param(2, dict(zero=3), ALL_KINDS, id="dp2-zero3-MG*-E-"),
    pytest.param(4, dict(pp=2, zero=1, num_layers_per_virtual_pipeline_stage=1, global_batch_size=8),
                 QWEN3_NEXT_LIKE, id="pp2-virtual-dp2-zero1-G-G-*-")])
def test_layouts_match_one_process(world, layout, model):
    (ref,) = run_ranks(_train_history, 1, _cfg(model, **{k: v for k, v in layout.items()
                                                         if k == "global_batch_size"}))
    got = run_ranks(_train_history, world, _cfg(model, **layout))
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [m[key] for m in ref if key in m], [m[key] for m in got[0] if key in m]
        assert len(a) == len(b) >= 2 and b == pytest.approx(a, rel=R_TRAIN), key


@pytest.mark.parametrize("model", [HYBRID, QWEN3_NEXT_LIKE], ids=["M*M-M*M-", "G-G-*-"])
def test_generation_carries_recurrent_state(model):
    """Logits of a prompt fed whole, then one token at a time through the cache (conv and recurrent
    states of the M / G layers, keys and values of the attention layers), equal the whole-sequence
    forward at every position (fp32: the same sums in another order, bounded like a forward)."""
    cfg = validate(_cfg(model), world_size=1)
    torch.manual_seed(0)
    model = models.build_model(cfg).eval()
    ids = torch.randint(0, 100, (2, 13))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model.decode(ids[:, :5], cache)]
        steps += [model.decode(ids[:, t:t + 1], cache) for t in range(5, 13)]
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got, full, rtol=0.0, atol=200 * U32 * float(full.abs().max()))
    assert sorted(cache.recurrent) == [i for i, k in enumerate(cfg.model.hybrid_layer_pattern) if k in "MG"]


def _build_and_save(settings, directory):
    """As the trainer builds it (deferred on the meta device, valued bucket by bucket by the ZeRO
    optimizer; an eager fallback fails), saved as iteration 0."""
    import warnings
    from megazero.checkpoint import save
    from megazero.optim.precision import compute_dtype
    from megazero.tensor_parallel.deferred import DeferredInitWarning, build_chunks, realize_rest
    from megazero.tensor_parallel.rng import seed_default_generators
    from megazero.training.loop import build_mesh
    from megazero.zero import build_optimizer
    cfg = validate(_cfg(ALL_KINDS, **settings), torch.distributed.get_world_size())
    mesh = build_mesh(cfg)
    seed_default_generators(cfg.training.seed, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeferredInitWarning)
        chunks = build_chunks(models.build_chunks, cfg, mesh, compute_dtype(cfg))
    optimizer = build_optimizer(chunks, mesh, cfg)
    realize_rest(chunks, mesh.device, compute_dtype(cfg))
    save(directory, 0, chunks, optimizer, mesh, cfg)


@pytest.mark.parametrize("world,settings", [
    (2, dict(tp=2, sequence_parallel=True, zero=1)), (2, dict(pp=2, zero=2)), (2, dict(zero=3))],
    ids=["tp2-sp-zero1", "pp2-zero2", "dp2-zero3"])
def test_initial_values_equal_one_process_bitwise(tmp_path, world, settings):
    """Every parameter of every kind of layer, built deferred at another layout and joined by the
    checkpoint into full tensors, equals the one-process eager build bitwise."""
    from megazero.checkpoint import read_weights
    want = models.full_state_dict(models.build_chunks(validate(_cfg(ALL_KINDS), 1))[0])
    run_ranks(_build_and_save, world, settings, str(tmp_path))
    got = read_weights(str(tmp_path))[3]
    assert sorted(got) == sorted(want)
    assert any(".mixer.A_log" in n for n in want) and any(".mixer.conv1d.weight" in n for n in want)
    assert [n for n in want if not torch.equal(want[n], got[n])] == []


@pytest.mark.slow
def test_bench_ssm_quick_runs():
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "scripts/bench_ssm.py", "--quick", "--json", "-"], cwd=root,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    assert {r["kind"] for r in rows} == {"Mamba-2", "Gated DeltaNet", "attention"}
    assert all(r["seconds"] > 0 and r["saved_bytes"] > 0 for r in rows)


def _greedy(model_settings, tp):
    """models.generate's greedy tokens on this rank (TP ranks each call it, as scripts/generate.py)."""
    from megazero.mesh import ParallelMesh
    cfg = validate(_cfg(model_settings, tp=tp), tp)
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else None
    model = models.build_model(cfg, mesh).eval()
    ids = torch.arange(3, 10).view(1, 7)
    return models.generate(model, ids, max_new_tokens=6)


@pytest.mark.parametrize("model", [HYBRID, QWEN3_NEXT_LIKE], ids=["M*M-M*M-", "G-G-*-"])
def test_greedy_generation_equals_argmax_of_the_whole_forward_and_tp2(model):
    """Greedy decoding through the cache picks what the argmax of a whole-sequence forward over the
    tokens so far picks, and TP 2 generates the same tokens."""
    out = _greedy(model, 1)
    whole = models.build_model(validate(_cfg(model), 1)).eval()
    with torch.no_grad():
        for t in range(7, out.shape[1]):
            assert int(whole(out[:, :t])[0, -1].argmax()) == int(out[0, t])
    assert all(torch.equal(o, out) for o in run_ranks(_greedy, 2, model, 2))


def test_squared_relu_mlp():
    """--squared-relu (Megatron-LM's flag): the MLP is fc2(relu(fc1 x)^2), checked in float64."""
    cfg = parse_args(["--mock-data", "--squared-relu", "--num-layers", "1", "--hidden-size", "16",
                      "--ffn-hidden-size", "24"], world_size=1)
    assert cfg.model.activation == "squared_relu" and not cfg.model.gated_mlp
    mlp = models.build_model(cfg).decoder["0"].mlp.double()
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    want = torch.relu(x @ mlp.fc1.weight.T + mlp.fc1.bias).square() @ mlp.fc2.weight.T + mlp.fc2.bias
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_hugging_face_export_refuses_a_hybrid_stack_by_name():
    """A G layer in a hybrid pattern has no transformers architecture (Mamba2 and NemotronH hold M, *, -
    and E); Gated DeltaNet in transformer layers and gated attention export as Qwen3Next
    (tests/test_hf_qwen3next.py), and no other architecture holds them."""
    from megazero_models.hf_export import arch_of, missing
    cfg = validate(_cfg(QWEN3_NEXT_LIKE), 1)
    with pytest.raises(ConfigError, match="--hybrid-layer-pattern 'G-G-\\*-' has 'G' layers"):
        arch_of(cfg.model, cfg.moe)
    gated = dict(QWEN3_NEXT_MEGATRON, experimental_attention_variant=None, linear_attention_freq=None)
    for model, needle in ((QWEN3_NEXT_MEGATRON, "Gated DeltaNet layers, --experimental-attention-variant"),
                          (gated, "the attention output gate, --attention-output-gate")):
        cfg = validate(_cfg(model), 1)
        assert arch_of(cfg.model, cfg.moe) == "qwen3_next"
        assert needle in missing(cfg.model, "qwen3", cfg.moe)


def test_attention_output_gate():
    """--attention-output-gate (Qwen3-Next): what reaches the output projection is attention's output
    times sigmoid(x W_gate), checked in float64 against the same layer without the gate."""
    cfg = parse_args(["--mock-data", "--attention-output-gate", "--num-layers", "1", "--hidden-size", "16",
                      "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2"],
                     world_size=1)
    att = models.build_model(cfg).decoder["0"].attention.double().eval()  # no attention dropout
    seen = []
    att.proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    att(x)
    gate, att.gate = att.gate, None
    att(x)
    torch.testing.assert_close(seen[0], seen[1] * torch.sigmoid(x @ gate.weight.T + gate.bias),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="--attention-output-gate with --multi-latent-attention"):
        parse_args(["--mock-data", "--attention-output-gate", "--multi-latent-attention"], world_size=1)


def test_flops_count_each_kind_of_layer():
    """Model FLOPs of a hybrid step, written out by hand for M*-G (Megatron-LM's per-kind counts)."""
    from megazero.planning.flops import model_flops_per_iteration, recompute_flops_per_iteration
    model = dict(QWEN3_NEXT_LIKE, **HYBRID)
    model.update(hybrid_layer_pattern="M*-G", num_layers=4, attention_output_gate=False, ffn_hidden_size=64,
                 activation="gelu")
    cfg = validate(_cfg(model, recompute_granularity="selective"), 1)
    h, s, V = 32, 20, cfg.model.padded_vocab_size
    d_in, n, heads = 8 * 8, 8, 8  # Mamba: 8 heads of 8, 2 groups of state 8
    mamba = 2 * h * (2 * d_in + 2 * 2 * n + heads) + 2 * d_in * h + 7 * d_in * n
    q, kv = 4 * 8, 2 * 8  # attention: 4 heads, 2 groups, 8 channels
    attention = 2 * h * (q + 2 * kv) + 2 * q * h + 4 * s * q
    mlp = 2 * 2 * h * 64
    k, v = 2 * 8, 4 * 8  # DeltaNet: 2 key heads of 8, 4 value heads of 8
    deltanet = 2 * (h * (2 * k + 2 * v + 2 * 4) + 4 * (2 * k + v) + 4 * 4 * 8 * 8 + h * v)
    tokens = cfg.training.global_batch_size * s
    forward = mamba + attention + mlp + deltanet + 2 * h * V
    assert model_flops_per_iteration(cfg) == pytest.approx(3 * forward * tokens, rel=1e-12)
    replayed = 7 * d_in * n + 4 * s * q + 2 * (4 * (2 * k + v) + 4 * 4 * 8 * 8)  # scan, core, rule
    assert recompute_flops_per_iteration(cfg) == pytest.approx(replayed * tokens, rel=1e-12)


GATED_BIASED = dict(ALL_KINDS, add_bias_linear=True, attention_output_gate=True)


@pytest.mark.parametrize("model", [ALL_KINDS, GATED_BIASED], ids=["MG*-E-", "MG*-E--gate"])
def test_estimator_counts_the_model_parameters(model):
    """The estimator's parameter count (the start-up line's, the planner's) equals the model's."""
    from megazero.planning.estimate import total_params
    cfg = validate(_cfg(model), 1)
    built = models.build_model(cfg)
    pad = (cfg.model.padded_vocab_size - cfg.model.vocab_size) * cfg.model.hidden_size
    tied = 1 if not cfg.model.untie_embeddings_and_output_weights else 2
    assert total_params(cfg) == sum(p.numel() for p in built.parameters()) - tied * pad


def test_megatron_hybrid_spec_is_accepted_with_a_pattern():
    """Megatron-LM's hybrid scripts name the stack's spec: accepted (and named) with a pattern."""
    spec = ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    cfg = parse_args(["--mock-data", "--hybrid-layer-pattern", "G*"] + spec, world_size=1)
    assert any("--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec" in n for n in cfg.notes)
    # alone, as pretrain_mamba.py built it: every layer a Mamba-2 layer
    alone = parse_args(["--mock-data", "--num-layers", "3", "--mamba-num-groups", "1"] + spec, world_size=1)
    assert alone.model.hybrid_layer_pattern == "MMM"
    with pytest.raises(ConfigError, match="custom layer specs are not implemented"):
        parse_args(["--mock-data", "--spec", "my.module", "my_spec"], world_size=1)


@pytest.mark.parametrize("world,layout,model", [
    pytest.param(2, dict(context_parallel_size=2), HYBRID, id="cp2"),
    pytest.param(2, dict(context_parallel_size=2), QWEN3_NEXT_LIKE, id="cp2-G-G-*-"),
    pytest.param(4, dict(context_parallel_size=2, tp=2, sequence_parallel=True), HYBRID, id="tp2-sp-cp2",
                 marks=SLOW),
    pytest.param(4, dict(context_parallel_size=2, tp=2, sequence_parallel=True), QWEN3_NEXT_LIKE,
                 id="tp2-sp-cp2-G-G-*-", marks=SLOW)])
def test_context_parallel_matches_one_process(world, layout, model):
    """Context parallelism across Mamba-2 and Gated DeltaNet layers: each CP rank's chunks continue the
    conv inputs and the state of the chunks before them (models/ssm_cp.py); attention layers run ring
    attention."""
    (ref,) = run_ranks(_train_history, 1, _cfg(model))
    got = run_ranks(_train_history, world, _cfg(model, **layout))
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [m[key] for m in ref if key in m], [m[key] for m in got[0] if key in m]
        assert len(a) == len(b) >= 2 and b == pytest.approx(a, rel=R_TRAIN), key


def megatron_mamba_train_sh(tmp, sp):
    """NVIDIA/Megatron-LM examples/mamba/train.sh (7531da5), MODEL_SCALE=800M: its options with every
    flag kept, sizes scaled down (48 layers of 1024 -> 8 of 256, 16 heads -> 8 with its 8 query groups,
    sequence 4096 -> 32, the sample counts and batch 32 -> 8), 8 ranks -> 2, mock data for --data-path
    (exclusive here) and a small sentencepiece model for TOKENIZER_PATH; pretrain_mamba.py's stack is
    what its --spec and ratios ask for."""
    return ["--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
            "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
            "--untie-embeddings-and-output-weights", "--init-method-std", "0.02",
            "--position-embedding-type", "none", "--num-layers", "8", "--hidden-size", "256",
            "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "8",
            "--hybrid-attention-ratio", "0.08", "--hybrid-mlp-ratio", "0.5", "--seq-length", "32",
            "--max-position-embeddings", "32", "--train-samples", "16", "--lr-warmup-samples", "4",
            "--lr-decay-samples", "12", "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt", "--mock-data",
            "--data-cache-path", f"{tmp}/cache", "--split", "99,1,0", "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", sp, "--distributed-backend", "nccl",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2.5e-4", "--min-lr", "2.5e-5",
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--log-interval", "10", "--save-interval", "2000", "--eval-interval", "2000",
            "--eval-iters", "32",
            "--bf16", "--use-mcore-models", "--spec", "megatron.core.models.mamba.mamba_layer_specs",
            "mamba_stack_spec",
            "--no-create-attention-mask-in-dataloader", "--tensorboard-dir", f"{tmp}/tb"]


def test_megatron_mamba_example_builds_its_stack(tmp_path, sp_model):  # noqa: F811
    """Its ratios give Megatron-LM's allocation (1 attention and 4 MLP layers among 8)."""
    cfg = parse_args(megatron_mamba_train_sh(tmp_path, sp_model), world_size=2)
    m = cfg.model
    assert (m.hybrid_layer_pattern, m.position_embedding_type, m.num_query_groups) == ("M-M-*-M-", "none", 8)
    assert cfg.parallel.zero_stage == 1 and cfg.precision.bf16


@pytest.mark.slow
def test_megatron_mamba_example_trains_unmodified(tmp_path, sp_model):  # noqa: F811
    from test_megatron_scripts import _pretrain
    argv = megatron_mamba_train_sh(tmp_path, sp_model) + ["--metrics-file", str(tmp_path / "m.jsonl")]
    assert run_ranks(_pretrain, 2, argv, timeout=300) == [0, 0]
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)


def test_megatron_allocation_of_ratios():
    """Megatron-LM's allocation rule at sizes its own notes list: attention evenly spaced between runs
    of Mamba layers, MLP layers spread evenly and right-justified; a spec alone gives all Mamba."""
    from megazero.config.hybrid import allocate_pattern
    assert allocate_pattern(9) == "MMMMMMMMM"
    assert allocate_pattern(10, 0.3, 0.2) == "MM*M-*M*M-"
    assert allocate_pattern(48, 0.25, 0.25) == "MM-*MM-*MM*-MM*-MM*-MM*-M*M-M*M-M*M-M*M-*MM-*MM-"
    with pytest.raises(ConfigError, match="does not hold the layer counts"):
        parse_args(["--mock-data", "--hybrid-layer-pattern", "M*M-", "--hybrid-attention-ratio", "0.5"],
                   world_size=1)


def bridge_nemotronh_4b_flags(tmp):
    """NVIDIA-NeMo/Megatron-Bridge tests/functional_tests/ckpts/nemotronh_4b/test_nemotronh_4b_mcore.sh
    (efbe2d5): its pretrain_mamba.py flags, every one kept (the 26-layer pattern too), widths scaled
    down (hidden 3072 -> 64, 32 heads of 128 -> 8 of 16 with its 8 query groups, 112 Mamba heads -> 16,
    ffn 12288 -> 256, vocabulary 151936 -> 511, sequence 8192 -> 32, 10 iterations -> 2 with the save
    and eval intervals 5 -> 1 and 4 eval iterations -> 1); LOAD_DIR an empty directory (nothing to
    load: a fresh start, as Megatron-LM starts without a checkpoint there)."""
    return ["--init-method-std", "0.014", "--disable-bias-linear", "--use-rope-scaling", "--squared-relu",
            "--qk-layernorm", "--rotary-percent", "1.0", "--rotary-base", "1000000",
            "--use-rotary-position-embeddings", "--hybrid-override-pattern", "M-M-M-M*-M-M-M-M*-M-M-M-M*",
            "--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec",
            "--num-layers", "26", "--hidden-size", "64", "--num-attention-heads", "8",
            "--mamba-num-heads", "16",
            "--ffn-hidden-size", "256", "--kv-channels", "16", "--group-query-attention",
            "--position-embedding-type", "none", "--attention-backend", "fused", "--num-query-groups", "8",
            "--normalization", "RMSNorm", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
            "--save-interval", "1", "--eval-interval", "1", "--eval-iters", "1", "--load", f"{tmp}/load",
            "--save", f"{tmp}/save", "--ckpt-format", "torch_dist", "--log-progress", "--bf16",
            "--lr", "4.5e-4", "--min-lr", "4.5e-5", "--num-workers", "2", "--tensorboard-dir", f"{tmp}/tb",
            "--log-interval", "1",
            "--log-throughput", "--no-load-optim", "--no-load-rng"]


def test_bridge_nemotronh_script_builds_its_model(tmp_path):
    """As Megatron-LM reads it: --use-rotary-position-embeddings wins over --position-embedding-type
    none (its legacy rule; named at start-up), squared ReLU, q/k norms, the pattern's 26 layers."""
    cfg = parse_args(bridge_nemotronh_4b_flags(tmp_path), world_size=2)
    m = cfg.model
    assert (m.position_embedding_type, m.activation, m.qk_layernorm, m.use_rope_scaling) == \
        ("rope", "squared_relu", True, False)  # Megatron-LM's hybrid model ignores --use-rope-scaling
    assert [m.hybrid_layer_pattern.count(k) for k in "M*-"] == [12, 3, 11]
    assert any("--use-rotary-position-embeddings sets --position-embedding-type rope" in n for n in cfg.notes)


@pytest.mark.slow
def test_bridge_nemotronh_script_trains_unmodified(tmp_path):
    from test_megatron_scripts import _pretrain
    (tmp_path / "load").mkdir()
    argv = bridge_nemotronh_4b_flags(tmp_path) + ["--metrics-file", str(tmp_path / "m.jsonl")]
    assert run_ranks(_pretrain, 2, argv, timeout=300) == [0, 0]
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)


def test_attention_layers_take_multi_latent_attention():
    """With --multi-latent-attention the pattern's attention layers are DeepSeek's MLA, as a
    transformer layer's would be; the one-process model and TP 2 + SP train alike."""
    mla = dict(HYBRID, hybrid_layer_pattern="M*", num_layers=2, multi_latent_attention=True, q_lora_rank=16,
               kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, num_query_groups=None,
               position_embedding_type="rope")
    cfg = validate(_cfg(mla), 1)
    assert type(models.build_model(cfg).decoder["1"].attention).__name__ == "MLAttention"
    (ref,) = run_ranks(_train_history, 1, _cfg(mla))
    got = run_ranks(_train_history, 2, _cfg(mla, tp=2, sequence_parallel=True))
    for key in ("loss", "grad_norm"):
        a, b = [m[key] for m in ref], [m[key] for m in got[0]]
        assert b == pytest.approx(a, rel=R_TRAIN), key


# Megatron-LM's Qwen3-Next form: Gated DeltaNet in the attention place of 3 of every 4 transformer layers
QWEN3_NEXT_MEGATRON = dict(
    num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_chunk_size=8, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
    activation="swiglu", num_query_groups=2, attention_output_gate=True, qk_layernorm=True)


def test_gated_deltanet_in_transformer_layers_flags_and_counts():
    """--experimental-attention-variant gated_delta_net --linear-attention-freq N (Megatron-LM's flags):
    every N-th layer keeps attention; the estimator counts the model's parameters; refusals by name."""
    from megazero.planning.estimate import total_params
    variant = ["--experimental-attention-variant", "gated_delta_net"]
    cfg = parse_args(["--mock-data", "--num-layers", "4", "--linear-attention-freq", "4",
                      "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
                      "--linear-key-head-dim", "8", "--linear-value-head-dim", "8"] + variant, world_size=1)
    model = models.build_model(cfg)
    kinds = [type(layer.attention).__name__ for layer in model.decoder.values()]
    assert kinds == ["DeltaNetAttention"] * 3 + ["Attention"]
    pad = (cfg.model.padded_vocab_size - cfg.model.vocab_size) * cfg.model.hidden_size
    assert total_params(cfg) == sum(p.numel() for p in model.parameters()) - pad
    for flags, needle in ((["--linear-attention-freq", "2"], "needs --experimental-attention-variant"),
                          (variant, "needs --linear-attention-freq"),
                          (variant + ["--linear-attention-freq", "[1,0]", "--num-layers", "3"],
                           "--linear-attention-freq [1, 0]: lists 2 layers")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            parse_args(["--mock-data"] + flags, world_size=1)


@pytest.mark.parametrize("world,layout", [
    pytest.param(2, dict(tp=2, sequence_parallel=True, recompute_granularity="selective"), id="tp2-sp"),
    pytest.param(2, dict(context_parallel_size=2), id="cp2", marks=SLOW)])
def test_gated_deltanet_in_transformer_layers_matches_one_process(world, layout):
    (ref,) = run_ranks(_train_history, 1, _cfg(QWEN3_NEXT_MEGATRON))
    got = run_ranks(_train_history, world, _cfg(QWEN3_NEXT_MEGATRON, **layout))
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [m[key] for m in ref if key in m], [m[key] for m in got[0] if key in m]
        assert len(a) == len(b) >= 2 and b == pytest.approx(a, rel=R_TRAIN), key


def test_gated_deltanet_in_transformer_layers_generates_with_its_state():
    cfg = validate(_cfg(QWEN3_NEXT_MEGATRON), world_size=1)
    torch.manual_seed(0)
    model = models.build_model(cfg).eval()
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        full, cache = model(ids), KVCache()
        steps = [model.decode(ids[:, :4], cache)]
        steps += [model.decode(ids[:, t:t + 1], cache) for t in range(4, 9)]
        got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got, full, rtol=0.0, atol=200 * U32 * float(full.abs().max()))
    assert sorted(cache.recurrent) == [0, 1, 2]


def test_linear_attention_freq_from_a_config_file(tmp_path):
    """A --config file's list expression is read as the flag's is."""
    from megazero.config import config_from_dict
    cfg = validate(config_from_dict(dict(_cfg(QWEN3_NEXT_MEGATRON).to_dict()["model"], mock_data=True,
                                         linear_attention_freq="[1,0]*2")), 1)
    assert cfg.model.linear_attention_freq == [1, 0, 1, 0]


def test_use_checkpoint_args_takes_the_hybrid_architecture(tmp_path):
    """A fine-tune with --use-checkpoint-args builds the saved hybrid stack (pattern, Mamba and DeltaNet
    sizes, gate) and loads its weights; a run of another pattern is refused by name on load."""
    base = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "0.01", "--train-iters", "1", "--save-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0"]
    arch = ["--hybrid-layer-pattern", "MG*-", "--hidden-size", "32", "--num-attention-heads", "4",
            "--mamba-num-heads", "4", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--mamba-state-dim",
            "8", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
            "--linear-value-head-dim", "8", "--attention-output-gate", "--position-embedding-type", "none"]
    from test_megatron_scripts import _pretrain
    assert run_ranks(_pretrain, 1, base + arch + ["--save", str(tmp_path / "a")]) == [0]
    from_a = ["--load", str(tmp_path / "a"), "--use-checkpoint-args", "--finetune"]
    cfg = parse_args(base + from_a, world_size=1)
    m = cfg.model
    got = (m.hybrid_layer_pattern, m.mamba_num_heads, m.linear_num_value_heads, m.attention_output_gate)
    assert got == ("MG*-", 4, 4, True)
    assert run_ranks(_pretrain, 1, base + ["--load", str(tmp_path / "a"), "--use-checkpoint-args",
                                           "--finetune", "--save", str(tmp_path / "b")]) == [0]
    other = [("GM*-" if w == "MG*-" else w) for w in arch]
    assert run_ranks(_pretrain, 1, base + other + ["--load", str(tmp_path / "a"), "--finetune"]) == [2]
