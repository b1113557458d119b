"""Hugging Face Mamba2 and NemotronH against transformers (tiny random models built here, nothing
downloaded; models/hf_mamba.py, docs/hybrid.md).  transformers' PyTorch paths (no mamba_ssm kernels on
the CPU) are the reference.  Sequences of SEQ = 37 tokens over chunks of 16 (not a multiple).

Import: logits within 1e-5 of transformers' (and the scaled fp32 bound), greedy generation (recurrent
and KV caches) equal to transformers' ``generate``; the in-projection and conv rows taken in
transformers' order instead of megazero's per-group order change the logits.  Export: every tensor
equal to the imported model's, in memory (``to_hf``) and through the streaming converter
(``convert_hf.py``'s ``to_megazero`` / ``to_hf``); transformers loads it as the same architecture.
Fine-tuning: 3 SGD steps under TP 2 equal one process (loss, grad norm), the first loss is
transformers' (float64), and the TP 2 run's checkpoint exports to a model transformers loads with
megazero's logits.  What megazero cannot represent is refused by name."""
import json

import pytest
import torch

from megazero.config import ConfigError, config_from_dict
from megazero.process.local_ranks import run_ranks
from models.hf import config_from_hf, from_hf, to_hf
from hf_families import assert_greedy_equals_transformers, assert_refused, perturbed
from hf_finetune_runs import (assert_export_matches, assert_layouts_agree, convert, converted_back,
                              finetune_settings, first_loss, safetensors_of, train_all)
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")
VOCAB, SEQ, CHUNK = 96, 37, 16
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
MAMBA = dict(vocab_size=VOCAB, hidden_size=32, n_groups=2, chunk_size=CHUNK, bos_token_id=0,
             eos_token_id=None, pad_token_id=None)
CLASSES = {"mamba2": "Mamba2", "mamba2-tied-bias": "Mamba2", "nemotron-h": "NemotronH",
           "nemotron-h-moe": "NemotronH"}


def family_config(name):
    if name == "mamba2":  # 8 heads of 8 channels in 2 groups, state 16
        return transformers.Mamba2Config(**MAMBA, num_heads=8, head_dim=8, state_size=16, expand=2,
                                         num_hidden_layers=2, tie_word_embeddings=False)
    if name == "mamba2-tied-bias":  # projection biases, the head tied to the embeddings, 4 groups
        return transformers.Mamba2Config(**dict(MAMBA, n_groups=4), num_heads=8, head_dim=4, state_size=8,
                                         expand=1, num_hidden_layers=2, use_bias=True,
                                         tie_word_embeddings=True)
    if name == "nemotron-h":  # Mamba-2, attention (2 key/value heads), Mamba-2, squared-ReLU MLP
        types = ["linear_attention", "full_attention", "linear_attention", "mlp"]
        return transformers.NemotronHConfig(**MAMBA, layers_block_type=types, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                            mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16,
                                            max_position_embeddings=128)
    if name == "nemotron-h-moe":  # 8 squared-ReLU experts in 4 groups (top-2 groups), top-2, scaled,
        # a shared expert; Mamba-2, MoE, attention, MoE
        types = ["linear_attention", "moe", "full_attention", "moe"]
        return transformers.NemotronHConfig(**MAMBA, layers_block_type=types, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                            mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16,
                                            max_position_embeddings=128, n_routed_experts=8,
                                            num_experts_per_tok=2, moe_intermediate_size=16,
                                            moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5, norm_topk_prob=True)
    raise KeyError(name)


def hf_model(name, **over):
    """A tiny random model of ``name`` (config fields changed by ``over``), every weight perturbed."""
    torch.manual_seed(0)
    config = family_config(name)
    for k, v in over.items():
        setattr(config, k, v)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    return perturbed(model.eval())


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module", params=list(CLASSES))
def family(request):
    return request.param, hf_model(request.param)


def test_import_matches_transformers_logits(family):
    name, hf = family
    model = from_hf(hf).eval()
    m = model.cfg.model
    assert m.position_embedding_type == "none" and m.mamba_chunk_size == CHUNK and SEQ % CHUNK
    ref = _logits(hf)
    torch.testing.assert_close(_logits(model), ref, **fp32_bound(ref, C_FWD))
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-5)  # the bound too
    if name == "nemotron-h":
        assert m.hybrid_layer_pattern == "M*M-" and m.activation == "squared_relu"
    # transformers' row order read as megazero's per-group order: another model
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    layer = "backbone.layers.0." if name.startswith("mamba2") else "model.layers.0."
    wrong = from_hf(hf).eval()
    with torch.no_grad():
        in_proj = dict(wrong.named_parameters())["decoder.0.mixer.in_proj.weight"]
        in_proj.copy_(state[layer + "mixer.in_proj.weight"])
    assert (_logits(wrong) - ref).abs().max() > 1e-3


def test_greedy_generation_equals_transformers(family):
    """Prompt 8 + 24 new tokens: the recurrent (and KV) caches against transformers' own."""
    name, hf = family
    model = from_hf(hf).eval()
    prompt = IDS[:, :8]  # an explicit mask: transformers would mask prompt tokens equal to the pad id
    assert_greedy_equals_transformers(hf, model, prompt, attention_mask=torch.ones_like(prompt))


def test_export_gives_back_every_tensor(family, tmp_path):
    """Against transformers' own files of the model (NemotronH's: backbone.*, one tensor per expert)."""
    name, hf = family
    to_hf(from_hf(hf), str(tmp_path / "back"))
    hf.save_pretrained(str(tmp_path / "hf"))
    want, got = safetensors_of(str(tmp_path / "hf")), safetensors_of(str(tmp_path / "back"))
    assert "lm_head.weight" in want or hf.config.tie_word_embeddings  # a tied head is not written
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32,
                                                             experts_implementation="eager").eval()
    assert type(back).__name__ == CLASSES[name] + "ForCausalLM"
    assert torch.equal(_logits(back), _logits(hf))
    assert config_from_hf(back.config) == config_from_hf(hf.config)


def test_the_streaming_converter_round_trips_every_tensor(family, tmp_path):
    name, hf = family
    want, got = converted_back(hf, tmp_path)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with open(tmp_path / "back" / "config.json") as fh:
        assert json.load(fh)["model_type"] == hf.config.model_type


def test_original_mamba2_files_import(tmp_path):
    """The original Mamba-2 files' embeddings name (``backbone.embedding.weight``); files of a tied model
    that write the head out too."""
    from safetensors.torch import save_file
    from models.hf_convert import to_hf as ckpt_to_hf, to_megazero
    hf = hf_model("mamba2-tied-bias")
    hf.save_pretrained(str(tmp_path / "hf"))
    tensors = safetensors_of(str(tmp_path / "hf"))
    for i, rename in enumerate([False, True]):
        files = dict(tensors)
        if rename:
            files["backbone.embedding.weight"] = files.pop("backbone.embeddings.weight")
        else:
            files["lm_head.weight"] = files["backbone.embeddings.weight"].clone()
        save_file(files, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
        to_megazero(str(tmp_path / "hf"), str(tmp_path / f"ckpt{i}"))
        ckpt_to_hf(str(tmp_path / f"ckpt{i}"), str(tmp_path / f"back{i}"))
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"back{i}"),
                                                                 dtype=torch.float32).eval()
        assert torch.equal(_logits(back), _logits(hf))


@pytest.mark.parametrize("name,over,needle", [
    ("mamba2", dict(use_conv_bias=False), "use_conv_bias=False; megazero's Mamba-2 conv always has a bias"),
    ("mamba2", dict(conv_kernel=3), "conv_kernel=3; megazero's Mamba-2 conv has width 4"),
    ("mamba2", dict(time_step_limit=(0.0, 0.5)), "time_step_limit=\\(0.0, 0.5\\); clamping the time step"),
    ("mamba2", dict(hidden_act="gelu"), "hidden_act='gelu'; megazero's Mamba-2 mixer applies SiLU"),
    ("nemotron-h", dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu'; megazero's Nemotron-H MLP"),
    ("nemotron-h", dict(use_bias=True), "use_bias=True; biases on the Mamba-2 projections alone"),
    ("nemotron-h", dict(attention_bias=True), "attention_bias=True; Nemotron-H's attention projections"),
    ("nemotron-h", dict(sliding_window=8), "sliding_window=8; Nemotron-H's attention is full"),
    ("nemotron-h-moe", dict(moe_latent_size=8), "moe_latent_size=8; the experts' latent projections"),
    ("nemotron-h-moe", dict(norm_topk_prob=False), "norm_topk_prob=False; megazero normalises the chosen"),
    ("nemotron-h-moe", dict(n_group=3), "n_group=3; groups of at least 2 experts dividing"),
])
def test_what_megazero_cannot_represent_is_refused_by_name(name, over, needle):
    assert_refused(family_config(name), over, needle)


@pytest.mark.parametrize("name,over,hf_type,needle", [
    ("nemotron-h", {}, "mamba2", "--hybrid-layer-pattern 'M\\*M-' has '\\*' layers \\(mamba2 has M only\\)"),
    ("nemotron-h", dict(activation="gelu"), "nemotron_h", "nemotron_h needs --squared-relu"),
    ("nemotron-h", dict(softmax_scale=0.5), "nemotron_h", "softmax_scale 0.5 \\(nemotron_h has none\\)"),
    ("nemotron-h-moe", dict(moe_router_group_score_topk=1), "nemotron_h",
     "a group's score of other than its 2 best experts"),
    ("mamba2", {}, "llama", "a hybrid layer stack, --hybrid-layer-pattern \\(llama has transformer layers"),
])
def test_export_as_an_architecture_that_cannot_hold_the_model_is_refused(name, over, hf_type, needle,
                                                                         tmp_path):
    model = from_hf(hf_model(name), cfg_overrides=dict(over, hf_model_type=hf_type))
    with pytest.raises(ConfigError, match=f"--hf-model-type {hf_type} cannot hold this model: {needle}"):
        to_hf(model, str(tmp_path))


SCRATCH = dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=48,
               vocab_size=VOCAB, seq_length=64, max_position_embeddings=64, position_embedding_type="none",
               normalization="RMSNorm", activation="squared_relu", add_bias_linear=False, mamba_num_heads=8,
               mamba_head_dim=8, mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=CHUNK,
               tensor_model_parallel_size=1, pipeline_model_parallel_size=1, hidden_dropout=0.0,
               attention_dropout=0.0)
MOE_FLAGS = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_load_balancing_type="none", moe_shared_expert_intermediate_size=24)


@pytest.mark.parametrize("pattern,extra,cls", [("MMM", dict(hidden_size=64), "Mamba2"),
                                               ("M*ME-", MOE_FLAGS, "NemotronH")])
def test_a_model_megazero_built_exports_as_the_first_architecture_holding_it(pattern, extra, cls, tmp_path):
    """Tied embeddings, megazero's own initialisation: Mamba2 ties its head, NemotronH gets a copy."""
    import models
    from megazero.config import validate
    cfg = validate(config_from_dict(dict(SCRATCH, **extra, num_layers=len(pattern),
                                         hybrid_layer_pattern=pattern)), 1, check_data=False)
    model = models.build_model(cfg).eval()
    assert not cfg.model.untie_embeddings_and_output_weights
    to_hf(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                             experts_implementation="eager").eval()
    assert type(back).__name__ == cls + "ForCausalLM"
    ref = _logits(back)
    torch.testing.assert_close(_logits(model), ref, **fp32_bound(ref, C_FWD))


# ---- fine-tuning under TP 2 ------------------------------------------------------------------------
FT_SEQ = 38  # 2 chunks of 16 and 6: TP 2 with sequence parallelism splits it
FINETUNED = ["mamba2", "nemotron-h", "nemotron-h-moe"]


def _settings(ckpt, save=None, tp=1):
    # sequence parallelism: what MoE layers under TP need
    return finetune_settings(ckpt, FT_SEQ, save, tp=tp, sequence_parallel=tp > 1)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid_finetune")
    hf = {name: hf_model(name) for name in FINETUNED}
    ckpt = {name: convert(hf[name], d / name) for name in FINETUNED}
    one = train_all({n: _settings(ckpt[n]) for n in FINETUNED})
    two = run_ranks(train_all, 2, {n: _settings(ckpt[n], str(d / n / "run"), tp=2) for n in FINETUNED},
                    timeout=600)
    return d, hf, one, two


@pytest.mark.slow
@pytest.mark.parametrize("name", FINETUNED)
def test_tp2_finetune_equals_one_process_and_exports_to_transformers(finetuned, name):
    d, hf, one, two = finetuned
    assert_layouts_agree(one[name], [rank[name] for rank in two])
    # transformers returns these models' logits in fp32 even in float64: the reference is rounded to fp32
    assert one[name][0]["loss"] == pytest.approx(first_loss(hf[name], FT_SEQ), abs=1e-5)
    assert_export_matches(d / name / "run", d / name / "exported", hf[name], CLASSES[name], SEQ,
                          experts_implementation="eager")
