"""The memory estimator on hybrid stacks: what Mamba-2 (``M``) and Gated DeltaNet (``G``) layers keep
for backward (models/ssm_saved.py), estimated and measured byte for byte.

The mixer tests hold the formulas to autograd's saved tensors for one mixer (fp32 and bf16, sequences
that are and are not multiples of the chunk, one and several groups per rank, two chunk sizes).  The
stack tests run a training step with the trainer's pieces (megazero.training.measure: saved-tensor
hooks over the whole schedule) and compare the estimate for the rank with what it measured (model state
too: parameter, gradient and optimizer bytes, equal to the byte): the
pattern ``M*M-``, a ``G`` pattern, and Gated DeltaNet in transformer layers (``--linear-attention-freq``)
with Qwen3-Next's attention output gate; selective and full recomputation, bf16, dropout, TP 2
with and without sequence parallelism (one Mamba group per rank), PP 2, and both mixers under CP 2
and 4 (the estimate is the largest CP rank's figure)."""
import pytest
import torch

from megazero.config import config_from_dict, validate
from megazero.mesh import ParallelMesh
from megazero.planning.activations import Dims, SSMDims
from megazero.planning.estimate import estimate_stages
from megazero.process.local_ranks import run_ranks
from models import saved_activations as SAVED, ssm_saved
from models.deltanet import DeltaNetShape, GatedDeltaNet
from models.mamba import MambaMixer, MambaShape

HYBRID = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300, seq_length=13,
              hidden_dropout=0.0, attention_dropout=0.0, hybrid_layer_pattern="M*M-", mamba_num_heads=8,
              mamba_head_dim=8, mamba_state_dim=8, mamba_num_groups=2, mamba_chunk_size=5,
              normalization="RMSNorm", position_embedding_type="none", add_bias_linear=False,
              micro_batch_size=2, global_batch_size=2, mock_data=True, train_iters=1)
DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_chunk_size=5)
# Qwen3-Next's form: Gated DeltaNet in three of four transformer layers' attention, gated full attention
LINEAR = dict(HYBRID, hybrid_layer_pattern=None, experimental_attention_variant="gated_delta_net",
              linear_attention_freq=2, activation="swiglu", position_embedding_type="rope",
              num_query_groups=2, attention_output_gate=True, **DELTANET)

CASES = {  # name: (settings, world size)
    "mamba": (dict(HYBRID), 1),
    "mamba-seq-multiple-of-chunk": (dict(HYBRID, seq_length=15), 1),
    "mamba-selective": (dict(HYBRID, recompute_granularity="selective"), 1),
    "mamba-full": (dict(HYBRID, recompute_granularity="full"), 1),
    "mamba-bf16-selective-dropout": (dict(HYBRID, bf16=True, recompute_granularity="selective",
                                          hidden_dropout=0.1, seq_length=15), 1),
    "deltanet-pattern": (dict(HYBRID, hybrid_layer_pattern="MG*-", **DELTANET), 1),
    "linear-freq-gate": (dict(LINEAR), 1),
    "linear-freq-gate-selective-bf16": (dict(LINEAR, recompute_granularity="selective", bf16=True), 1),
    "linear-freq-full-seq15": (dict(LINEAR, recompute_granularity="full", seq_length=15), 1),
    "mamba-tp2": (dict(HYBRID, tensor_model_parallel_size=2), 2),
    "mamba-tp2-sp-selective": (dict(HYBRID, tensor_model_parallel_size=2, sequence_parallel=True,
                                    seq_length=14, recompute_granularity="selective"), 2),
    "linear-freq-gate-tp2-sp": (dict(LINEAR, tensor_model_parallel_size=2, sequence_parallel=True,
                                     seq_length=14), 2),
    "mamba-pp2-1f1b": (dict(HYBRID, pipeline_model_parallel_size=2, global_batch_size=8), 2),
    # context parallelism: each rank scans two halves and runs the chain of chunk states
    "mamba-cp2": (dict(HYBRID, context_parallel_size=2, seq_length=28), 2),
    "mamba-cp4": (dict(HYBRID, context_parallel_size=4, seq_length=40), 4),
    "mamba-cp2-tp2-selective-bf16": (dict(HYBRID, context_parallel_size=2, tensor_model_parallel_size=2,
                                          seq_length=28, bf16=True, recompute_granularity="selective"), 4),
    "deltanet-cp2": (dict(HYBRID, hybrid_layer_pattern="G*G-", context_parallel_size=2, seq_length=28,
                          **DELTANET), 2),
    "deltanet-cp4": (dict(HYBRID, hybrid_layer_pattern="G*G-", context_parallel_size=4, seq_length=40,
                          **DELTANET), 4),
    "deltanet-cp2-tp2-selective-bf16": (dict(HYBRID, hybrid_layer_pattern="G*G-", context_parallel_size=2,
                                             tensor_model_parallel_size=2, seq_length=28, bf16=True,
                                             recompute_granularity="selective", **DELTANET), 4),
    "linear-freq-gate-cp2": (dict(LINEAR, context_parallel_size=2, seq_length=28), 2),
}
SLOW = ("mamba-tp2-sp-selective", "linear-freq-gate-tp2-sp", "mamba-pp2-1f1b", "mamba-cp4",
        "mamba-cp2-tp2-selective-bf16", "deltanet-cp4", "deltanet-cp2-tp2-selective-bf16",
        "linear-freq-gate-cp2")  # forked ranks


STATE = ("param_bytes", "grad_bytes", "optim_bytes")


def _measure(settings, world):
    import models
    from megazero.training.measure import measure_rank
    got = measure_rank(validate(config_from_dict(settings), world), models.build_chunks, iters=1)
    return got["pp_rank"], got["activation_bytes"], {k: got[k] for k in STATE}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_hybrid_activation_estimate_equals_measurement(name):
    settings, world = CASES[name]
    cfg = validate(config_from_dict(settings), world)
    rows = {r["pp_rank"]: r for r in estimate_stages(cfg, device="cpu", backend="gloo", saved=SAVED)}
    got = [_measure(settings, 1)] if world == 1 else run_ranks(_measure, world, settings, world)
    for pp_rank, row in rows.items():  # CP ranks differ (the chain of chunk states): the estimate is the most
        measured = [m for r, m, _ in got if r == pp_rank]
        assert row["activation_bytes"] == max(measured), (name, pp_rank, row["activation_bytes"], measured)
    for pp_rank, _, state in got:  # model state: the estimator's meta-device model, bucket for bucket
        assert {k: rows[pp_rank][k] for k in STATE} == state, (name, pp_rank)


# ---- one mixer ----------------------------------------------------------------------------------
def _mixer(kind, heads, groups, chunk, dtype):
    """A mixer and its :class:`Dims` (``heads`` value heads, ``groups`` B/C groups or key heads)."""
    p, n, r = 8, 7, heads // groups
    if kind == "M":
        shape = MambaShape(hidden_size=24, num_heads=heads, head_dim=p, state_dim=n, num_groups=groups,
                           chunk_size=chunk)
        mod = MambaMixer(shape, ParallelMesh.single(), layer_idx=0)
        ssm = SSMDims("M", heads, p, n, groups, heads * p + 2 * groups * n,
                      groups * (2 * r * p + 2 * n + r), heads * p, chunk, 4)
    else:
        mod = GatedDeltaNet(DeltaNetShape(hidden_size=24, num_key_heads=groups, num_value_heads=heads,
                                          key_head_dim=n, value_head_dim=p, chunk_size=chunk),
                            ParallelMesh.single(), layer_idx=0)
        ssm = SSMDims("G", heads, p, n, groups, 2 * groups * n + heads * p,
                      groups * (2 * n + 2 * r * p + 2 * r), heads * p, chunk, 4)
    E = 2 if dtype == torch.bfloat16 else 4
    return mod.to(dtype), lambda s, b: Dims(
        s=s, b=b, h=24, tp=1, sp=False, E=E, M=E, ap=1, gp=1, d=1, fp=1, vp=1, v=1, rope=False, rms=True,
        swiglu=False, half=E == 2, hidden_dropout=False, attention_dropout=False, backend="flash",
        device="cpu", kind=kind, ssm=ssm)


def _saved_bytes(mod, s, b, dtype):
    """Bytes of the storages autograd keeps for one forward (each once, parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in mod.parameters()}
    seen, held = {}, []  # held: no storage is freed and its address reused during the forward

    def pack(t):
        held.append(t)
        ptr = t.untyped_storage().data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mod(torch.randn(s, b, 24, dtype=dtype, requires_grad=True))
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["M", "G"])
def test_mixer_saved_bytes_equal_the_formula(kind):
    """Byte for byte, for sequences of 13 (padded to 15), 15 and 4 positions (one chunk) in chunks of 5
    or 3, one and two sequences, with three groups (several heads each), one group on the rank (TP =
    groups, where reshapes are views) or one head per group (one value head per key head), fp32 and
    bf16; and the chunk size moves the figure (the ``b H c L^2`` and per-chunk state terms)."""
    shapes = ((6, 3), (4, 1), (2, 2))
    for heads, groups in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            by_chunk = {}
            for chunk in (5, 3):
                mod, dims_of = _mixer(kind, heads, groups, chunk, dtype)
                for s, b in ((13, 2), (15, 1), (4, 1), (4, 2)):
                    got = _saved_bytes(mod, s, b, dtype)
                    assert ssm_saved.mixer_bytes(dims_of(s, b)) == got, (kind, heads, groups, dtype, chunk, s)
                    by_chunk[chunk, s] = got
            assert by_chunk[5, 15] != by_chunk[3, 15]


# ---- generation state --------------------------------------------------------------------------------
def _decode_cache(settings, world, steps=3):
    """Bytes the decode's cache holds (each storage once) after a 7-token prompt and each single-token
    step, by position count, on this TP rank."""
    import models
    from models.layers import KVCache
    cfg = validate(config_from_dict(settings), world)
    mesh = ParallelMesh.build(world, 1) if world > 1 else None
    model = models.build_model(cfg, mesh).eval()
    if settings.get("bf16"):
        model = model.to(torch.bfloat16)
    cache, held = KVCache(), {}
    torch.manual_seed(0)
    with torch.no_grad():
        model.decode(torch.randint(0, 300, (2, 7)), cache)
        for _ in range(steps):
            model.decode(torch.randint(0, 300, (2, 1)), cache)
            tensors = [*cache.keys.values(), *cache.values.values()]
            tensors += [t for st in getattr(cache, "recurrent", {}).values() for t in st.values()]
            held[cache.length] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                      for t in tensors}.values())
    return held


GENERATION = {
    "mamba-fp32": (dict(HYBRID), 1),
    "deltanet-bf16": (dict(HYBRID, hybrid_layer_pattern="MG*-", bf16=True, **DELTANET), 1),
    "linear-freq-tp2": (dict(LINEAR, tensor_model_parallel_size=2), 2),
    "mamba-mla": (dict(HYBRID, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8,
                       qk_pos_emb_head_dim=8, v_head_dim=8, position_embedding_type="rope"), 1),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if GENERATION[n][1] > 1 else n
                                  for n in GENERATION])
def test_generation_state_equals_the_decode_cache(name):
    """megazero/planning/generation.py: the KV caches of the attention layers (multi-latent attention's
    latents too), the conv and recurrent states of the M and G layers, byte for byte what a decode holds
    between single-token steps; the recurrent part stays the same while the KV cache grows by one
    position a step; and a plain transformer's grouped, windowed KV caches."""
    from megazero.planning.generation import generation_state
    settings, world = GENERATION[name]
    cfg = validate(config_from_dict(settings), world)
    held = _decode_cache(settings, 1) if world == 1 else run_ranks(_decode_cache, world, settings, world)[0]
    for positions, got in held.items():
        assert generation_state(cfg, 0, batch=2, positions=positions)["total"] == got, (name, positions)
    states = [generation_state(cfg, 0, 2, n) for n in held]
    assert len({s["conv_state"] + s["recurrent_state"] for s in states}) == 1
    plain = dict(settings, hybrid_layer_pattern=None, experimental_attention_variant=None,
                 linear_attention_freq=None, multi_latent_attention=False, num_query_groups=2,
                 window_size=[3, 0])
    if world == 1:  # a transformer's KV caches (grouped, a window: every position is kept)
        held = _decode_cache(plain, 1, steps=1)
        (positions, got), = held.items()
        assert generation_state(validate(config_from_dict(plain), 1), 0, 2, positions)["total"] == got
    assert all(s["conv_state"] > 0 and s["recurrent_state"] > 0 for s in states)
    kv = [s["kv_cache"] for s in states]
    assert kv[1] - kv[0] == kv[2] - kv[1] > 0


# ---- what the planner sees ----------------------------------------------------------------------------
MID = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
           normalization="RMSNorm", position_embedding_type="none", add_bias_linear=False,
           hidden_dropout=0.0, attention_dropout=0.0, mamba_num_heads=32, mamba_head_dim=64,
           mamba_state_dim=128, mamba_num_groups=8, mamba_chunk_size=128,
           micro_batch_size=1, global_batch_size=1, bf16=True, mock_data=True)


def _planner_figures(pattern, seq, attention="flash", **over):
    from megazero.planning.estimate import estimate_rank
    from megazero.planning.planner import peak_memory
    cfg = validate(config_from_dict(dict(MID, hybrid_layer_pattern=pattern, seq_length=seq, **over)), 1)
    row = estimate_rank(cfg, 0, saved=SAVED, attention=attention)
    assert peak_memory(cfg, saved=SAVED, attention=attention) == row["total_bytes"]
    return row["activation_bytes"], row["generation_state_bytes"]


def test_planner_sees_recurrent_layers_grow_linearly_and_attention_quadratically():
    """The planner's memory (peak_memory, the estimate it ranks layouts by) of ``M-M-`` against ``*-*-``
    (the same MLP layers, the same width) with the unfused attention kernel, which keeps the ``s x s``
    scores: from 1k to 4k to 16k positions (multiples of the 128-position chunk) the Mamba-2 stack's
    activations grow 4x a step up to its chunk-boundary states' ``(c + 1)^2`` term and constants, the
    attention stack's by more than 6x (the scores' ``s^2``), so the attention stack, lighter at 1k,
    is heavier at 16k.  Decoding, the Mamba-2 stack holds the same bytes at every length while the
    KV cache grows 4x a step; and a longer chunk keeps more (its ``L^2`` intra-chunk matrices)."""
    seqs = (1024, 4096, 16384)
    mamba = [_planner_figures("M-M-", s) for s in seqs]
    attention = [_planner_figures("*-*-", s, "unfused") for s in seqs]
    for (a, _), (b, _) in zip(mamba, mamba[1:]):
        assert 3.95 < b / a < 4.02, (a, b)  # below 4: the conv's k - 1 padding and per-head constants
    for (a, _), (b, _) in zip(attention, attention[1:]):
        assert b / a > 6, (a, b)
    assert mamba[0][0] > attention[0][0] and mamba[-1][0] < attention[-1][0]
    assert len({g for _, g in mamba}) == 1
    assert [g for _, g in attention] == [attention[0][1] * 4 ** i for i in range(3)]
    assert _planner_figures("M-M-", 4096, mamba_chunk_size=256)[0] > mamba[1][0]


def test_estimate_memory_prints_the_generation_state(capsys):
    """``estimate_memory.py`` on a hybrid stack: the table, and the bytes a decode holds (its JSON rows
    carry ``generation_state_bytes``, the same figure)."""
    import json
    from megazero.planning.generation import generation_state
    from models.cli import estimate_memory_main
    settings = dict(num_layers=4, hybrid_layer_pattern="M*M-", hidden_size=64, num_attention_heads=4,
                    mamba_num_heads=8, mamba_head_dim=16, mamba_num_groups=2, seq_length=256, vocab_size=512,
                    micro_batch_size=2, global_batch_size=2, position_embedding_type="none")
    flags = [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))] + ["--bf16"]
    assert estimate_memory_main(["--world-size", "1"] + flags) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("generation:")]
    assert estimate_memory_main(["--world-size", "1", "--json"] + flags) == 0
    row = json.loads(capsys.readouterr().out)["stages"][0]
    assert row["generation_state_bytes"] > 0 and len(line) == 1
    assert f"{row['generation_state_bytes'] / 2 ** 30:.3f} GiB" in line[0]
    cfg = validate(config_from_dict(dict(settings, bf16=True, mock_data=True)), 1)
    assert row["generation_state_bytes"] == generation_state(cfg)["total"]


def test_planner_cpu_dropout_counts_one_mask_a_hybrid_layer():
    """On CPUs the planner costs each dropout mask drawn: a hybrid layer draws one hidden mask (a
    transformer layer two), and only the attention layers drop scores (one ``*`` in ``M*M-``; two of
    four layers with ``--linear-attention-freq 2``)."""
    from types import SimpleNamespace
    from megazero.planning.planner import _dropout_s
    hw = SimpleNamespace(dropout_s=2e-9, attention_dropout_s=3e-9)
    drop = dict(hidden_dropout=0.1, attention_dropout=0.1)
    b, s, h, a = 2, 13, 32, 4
    masks, scores = b * s * h * 2e-9, b * a * s * s * 3e-9
    hybrid = validate(config_from_dict(dict(HYBRID, **drop)), 1)
    assert _dropout_s(hybrid, hw) == pytest.approx(masks + scores / 4, rel=1e-12)
    linear = validate(config_from_dict(dict(LINEAR, **drop)), 1)
    assert _dropout_s(linear, hw) == pytest.approx(2 * masks + scores / 2, rel=1e-12)
    plain = validate(config_from_dict(dict(HYBRID, hybrid_layer_pattern=None, **drop)), 1)
    assert _dropout_s(plain, hw) == pytest.approx(2 * masks + scores, rel=1e-12)
