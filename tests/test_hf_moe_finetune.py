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
import torch

from megazero.config import config_from_dict
from megazero.data.mock import MockGPTData
from megazero.process.local_ranks import run_ranks
from hf_families import EXPORTED_AS, VOCAB, hf_model
from tolerance import R_TRAIN

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # 4-rank training runs of two architectures
SEQ, GBS, SEED = 32, 4, 1234
ARCHITECTURES = ["mixtral", "qwen2-moe", "gpt-oss", "glm4-moe", "deepseek-v3"]
HF_OVER = {"qwen2-moe": dict(output_router_logits=True)}  # its aux loss (router_aux_loss_coef 0.02) trains
LAYOUT_OVER = {"gpt-oss": dict(expert_tensor_parallel_size=1)}  # biased experts: expert TP 1 (Megatron-LM's)


def _settings(ckpt, save=None, tp=1, ep=1):
    settings = dict(load=ckpt, finetune=True, use_checkpoint_args=True, mock_data=True, seq_length=SEQ,
                    micro_batch_size=1, global_batch_size=GBS, train_iters=3, optimizer="sgd", lr=0.05,
                    sgd_momentum=0.0, lr_decay_style="constant", seed=SEED, hidden_dropout=0.0,
                    attention_dropout=0.0, log_interval=100, tensor_model_parallel_size=tp,
                    expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                    moe_token_dispatcher_type="alltoall")
    if save:
        settings.update(save=save, save_interval=3)
    return settings


def _train_all(runs):
    import models
    from megazero.training import train
    return {name: train(config_from_dict(settings), models.build_chunks) for name, settings in runs.items()}


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    from models.hf_convert import to_megazero
    d = tmp_path_factory.mktemp("moe_finetune")
    hf = {}
    for name in ARCHITECTURES:
        hf[name] = hf_model(name, **HF_OVER.get(name, {}))
        hf[name].save_pretrained(str(d / name / "hf"))
        to_megazero(str(d / name / "hf"), str(d / name / "ckpt"))
    one = _train_all({n: _settings(str(d / n / "ckpt")) for n in ARCHITECTURES})
    four = run_ranks(_train_all, 4, {n: dict(_settings(str(d / n / "ckpt"), str(d / n / "run"), tp=2, ep=2),
                                             **LAYOUT_OVER.get(n, {})) for n in ARCHITECTURES}, timeout=600)
    return d, hf, one, four


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_ep2_tp2_finetune_equals_one_process(finetuned, name):
    d, hf, one, four = finetuned
    for rank in four:  # the loss reaches every rank
        assert [m["loss"] for m in rank[name]] == [m["loss"] for m in four[0][name]]
    keys = ("loss", "grad_norm") + (("moe_aux_loss",) if name in HF_OVER else ())
    for key in keys:
        a, b = [m[key] for m in one[name]], [m[key] for m in four[0][name]]
        assert len(a) == 3 and b == pytest.approx(a, rel=R_TRAIN), key
    assert one[name][2]["loss"] != one[name][0]["loss"]  # it trained
    if name in HF_OVER:
        assert one[name][0]["moe_aux_loss"] > 0


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_first_moe_finetune_loss_is_the_transformers_loss(finetuned, name):
    d, hf, one, _ = finetuned
    tokens = MockGPTData(VOCAB, SEQ, seed=SEED).get_tokens(list(range(GBS)), "train")  # the first batch
    model = hf[name].double()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    model.float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert one[name][0]["loss"] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_finetuned_moe_checkpoint_exports_to_transformers(finetuned, name):
    from models.checkpoint import load_model
    from models.hf_convert import to_hf
    d, hf, _, _ = finetuned
    to_hf(str(d / name / "run"), str(d / name / "exported"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(d / name / "exported"),
                                                             dtype=torch.float64,
                                                             experts_implementation="eager").eval()
    assert type(back).__name__ == EXPORTED_AS[name] + "ForCausalLM"
    model, info = load_model(str(d / name / "run"))
    assert info["iteration"] == 3 and model.cfg.moe.num_experts == 8
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).double(), back(ids).logits, rtol=0, atol=1e-5)
        moved = (back(ids).logits - hf[name].double()(ids).logits).abs().max().item()
    hf[name].float()
    assert moved > 1e-4  # the exported weights are the fine-tuned ones
