"""Deferred initialisation of dense and MoE models (:mod:`megazero.tensor_parallel.deferred`): built on
the meta device, every parameter defers (nothing computed, 4 bytes held each) and its value is the eager
build's, bitwise, in one process and under expert parallelism and expert TP; a model that cannot defer
is built in memory with a :class:`DeferredInitWarning` naming what could not defer and why (here an
error: every build below must defer)."""
import warnings

import pytest
import torch
import torch.nn as nn

from megazero.config import config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from megazero.mesh import ParallelMesh
from megazero.tensor_parallel.deferred import (DeferredInitWarning, build_chunks, building_deferred,
                                               initial_value, is_deferred, realize_rest)

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
             mock_data=True, hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
# shared experts with their gate, the expert bias (sigmoid routing), gated experts without biases
RICH = dict(MOE, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_load_balancing_type="none", activation="swiglu", add_bias_linear=False)
MODELS = {"dense": {}, "moe_biases": dict(MOE, activation="gelu"), "moe_rich": RICH,
          "moe_alternate": dict(RICH, moe_layer_freq="[1,0]", untie_embeddings_and_output_weights=True,
                                position_embedding_type="learned_absolute")}
ATTRS = ("expert_parallel", "tensor_model_parallel", "partition_dim", "sequence_parallel", "requires_grad")


def _cfg(world=1, **extra):
    return validate(config_from_dict(dict(SMALL, **extra)), world)


def _provider(cfg, mesh):
    import models
    return models.build_chunks(cfg, mesh)


def _deferred(cfg, mesh):
    """This rank's chunk built deferred, a fallback to the eager build an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeferredInitWarning)
        (chunk,) = build_chunks(_provider, cfg, mesh, torch.float32)
    return chunk


def _check_deferred(cfg, mesh):
    """Every parameter deferred, holding 4 bytes, with the eager build's value and marks."""
    got = dict(_deferred(cfg, mesh).named_parameters())
    want = dict(_provider(cfg, mesh)[0].named_parameters())
    assert got.keys() == want.keys()
    assert [n for n, p in got.items() if not is_deferred(p)] == []
    assert sum(p.untyped_storage().nbytes() for p in got.values()) == 4 * len(got)
    for name, p in got.items():
        value = initial_value(p)
        assert value.dtype == want[name].dtype and torch.equal(value, want[name].detach()), name
        assert [getattr(p, a, None) for a in ATTRS] == [getattr(want[name], a, None) for a in ATTRS], name
    return len(got)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_parameter_defers_to_the_eager_value(model):
    count = _check_deferred(_cfg(**MODELS[model]), ParallelMesh.single())
    if model != "dense":  # router, expert bias, stacked experts, shared experts and gate among them
        assert count > 28


def test_moe_realized_by_the_optimizer_as_the_eager_build():
    """ZeRO-3 initialises the deferred MoE model bucket by bucket to the eager build's values; the
    frozen expert bias (realize_rest) keeps fp32 in a bf16 model."""
    from megazero.zero import build_optimizer
    from models.gpt import full_state_dict
    cfg, mesh = _cfg(zero_stage=3, **RICH), ParallelMesh.single()
    chunk = _deferred(cfg, mesh)
    opt = build_optimizer([chunk], mesh, cfg)
    realize_rest([chunk], mesh.device, torch.bfloat16)
    assert not any(is_deferred(p) for p in chunk.parameters())
    bias = chunk.decoder["0"].mlp.router.expert_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(4))
    with opt.gathered_params():
        got = {n: t.clone() for n, t in full_state_dict(chunk).items()}
    want = full_state_dict(_provider(cfg, mesh)[0])
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert any("experts.3.fc2_weight" in k for k in got)


LAYOUTS = {"ep2": dict(expert_model_parallel_size=2), "etp2": dict(expert_tensor_parallel_size=2),
           "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True)}


def _ranks(layouts):
    """On each of 2 ranks: every layout built deferred against its eager build, then the first one
    realized by ZeRO-3 and gathered whole."""
    from megazero.training import build_mesh
    from megazero.zero import build_optimizer
    from models.gpt import full_state_dict
    counts = [_check_deferred(cfg, build_mesh(cfg)) for cfg in layouts]
    cfg = layouts[0]
    mesh = build_mesh(cfg)
    chunk = _deferred(cfg, mesh)
    opt = build_optimizer([chunk], mesh, cfg)
    with opt.gathered_params():
        realized = {n: t.clone() for n, t in full_state_dict(chunk).items()}
    return counts, realized


@pytest.mark.parametrize("layouts", [("ep2", "etp2", "tp2_sp")])
def test_moe_defers_under_expert_parallelism(layouts):
    cfgs = [_cfg(2, zero_stage=3, **RICH, **LAYOUTS[name]) for name in layouts]
    ranks = run_ranks(_ranks, 2, cfgs, timeout=120)
    want = {n: t.detach() for n, t in _full(_cfg(**RICH)).items()}
    for counts, realized in ranks:
        assert all(c > 28 for c in counts)
        assert realized.keys() == want.keys()
        assert [k for k in want if not torch.equal(realized[k], want[k])] == []


def _full(cfg):
    from models.gpt import full_state_dict
    return full_state_dict(_provider(cfg, ParallelMesh.single())[0])


# ---- a model that cannot defer: built in memory, with a warning that says why ----------------------
def test_fallback_warns_naming_the_parameter():
    cfg, mesh = _cfg(), ParallelMesh.single()

    def plain(cfg, mesh):  # a torch module: its weight stays on the meta device
        return [nn.Sequential(nn.Linear(4, 3))]
    with pytest.warns(DeferredInitWarning, match=r"parameter 0\.weight \(left on the meta device"):
        (lin,) = build_chunks(plain, cfg, mesh, torch.float32)
    assert not lin[0].weight.is_meta

    def eager(cfg, mesh):  # values made under the meta device, on an explicit device
        return [nn.Linear(4, 3, device="cpu")]
    with pytest.warns(DeferredInitWarning, match=r"2 tensors could not defer: chunk 0 parameter weight "
                                                 r"\(created with its value"):
        build_chunks(eager, cfg, mesh, torch.float32)

    def failing(cfg, mesh):
        if building_deferred():
            raise RuntimeError("no meta here")
        return _provider(cfg, mesh)
    raised = r"raised RuntimeError: no meta here \(at .*test_deferred_init"  # where, outside torch
    with pytest.warns(DeferredInitWarning, match=raised):
        (model,) = build_chunks(failing, cfg, mesh, torch.float32)
    assert not any(is_deferred(p) for p in model.parameters())
