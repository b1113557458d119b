"""Mixture-of-experts settings: Megatron-LM's flags, the layer pattern, the derived sizes, and one line
naming the flags (exit status 2) for every combination megazero refuses."""
import pytest

from megazero.config import ConfigError, parse_args
from megazero.moe.settings import moe_layer_pattern, moe_layers

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--disable-bias-linear", "--num-experts", "8"]


def test_flags_reach_the_moe_section():
    cfg = parse_args(BASE + ["--moe-ffn-hidden-size", "96", "--moe-router-topk", "2", "--moe-layer-freq",
                             "([0]*1+[1]*1)*2", "--moe-router-score-function", "sigmoid",
                             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
                             "--moe-router-load-balancing-type", "seq_aux_loss",
                             "--moe-aux-loss-coeff", "1e-2",
                             "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
                             "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
                             "--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm",
                             "--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate",
                             "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                             "--pipeline-model-parallel-size", "2"], world_size=16)
    m = cfg.moe
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_router_score_function) == \
        (8, 96, 2, "sigmoid")
    assert m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate == 0.01
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == \
        ("seq_aux_loss", 1e-2, 1e-3)
    assert (m.moe_token_dispatcher_type, m.moe_expert_capacity_factor, m.moe_token_drop_policy) == \
        ("alltoall", 1.5, "position")
    assert m.moe_pad_expert_input_to_capacity and m.moe_shared_expert_gate
    assert m.moe_shared_expert_intermediate_size == 128
    # expert data parallel = world / (expert TP x EP x PP)
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size, m.expert_data_parallel_size) == \
        (4, 1, 2)
    assert moe_layers(cfg) == [1, 3]


def test_defaults_follow_megatron():
    cfg = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=4)
    m = cfg.moe
    assert m.moe_ffn_hidden_size == cfg.model.ffn_hidden_size == 256  # --ffn-hidden-size
    assert m.expert_tensor_parallel_size == 2  # --tensor-model-parallel-size
    assert (m.moe_router_topk, m.moe_token_dispatcher_type, m.moe_router_load_balancing_type) == \
        (2, "allgather", "aux_loss")
    assert m.expert_data_parallel_size == 2 and moe_layers(cfg) == [0, 1, 2, 3]
    assert moe_layers(parse_args(BASE[:-2], world_size=1)) == []  # a dense model


@pytest.mark.parametrize("freq,layers,want", [
    ("1", 3, [True, True, True]), ("2", 5, [True, False, True, False, True]),
    (3, 4, [True, False, False, True]),
    ("([0]*1+[1]*1)*2", 4, [False, True, False, True]), ("[1,0,0,1]", 4, [True, False, False, True]),
])
def test_layer_pattern(freq, layers, want):
    assert moe_layer_pattern(freq, layers) == want


@pytest.mark.parametrize("freq,msg", [("0", "at least 1"), ("[1,2,0,1]", "not a list of 0s and 1s"),
                                      ("__import__('os')", "give an integer N"),
                                      ("[1]*3", "gives 3 layers but --num-layers is 4")])
def test_layer_pattern_errors(freq, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        moe_layer_pattern(freq, 4)


@pytest.mark.parametrize("extra,world,needle", [
    (["--moe-router-topk", "9"], 1, "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    (["--expert-model-parallel-size", "3"], 3,
     "--num-experts 8 is not divisible by --expert-model-parallel-size 3"),
    (["--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4,
     "world size 4 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 x "
     "--pipeline-model-parallel-size 2"),
    (["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"], 2,
     "not divisible by --expert-tensor-parallel-size 2 x --expert-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--moe-router-load-balancing-type", "sinkhorn"], 1, "--moe-router-load-balancing-type sinkhorn is not "
                                                          "implemented"),
    (["--moe-router-enable-expert-bias"], 1,
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (["--moe-pad-expert-input-to-capacity"], 1, "needs --moe-expert-capacity-factor"),
    (["--moe-input-jitter-eps", "0.1"], 1, "--moe-input-jitter-eps: this mixture-of-experts option is not "
                                           "implemented"),
    (["--moe-router-dtype", "fp64"], 1, "--moe-router-dtype fp64"),
    (["--moe-layer-freq", "3", "--num-layers", "2", "--moe-ffn-hidden-size", "0"], 1,
     "--moe-ffn-hidden-size must be a positive integer"),
])
def test_refused_combinations_name_the_flags(extra, world, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_args(BASE + extra, world_size=world)


def test_expert_flags_need_num_experts():
    with pytest.raises(ConfigError, match="--expert-model-parallel-size needs --num-experts"):
        parse_args(BASE[:-2] + ["--expert-model-parallel-size", "2"], world_size=2)


def test_bad_moe_flags_exit_2_with_one_line(monkeypatch, capsys):
    from models.cli import pretrain_main
    monkeypatch.setenv("WORLD_SIZE", "4")
    for extra, needle in ((["--moe-router-topk", "9"], "--moe-router-topk 9"),
                          (["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3"),
                          (["--expert-model-parallel-size", "8"], "--expert-model-parallel-size 8"),
                          (["--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
                          (["--moe-router-load-balancing-type", "sinkhorn"], "sinkhorn is not implemented")):
        assert pretrain_main(BASE + extra + ["--dry-run"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and needle in err[0], err


# ---- what a run reports: parameters, FLOPs, the console line --------------------------------------
DENSE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--swiglu",
         "--disable-bias-linear"]  # SwiGLU's default --ffn-hidden-size: 128
MODEL = DENSE + ["--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2",
                 "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"]


def test_total_and_active_parameters_match_the_built_model():
    from megazero.planning.estimate import stage_params, total_params
    from megazero.training.summary import parameter_line, provider_stage_counts
    from models import build_chunks, build_model, saved_activations as SAVED
    cfg = parse_args(MODEL, world_size=1)
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert total_params(cfg, padded=True) == stage_params(cfg, 0, saved=SAVED) == n
    per_expert = 3 * 64 * 32  # SwiGLU: gate, fc1, fc2
    assert total_params(cfg) - total_params(cfg, active=True) == 2 * (8 - 2) * per_expert  # 2 MoE layers
    line = parameter_line(cfg, provider_stage_counts(cfg, build_chunks))
    assert f"{total_params(cfg, active=True):,}" in line and "2 of 8 experts" in line
    ep = parse_args(MODEL + ["--expert-model-parallel-size", "4"], world_size=4)
    assert stage_params(ep, 0, saved=SAVED) == n - 2 * (8 - 2) * per_expert  # a rank holds 2 of 8 experts


def test_flops_count_the_active_experts():
    from megazero.planning.flops import model_flops_per_iteration
    cfg, dense = parse_args(MODEL, world_size=1), parse_args(DENSE, world_size=1)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    h, f, s = 64, 32, 48
    # forward FLOPs per token, 2 x multiply-adds (SwiGLU: 3 matrices): router, 2 experts, shared, gate
    moe_layer = 2 * h * 8 + 2 * 3 * 2 * h * f + 3 * 2 * h * s + 2 * h
    dense_mlp = 3 * 2 * h * 128  # the dense MLP the MoE layers replace
    assert model_flops_per_iteration(cfg) - model_flops_per_iteration(dense) == \
        pytest.approx(3 * tokens * 2 * (moe_layer - dense_mlp), rel=1e-12)  # 2 MoE layers, x3 with backward


def test_console_line_reports_the_routers():
    from megazero.training.log import format_line
    row = dict(iteration=3, loss=4.0, lr=1e-3, grad_norm=0.5, loss_scale=1.0, iteration_time=0.1,
               tokens_per_sec=10.0, moe_aux_loss=1.0123, moe_tokens_per_expert_min=3.0,
               moe_tokens_per_expert_max=29.0, moe_imbalance=1.81, moe_dropped_tokens=5.0)
    line = format_line(row, 10)
    assert "moe aux loss 1.0123 tokens/expert 3-29 (imbalance 1.81) dropped 5" in line
    assert "z loss" not in line
    line = format_line(dict(row, moe_z_loss=0.0456), 10)
    assert "moe aux loss 1.0123 z loss 0.0456 tokens/expert 3-29" in line
