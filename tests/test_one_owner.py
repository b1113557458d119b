"""Rules with one owner: the trainer and the engine join the process group through one function
(store prefix, timeout, device and backend choice), and the world's decomposition (dp, expert DP)
is the mesh's alone."""
from datetime import timedelta

import pytest
import torch.distributed as dist

import megazero.resilience.watchdog as watchdog
from megazero.config import config_from_dict, validate
from megazero.mesh import axis_sizes, expert_sizes


class Joined(Exception):
    pass


@pytest.fixture
def joins(monkeypatch):
    """Every join reaches watchdog.join_process_group, recorded here instead of joining."""
    seen = []

    def fake(backend, timeout):
        seen.append((backend, timeout))
        raise Joined()
    monkeypatch.setattr(watchdog, "join_process_group", fake)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    return seen


def test_trainer_and_engine_join_the_same_way(joins):
    from megazero.engine import init_distributed as engine_join
    from megazero.training import init_distributed as trainer_join
    with pytest.raises(Joined):
        trainer_join(timeout=timedelta(minutes=3))
    with pytest.raises(Joined):
        engine_join(timeout=3)  # DeepSpeed's minutes
    assert joins == [("gloo", timedelta(minutes=3))] * 2


@pytest.mark.parametrize("world, tp, pp, cp, ep, etp", [
    (8, 2, 2, 1, 1, None), (16, 2, 2, 2, 2, 1), (8, 1, 2, 1, 4, None), (12, 3, 1, 2, 2, 3)])
def test_the_world_is_decomposed_by_the_mesh_alone(world, tp, pp, cp, ep, etp):
    sizes = axis_sizes(world, tp, pp, cp, ep, etp)
    assert sizes["dp"] * tp * pp * cp == world
    assert expert_sizes(world, tp, pp, ep, etp) == {k: sizes[k] for k in ("etp", "ep", "edp")}
    cfg = validate(config_from_dict(dict(
        mock_data=True, num_layers=4, hidden_size=48, num_attention_heads=12, seq_length=48,
        max_position_embeddings=48, vocab_size=100, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        sequence_parallel=tp > 1, num_experts=4, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, add_bias_linear=False)), world)
    assert cfg.parallel.data_parallel_size == sizes["dp"]
    assert cfg.moe.expert_data_parallel_size == sizes["edp"]


def test_one_exit_status_rule():
    """Every front end ends with megazero.errors.exit_status_of: an unusable checkpoint is a usage
    error (2) under the trainer and the engine alike, a failed save a failure (1)."""
    from megazero.checkpoint import CheckpointError
    from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointSaveError
    from megazero.errors import EXIT_FAILURE, EXIT_USAGE, ConfigError, exit_status_of
    from megazero.resilience import NumericalError
    from megazero.resilience.errors import report_failure
    import io
    cases = [(ConfigError("x"), EXIT_USAGE), (CheckpointError("x"), EXIT_USAGE),
             (CheckpointCorrupt("x"), EXIT_USAGE), (CheckpointSaveError("x"), EXIT_FAILURE),
             (NumericalError("x"), EXIT_FAILURE), (RuntimeError("a bug"), EXIT_FAILURE)]
    for err, status in cases:
        assert exit_status_of(err) == status, err
        assert report_failure(err, rank=0, world_size=1, stream=io.StringIO(), wait=0) == status, err


def test_an_error_only_one_rank_raised_is_not_lost():
    """A configuration error raised on rank 1 alone (an engine script's): rank 1 waits for the launcher
    to end it as usual; still alive after the wait, it prints the line itself, with its rank.  The
    trainer's errors, raised on every rank alike, stay rank 0's one line."""
    import io
    from megazero.errors import ConfigError
    from megazero.resilience.errors import report_failure
    out = io.StringIO()
    assert report_failure(ConfigError("--my-flag 7: give 1 or 2"), prog="s.py", rank=1, world_size=2,
                          stream=out, wait=0.1, speak_after_wait=True) == 2
    assert out.getvalue() == "s.py: error: rank 1: --my-flag 7: give 1 or 2\n"
    quiet = io.StringIO()
    assert report_failure(ConfigError("--x"), rank=1, world_size=2, stream=quiet, wait=0.1) == 2
    assert quiet.getvalue() == ""


def test_the_engines_hook_lets_a_lone_rank_speak(monkeypatch):
    """An engine script's uncaught error goes through report_failure with speak_after_wait."""
    import megazero.resilience.errors as errors
    from megazero.engine.process_exit import ReportUncaught
    from megazero.errors import ConfigError
    seen = {}

    def fake(err, **kw):
        seen.update(kw)
        return 2
    monkeypatch.setattr(errors, "report_failure", fake)
    with pytest.raises(SystemExit) as ended:
        ReportUncaught(lambda *a: None)(ConfigError, ConfigError("--x"), None)
    assert ended.value.code == 2 and seen.get("speak_after_wait") is True
