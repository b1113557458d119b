"""Fine-tuning every architecture megazero imports, from its converted Hugging Face weights
(tests/hf_families.py, tiny random models): ``convert_hf.py --direction to-megazero``, then 3 SGD steps
with ``--finetune --use-checkpoint-args`` in one process and under TP 2 x PP 2 (4 ranks), on 32-token
sequences (longer than every window).  The layouts agree step by step (loss, gradient norm: R_TRAIN);
the first loss is transformers' own loss of that batch (float64); the TP 2 x PP 2 run's checkpoint
exports (``--direction to-hf``, tensor by tensor: Phi-3's fused weights fused again) to a directory
transformers loads as the same architecture, whose logits equal megazero's of the trained weights."""
import pytest

from megazero.process.local_ranks import run_ranks
from hf_families import EXPORTED_AS, hf_model
from hf_finetune_runs import (assert_export_matches, assert_layouts_agree, convert, finetune_settings,
                              first_loss, train_all)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # 4-rank training runs of nine architectures
SEQ = 32
ARCHITECTURES = ["mistral-window", "qwen2-window", "qwen3", "gemma", "gemma2", "gemma3", "llama4", "phi3",
                 "olmo2", "smollm3", "llama-yarn", "llama-dynamic"]
TP_FRIENDLY = {"gemma": dict(num_key_value_heads=2),  # tests/hf_families.py's Gemma has one key/value head
               "gemma3": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)}


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune")
    hf = {name: hf_model(name, **TP_FRIENDLY.get(name, {})) for name in ARCHITECTURES}
    ckpt = {name: convert(hf[name], d / name) for name in ARCHITECTURES}
    one = train_all({n: finetune_settings(ckpt[n], SEQ) for n in ARCHITECTURES})
    four = run_ranks(train_all, 4, {n: finetune_settings(ckpt[n], SEQ, str(d / n / "run"), tp=2,
                                                         pipeline_model_parallel_size=2)
                                    for n in ARCHITECTURES}, timeout=600)
    return d, hf, one, four


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_tp2_pp2_finetune_equals_one_process(finetuned, name):
    d, hf, one, four = finetuned
    assert_layouts_agree(one[name], [rank[name] for rank in four])


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_first_finetune_loss_is_the_transformers_loss(finetuned, name):
    d, hf, one, _ = finetuned
    assert one[name][0]["loss"] == pytest.approx(first_loss(hf[name], SEQ), abs=1e-5)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_finetuned_checkpoint_exports_to_transformers(finetuned, name):
    d, hf, _, _ = finetuned
    assert_export_matches(d / name / "run", d / name / "exported", hf[name], EXPORTED_AS.get(name, "Llama"),
                          SEQ)
