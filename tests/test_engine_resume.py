"""The engine resumes exactly at another data-parallel size (issue 42, item 4): the micro-batch counter
is derived from the optimizer step and this run's gradient accumulation, never restored raw, and a
``train_batch_size`` other than the saved one is refused with one line.

Saved at DP 2 with accumulation 1 after step 5 (an odd count of micro-batches per rank), resumed at
DP 1 with accumulation 2 (the same global batch of 4 sequences): the resumed steps must equal an
uninterrupted DP 1 run's.  Restoring the saved micro-batch count (5) made the first resumed update
use one micro-batch instead of two, which moved the next losses by 4e-3 to 6e-3 and weights by up to
1.6e-3.

Tolerance: the two sides differ only in the first five steps' gradient summation order (two ranks'
all-reduce against one process's accumulation; equal bitwise here, observed); tests/tolerance.py's
Adam rule, ``R_TRAIN_ADAM`` relative to the loss, and for the weights absolute at ``R_TRAIN_ADAM``
times the model's largest weight (tolerance.py: rounding scales with the operands; a coordinate whose
gradient is ~0, such as an attention key's bias, is moved by Adam at that scale, not its own) covers
it and fails an update that uses half the batch.
"""
import pytest
import torch

from megazero.process.local_ranks import RankError, run_ranks
from tolerance import R_TRAIN_ADAM

pytest.importorskip("transformers")

from engine_common import MODELS, ds_config, train  # noqa: E402

SAVED_AT, MORE = 5, 3


def _engine(ga):
    import megazero
    model = MODELS["bert"]()
    engine, _, _, _ = megazero.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(2, ga))
    return engine


def _weights(engine):
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _save_at_dp2(directory):
    engine = _engine(1)
    losses, _ = train(engine, "bert", SAVED_AT)
    engine.save_checkpoint(directory)
    return losses, engine.micro_steps


def _resume_at_dp1(directory, ga):
    engine = _engine(ga)
    engine.load_checkpoint(directory)
    counters = (engine.global_steps, engine.micro_steps)
    losses, _ = train(engine, "bert", MORE, first_step=SAVED_AT)
    return losses, _weights(engine), counters


def _uninterrupted_dp1():
    engine = _engine(2)
    losses, _ = train(engine, "bert", SAVED_AT + MORE)
    return losses, _weights(engine)


@pytest.mark.slow
def test_saved_at_dp2_resumed_at_dp1_with_accumulation_equals_an_uninterrupted_run(tmp_path):
    d = str(tmp_path / "ckpt")
    first, micro = run_ranks(_save_at_dp2, 2, d)[0]
    assert micro == SAVED_AT  # one micro-batch per step and rank: the saved count is odd
    losses, weights, counters = run_ranks(_resume_at_dp1, 1, d, 2)[0]
    assert counters == (SAVED_AT, 2 * SAVED_AT)  # derived from the step and this run's accumulation
    ref_losses, ref_weights = run_ranks(_uninterrupted_dp1, 1)[0]
    assert max(abs(a - b) for a, b in zip(first, ref_losses)) <= R_TRAIN_ADAM * max(ref_losses)
    got, want = torch.tensor(losses), torch.tensor(ref_losses[SAVED_AT:])
    torch.testing.assert_close(got, want, rtol=R_TRAIN_ADAM, atol=0.0)
    largest = max(float(ref.abs().max()) for ref in ref_weights.values())
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=0.0, atol=R_TRAIN_ADAM * largest, msg=name)
    # another train_batch_size (DP 1 x accumulation 1 x micro 2 = 2, saved 4): one line, no resume
    with pytest.raises(RankError, match=r"saved with train_batch_size 4, this engine's is 2 .*give ds_config "
                                        r"train_batch_size 4"):
        run_ranks(_resume_at_dp1, 1, d, 1)
