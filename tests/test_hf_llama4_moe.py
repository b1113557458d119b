"""Llama 4 (text) with its MoE layers both ways (tests/hf_families.py ``llama4-moe``: 4 layers, MoE layers 1
and 3 with 4 experts, top-1 sigmoid routing on the expert's input, a shared expert; dense layers between):

- import: every tensor, logits within 1e-5 of transformers' (and the scaled fp32 bound), greedy decoding
  equal; the same weights with the routing weight on the output are measurably another model;
- tensor by tensor: transformers' state -> megazero -> transformers gives back every tensor exactly;
- export: transformers loads the written directory as ``Llama4ForCausalLM`` with the same logits and a
  config that imports as the same megazero model;
- fine-tune (slow): converted (``models.hf_convert.to_megazero``), 3 SGD steps with ``--finetune
  --use-checkpoint-args`` in one process and under EP 2 x TP 2 (sequence parallel, 4 ranks) agree
  within R_TRAIN; the first loss is transformers' own loss of that batch (float64); the EP 2 x TP 2
  checkpoint exports to a directory transformers loads with megazero's logits of the trained weights;
- refusals by name: top-k > 1, jitter; exports that cannot hold the model."""
import pytest
import torch

from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from models.hf import config_from_hf, from_hf, hf_state_from_megazero, megazero_state_from_hf, to_hf
from hf_families import SEQ, VOCAB, assert_greedy_equals_transformers, assert_refused, family_config, hf_model
from hf_finetune_runs import (assert_export_matches, assert_layouts_agree, convert, finetune_settings,
                              first_loss, train_one)
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
NAME = "llama4-moe"


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def hf():
    return hf_model(NAME)


def test_config_imports_the_moe_layers(hf):
    assert hf.config.moe_layers == [1, 3]
    got = config_from_hf(hf.config)
    assert {k: got[k] for k in ("num_experts", "moe_router_topk", "moe_layer_freq", "moe_ffn_hidden_size",
                                "moe_shared_expert_intermediate_size", "moe_router_score_function",
                                "moe_apply_probs_on_input", "ffn_hidden_size")} == dict(
        num_experts=4, moe_router_topk=1, moe_layer_freq="[0,1,0,1]", moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
        moe_apply_probs_on_input=True, ffn_hidden_size=48)


def test_import_matches_transformers_logits(hf):
    model = from_hf(hf).eval()
    ref = _logits(hf)
    torch.testing.assert_close(_logits(model), ref, **fp32_bound(ref, C_FWD))
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-5)
    on_output = from_hf(hf, cfg_overrides=dict(moe_apply_probs_on_input=False)).eval()
    assert (_logits(on_output) - ref).abs().max() > 100 * fp32_bound(ref, C_FWD)["atol"]


def test_tensor_by_tensor_round_trip(hf):
    model = from_hf(hf)
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    mine = megazero_state_from_hf(state, model.cfg, "llama4_text")
    assert mine["decoder.1.mlp.experts.2.gate_weight"].shape == (16, 32)  # [F, hidden], one expert
    torch.testing.assert_close(mine["decoder.1.mlp.experts.2.gate_weight"],
                               state["model.layers.1.feed_forward.experts.gate_up_proj"][2, :, :16].t(),
                               rtol=0, atol=0)
    back = hf_state_from_megazero(mine, model.cfg)
    assert sorted(back) == sorted(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_greedy_generation_equals_transformers(hf):
    model = from_hf(hf).eval()
    assert_greedy_equals_transformers(hf, model, IDS[:, :8])


def test_export_loads_back_in_transformers(hf, tmp_path):
    model = from_hf(hf).eval()
    to_hf(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(back).__name__ == "Llama4ForCausalLM" and back.config.moe_layers == [1, 3]
    torch.testing.assert_close(_logits(back), _logits(hf), rtol=0, atol=1e-5)
    assert config_from_hf(back.config) == config_from_hf(hf.config)


@pytest.mark.parametrize("over,needle", [
    (dict(num_experts_per_tok=2), "num_experts_per_tok=2; the routing weight on the expert's input "
                                  r"\(--moe-apply-probs-on-input\) is top-1 only"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1; jitter on the router's input"),
    (dict(moe_layers=[1, 4]), r"moe_layers=\[1, 4\]; layer indices between 0 and"),
])
def test_what_megazero_cannot_represent_is_refused_by_name(over, needle):
    assert_refused(family_config(NAME), over, needle)


@pytest.mark.parametrize("over,hf_type,needle", [
    (dict(moe_apply_probs_on_input=False), "llama4_text",
     "llama4_text's experts need --moe-apply-probs-on-input"),
    ({}, "mixtral", r"--moe-apply-probs-on-input \(mixtral weighs the experts' outputs"),
    (dict(moe_shared_expert_intermediate_size=32), "llama4_text",
     "llama4_text.s experts need an ungated shared expert of --moe-ffn-hidden-size 16"),
])
def test_export_that_cannot_hold_the_model_is_refused(hf, over, hf_type, needle):
    from models.hf_export import arch_of
    cfg = validate(config_from_dict(dict(config_from_hf(hf.config), **over, hf_model_type=hf_type)), 1,
                   check_data=False)
    with pytest.raises(ConfigError, match=f"--hf-model-type {hf_type} cannot hold this model: {needle}"):
        arch_of(cfg.model, cfg.moe)


# ---- fine-tune under EP 2 x TP 2 ---------------------------------------------------------------
FT_SEQ = 32


def _settings(ckpt, save=None, tp=1, ep=1):
    return finetune_settings(ckpt, FT_SEQ, save, tp=tp, expert_model_parallel_size=ep,
                             sequence_parallel=tp > 1, moe_token_dispatcher_type="alltoall")


@pytest.fixture(scope="module")
def finetuned(hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama4_moe_finetune")
    ckpt = convert(hf, d)
    one = train_one(_settings(ckpt))
    four = run_ranks(train_one, 4, _settings(ckpt, str(d / "run"), tp=2, ep=2), timeout=600)
    return d, one, four


@pytest.mark.slow
def test_ep2_tp2_finetune_equals_one_process(finetuned):
    _, one, four = finetuned
    assert_layouts_agree(one, four)


@pytest.mark.slow
def test_first_finetune_loss_is_the_transformers_loss(finetuned, hf):
    _, one, _ = finetuned
    assert one[0]["loss"] == pytest.approx(first_loss(hf, FT_SEQ), abs=1e-5)


@pytest.mark.slow
def test_the_finetuned_checkpoint_exports_to_transformers(finetuned, hf):
    d, _, _ = finetuned
    model = assert_export_matches(d / "run", d / "exported", hf, "Llama4", SEQ)
    assert model.cfg.moe.moe_apply_probs_on_input
