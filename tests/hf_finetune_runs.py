"""The fine-tuning runs the Hugging Face import tests share (test_hf_finetune, test_hf_moe_finetune,
test_hf_hybrid, test_hf_llama4_moe, test_hf_qwen3next): a transformers model converted tensor by tensor
(``models.hf_convert.to_megazero``), 3 SGD steps of ``--finetune --use-checkpoint-args`` on mock data
(dropout off) in one process and under a parallel layout, and the checks on them: the layouts agree step
by step, the first loss is transformers' own (float64), the trained checkpoint exports to a model
transformers loads with megazero's logits."""
import pytest
import torch

from tolerance import R_TRAIN

GBS, SEED, ITERS = 4, 1234, 3


def convert(hf, d) -> str:
    """``hf`` saved under ``d``/hf and converted to a megazero checkpoint in ``d``/ckpt (returned)."""
    from models.hf_convert import to_megazero
    hf.save_pretrained(str(d / "hf"))
    to_megazero(str(d / "hf"), str(d / "ckpt"))
    return str(d / "ckpt")


def safetensors_of(path) -> dict:
    """Every tensor of the ``.safetensors`` files in directory ``path``, by name."""
    import os
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def converted_back(hf, d):
    """``hf``'s own files and those ``convert_hf.py``'s two directions give back (``d``/back): the
    tensors of each, ``(want, got)``."""
    from models.hf_convert import to_hf
    to_hf(convert(hf, d), str(d / "back"))
    return safetensors_of(str(d / "hf")), safetensors_of(str(d / "back"))


def finetune_settings(ckpt, seq, save=None, lr=0.05, tp=1, **layout) -> dict:
    """The settings of ITERS SGD steps fine-tuning ``ckpt`` on ``seq``-token mock sequences (``layout``:
    more parallel settings); with ``save``, the last step's checkpoint is saved there."""
    settings = dict(load=ckpt, finetune=True, use_checkpoint_args=True, mock_data=True, seq_length=seq,
                    micro_batch_size=1, global_batch_size=GBS, train_iters=ITERS, optimizer="sgd", lr=lr,
                    sgd_momentum=0.0, lr_decay_style="constant", seed=SEED, hidden_dropout=0.0,
                    attention_dropout=0.0, log_interval=100, tensor_model_parallel_size=tp, **layout)
    if save:
        settings.update(save=save, save_interval=ITERS)
    return settings


def train_one(settings):
    """This rank's history (one metrics dict a step) of a run of ``settings``."""
    import models
    from megazero.config import config_from_dict
    from megazero.training import train
    return train(config_from_dict(settings), models.build_chunks)


def train_all(runs):
    """Each architecture's fine-tuning history, on this rank (``runs``: name -> settings)."""
    return {name: train_one(settings) for name, settings in runs.items()}


def assert_layouts_agree(one, ranks, keys=("loss", "grad_norm")):
    """Every rank's history in ``ranks`` equals the one-process history ``one`` step by step (``keys``
    within R_TRAIN; the loss the same on every rank), and the loss moved."""
    for rank in ranks:
        assert [m["loss"] for m in rank] == [m["loss"] for m in ranks[0]]  # the loss reaches every rank
        for key in keys:
            a, b = [m[key] for m in one], [m[key] for m in rank]
            assert len(a) == ITERS and b == pytest.approx(a, rel=R_TRAIN), key
    assert one[-1]["loss"] != one[0]["loss"]  # it trained


def first_loss(hf, seq) -> float:
    """transformers' own loss of the first mock batch of ``seq`` tokens, the model run in float64 (some
    return fp32 logits even so: the reference is then rounded to fp32)."""
    from megazero.data.mock import MockGPTData
    vocab = hf.config.vocab_size
    tokens = MockGPTData(vocab, seq, seed=SEED).get_tokens(list(range(GBS)), "train")
    model = hf.double()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.double()
    hf.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).item()


def assert_export_matches(run, out, hf, cls, seq, **load):
    """The checkpoint ``run`` (ITERS steps fine-tuned from ``hf``) exports to ``out``, which transformers
    loads (``load``: more from_pretrained arguments) as ``cls``ForCausalLM with megazero's logits
    (float64, within 1e-5) and other than ``hf``'s.  Returns the megazero model of ``run``."""
    import transformers
    from models.checkpoint import load_model
    from models.hf_convert import to_hf
    to_hf(str(run), str(out))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64, **load).eval()
    assert type(back).__name__ == cls + "ForCausalLM"
    model, info = load_model(str(run))
    assert info["iteration"] == ITERS
    ids = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exported = back(ids).logits.double()  # transformers may return these logits in fp32
        torch.testing.assert_close(model(ids).double(), exported, rtol=0, atol=1e-5)
        moved = (exported - hf.double()(ids).logits.double()).abs().max().item()
    hf.float()
    assert moved > 1e-4  # the exported weights are the fine-tuned ones
    return model
