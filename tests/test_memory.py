"""The memory estimator counts exactly the parameters the model builds, per rank and stage."""
import json
import os
import subprocess
import sys

import pytest

from megazero.config import config_from_dict, validate
from megazero.memory import estimate, stage_params, total_params
from megazero.mesh import ParallelMesh
from megazero.testing import run_ranks

GPT2 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300, seq_length=16)
LLAMA = dict(GPT2, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False, num_query_groups=2, untie_embeddings_and_output_weights=True)


def cfg_of(world=1, **kw):
    cfg = config_from_dict(dict(mock_data=True, **kw))
    return validate(cfg, world)


def _count(settings):
    import models
    cfg = cfg_of(4, **settings)
    par = cfg.parallel
    mesh = ParallelMesh.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size)
    chunks = models.build_chunks(cfg, mesh)
    return mesh.pp_rank, sum(p.numel() for c in chunks for p in c.parameters())


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_stage_params_match_the_built_model(arch):
    settings = dict(arch, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    cfg = cfg_of(4, **settings)
    for pp_rank, n in run_ranks(_count, 4, settings):
        assert n == stage_params(cfg, pp_rank)


@pytest.mark.parametrize("arch", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_total_params_match_one_process(arch):
    import models
    cfg = cfg_of(1, **dict(arch, vocab_size=256, make_vocab_size_divisible_by=128))  # no padding
    assert sum(p.numel() for p in models.build_model(cfg).parameters()) == total_params(cfg)


def test_estimate_follows_the_zero_formula():
    cfg = cfg_of(8, **GPT2, bf16=True, tensor_model_parallel_size=2)
    rows = estimate(cfg)
    psi, n = rows[0]["params_per_rank"], 4
    assert [r["param_bytes"] for r in rows] == [2 * psi, 2 * psi, 2 * psi, 2 * psi // n]
    assert [r["grad_bytes"] for r in rows] == [4 * psi, 4 * psi, 4 * psi // n, 4 * psi // n]
    assert [r["optim_bytes"] for r in rows] == [12 * psi, 12 * psi // n, 12 * psi // n, 12 * psi // n]
    full = cfg_of(8, **GPT2, bf16=True, tensor_model_parallel_size=2, recompute_granularity="full")
    sel = cfg_of(8, **GPT2, bf16=True, tensor_model_parallel_size=2, recompute_granularity="selective")
    acts = [estimate(c)[0]["activation_bytes"] for c in (cfg, sel, full)]
    assert acts[0] > acts[1] > acts[2] > 0


def test_estimate_memory_script_json():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "estimate_memory.py"), "--json",
                          "--model", "gpt2-small", "--world-size", "8", "--tensor-model-parallel-size", "2",
                          "--bf16"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert data["data_parallel_size"] == 4 and len(data["stages"]) == 4
    assert all(set(s) >= {"param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "total_bytes"}
               for s in data["stages"])
    totals = [s["total_bytes"] for s in data["stages"]]
    assert totals == sorted(totals, reverse=True) and totals[3] < totals[0]


def test_offload_moves_optimizer_bytes_off_the_device():
    on = estimate(cfg_of(2, **GPT2, zero_stage=2, offload_optimizer=True))
    off = estimate(cfg_of(2, **GPT2, zero_stage=2))
    assert on[2]["optim_on_cpu"] and not on[0]["optim_on_cpu"]
    assert on[2]["total_bytes"] == off[2]["total_bytes"] - off[2]["optim_bytes"]
    # fp32 params offloaded need a separate fp32 master copy on the host: 4 + 8 bytes per param
    assert on[2]["optim_bytes"] == 12 * on[2]["params_per_rank"] // 2
