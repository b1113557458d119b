"""Global batch size as training goes on: constant, Megatron-LM's ``--step-batch-size-schedule``, or
older Megatron-LM's ``--rampup-batch-size``.

A schedule is a tuple of ``(threshold, batch size)`` pairs, thresholds in samples consumed, the
first 0, strictly increasing: the batch of an iteration is the size of the last pair whose threshold
is at most the number of samples consumed before it.  Iteration ``t`` takes the next ``G_t`` samples
of the one global sample order, ``[consumed, consumed + G_t)`` (:func:`megazero.data.micro_batches`),
so every layout, the one-process oracle included, sees the same samples in the same iterations.

- ``--step-batch-size-schedule "0:16 2.4B:320 ..."``: thresholds in *tokens* with K, M, B, T suffixes
  (Megatron-LM passes the sequence length, so its thresholds are tokens), converted to samples by
  integer division by ``--seq-length``;
- ``--rampup-batch-size START INCREMENT SAMPLES``: ``START + k x INCREMENT`` from
  ``ceil(k x SAMPLES / n)`` samples on, ``k = 1 .. n``, ``n = (G - START) / INCREMENT`` (older
  Megatron-LM's rule, in exact integer arithmetic).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

Schedule = Tuple[Tuple[int, int], ...]
_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _number(text: str) -> int:
    text = text.strip().upper()
    mult = _SUFFIXES.get(text[-1:], 1)
    if mult != 1:
        text = text[:-1]
    return int(float(text) * mult)


def parse_step_schedule(text: str, seq_length: int) -> Schedule:
    """``--step-batch-size-schedule`` (thresholds in tokens) as a schedule in samples; ValueError
    naming the flag for a malformed one."""
    flag = "--step-batch-size-schedule"
    pairs = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((_number(threshold) // seq_length, _number(batch)))
        except ValueError:
            raise ValueError(f"{flag}: {entry!r} is not THRESHOLD:BATCH (e.g. 0:16 or 2.4B:320)") from None
    pairs.sort()
    if not pairs or pairs[0][0] != 0:
        raise ValueError(f"{flag} {text!r}: the first threshold must be 0 (the batch size to start with)")
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if b <= a:
            raise ValueError(f"{flag} {text!r}: thresholds must increase by at least --seq-length "
                             f"{seq_length} tokens (one sample); two fall on sample {a}")
    if any(g < 1 for _, g in pairs):
        raise ValueError(f"{flag} {text!r}: batch sizes must be positive")
    return tuple(pairs)


def rampup_schedule(start: int, increment: int, samples: int, global_batch_size: int) -> Schedule:
    """``--rampup-batch-size START INCREMENT SAMPLES`` up to ``global_batch_size`` as a schedule."""
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 0:
        raise ValueError(f"{flag}: START and INCREMENT must be positive and SAMPLES >= 0")
    if global_batch_size < start or (global_batch_size - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size {global_batch_size} must be START plus a whole "
                         "number of "
                         "INCREMENTs")
    steps = (global_batch_size - start) // increment
    pairs = [(0, start)] + [(-(-k * samples // steps), start + k * increment) for k in range(1, steps + 1)]
    out = []
    for threshold, g in pairs:  # with fewer samples than increments several sizes share a threshold
        if out and out[-1][0] == threshold:
            out[-1] = (threshold, g)
        else:
            out.append((threshold, g))
    return tuple(out)


def batch_size_at(schedule: Schedule, consumed: int) -> int:
    """The global batch size of the iteration that starts after ``consumed`` samples."""
    size = schedule[0][1]
    for threshold, g in schedule:
        if consumed < threshold:
            break
        size = g
    return size


def iterations_for_samples(schedule: Schedule, samples: int) -> int:
    """Iterations that consume at least ``samples`` samples (Megatron-LM's rule for --train-samples)."""
    consumed = iterations = 0
    while consumed < samples:
        consumed += batch_size_at(schedule, consumed)
        iterations += 1
    return iterations


def consumed_after(schedule: Schedule, iterations: int, start: int = 0) -> int:
    """Samples consumed after ``iterations`` more iterations from ``start`` samples."""
    consumed = start
    for _ in range(iterations):
        consumed += batch_size_at(schedule, consumed)
    return consumed


def schedule_of(training, seq_length: int, global_batch_size: Optional[int]) -> Schedule:
    """The schedule a :class:`~megazero.config.TrainingConfig` asks for (``global_batch_size``: the
    resolved one, for the constant case and the ramp-up's end)."""
    if training.step_batch_size_schedule:
        return parse_step_schedule(training.step_batch_size_schedule, seq_length)
    if training.rampup_batch_size:
        return rampup_schedule(*training.rampup_batch_size, global_batch_size)
    return ((0, global_batch_size),)


def sizes(schedule: Schedule) -> Sequence[int]:
    """The distinct batch sizes of ``schedule``."""
    return sorted({g for _, g in schedule})
