"""Mock data: the same global samples at every layout, disjoint eval data, learnable structure."""
import math

import numpy as np
import pytest
import torch

from megazero.config import ConfigError, MegazeroConfig
from megazero.data import MockGPTData, build_data, micro_batches, sample_range


def test_sample_depends_only_on_seed_and_index():
    src = MockGPTData(300, 16, seed=7)
    a = src.get_tokens([3, 10, 11])
    b = MockGPTData(300, 16, seed=7).get_tokens([11, 3])
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], MockGPTData(300, 16, seed=8).get_tokens([3])[0])
    assert a.dtype == torch.int64 and a.shape == (3, 17) and 0 <= a.min() and a.max() < 300


@pytest.mark.parametrize("dp,mbs", [(1, 1), (2, 2), (4, 1), (8, 1), (2, 4)])
def test_every_layout_sees_the_same_global_batch(dp, mbs):
    src, gbs = MockGPTData(128, 8, seed=1), 8
    for step in (0, 3):
        single = torch.cat([b["tokens"] for b in micro_batches(src, step, gbs, 2, 0, 1)])
        parts = [b for d in range(dp) for b in micro_batches(src, step, gbs, mbs, d, dp)]
        assert all(b["tokens"].shape == (mbs, 8) for b in parts)
        assert len(parts) == gbs // mbs
        assert torch.equal(torch.cat([b["tokens"] for b in parts]), single)
        assert torch.equal(single, src.get_tokens(list(range(step * gbs, (step + 1) * gbs)))[:, :-1])


def test_labels_are_next_tokens_and_mask_is_ones():
    (b,) = micro_batches(MockGPTData(64, 12), 2, 4, 4)
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    assert b["loss_mask"].dtype == torch.float32 and bool((b["loss_mask"] == 1).all())


def test_ranges_are_contiguous_shares():
    assert list(sample_range(2, 8, 1, 4)) == [18, 19]
    with pytest.raises(ValueError, match="divisible"):
        sample_range(0, 6, 0, 4)


def test_eval_split_is_disjoint_from_training():
    src = MockGPTData(4096, 32, seed=3)
    train = {tuple(r.tolist()) for r in src.get_tokens(range(64), "train")}
    valid = {tuple(r.tolist()) for r in src.get_tokens(range(64), "valid")}
    assert not train & valid


def test_structure_is_learnable():
    """The best bigram predictor's cross-entropy is far below ln(vocab) (what the loss falls to)."""
    vocab = 256
    ids = MockGPTData(vocab, 128, seed=5).get_tokens(range(256)).numpy()
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (ids[:, :-1].ravel(), ids[:, 1:].ravel()), 1)
    probs = counts / counts.sum(1, keepdims=True).clip(min=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -(counts * np.where(probs > 0, np.log(probs), 0)).sum() / counts.sum()
    assert entropy < 0.4 * math.log(vocab)


def test_build_data():
    cfg = MegazeroConfig()
    cfg.data.mock_data = True
    assert isinstance(build_data(cfg), MockGPTData)
    cfg.data.mock_data, cfg.data.data_path = False, ["some/prefix"]
    with pytest.raises(ConfigError, match="--data-path"):
        build_data(cfg)
