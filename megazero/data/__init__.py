"""Training data: token sources and the fixed rule that cuts global batches into micro-batches.

A *source* has ``get_tokens(indices, split) -> LongTensor[n, seq_length + 1]``: the token ids of
global samples ``indices``.  :func:`micro_batches` is the only place that decides which sample
goes where, so every layout sees the same data:

* the global batch of step ``t`` is samples ``[t * G, (t + 1) * G)`` (``G`` = global batch size);
  with a batch-size schedule (:mod:`megazero.config.batch_schedule`) the batch of each step is the next
  ``G_t`` samples after those consumed, ``[c_t, c_t + G_t)``;
* data-parallel rank ``d`` of ``D`` takes the contiguous share ``[t*G + d*G/D, t*G + (d+1)*G/D)``;
* it cuts the share, in order, into micro-batches of ``--micro-batch-size`` samples.

One process with the same global batch therefore sees exactly the same samples (all shares, in
rank order).  Evaluation batch ``k`` is samples ``[k * G, (k + 1) * G)`` of the ``valid`` split,
which the source keeps disjoint from training samples.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from megazero.data.mock import MockGPTData
from megazero.errors import ConfigError

__all__ = ["MockGPTData", "build_data", "sample_range", "micro_batches", "stage_keys", "to_device"]
# Real data (``--data-path``): megazero.data.indexed (Megatron's .bin/.idx), megazero.data.tokenizer,
# megazero.data.gpt_dataset.BlendedGPTData (the source build_data returns).  The trainer's step after
# step loading (this stage's tensors, the next step prefetched): megazero.data.loader.StepBatches.


def build_data(cfg):
    """The token source that the (validated) config asks for."""
    d = cfg.data
    if d.mock_data:
        data = MockGPTData(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.training.seed)
        if d.eod_mask_loss:  # the tokenizer's EOD id (--tokenizer-type NullTokenizer: --vocab-size)
            from megazero.data.tokenizer import tokenizer_from_config
            data.masked_token = tokenizer_from_config(cfg).eod
        return data
    if not (d.data_path or d.train_data_path):
        raise ConfigError("no training data: pass --mock-data or --data-path PREFIX")
    try:
        if d.sft:  # conversations, the loss on the responses (megazero.data.sft)
            from megazero.data.sft import build_sft_data
            data = build_sft_data(cfg)
        else:
            data = _real_data(cfg)
        if d.eod_mask_loss:
            from megazero.data.tokenizer import tokenizer_from_config
            data.masked_token = tokenizer_from_config(cfg).eod
        return data
    except FileNotFoundError as err:
        raise ConfigError(f"--data-path: {err}") from None
    except ValueError as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith("--") else f"--data-path: {msg}") from None


def _real_data(cfg):
    """``--data-path`` cut by ``--split``, or the sets of ``--train/--valid/--test-data-path``
    (:mod:`megazero.data.eval_sets`: several validation sets, the test set, --full-validation)."""
    from megazero.data.eval_sets import SeparateSplits, evaluates, plan_of, separate_sources
    from megazero.data.gpt_dataset import BlendedGPTData
    d, seq, seed, vocab = cfg.data, cfg.model.seq_length, cfg.training.seed, cfg.model.vocab_size
    options = dict(vocab_size=vocab, mmap=d.mmap_bin_files, threads=d.num_dataset_builder_threads)
    if d.data_path:
        data = BlendedGPTData(d.data_path, seq, d.split, seed, **options)
        data.check(("train", "valid") if evaluates(cfg) else ("train",))
        data.check_vocab()
        data.eval_sets = plan_of(data, cfg)
        return data
    whole = {"train": "1,0,0", "valid": "0,1,0", "test": "0,0,1"}

    def make(items, split):
        source = BlendedGPTData(items, seq, whole[split], seed, flag=f"--{split}-data-path", **options)
        source.check((split,))
        source.check_vocab()
        return source
    return SeparateSplits(separate_sources(cfg, make), cfg)


def sample_range(step: Optional[int], global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 first: Optional[int] = None) -> range:
    """Global sample indices of data-parallel rank ``dp_rank``'s share of batch ``step`` (of the batch
    that starts at sample ``first`` instead, when given: a batch-size schedule)."""
    if global_batch_size % dp_size:
        raise ValueError(f"global batch {global_batch_size} is not divisible by data-parallel size {dp_size}")
    share = global_batch_size // dp_size
    start = (step * global_batch_size if first is None else first) + dp_rank * share
    return range(start, start + share)


BATCH_KEYS = ("tokens", "labels", "loss_mask")


def stage_keys(chunks) -> tuple:
    """The micro-batch tensors a pipeline stage reads: ``tokens`` where one of its chunks embeds the
    input (the first stage) or finds packed documents in them (``needs_tokens``: every stage with
    ``--reset-attention-mask`` or ``--reset-position-ids``), ``labels`` and ``loss_mask`` where one
    computes the loss (the last)."""
    first = any(getattr(c, "pre_process", True) or getattr(c, "needs_tokens", False) for c in chunks)
    last = any(getattr(c, "post_process", True) for c in chunks)
    return (("tokens",) if first else ()) + (("labels", "loss_mask") if last else ())


def micro_batches(source, step: Optional[int], global_batch_size: int, micro_batch_size: int,
                  dp_rank: int = 0, dp_size: int = 1, split: str = "train",
                  device: Optional[torch.device] = None,
                  first: Optional[int] = None, keys: Sequence[str] = BATCH_KEYS) -> List[Dict[str, torch.Tensor]]:
    """This rank's micro-batches of batch ``step`` (or of the batch of ``global_batch_size`` samples
    that starts at sample ``first``): dicts of ``tokens``, ``labels`` (the next token) and
    ``loss_mask``, each ``[micro_batch_size, seq_length]``.  The mask is all ones unless the source
    has a ``masked_token`` (``--eod-mask-loss``): positions whose input is that token (the
    prediction across a document boundary) are then left out, as in Megatron-LM.

    ``keys``: the tensors to build (:func:`stage_keys`: a middle pipeline stage reads none, and then
    no sample is read either).  ``device``: where they go; to a device other than the CPU through
    pinned memory with ``non_blocking`` copies (:func:`to_device`)."""
    indices = sample_range(step, global_batch_size, dp_rank, dp_size, first)
    if len(indices) % micro_batch_size:
        raise ValueError(f"a share of {len(indices)} samples is not divisible by micro-batch size "
                         f"{micro_batch_size}")
    if not keys:
        return [{} for _ in range(len(indices) // micro_batch_size)]
    ids = source.get_tokens(list(indices), split)
    trained = source.get_loss_mask(list(indices), split) \
        if "loss_mask" in keys and hasattr(source, "get_loss_mask") else None
    out = []
    for start in range(0, len(indices), micro_batch_size):
        chunk = ids[start:start + micro_batch_size]
        tokens, labels = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        masked = getattr(source, "masked_token", None)
        mask = (tokens != masked).float() if masked is not None else torch.ones(labels.shape)
        if trained is not None:  # a source that trains some labels only (--sft: the responses)
            mask = mask * trained[start:start + micro_batch_size]
        batch = {"tokens": tokens, "labels": labels, "loss_mask": mask}
        out.append(to_device({k: batch[k] for k in keys}, device))
    return out


def to_device(batch: Dict[str, torch.Tensor], device: Optional[torch.device]) -> Dict[str, torch.Tensor]:
    """``batch`` on ``device`` (unchanged for None or the CPU).  To an accelerator each tensor is
    pinned first and copied with ``non_blocking``: the host does not wait for the copy, which runs
    in stream order before the kernels that read it (the pinned allocator keeps the host copy until
    the transfer is done)."""
    if device is None or torch.device(device).type == "cpu":
        return batch if device is None else {k: v.to(device) for k, v in batch.items()}
    out = {}
    for k, v in batch.items():
        try:
            v = v.pin_memory()
        except RuntimeError:  # an accelerator without pinned host memory: a plain copy
            pass
        out[k] = v.to(device, non_blocking=v.is_pinned())
    return out
