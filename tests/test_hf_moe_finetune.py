"""Fine-tuning the Hugging Face mixtures of experts (tests/hf_families.py: Mixtral, and Qwen2-MoE with its
gated shared expert, a dense first layer and its load-balancing loss switched on by
``output_router_logits``, gpt-oss, GLM-4.5 and DeepSeek-V3 with their grouped sigmoid routing, expert bias
and scaling, and DeepSeek-V3's multi-latent attention), converted tensor by tensor
(``models.hf_convert.to_megazero``): 3 SGD steps
with ``--finetune --use-checkpoint-args`` in one process and under EP 2 x TP 2 (4 ranks, sequence
parallel, all-to-all dispatch).  The layouts agree step by step (loss, gradient norm and the
load-balancing loss: R_TRAIN); the first loss is transformers' own loss of that batch (float64); the
EP 2 x TP 2 run's checkpoint exports (``to_hf``, expert by expert under the published names) to a
directory transformers loads as the same architecture, whose logits equal megazero's of the trained
weights."""
import pytest

from megazero.process.local_ranks import run_ranks
from hf_families import EXPORTED_AS, hf_model
from hf_finetune_runs import (assert_export_matches, assert_layouts_agree, convert, finetune_settings,
                              first_loss, train_all)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # 4-rank training runs of two architectures
SEQ = 32
ARCHITECTURES = ["mixtral", "qwen2-moe", "gpt-oss", "glm4-moe", "deepseek-v3"]
HF_OVER = {"qwen2-moe": dict(output_router_logits=True)}  # its aux loss (router_aux_loss_coef 0.02) trains
LAYOUT_OVER = {"gpt-oss": dict(expert_tensor_parallel_size=1)}  # biased experts: expert TP 1 (Megatron-LM's)


def _settings(ckpt, save=None, tp=1, ep=1):
    return finetune_settings(ckpt, SEQ, save, tp=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                             moe_token_dispatcher_type="alltoall")


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_finetune")
    hf = {name: hf_model(name, **HF_OVER.get(name, {})) for name in ARCHITECTURES}
    ckpt = {name: convert(hf[name], d / name) for name in ARCHITECTURES}
    one = train_all({n: _settings(ckpt[n]) for n in ARCHITECTURES})
    four = run_ranks(train_all, 4, {n: dict(_settings(ckpt[n], str(d / n / "run"), tp=2, ep=2),
                                            **LAYOUT_OVER.get(n, {})) for n in ARCHITECTURES}, timeout=600)
    return d, hf, one, four


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_ep2_tp2_finetune_equals_one_process(finetuned, name):
    d, hf, one, four = finetuned
    keys = ("loss", "grad_norm") + (("moe_aux_loss",) if name in HF_OVER else ())
    assert_layouts_agree(one[name], [rank[name] for rank in four], keys)
    if name in HF_OVER:
        assert one[name][0]["moe_aux_loss"] > 0


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_first_moe_finetune_loss_is_the_transformers_loss(finetuned, name):
    d, hf, one, _ = finetuned
    assert one[name][0]["loss"] == pytest.approx(first_loss(hf[name], SEQ), abs=1e-5)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_finetuned_moe_checkpoint_exports_to_transformers(finetuned, name):
    d, hf, _, _ = finetuned
    model = assert_export_matches(d / name / "run", d / name / "exported", hf[name], EXPORTED_AS[name], SEQ,
                                  experts_implementation="eager")
    assert model.cfg.moe.num_experts == 8
