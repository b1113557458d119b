"""DeepSeek-V3's and GLM-4.5's multi-token prediction weights through the Hugging Face conversion
(models/hf_deepseek.py): transformers' models have no MTP layers, but the published files hold depth k
at ``model.layers.<L + k>.*`` (enorm, hnorm, eh_proj, a transformer layer, shared_head.norm, and copies
of the embedding and head).  A tiny directory of each (tests/hf_families.py's, one depth's tensors added
to the file as the published ones are) converts with ``convert_hf.py``'s importer to a checkpoint with
``--mtp-num-layers 1`` whose MTP parameters are those tensors, and back to files holding the same
tensors (bytes equal) that transformers still loads with the same logits; a copy of the head that
differs from the model's is not silently dropped.  The imported depth's loss equals DeepSeek-V3's
definition written with transformers' modules (float64; fp32 bound)."""
import json
import os

import pytest
import torch

from hf_families import VOCAB, SEQ, hf_model
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # two conversions and a transformers load (~4 s)


def _mtp_tensors(hf):
    """Depth 0's tensors as DeepSeek-V3's files name them: a transformers decoder layer of index L (an
    MoE layer, as the last one is), its norms and projection, random; the embedding and head copied."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer
    c, L = hf.config, hf.config.num_hidden_layers
    torch.manual_seed(5)
    layer = (Glm4MoeDecoderLayer if c.model_type == "glm4_moe" else DeepseekV3DecoderLayer)(c, L)
    out = {f"model.layers.{L}.{k}": 0.1 * torch.randn_like(v) + ("norm" in k)  # no init ran: all drawn here
           for k, v in layer.state_dict().items()}
    gate_up, down = (out.pop(f"model.layers.{L}.mlp.experts.{k}") for k in ("gate_up_proj", "down_proj"))
    for e in range(gate_up.shape[0]):  # the experts one by one, as the published files hold them
        gate, up = gate_up[e].chunk(2)
        out.update({f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight": gate,
                    f"model.layers.{L}.mlp.experts.{e}.up_proj.weight": up,
                    f"model.layers.{L}.mlp.experts.{e}.down_proj.weight": down[e]})
    h = c.hidden_size
    out.update({f"model.layers.{L}.enorm.weight": 1 + 0.1 * torch.randn(h),
                f"model.layers.{L}.hnorm.weight": 1 + 0.1 * torch.randn(h),
                f"model.layers.{L}.eh_proj.weight": 0.1 * torch.randn(h, 2 * h),
                f"model.layers.{L}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h),
                f"model.layers.{L}.embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
                f"model.layers.{L}.shared_head.head.weight": hf.lm_head.weight.detach().clone()})
    return out


def _write_with_mtp(hf, d, **changed):
    """``hf`` saved to ``d``, its file holding depth 0's tensors too (``changed`` replaced)."""
    from safetensors.torch import load_file, save_file
    hf.save_pretrained(str(d))
    path = os.path.join(d, "model.safetensors")
    mtp = dict(_mtp_tensors(hf), **changed)
    save_file(dict(load_file(path), **mtp), path, metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as fh:
        config = json.load(fh)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(dict(config, num_nextn_predict_layers=1), fh)
    return mtp


@pytest.mark.parametrize("family", ["deepseek-v3", "glm4-moe"])
def test_mtp_weights_round_trip(family, tmp_path):
    from safetensors.torch import load_file
    from models.checkpoint import load_model
    from models.hf_convert import to_hf, to_megazero
    hf = hf_model(family)
    mtp = _write_with_mtp(hf, tmp_path / "src")
    to_megazero(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    model, _ = load_model(str(tmp_path / "ckpt"))
    assert model.cfg.model.mtp_num_layers == 1
    params = dict(model.named_parameters())
    L = hf.config.num_hidden_layers
    for ours, theirs in [("enorm.weight", "enorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
                         ("final_norm.weight", "shared_head.norm.weight"),
                         ("layer.attention.proj.weight", "self_attn.o_proj.weight"),
                         ("layer.mlp.router.expert_bias", "mlp.gate.e_score_correction_bias")]:
        assert torch.equal(params[f"mtp.{L}.{ours}"].detach(), mtp[f"model.layers.{L}.{theirs}"]), ours
    to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    back = {k: v for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")
            for k, v in load_file(str(tmp_path / "out" / f)).items()}
    for name, t in mtp.items():  # every tensor of the depth, the copies included, written back unchanged
        assert torch.equal(back[name], t), name
    with open(tmp_path / "out" / "config.json") as fh:
        assert json.load(fh)["num_nextn_predict_layers"] == 1
    to_hf(str(tmp_path / "ckpt"), str(tmp_path / "bf16"), dtype="bf16")  # the routers stay fp32
    half = {k: v.dtype for f in os.listdir(tmp_path / "bf16") if f.endswith(".safetensors")
            for k, v in load_file(str(tmp_path / "bf16" / f)).items()}
    router = f"model.layers.{L - 1}.mlp.gate."
    assert half[router + "weight"] == half[router + "e_score_correction_bias"] == torch.float32
    assert half["model.embed_tokens.weight"] == torch.bfloat16
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_a_head_copy_that_differs_is_not_dropped(tmp_path):
    from megazero.config import ConfigError
    from models.hf_convert import to_megazero
    hf = hf_model("deepseek-v3")
    L = hf.config.num_hidden_layers
    other = torch.randn_like(hf.lm_head.weight)
    _write_with_mtp(hf, tmp_path / "src", **{f"model.layers.{L}.shared_head.head.weight": other})
    with pytest.raises(ConfigError, match=f"tensor 'model.layers.{L}.shared_head.head.weight' is not used"):
        to_megazero(str(tmp_path / "src"), str(tmp_path / "ckpt"))


def _reference_depth_loss(hf, mtp, tokens, swapped=False):
    """Depth 0's loss as DeepSeek-V3 defines it, from transformers' modules in float64: the main model's
    normed hidden state h and the embedding of token t+1 give eh_proj([enorm(emb); hnorm(h)]), then the
    depth's decoder layer (causal, RoPE at the same positions), shared_head.norm and the head predict
    token t+2 (the last position has none).  ``swapped``: [hnorm(h); enorm(emb)], the other order."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    c, L = hf.config, hf.config.num_hidden_layers
    hf = hf.double()
    layer = DeepseekV3DecoderLayer(c, L).double()
    own = {k[len(f"model.layers.{L}."):]: v.double() for k, v in mtp.items()}
    E = c.n_routed_experts
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([own.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                              own.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                   for e in range(E)])
    own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{e}.down_proj.weight")
                                                for e in range(E)])
    layer.load_state_dict({k: v for k, v in own.items() if k in layer.state_dict()})
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(c.hidden_size, c.rms_norm_eps).double()
        norms[name].weight.data = own[f"{name}.weight"]
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    s = ids.shape[1]
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state
        parts = [norms["enorm"](hf.model.embed_tokens(labels)), norms["hnorm"](h)]
        x = torch.cat(parts[::-1] if swapped else parts, -1) @ own["eh_proj.weight"].t()
        pos = torch.arange(s).unsqueeze(0)
        causal = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        y = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        logits = hf.lm_head(norms["shared_head.norm"](y))
    hf.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, c.vocab_size),
                                             labels[:, 1:].reshape(-1))


def test_the_imported_depth_predicts_as_deepseek_defines_it(tmp_path):
    from models.checkpoint import load_model
    from models.hf_convert import to_megazero
    hf = hf_model("deepseek-v3")
    hf.config._attn_implementation = "eager"
    mtp = _write_with_mtp(hf, tmp_path / "src")
    to_megazero(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    model, _ = load_model(str(tmp_path / "ckpt"))
    model = model.double().train()  # the depths' losses are recorded in training (no dropout: 0 here)
    model.mtp.stats.backward_scale = 1.0
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(4))
    model(tokens[:, :-1], labels=tokens[:, 1:])
    want = _reference_depth_loss(hf, mtp, tokens)
    bound = fp32_bound(want, C_FWD)  # megazero's float64 model keeps fp32 RoPE tables and expert bias
    torch.testing.assert_close(model.mtp.stats.losses[0].double(), want, **bound)
    other = _reference_depth_loss(hf, mtp, tokens, swapped=True)
    assert abs(other - want) > 100 * bound["atol"]  # the order of eh_proj's halves is seen


MEGATRON_DEEPSEEK = dict(  # Megatron-LM's DeepSeek-V3 flags at toy size, trained from scratch (no import)
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, mock_data=True,
    micro_batch_size=1, global_batch_size=4, position_embedding_type="rope", normalization="RMSNorm",
    norm_epsilon=1e-6, activation="swiglu", add_bias_linear=False, untie_embeddings_and_output_weights=True,
    multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
    v_head_dim=12, qk_layernorm=True, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
    num_experts=8, moe_router_topk=4, moe_layer_freq="[0,1]", moe_ffn_hidden_size=24,  # 4 / 2 groups: 2
    moe_shared_expert_intermediate_size=24, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2, mtp_num_layers=1,
    hidden_dropout=0.0, attention_dropout=0.0)


def test_a_megatron_deepseek_model_exports_as_deepseek_v3(tmp_path):
    """A model of Megatron-LM's DeepSeek-V3 flags (MLA with YaRN by default, its mscale on the scores;
    the seq_aux_loss left out) exports as DeepseekV3 with the same logits; --rope-type rope with an
    mscale is refused by name (transformers scales the scores only under YaRN)."""
    import models
    from megazero.config import ConfigError, config_from_dict, validate
    from models.hf import to_hf
    cfg = validate(config_from_dict(MEGATRON_DEEPSEEK), world_size=1)
    model = models.build_model(cfg).eval()
    to_hf(model, str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert back.config.rope_parameters["rope_type"] == "yarn"
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :100], back.eval()(ids).logits, rtol=0, atol=1e-5)
    plain = models.build_model(validate(config_from_dict(dict(MEGATRON_DEEPSEEK, rope_type="rope")), 1))
    with pytest.raises(ConfigError, match="--rope-type rope with --rotary-scaling-factor 4.0 and --msc"):
        to_hf(plain, str(tmp_path / "plain"))


def test_rope_on_halves_imports_as_pairs(tmp_path):
    """``rope_interleave`` false (RoPE on halves): the import interleaves the rotary rows, through
    from_hf and convert_hf.py alike; logits within 1e-5 of transformers', the export (pairs,
    rope_interleave true) loads back with them; the same weights rotated as pairs are another model."""
    from models.checkpoint import load_model
    from models.hf import from_hf, to_hf
    from models.hf_convert import to_megazero
    hf = hf_model("deepseek-v3", rope_interleave=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
        pairs = hf_model("deepseek-v3")(ids).logits  # the same weights (seed), RoPE on pairs
        assert (pairs - want).abs().max() > 100 * fp32_bound(want, C_FWD)["atol"]
        torch.testing.assert_close(from_hf(hf).eval()(ids), want, rtol=0, atol=1e-5)
        hf.save_pretrained(str(tmp_path / "src"))
        to_megazero(str(tmp_path / "src"), str(tmp_path / "ckpt"))
        model, _ = load_model(str(tmp_path / "ckpt"))
        torch.testing.assert_close(model.eval()(ids), want, rtol=0, atol=1e-5)
        to_hf(model, str(tmp_path / "out"))
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
        assert back.config.rope_interleave
        torch.testing.assert_close(back.eval()(ids).logits, want, rtol=0, atol=1e-5)
