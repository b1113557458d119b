"""Converting between Hugging Face directories and megazero checkpoints one tensor at a time (what
``scripts/convert_hf.py`` runs): the model is never held whole, so a 7B model converts in a few GB.

- :func:`to_megazero`: the megazero model is built on the meta device (names, shapes, layouts, no
  memory); each parameter is made from the Hugging Face tensors it needs, read from the safetensors
  files as it is written; the tokenizer files and ``generation_config.json`` go to ``DST/hf_files``,
  which the checkpoint's configuration names as its tokenizer, with the source's bos/eos/pad ids
  (``megazero_token_ids.json``: an export writes them into its ``config.json``).  The source is
  checked first, by a dry run of the mapping on the tensors' shapes (:func:`check_weights`).
- :func:`to_hf`: each parameter of the checkpoint is read alone (any saved layout), split into its
  Hugging Face tensors and streamed into ``model-0000i-of-0000N.safetensors`` shards of
  ``--max-shard-size`` (with ``model.safetensors.index.json``) in ``--dtype``; then ``config.json``,
  ``generation_config.json`` and the tokenizer.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional

import torch

from megazero.config import ConfigError, config_from_dict, validate
from megazero.mesh import ParallelMesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
            "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
ASSETS = "hf_files"  # beside the iter_* directories of a converted checkpoint
TOKEN_IDS = "megazero_token_ids.json"  # in ASSETS: the source config's special ids, which an export keeps
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
FP32_TENSORS = {t: (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")  # their routers, in any --dtype
                for t in ("glm4_moe", "deepseek_v3")}
FP32_TENSORS["nemotron_h"] = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")  # NemotronH's MoE


def _whole_model_cfg(settings: dict):
    whole = dict(settings, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, mock_data=True)
    return validate(config_from_dict(whole), 1)


def to_megazero(src: str, dst: str, allow_unused_weights: bool = False, notes: Optional[list] = None) -> str:
    """Hugging Face directory ``src`` -> checkpoint directory ``dst`` (iteration 0, weights only).

    The source is checked before anything is written (a :class:`ConfigError` naming the file
    otherwise): ``config.json`` (:func:`read_hf_config`), the weight files (inside ``src``, well-formed:
    :mod:`models.safetensors_io`), and the tensors (:func:`check_weights`): each one the model needs
    is there with the shape the config implies, and each one there is used, unless
    ``allow_unused_weights`` (then the unused ones are dropped, and ``notes``, when given, gets a line
    saying how many and which first)."""
    from megazero.checkpoint import save_weights
    from . import build_model
    from .hf import layers_present, megazero_names, megazero_tensor
    from .safetensors_io import HFWeights
    from .hf_config import config_from_hf
    from .hf_deepseek import mtp_depths, pairs_getter
    hf_config, cfg = read_hf_config(src)
    weights = HFWeights(src)
    depths = mtp_depths(weights.names(), hf_config)  # DeepSeek-V3's files hold its MTP layers
    if depths:
        cfg = _whole_model_cfg(dict(config_from_hf(hf_config), mtp_num_layers=depths))
    present = layers_present(weights.names(), hf_config.model_type)
    absent = next((i for i in range(cfg.model.num_layers) if i not in present), None)
    if absent is not None:  # before building the model, which takes time in proportion to the layers
        raise ConfigError(f"{src}: config.json describes {cfg.model.num_layers} layers, but its weight files "
                          f"hold no tensor of layer {absent} (they hold {len(present)} layer"
                          f"{'s' if len(present) != 1 else ''})")
    meta = ParallelMesh.single(torch.device("meta"))
    with torch.device("meta"):
        skeleton = build_model(cfg, meta)
    names = megazero_names(cfg)
    built = [n for n, _ in skeleton.named_parameters()]
    if sorted(names) != sorted(built):
        raise RuntimeError(f"the Hugging Face mapping names {sorted(set(names) ^ set(built))} differently "
                           "from the model")
    unused = check_weights(src, weights, cfg, skeleton, hf_config.model_type, allow_unused_weights)
    if unused and notes is not None:
        plural = "s" if len(unused) > 1 else ""
        notes.append(f"dropped {len(unused)} unused tensor{plural} (the first: {unused[0]})")
    if _copy_hf_files(src, os.path.join(dst, ASSETS)):
        cfg.data.tokenizer_model, cfg.data.tokenizer_type = os.path.abspath(os.path.join(dst, ASSETS)), \
            "HuggingFaceTokenizer"
        ids = {k: getattr(hf_config, k, None) for k in SPECIAL_IDS}
        with open(os.path.join(dst, ASSETS, TOKEN_IDS), "w") as fh:
            json.dump({k: v for k, v in ids.items() if v is not None}, fh)

    get = pairs_getter(lambda hf_name: weights.get(hf_name, torch.float32), hf_config)

    def values(name, _p):  # fp32, read and converted a chunk at a time
        return megazero_tensor(name, cfg, get, hf_config.model_type)
    return save_weights(dst, [skeleton], ParallelMesh.single(), cfg, iteration=0,
                        extra={"converted_from": os.path.abspath(src)}, values=values)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def read_hf_config(src: str):
    """``(transformers config, whole-model megazero config)`` of ``src/config.json``; a
    :class:`ConfigError` naming the file for JSON that does not parse, a missing or unknown
    ``model_type``, a field of the wrong type or value, or a model megazero cannot build."""
    from transformers import AutoConfig
    from .hf_config import check_model_type, config_from_hf
    from .safetensors_io import file_inside
    path = file_inside(src, "config.json", os.path.join(src, "config.json"))
    try:
        with open(path, "rb") as fh:
            raw = json.loads(fh.read().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; a Hugging Face model directory has a config.json") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid JSON ({_one_line(err)})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{path}: no model_type (a Hugging Face config.json is an object naming its "
                          "architecture in model_type)")
    try:
        check_model_type(raw["model_type"])
        hf_config = AutoConfig.from_pretrained(src)
        return hf_config, _whole_model_cfg(config_from_hf(hf_config))
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except _config_errors() as err:
        raise ConfigError(f"{path}: a field is missing or has the wrong type or value "
                          f"({type(err).__name__}: {_one_line(err)})") from None


def _config_errors() -> tuple:
    """What transformers and :func:`config_from_hf` raise for a config.json with bad fields."""
    errors = [OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError]
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5's typed config fields
        errors.append(StrictDataclassError)
    except ImportError:
        pass
    return tuple(errors)


class _ShapeOf:
    """A tensor's stand-in in the dry run of :func:`check_weights`: its shape, carried through the
    operations the mapping applies (views of a meta tensor; ``torch.cat``, ``torch.stack`` and a norm's
    ``+ 1`` on the shapes alone, because on the meta device those import ``torch._dynamo``: seconds)."""

    def __init__(self, t: torch.Tensor):
        self.meta = t

    @property
    def shape(self) -> torch.Size:
        return self.meta.shape

    def dim(self) -> int:
        return self.meta.dim()

    def float(self) -> "_ShapeOf":
        return self

    def __add__(self, _other) -> "_ShapeOf":
        return self

    def t(self) -> "_ShapeOf":
        return _ShapeOf(self.meta.t())

    def transpose(self, *dims) -> "_ShapeOf":
        return _ShapeOf(self.meta.transpose(*dims))

    def reshape(self, *shape) -> "_ShapeOf":
        return _ShapeOf(self.meta.reshape(*shape))

    def chunk(self, *args, **kwargs) -> list:
        return [_ShapeOf(t) for t in self.meta.chunk(*args, **kwargs)]

    def split(self, *args, **kwargs) -> list:
        return [_ShapeOf(t) for t in self.meta.split(*args, **kwargs)]

    def __getitem__(self, i) -> "_ShapeOf":
        return _ShapeOf(self.meta[i])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in (torch.cat, torch.stack):
            return NotImplemented
        parts, dim = [list(p.shape) for p in args[0]], (args[1:] or [(kwargs or {}).get("dim", 0)])[0]
        first = parts[0]
        if func is torch.stack:
            if any(p != first for p in parts):
                raise RuntimeError(f"stack of tensors of unequal shapes {parts}")
            return _ShapeOf(torch.empty(first[:dim % (len(first) + 1)] + [len(parts)] +
                                        first[dim % (len(first) + 1):], device="meta"))
        d = dim % len(first)
        if any(len(p) != len(first) or p[:d] + p[d + 1:] != first[:d] + first[d + 1:] for p in parts):
            raise RuntimeError(f"concatenation along dimension {d} of tensors of shapes {parts}")
        return _ShapeOf(torch.empty(first[:d] + [sum(p[d] for p in parts)] + first[d + 1:], device="meta"))


class _Recorder:
    """``get(hf_name)`` for the dry run: the tensor's :class:`_ShapeOf`; the names asked, found and
    missing."""

    def __init__(self, weights, used: set):
        self.weights, self.used, self.asked, self.missing = weights, used, [], []

    def __call__(self, hf_name: str) -> _ShapeOf:
        self.asked.append(hf_name)
        try:
            t = self.weights.meta(hf_name)
        except KeyError:
            self.missing.append(hf_name)
            raise
        self.used.add(hf_name)
        return _ShapeOf(t)


def check_weights(src: str, weights, cfg, skeleton, arch: str, allow_unused: bool = False) -> List[str]:
    """Map every parameter of ``skeleton`` from the shapes of ``weights`` (a dry run on shapes, nothing
    read): a :class:`ConfigError` naming the tensor and its file for one that is missing, one of
    another shape than ``src/config.json`` implies, or (unless ``allow_unused``) one no parameter
    uses, apart from buffers megazero recomputes (:func:`models.hf.unneeded_buffer`) and an
    ``lm_head.weight`` that equals the embeddings a tied config uses for the head."""
    from .hf import EMBEDDINGS, megazero_tensor, unneeded_buffer
    config, used = os.path.join(src, "config.json"), set()
    for name, p in skeleton.named_parameters():
        get = _Recorder(weights, used)
        try:
            t = megazero_tensor(name, cfg, get, arch)
        except KeyError:
            raise ConfigError(f"{src}: no tensor {get.missing[0]!r} (for megazero's {name}) in its weight "
                              f"files; they do not hold the model {config} describes") from None
        except (RuntimeError, ValueError, IndexError) as err:
            shapes = {n: list(weights.meta(n).shape) for n in get.asked if n in weights}
            raise ConfigError(f"{weights.where(get.asked[-1])}: tensors {shapes} do not fit megazero's "
                              f"{name} of the model {config} describes ({_one_line(err)})") from None
        want = list(p.shape)
        if name in ("word_embeddings.weight", "output_layer.weight"):
            want[0] = cfg.model.vocab_size  # the parameter is padded, the source is not
        if list(t.shape) != want:
            source = {n: list(weights.meta(n).shape) for n in get.asked if n in weights}
            raise ConfigError(f"{weights.where(get.asked[-1])}: tensor shapes {source} give megazero's "
                              f"{name} the shape {list(t.shape)}; the model {config} describes needs {want}")
    unused = [n for n in weights.names() if n not in used and not unneeded_buffer(n, arch)]
    unused = [n for n in unused if not _mtp_copy(n, weights, cfg)]
    embeddings = EMBEDDINGS.get(arch, EMBEDDINGS["llama"])  # GPT-2's, Mamba2's and NemotronH's their own
    if "lm_head.weight" in unused and not cfg.model.untie_embeddings_and_output_weights \
            and embeddings in used and weights.same("lm_head.weight", embeddings):
        unused.remove("lm_head.weight")  # some exports of a tied model write the head too
    if unused and not allow_unused:
        why = " (config.json ties the head to the embeddings, and this head differs from them)" \
            if unused[0] == "lm_head.weight" else ""
        many = f"{len(unused)} unused tensors" if len(unused) > 1 else "the one unused tensor"
        if arch == "qwen3_next" and unused[0].startswith("mtp."):  # the published files carry them
            raise ConfigError(f"{weights.where(unused[0])}: tensor {unused[0]!r} ({many}) belongs to "
                              "Qwen3-Next's multi-token prediction layers, which megazero does not "
                              "import; pass --allow-unused-weights to drop them")
        raise ConfigError(f"{weights.where(unused[0])}: tensor {unused[0]!r} is not used by the model "
                          f"{config} describes{why} ({many}): the weights and the config disagree (more "
                          "layers than num_hidden_layers?); fix config.json, or pass --allow-unused-weights "
                          "to drop them")
    return unused


def _mtp_copy(name: str, weights, cfg) -> bool:
    """Whether ``name`` is a multi-token prediction depth's copy of the embedding or the head in
    DeepSeek-V3's files (``model.layers.<i>.embed_tokens`` / ``shared_head.head``, ``i`` a depth megazero
    imports) equal to the model's own, which megazero shares."""
    from .hf_deepseek import MTP_COPIES
    layers, parts = cfg.model.num_layers, name.split(".", 3)
    depths = range(layers, layers + (cfg.model.mtp_num_layers or 0))
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in MTP_COPIES \
            or not parts[2].isdigit() or int(parts[2]) not in depths:
        return False
    tied = not cfg.model.untie_embeddings_and_output_weights
    own = "model.embed_tokens.weight" if parts[3] == MTP_COPIES[0] or tied else "lm_head.weight"
    return own in weights and weights.same(name, own)


def _copy_hf_files(src: str, dst: str) -> bool:
    """Copy the tokenizer files and generation_config.json of ``src``; whether a tokenizer was there."""
    from .safetensors_io import file_inside
    present = [f for f in HF_FILES if os.path.isfile(os.path.join(src, f))]
    for f in present:  # a link out of the model directory would copy that file into the checkpoint
        file_inside(src, f, os.path.join(src, f))
    if present:
        os.makedirs(dst, exist_ok=True)
    for f in present:
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    return any(f in present for f in TOKENIZER_FILES)


def to_hf(src: str, dst: str, iteration: Optional[int] = None, tokenizer: Optional[str] = None,
          dtype: str = "fp32", max_shard_size: str = "5GB") -> str:
    """Checkpoint directory ``src`` -> Hugging Face directory ``dst``; returns a line saying what was
    written.  Without ``iteration``, a checkpoint found damaged while it is read (a block that does not
    match its checksum) is given up, its shards removed, and the previous one exported, as ``--load``
    does."""
    from megazero.checkpoint import CheckpointCorrupt, CheckpointError, open_weights
    from .hf import hf_config_from
    skipped, damaged = [], []
    while True:
        notes: list = []
        try:
            path, meta, saved, get, close = open_weights(src, iteration, flag="--input", notes=notes,
                                                         skip=skipped)
        except CheckpointError as err:
            if not damaged:
                raise
            rest = str(err).split("no usable checkpoint: ", 1)[-1]  # why the older ones failed
            raise CheckpointCorrupt(f"--input {src}: no usable checkpoint: {'; '.join(damaged + [rest])}") \
                from err
        try:
            cfg, files = _write_weights(dst, saved, get, dtype, max_shard_size)
            break
        except CheckpointCorrupt as err:
            if iteration is not None:
                raise
            damaged.append(str(err))
            skipped.append(int(meta["iteration"]))
        finally:
            close()
    hf_config = hf_config_from(cfg)
    hf_config.dtype = str(DTYPES[dtype]).replace("torch.", "")
    hf_config.save_pretrained(dst)
    plural = "s" if len(files) > 1 else ""
    notes = [f"skipped {d}" for d in damaged] + notes
    why = f"; not the newest: {'; '.join(notes)}" if notes else ""
    line = (f"wrote {dst} ({len(files)} safetensors file{plural}, {dtype}) from {path} "
            f"(iteration {meta['iteration']}{why})")
    return line + _tokenizer_and_generation(dst, tokenizer or saved.get("data", {}).get("tokenizer_model"),
                                            saved)


def _write_weights(dst: str, saved: dict, get, dtype: str, max_shard_size: str):
    """Stream the checkpoint's parameters (``get(name)``) into safetensors shards in ``dst``; returns
    ``(whole-model config, file names)``.  On an error the shards written so far are removed."""
    from .checkpoint import model_settings
    from .hf import export_groups
    from .safetensors_io import ShardedWriter, parse_size
    from .hf_export import arch_of
    cfg = _whole_model_cfg(model_settings(saved))
    groups, arch = export_groups(cfg), arch_of(cfg.model, cfg.moe)
    writer = ShardedWriter(dst, parse_size(max_shard_size), sum(len(hf) for _, hf, _ in groups))
    try:
        for mz_names, hf_names, fn in groups:
            tensors = [get(name) for name in mz_names]
            for hf_name, t in zip(hf_names, fn(*tensors)):  # routers that transformers keeps in fp32 stay so
                fp32 = arch in FP32_TENSORS and hf_name.endswith(FP32_TENSORS[arch])
                writer.add(hf_name, t, torch.float32 if fp32 else DTYPES[dtype])
            del tensors
        return cfg, writer.close()
    except BaseException:
        writer.abort()
        raise


def _recorded_ids(saved: Optional[dict]) -> dict:
    """The bos/eos/pad ids that a converted checkpoint recorded (``ASSETS/TOKEN_IDS``), when the run
    started from one (its ``--load`` or ``--pretrained-checkpoint``), with ``"from"``: that directory;
    {} otherwise."""
    ck = (saved or {}).get("checkpoint", {})
    for directory in (ck.get("load"), ck.get("pretrained_checkpoint")):
        path = os.path.join(directory, ASSETS, TOKEN_IDS) if directory else ""
        if path and os.path.isfile(path):
            with open(path) as fh:
                return {"from": directory, **json.load(fh)}
    return {}


def _tokenizer_and_generation(dst: str, tokenizer: Optional[str], saved: Optional[dict] = None) -> str:
    """Export the tokenizer (its special ids into config.json) and write generation_config.json (the
    tokenizer directory's own when it has one); returns what to add to the report line.  Without a
    tokenizer, the special ids of the converted checkpoint the run started from (``saved``: the run's
    configuration) still go into config.json."""
    from transformers import AutoConfig, GenerationConfig
    from .hf import export_tokenizer
    note = ""
    if not tokenizer:
        note = "; no tokenizer (the run had none: pass --tokenizer-model to add one)"
        ids = _recorded_ids(saved)
        if ids:  # e.g. --no-use-tokenizer-model-from-checkpoint-args: the source's ids all the same
            source = ids.pop("from")
            config = AutoConfig.from_pretrained(dst)
            for k, v in ids.items():
                setattr(config, k, v)
            config.save_pretrained(dst)
            note += f"; the special ids recorded in {source}"
    elif not os.path.exists(tokenizer):
        note = f"; tokenizer {tokenizer} not found from here (pass --tokenizer-model PATH)"
    else:
        try:
            tok = export_tokenizer(tokenizer, dst)
        except ValueError as err:
            note = f"; tokenizer not exported: {err}"
        else:
            config = AutoConfig.from_pretrained(dst)  # the tokenizer's special ids in the model's config,
            ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
            recorded = os.path.join(tokenizer, TOKEN_IDS)  # or those of the model it was converted from
            if os.path.isfile(recorded):
                with open(recorded) as fh:
                    ids.update(json.load(fh))
            for k, v in ids.items():
                setattr(config, k, v)
            config.save_pretrained(dst)
            note = f" with tokenizer {tokenizer} ({type(tok).__name__})"
    own = None
    if tokenizer and os.path.isdir(tokenizer):
        own = os.path.join(tokenizer, "generation_config.json")
    if own and os.path.isfile(own):
        shutil.copy2(own, os.path.join(dst, "generation_config.json"))
    else:
        GenerationConfig.from_model_config(AutoConfig.from_pretrained(dst)).save_pretrained(dst)
    return note + "; generation_config.json"
