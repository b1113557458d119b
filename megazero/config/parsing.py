"""From flags, a ``--config`` file and a ``--model`` preset to a :class:`MegazeroConfig`.

Layering, lowest to highest priority: dataclass defaults < ``--model PRESET`` < ``--config FILE``
(YAML or JSON, flat ``flag-name: value`` keys or nested by section) < command-line flags.
Reading a file (the config, the tokenizer behind ``--tokenizer-model``) happens here, never in
validation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from typing import Any, Dict, List, Optional, Sequence

from megazero.config.megatron import add_flags, extra_words, required_notes, translate
from megazero.errors import ConfigError
from megazero.config.sections import SECTIONS, MegazeroConfig, field_index, flag_of
from megazero.config.validation import validate


class _Parser(argparse.ArgumentParser):
    """argparse, where under a launcher only global rank 0 prints a usage error: every other rank
    exits with the same status 2, silently, once its launcher ends it (or after a bounded wait)."""

    def error(self, message: str):
        rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
        if rank != 0 and world > 1:
            from megazero.resilience.errors import report_failure
            sys.exit(report_failure(ConfigError(message), prog=self.prog, rank=rank, world_size=world))
        super().error(message)


def build_parser(presets: Optional[Dict[str, dict]] = None) -> argparse.ArgumentParser:
    """The argparse parser for every flag (defaults suppressed so given flags can be told apart)."""
    p = _Parser(
        description="Pretrain a GPT model with tensor, pipeline and data parallelism and ZeRO.",
        argument_default=argparse.SUPPRESS, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # as Megatron-LM's: a flag is spelled out, never guessed from a prefix
        usage="%(prog)s [--flag VALUE ...]  (Megatron-LM's flags; --help lists them all)")
    p.add_argument("--config", help="YAML or JSON file of settings; flags override it.")
    p.add_argument("--model", dest="model_preset", choices=sorted(presets) if presets else None,
                   help="Named model preset" + (f" ({', '.join(sorted(presets))})" if presets else ""))
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section, cls.__doc__)
        for f in fields(cls):
            if not f.metadata.get("derived"):
                group.add_argument(flag_of(f), **_argparse_kwargs(f))
    add_flags(p)
    return p


def _argparse_kwargs(f) -> Dict[str, Any]:
    meta = f.metadata
    kw: Dict[str, Any] = {"dest": f.name, "help": meta.get("flag_help", meta["help"])}
    if "action" in meta:
        kw["action"] = meta["action"]
    elif f.type in ("bool", bool):
        kw["action"] = "store_true"
    else:
        kw["type"] = meta.get("type", _scalar_type(f))
        kw.update({k: meta[k] for k in ("choices", "nargs") if k in meta})
        if "choices" in meta and kw["type"] is str:
            kw["type"] = _Choice(meta["choices"])
    return kw


class _Choice:
    """A choice in any letter case as its canonical spelling (``rmsnorm`` is ``RMSNorm``, as scripts
    built on Megatron-LM spell it); other words pass through for argparse to refuse."""

    def __init__(self, choices):
        self.canonical = {c.lower(): c for c in choices}
        self.__name__ = "choice"  # argparse names the type in its errors

    def __call__(self, text: str) -> str:
        return self.canonical.get(text.lower(), text)


def _scalar_type(f):
    t = str(f.type)
    if "float" in t:
        return float
    if "int" in t:
        return int
    return str


def _load_file(path: str) -> Dict[str, Any]:
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror})") from None
    if path.endswith((".yaml", ".yml")):
        import yaml
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_").lstrip("_")] = value
    return flat


def _tokenizer_vocab_size(data: Dict[str, Any], vocab_size: Optional[int]) -> Optional[int]:
    """The vocabulary size the tokenizer settings give (as in Megatron-LM, it sets the model's), or
    None without a tokenizer."""
    from megazero.data.tokenizer import tokenizer_from_settings
    try:
        tok = tokenizer_from_settings(data.get("tokenizer_type"), data.get("tokenizer_model"),
                                      data.get("vocab_file"), data.get("merge_file"), vocab_size)
    except (OSError, ValueError) as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith("--") else f"--tokenizer-model: {msg}") from None
    return None if tok is None else tok.vocab_size


def _checkpoint_args(settings: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``--use-checkpoint-args``: per section, the settings taken from the ``--load`` checkpoint: the
    architecture and dropout, and its tokenizer unless one is given here (none when the directory
    holds no checkpoint yet: the load itself then decides)."""
    from megazero.checkpoint.errors import CheckpointError
    from megazero.checkpoint.format import CHECKPOINT_ARGS, CHECKPOINT_TOKENIZER_ARGS
    from megazero.checkpoint.resolve import saved_config
    if not settings.get("load"):
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint to take the model's "
                          "architecture from)")
    try:
        saved = saved_config(settings["load"], settings.get("ckpt_step")) or {}
    except CheckpointError as err:
        raise ConfigError(f"--use-checkpoint-args: {err}") from None
    model, moe, data = saved.get("model", {}), saved.get("moe", {}), saved.get("data", {})
    out = {"model": {k: model[k] for k in CHECKPOINT_ARGS if k in model},
           "moe": {k: moe[k] for k in CHECKPOINT_ARGS if k in moe}, "data": {}}
    if settings.get("no_use_tokenizer_model_from_checkpoint_args") or \
            any(settings.get(k) is not None for k in CHECKPOINT_TOKENIZER_ARGS):
        return out
    out["data"] = {k: data[k] for k in CHECKPOINT_TOKENIZER_ARGS if data.get(k) is not None}
    for k in ("tokenizer_model", "vocab_file", "merge_file"):
        if k in out["data"] and not os.path.exists(out["data"][k]):
            flag = "--" + k.replace("_", "-")
            raise ConfigError(f"--use-checkpoint-args: the checkpoint's tokenizer ({flag} {out['data'][k]}) "
                              f"is not found from here; pass {flag} PATH, or "
                              "--no-use-tokenizer-model-from-checkpoint-args to train without it")
    return out


def config_from_dict(settings: Dict[str, Any], presets: Optional[Dict[str, dict]] = None) -> MegazeroConfig:
    """Build a config from ``{field_name: value}`` (a preset named by ``model_preset`` first, then
    with ``use_checkpoint_args`` the ``--load`` checkpoint's architecture, dropout and tokenizer).  With
    a tokenizer (``tokenizer_model``, ``vocab_file``/``merge_file``, ``tokenizer_type``) the tokenizer's
    vocabulary size replaces ``vocab_size``."""
    index = field_index()
    per_section: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
    preset = settings.get("model_preset") or settings.get("model")
    if isinstance(preset, str):
        if not presets or preset not in presets:
            known = ", ".join(sorted(presets or {})) or "none registered"
            raise ConfigError(f"--model {preset}: unknown model preset; choose one of: {known}")
        for k, v in presets[preset].items():
            per_section[index[k][0]][k] = v
    if settings.get("use_checkpoint_args"):  # over the preset, under the settings given
        for section, taken in _checkpoint_args(settings).items():
            per_section[section].update(taken)
    for key, value in settings.items():
        if key in ("model_preset", "model", "config"):
            continue
        if key == "use_distributed_optimizer":  # accepted here too: config files may use it
            if value:
                per_section["parallel"]["zero_stage"] = max(1, settings.get("zero_stage", 1))
            continue
        if key not in index:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"unknown setting {key!r} (flag {flag}); see --help for the list")
        per_section[index[key][0]][key] = _float_text(index[key][1], value)
    _data_args_files(per_section["data"])
    from megazero.config.vocab import checkpoint_vocab
    saved_vocab = checkpoint_vocab(settings, per_section)
    vocab = _tokenizer_vocab_size(per_section["data"], per_section["model"].get("vocab_size"))
    padded: List[str] = []
    if saved_vocab is not None and vocab is not None:  # the checkpoint's (padded) vocabulary wins
        vocab, padded = saved_vocab.check_fits(vocab), saved_vocab.notes(vocab)
    notes = _no_tokenizer(per_section) if vocab is None else _vocab_replaced(settings, per_section, vocab)
    notes = list(notes) + padded
    if vocab is not None:
        per_section["model"]["vocab_size"] = vocab
    return MegazeroConfig(**{s: cls(**per_section[s]) for s, cls in SECTIONS.items()},
                          model_preset=preset if isinstance(preset, str) else None, notes=tuple(notes))


def _read_args_file(flag: str, path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot read it ({err.strerror})") from None


def _data_args_files(data: Dict[str, Any]) -> None:
    """``--data-args-path FILE`` (the ``--data-path`` items, whitespace-separated) and
    ``--per-split-data-args-path FILE`` (JSON: ``train``/``valid``/``test`` items, each a list or a
    whitespace-separated string), read into the settings they stand for, as Megatron-LM reads them."""
    path = data.get("data_args_path")
    if path:
        if data.get("data_path"):
            raise ConfigError("--data-args-path and --data-path both name the data; give one")
        data["data_path"] = _read_args_file("--data-args-path", path).split()
        if not data["data_path"]:
            raise ConfigError(f"--data-args-path {path}: the file names no dataset prefix")
    path = data.get("per_split_data_args_path")
    if not path:
        return
    given = [f"--{k.replace('_', '-')}" for k in ("train_data_path", "valid_data_path", "test_data_path")
             if data.get(k)]
    if given:
        raise ConfigError(f"--per-split-data-args-path and {given[0]} both name the data; give one")
    text = _read_args_file("--per-split-data-args-path", path)
    try:
        splits = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"--per-split-data-args-path {path}: not JSON ({err})") from None
    if not (isinstance(splits, dict) and set(splits) <= {"train", "valid", "test"} and splits.get("train")):
        raise ConfigError(f"--per-split-data-args-path {path}: expected a JSON object with a \"train\" list "
                          "and optional \"valid\" and \"test\" lists of prefixes (or WEIGHT PREFIX pairs)")
    for split, items in splits.items():
        if isinstance(items, str):
            items = items.split()
        if items is None:
            items = []
        if not isinstance(items, list) or not all(isinstance(x, (str, int, float)) for x in items):
            raise ConfigError(f"--per-split-data-args-path {path}: \"{split}\" must be a list of prefixes "
                              "(or WEIGHT PREFIX pairs) or one whitespace-separated string")
        data[f"{split}_data_path"] = [str(x) for x in items]


def _float_text(f, value):
    """A float setting given as text in a config file (YAML 1.1 reads ``1e-3`` as a string) as its number;
    text that is not a number is left for validation to name."""
    if isinstance(value, str) and str(f.type) in ("float", "Optional[float]"):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _vocab_replaced(settings: Dict[str, Any], per_section: Dict[str, Dict[str, Any]],
                    vocab: int) -> List[str]:
    """A --vocab-size given beside a tokenizer with another number of ids: as in Megatron-LM the tokenizer
    sets the vocabulary; the start-up note says so, naming both."""
    given = settings.get("vocab_size")
    data = per_section["data"]
    if given is None or given == vocab or data.get("tokenizer_type") == "NullTokenizer":
        return []
    source = data.get("tokenizer_model") or data.get("vocab_file")
    return [f"WARNING: --vocab-size {given} ignored: the tokenizer ({source}) has {vocab:,} ids and sets the "
            "model's vocabulary, as in Megatron-LM; drop --vocab-size (or train without a tokenizer: "
            "--tokenizer-type NullTokenizer --vocab-size N)"]


def _no_tokenizer(per_section: Dict[str, Dict[str, Any]]) -> List[str]:
    """Real data without a tokenizer: an error without --vocab-size (the model's vocabulary would be a
    default unrelated to the data), a warning with it (no tokenizer checks the ids or goes with exports)."""
    data = per_section["data"]
    real = [f for f in ("data_path", "train_data_path") if data.get(f)]
    if not real:
        return []
    flag = "--" + real[0].replace("_", "-")
    if "vocab_size" not in per_section["model"]:
        raise ConfigError(f"{flag} without a tokenizer: the vocabulary size is unknown. Give the tokenizer "
                          "the data was made with (--tokenizer-model, or --vocab-file/--merge-file; its "
                          "vocabulary sets the model's), or --tokenizer-type NullTokenizer --vocab-size N, "
                          "or at least --vocab-size N (the largest id + 1)")
    return [f"WARNING: {flag} without a tokenizer: the model's vocabulary is --vocab-size "
            f"{per_section['model']['vocab_size']}, which nothing checks against the data's tokenizer, and "
            "exported models carry no tokenizer; pass --tokenizer-model to use the data's own"]


def parse_args(argv: Optional[Sequence[str]] = None, presets: Optional[Dict[str, dict]] = None,
               world_size: Optional[int] = None, validate_now: bool = True,
               check_data: bool = True, parser: Optional[argparse.ArgumentParser] = None) -> MegazeroConfig:
    """Parse Megatron-style flags (after an optional --config file and --model preset) and validate
    (:func:`~megazero.config.validation.validate`; ``check_data=False`` for a program that reads no
    data, such as a memory estimate or the layout planner: then neither --mock-data nor
    --data-path is needed).  ``parser``: a :func:`build_parser` of the same ``presets``, for a caller
    that parses many command lines (building one takes longer than parsing)."""
    parser = build_parser(presets) if parser is None else parser
    parsed, extras = parser.parse_known_args(argv)
    refused, unknown = extra_words(extras)  # every refused flag is named in one error, unknown words too
    ns = vars(parsed)
    settings: Dict[str, Any] = {}
    if "config" in ns:
        settings.update(_load_file(ns.pop("config")))
    settings.update(ns)
    try:
        settings, notes = translate(settings, set(ns), refused)
    except ConfigError as err:
        raise ConfigError(f"{err}; and {unknown}" if unknown else str(err)) from None
    if unknown:  # nothing refused: argparse's usage error
        parser.error(unknown)
    cfg = config_from_dict(settings, presets)
    cfg.notes = tuple(notes) + cfg.notes + tuple(required_notes(settings, presets))
    return validate(cfg, world_size, check_data) if validate_now else cfg
