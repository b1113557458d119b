"""DeepSeek-V3 routing: group-limited top-k (``--moe-router-num-groups``, ``--moe-router-group-topk``),
sigmoid scores normalised over the chosen experts, ``--moe-router-topk-scaling-factor`` and the expert
bias, against a float64 loop written here; then a tiny MoE GPT with that routing under EP 2 against
one process (losses, gradient norms and tokens per expert, which the expert-bias update reads).

Tolerances: the routing reference is float64 on both sides (1e-12); the training runs are fp32 SGD
under another layout (tests/tolerance.py R_TRAIN); token counts are integers and must be equal."""
import itertools

import pytest
import torch

from megazero.config import ConfigError, config_from_dict, validate
from megazero.moe.routing import group_limited_topk, topk_routing
from megazero.process.local_ranks import run_ranks
from tolerance import R_TRAIN


def _reference(logits, topk, groups, group_topk, per_group, score, pre_softmax=False, bias=None, scale=None):
    """Token by token, expert by expert, in float64 Python: (probs [T, E], chosen sets)."""
    t, e = logits.shape
    size = e // groups
    probs = torch.zeros(t, e, dtype=torch.float64)
    chosen_all = []
    for i in range(t):
        row = [float(v) for v in logits[i]]
        if score == "sigmoid":
            sc = [1.0 / (1.0 + torch.exp(torch.tensor(-v, dtype=torch.float64)).item()) for v in row]
            rank = [s + (float(bias[j]) if bias is not None else 0.0) for j, s in enumerate(sc)]
        elif pre_softmax:
            z = sum(torch.exp(torch.tensor(v - max(row), dtype=torch.float64)).item() for v in row)
            sc = [torch.exp(torch.tensor(v - max(row), dtype=torch.float64)).item() / z for v in row]
            rank = sc
        else:
            rank = row
        gscore = [sum(sorted(rank[g * size:(g + 1) * size], reverse=True)[:per_group]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -gscore[g])[:group_topk]
        allowed = [j for g in best for j in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda j: -rank[j])[:topk]
        chosen_all.append(set(chosen))
        if score == "sigmoid":
            w = [sc[j] for j in chosen]
            w = [v / sum(w) for v in w] if topk > 1 else w
        elif pre_softmax:
            w = [sc[j] for j in chosen]
        else:
            m = max(row[j] for j in chosen)
            ex = [torch.exp(torch.tensor(row[j] - m, dtype=torch.float64)).item() for j in chosen]
            w = [v / sum(ex) for v in ex]
        for j, v in zip(chosen, w):
            probs[i, j] = v * (scale if scale else 1.0)
    return probs, chosen_all


CASES = {  # name: (experts, topk, groups, group_topk, per_group override, score, pre_softmax, bias, scale)
    "deepseek-v3-shape": (16, 4, 4, 2, None, "sigmoid", False, True, 2.5),
    "top2-of-4-groups-choose-2": (8, 2, 4, 2, None, "sigmoid", False, True, None),
    "hf-group-score-2": (8, 2, 4, 2, 2, "sigmoid", False, False, 1.5),
    "softmax-after-topk": (12, 3, 3, 1, None, "softmax", False, False, None),
    "softmax-pre": (8, 2, 2, 1, None, "softmax", True, False, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_group_limited_routing_matches_a_float64_loop(name):
    e, k, groups, gk, per, score, pre, with_bias, scale = CASES[name]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, e, generator=gen, dtype=torch.float64) * 2
    bias = torch.randn(e, generator=gen, dtype=torch.float64) * 0.3 if with_bias else None
    probs, routing_map = topk_routing(logits, k, score, pre, scale, bias, groups, gk, per)
    per_group = per or k // gk
    ref, chosen = _reference(logits, k, groups, gk, per_group, score, pre, bias, scale)
    torch.testing.assert_close(probs, ref, rtol=1e-12, atol=1e-12)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in routing_map] == chosen
    plain = topk_routing(logits, k, score, pre, scale, bias)[1]
    changed = int((plain != routing_map).any(dim=1).sum())
    if per_group == 1 and k == gk:  # group maxima, one expert per group: the plain top-k, exactly
        assert changed == 0
    else:  # the groups matter: plain top-k chooses other experts for some tokens
        assert changed >= 5


def test_group_limit_keeps_every_choice_inside_the_best_groups():
    """A direct check of the rule on a hand-made token: the group with the single best expert loses to
    two groups whose two best experts add up to more."""
    scores = torch.tensor([[0.0, 0.9, 0.1, 0.0, 0.5, 0.49, 0.47, 0.47]], dtype=torch.float64)
    values, idx = group_limited_topk(scores, 2, 4, 2, per_group=2)
    assert sorted(idx.flatten().tolist()) == [4, 5]  # groups 2 (0.99) and 3 (0.94) beat group 0 (0.9)
    values, idx = group_limited_topk(scores, 2, 4, 2, per_group=1)  # Megatron's 2 // 2 = 1: group maxima
    assert sorted(idx.flatten().tolist()) == [1, 4]


BASE = dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
            vocab_size=100, global_batch_size=4, micro_batch_size=1, train_iters=3, lr_decay_iters=4,
            optimizer="sgd", lr=0.1,
            sgd_momentum=0.0, log_interval=100, hidden_dropout=0.0, attention_dropout=0.0,
            add_bias_linear=False, num_experts=8, moe_router_topk=3, moe_layer_freq="[0,1]",
            moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=16,
            moe_token_dispatcher_type="alltoall",
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.05, moe_router_load_balancing_type="none",
            moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2)
KEYS = ("loss", "grad_norm", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max", "moe_imbalance")


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


@pytest.mark.slow
def test_group_limited_routing_under_ep2_matches_one_process():
    """EP 2 x DP 2 (the groups straddle ranks: 4 groups of 2 experts, 4 experts per rank) against one
    process, three steps, so the expert bias moved by step 1 changes the routing of steps 2 and 3."""
    one = _train(config_from_dict(dict(BASE)))
    ranks = run_ranks(_train, 2, config_from_dict(dict(BASE, expert_model_parallel_size=2)), timeout=300)
    for hist in ranks:
        for key in ("loss", "grad_norm"):
            assert [m[key] for m in hist] == pytest.approx([m[key] for m in one], rel=R_TRAIN), key
        for key in KEYS[2:]:
            assert [m[key] for m in hist] == [m[key] for m in one], key
    ungrouped = _train(config_from_dict(dict(BASE, moe_router_num_groups=None, moe_router_group_topk=None)))
    assert any(a["moe_tokens_per_expert_max"] != b["moe_tokens_per_expert_max"] or a["loss"] != b["loss"]
               for a, b in zip(one, ungrouped))  # the groups changed the routing


@pytest.mark.parametrize("bad, words", [
    (dict(moe_router_num_groups=3), "--moe-router-num-groups 3 must divide --num-experts 8"),
    (dict(moe_router_group_topk=None), "go together"),
    (dict(moe_router_group_topk=5), "--moe-router-group-topk 5 must be between 1"),
    (dict(moe_router_topk=5, moe_router_group_topk=2), "hold fewer than --moe-router-topk 5"),
    (dict(moe_router_topk=1), "set --moe-router-group-score-topk"),
    (dict(num_experts=None, moe_shared_expert_intermediate_size=None),
     "--moe-router-num-groups needs --num-experts"),
])
def test_bad_group_settings_are_refused_by_name(bad, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(config_from_dict(dict(BASE, **bad)), world_size=1)


def test_flags_parse():
    from megazero.config import parse_args
    argv = list(itertools.chain.from_iterable(
        (f"--{k}", v) for k, v in dict(num_layers="2", hidden_size="32", num_attention_heads="4",
                                       seq_length="16", max_position_embeddings="16", vocab_size="100",
                                       num_experts="8", moe_router_num_groups="4", moe_router_group_topk="2",
                                       moe_router_group_score_topk="2", micro_batch_size="1",
                                       train_iters="1").items()))
    cfg = parse_args([a.replace("_", "-") if a.startswith("--") else a for a in argv] + ["--mock-data"])
    assert (cfg.moe.moe_router_num_groups, cfg.moe.moe_router_group_topk,
            cfg.moe.moe_router_group_score_topk) == (4, 2, 2)


def test_export_to_an_architecture_without_groups_is_refused_by_name():
    from models.hf_export import arch_of
    mixtral = dict(BASE, moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                   moe_router_topk_scaling_factor=None, moe_shared_expert_intermediate_size=None,
                   moe_layer_freq="[1,1]", position_embedding_type="rope", normalization="RMSNorm",
                   activation="swiglu", hf_model_type="mixtral")
    cfg = validate(config_from_dict(mixtral), world_size=1)
    with pytest.raises(ConfigError, match=r"mixtral cannot hold this model: group-limited routing, "
                                          r"--moe-router-num-groups \(mixtral has none\)"):
        arch_of(cfg.model, cfg.moe)


def test_device_limited_flag_of_older_megatron_is_refused_with_the_groups():
    from megazero.config import parse_args
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--vocab-size", "100", "--micro-batch-size", "1",
            "--train-iters", "1", "--mock-data", "--num-experts", "8"]
    with pytest.raises(ConfigError, match="--moe-router-topk-limited-devices: device-limited routing .* "
                                          "--moe-router-num-groups <EP size> --moe-router-group-topk N"):
        parse_args(argv + ["--moe-router-topk-limited-devices", "2"])
