"""The z-loss on the output logits (``--z-loss-coeff``; Swallow's ``--use-z-loss`` = 1e-4): per token
``z * logsumexp(logits)^2`` added to the cross-entropy, on one rank and vocabulary-parallel, against a
float64 reference (loss and gradient)."""
import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError, parse_args
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

# The library computes in fp32 (u = 2^-24).  Loss: |CE| <= 20 and z lse^2 <= 0.05 * 16^2 = 13, each
# carried with a few u relative, plus u * V from the normaliser's sum: well under 1e-5 + 1e-5 x |loss|.
# Gradient: (1 + 2 z lse) softmax - onehot, |entries| <= 2.6 / N, relative error a few u: atol 1e-6.
LOSS = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-5, atol=1e-6)
VOCAB, PADDED = 50, 64


def _case():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64) * 3 + 6  # lse far from max: ~9-16
    labels = torch.randint(0, VOCAB, (3, 5), generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    return logits, labels, mask


def _reference(z, smoothing):
    logits, labels, mask = _case()
    x = logits.clone().requires_grad_()
    real = x[..., :VOCAB]
    loss = F.cross_entropy(real.reshape(-1, VOCAB), labels.reshape(-1), reduction="none",
                           label_smoothing=smoothing).reshape(3, 5) + z * torch.logsumexp(real, -1) ** 2
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach(), x.grad


def _rank(tp, z, smoothing):
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else None
    logits, labels, mask = _case()
    shard = (logits.chunk(tp, -1)[mesh.coord("tp")] if mesh else logits).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, mesh, VOCAB, smoothing, z_loss=z)
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("tp,z,smoothing", [(1, 0.05, 0.0), (2, 0.05, 0.1), (2, 1e-4, 0.0)])
def test_z_loss_matches_float64(tp, z, smoothing):
    ref_loss, ref_grad = _reference(z, smoothing)
    plain_loss, _ = _reference(0.0, smoothing)
    # the z-loss moves the loss far beyond the tolerance (so a missing or shifted lse fails here)
    assert ((ref_loss - plain_loss).abs() > 1000 * LOSS["atol"]).all()
    res = [_rank(1, z, smoothing)] if tp == 1 else run_ranks(_rank, tp, tp, z, smoothing)
    for loss, _ in res:
        torch.testing.assert_close(loss.double(), ref_loss, **LOSS)
    grad = torch.cat([g for _, g in res], -1)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD)
    assert grad[..., VOCAB:].abs().sum() == 0


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--seq-length", "16"]


def test_use_z_loss_is_swallows_coefficient():
    cfg = parse_args(BASE + ["--use-z-loss"], world_size=1)
    assert cfg.training.z_loss_coeff == 1e-4 and any("--use-z-loss" in n for n in cfg.notes)
    assert parse_args(BASE, world_size=1).training.z_loss_coeff is None  # off by default
    with pytest.raises(ConfigError, match="--use-z-loss means --z-loss-coeff 0.0001"):
        parse_args(BASE + ["--use-z-loss", "--z-loss-coeff", "0.01"], world_size=1)
    with pytest.raises(ConfigError, match="with --mtp-num-layers is not implemented"):
        parse_args(BASE + ["--z-loss-coeff", "0.01", "--mtp-num-layers", "1"], world_size=1)


def test_model_loss_carries_the_z_loss():
    """The model's per-token loss with --use-z-loss is its loss without plus 1e-4 x lse^2 of its own logits
    (float64 reference from the logits; fp32 loss: |loss| ~ 5, lse^2 ~ 25, a few u each: 1e-5)."""
    from models import build_model
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    out = {}
    for flags in ([], ["--use-z-loss"]):
        cfg = parse_args(BASE + ["--hidden-dropout", "0", "--attention-dropout", "0"] + flags, world_size=1)
        model = build_model(cfg).eval()
        with torch.no_grad():
            out[bool(flags)] = (model(ids, labels=labels), model(ids))
    (plain, logits), (with_z, _) = out[False], out[True]
    lse = torch.logsumexp(logits.double(), -1)
    torch.testing.assert_close(with_z.double(), plain.double() + 1e-4 * lse ** 2, rtol=1e-5, atol=1e-5)
    assert (with_z - plain).abs().min() > 1e-4  # lse ~ log 65 = 4.2: the z term, 1.7e-3, is seen
