"""Validation and test sets with Megatron-LM's flags: what is evaluated, under which name, for how long.

- ``--valid-data-path`` (with ``--train-data-path``) is one validation set, a blend of its prefixes;
  with ``--multiple-validation-sets`` each prefix is a set of its own (no weights, as Megatron-LM
  requires), evaluated apart and reported as ``eval_loss-NAME`` / ``eval_ppl-NAME``, NAME from
  ``--validation-set-names`` or the set's index (Megatron-LM's ``validation-NAME`` suffix);
- ``--test-data-path`` is evaluated once, after the last iteration, as ``test_loss`` / ``test_ppl``
  (Megatron-LM's test set at the end of training);
- ``--eval-iters`` global batches per evaluation (0: none), or with ``--full-validation`` every whole
  global batch of the set's epoch (the tail of fewer than ``--global-batch-size`` samples is left out).

A set's evaluation batch ``k`` is its samples ``[k * G, (k + 1) * G)`` (:mod:`megazero.data`), the same at
every layout.  The sets are the source's splits: ``valid`` (one set), ``valid-0``, ``valid-1`` ...
(several), ``test``; :class:`SeparateSplits` maps each to its own token source.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

Plan = List[Tuple[str, str, int]]  # (metric suffix, split, batches)


def evaluates(cfg) -> bool:
    """Whether training evaluates at all: an ``--eval-interval`` and something to evaluate (Megatron-LM:
    ``--eval-iters`` > 0 or ``--full-validation``)."""
    tr = cfg.training
    return bool(tr.eval_interval) and (tr.eval_iters > 0 or tr.full_validation)


def _weighted(items: Sequence[str]) -> bool:
    try:
        float(items[0])
    except (TypeError, ValueError, IndexError):
        return False
    return len(items) > 1


def check(cfg) -> None:
    """ValueError, naming the flags, for combinations of the set flags that mean nothing."""
    d, tr = cfg.data, cfg.training
    if d.test_data_path and not d.train_data_path:
        raise ValueError("--test-data-path goes with --train-data-path (with --data-path, --split makes the "
                         "test split)")
    if tr.multiple_validation_sets:
        if not d.valid_data_path:
            raise ValueError("--multiple-validation-sets needs --valid-data-path PREFIX1 PREFIX2 ... (each "
                             "prefix a validation set of its own)")
        if _weighted(d.valid_data_path):
            raise ValueError("--multiple-validation-sets evaluates each --valid-data-path prefix on its own: "
                             "give the prefixes without weights (Megatron-LM's rule)")
    names = list(tr.validation_set_names or [])
    if names and not tr.multiple_validation_sets:
        raise ValueError("--validation-set-names needs --multiple-validation-sets (Megatron-LM's rule)")
    if names and len(names) != len(d.valid_data_path):
        raise ValueError(f"--validation-set-names gives {len(names)} names for {len(d.valid_data_path)} "
                         "--valid-data-path sets; give one name per set")
    if len(set(names)) != len(names):
        raise ValueError(f"--validation-set-names {' '.join(names)}: each set needs its own name")
    if tr.full_validation and d.mock_data:
        raise ValueError("--full-validation reads a validation set to its end, and --mock-data's never ends; "
                         "use --eval-iters N with mock data")
    for flag, items in (("--data-path", d.data_path), ("--valid-data-path", d.valid_data_path)):
        apart = flag == "--valid-data-path" and tr.multiple_validation_sets
        if tr.full_validation and items and (_weighted(items) or (len(items) > 1 and not apart)):
            raise ValueError(f"--full-validation with a blended validation set ({flag} {' '.join(items)}) "
                             "has no one epoch to read: give one prefix, or one per set with "
                             "--valid-data-path P1 P2 ... --multiple-validation-sets")
    sets = [f for f, on in (("--multiple-validation-sets", tr.multiple_validation_sets),
                            ("--full-validation", tr.full_validation), ("--test-data-path", d.test_data_path))
            if on]
    if getattr(d, "sft", False) and sets:
        raise ValueError(f"{sets[0]} with --sft is not implemented (conversations are evaluated on "
                         "--eval-iters batches of --valid-data-path as one set); drop it")
    threads = d.num_dataset_builder_threads
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"--num-dataset-builder-threads must be a positive integer, got {threads!r}")


def names(cfg) -> List[str]:
    """The validation sets' names with ``--multiple-validation-sets``."""
    given = list(cfg.training.validation_set_names or [])
    return given or [str(i) for i in range(len(cfg.data.valid_data_path))]


def separate_sources(cfg, make) -> Dict[str, object]:
    """``--train/--valid/--test-data-path``: split name -> ``make(items, split)`` (one source per set)."""
    d = cfg.data
    sources = {"train": make(d.train_data_path, "train")}
    if d.valid_data_path and evaluates(cfg):
        if cfg.training.multiple_validation_sets:
            for name, prefix in zip(names(cfg), d.valid_data_path):
                sources[f"valid-{name}"] = make([prefix], "valid")
        else:
            sources["valid"] = make(d.valid_data_path, "valid")
    if d.test_data_path and (cfg.training.eval_iters > 0 or cfg.training.full_validation):
        sources["test"] = make(d.test_data_path, "test")
    return sources


class SeparateSplits:
    """``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: one token source per set
    (Megatron-LM's separate sets instead of ``--split``); ``eval_sets`` the evaluation plan."""

    def __init__(self, sources: Dict[str, object], cfg=None):
        self.sources, self.masked_token = sources, None
        self.eval_sets: Optional[Plan] = None if cfg is None else plan_of(self, cfg)

    def get_tokens(self, indices, split: str = "train"):
        if split not in self.sources:
            raise ValueError(f"no {split} data: give --{split.split('-')[0]}-data-path")
        return self.sources[split].get_tokens(indices, split.split("-")[0])

    def samples_per_epoch(self, split: str) -> int:
        return self.sources[split].samples_per_epoch(split.split("-")[0])


def _batches(source, split: str, cfg, what: str) -> int:
    """``--eval-iters``, or with ``--full-validation`` the whole global batches of the set's epoch."""
    tr = cfg.training
    if not tr.full_validation:
        return tr.eval_iters
    n, g = source.samples_per_epoch(split), tr.global_batch_size
    if n < g:
        raise ValueError(f"--full-validation: {what} holds {n} samples of --seq-length "
                         f"{cfg.model.seq_length}, fewer than one --global-batch-size {g}; give it more "
                         "data or lower the batch size")
    return n // g


def plan_of(source, cfg) -> Plan:
    """The validation sets of ``source``: ``(metric suffix, split, batches)`` each."""
    if not evaluates(cfg):
        return []
    splits = [s for s in getattr(source, "sources", {}) if s.startswith("valid-")]
    if splits:
        return [(s[len("valid"):], s, _batches(source, s, cfg, f"validation set {s[len('valid-'):]}"))
                for s in splits]
    return [("", "valid", _batches(source, "valid", cfg, "the validation set"))]


def eval_plan(data, cfg) -> Plan:
    """What an evaluation of ``data`` runs (the plan its builder made, else ``--eval-iters`` batches of
    the ``valid`` split, e.g. mock data)."""
    made = getattr(data, "eval_sets", None)
    if made is not None:
        return made
    return [("", "valid", cfg.training.eval_iters)] if evaluates(cfg) else []


def final_test(data, cfg) -> Optional[Tuple[str, int]]:
    """``(split, batches)`` of the test set evaluated after the last iteration, or None."""
    if "test" not in getattr(data, "sources", {}):
        return None
    return "test", _batches(data, "test", cfg, "the test set")
