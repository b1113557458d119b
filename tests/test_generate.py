"""Generation: the KV cache gives the full forward pass's logits; greedy, top-k, top-p and seeded
sampling behave; tensor-parallel generation equals one process; the plotting script draws runs."""
import json
import os

import pytest
import torch

import models
from megazero.config import config_from_dict, validate
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from models.generate import next_token
from models.layers import KVCache

KINDS = {
    "gpt": dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=97),
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=64,
                  seq_length=32, vocab_size=97, position_embedding_type="rope", normalization="RMSNorm",
                  activation="swiglu", add_bias_linear=False, untie_embeddings_and_output_weights=True),
}


def _model(kind, tp=1, mesh=None):
    cfg = validate(config_from_dict(dict(KINDS[kind], mock_data=True, tensor_model_parallel_size=tp,
                                         init_method_std=0.2)), tp)
    return models.build_model(cfg, mesh).eval()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kv_cache_logits_equal_the_full_forward(kind):
    model = _model(kind)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()  # a prompt, then a chunk of several positions, then single steps
        parts = [model.decode(ids[:, :7], cache), model.decode(ids[:, 7:12], cache)]
        parts += [model.decode(ids[:, i:i + 1], cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20


def test_greedy_is_argmax_of_the_full_forward():
    model = _model("llama")
    ids = torch.tensor([[1, 2, 3]])
    out = models.generate(model, ids, max_new_tokens=6)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_and_restricted():
    model = _model("gpt")
    ids = torch.tensor([[4, 5]])
    a = models.generate(model, ids, 10, temperature=1.0, top_k=5, seed=3)
    assert torch.equal(a, models.generate(model, ids, 10, temperature=1.0, top_k=5, seed=3))
    assert torch.equal(models.generate(model, ids, 8, temperature=0.7, top_k=1, seed=9),
                       models.generate(model, ids, 8))  # top-k 1 is greedy
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(next_token(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert picks == {1, 2}
    picks = {int(next_token(logits, 1.0, top_p=0.5, generator=g)) for _ in range(100)}
    assert picks == {1}  # the most likely token alone holds more than half the mass
    out = models.generate(model, ids, 10, temperature=1.0, top_k=5, seed=3, eos_id=int(a[0, 2]))
    assert out.shape[1] == 3  # stops at the end-of-document token


@pytest.mark.parametrize("kwargs,needle", [
    (dict(max_new_tokens=-1), "--max-new-tokens"), (dict(temperature=-0.5), "--temperature"),
    (dict(top_k=-2), "--top-k"), (dict(top_p=0.0), "--top-p"), (dict(max_new_tokens=40), "learned positions"),
])
def test_bad_settings_name_the_flag(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        models.generate(_model("gpt"), torch.tensor([[1, 2]]), **kwargs)


def _generate_tp2(kind):
    model = _model(kind, tp=2, mesh=ParallelMesh.build(tp=2))
    return models.generate(model, torch.tensor([[7, 8, 9]]), 8, temperature=0.9, top_p=0.9, seed=5)


def test_tensor_parallel_generation_equals_one_process():
    want = models.generate(_model("llama"), torch.tensor([[7, 8, 9]]), 8, temperature=0.9, top_p=0.9, seed=5)
    for got in run_ranks(_generate_tp2, 2, "llama"):
        assert torch.equal(got, want)


def test_plot_metrics_overlays_runs(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "plot_metrics", os.path.join(os.path.dirname(__file__), "..", "scripts", "plot_metrics.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name, scale in (("a", 1.0), ("b", 0.5)):
        with open(tmp_path / f"{name}.jsonl", "w") as fh:
            for it in range(1, 6):
                row = dict(iteration=it, loss=scale * (6 - it), lr=1e-3, grad_norm=None if it == 2 else 0.5,
                           loss_scale=2.0 ** 16, tokens_per_sec=1000.0)
                if it % 2 == 0:
                    row["eval_loss"] = scale * (6 - it)
                fh.write(json.dumps(row) + "\n")
    out = tmp_path / "curves.png"
    assert script.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert script.series(script.read_metrics(str(tmp_path / "a.jsonl")), "grad_norm")[0] == [1, 3, 4, 5]
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert script.main([str(tmp_path / "bad.jsonl"), "-o", str(out)]) == 2
