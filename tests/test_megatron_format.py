"""Megatron-LM's pickled files read without running a pickle, and its arguments in megazero's terms
(no megatron-core needed: tests/test_megatron_checkpoints.py uses files megatron-core wrote)."""
import argparse
import os
import sys
import types

import pytest
import torch

from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError
from megazero.checkpoint.megatron.mapping import moe_settings_from_args, settings_from_args
from megazero.checkpoint.megatron.safe_load import Opaque, load_pt


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _with_fake_megatron_enum(path):
    """A file naming ``megatron.core.transformer.enums.AttnBackend`` as Megatron-LM's args do, written
    while a stand-in module of that name exists (removed before the file is read)."""
    import enum
    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    saved = {n: sys.modules.get(n) for n in names}
    mod = types.ModuleType(names[-1])

    class AttnBackend(enum.Enum):
        auto = 5
    AttnBackend.__module__, AttnBackend.__qualname__ = names[-1], "AttnBackend"
    mod.AttnBackend = AttnBackend
    try:
        for n in names[:-1]:
            sys.modules[n] = sys.modules.get(n) or types.ModuleType(n)
        sys.modules[names[-1]] = mod
        torch.save({"args": argparse.Namespace(num_layers=2, attention_backend=AttnBackend.auto,
                                               params_dtype=torch.bfloat16), "iteration": 3}, path)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def test_stored_args_load_with_megatron_classes_as_inert_stand_ins(tmp_path):
    path = str(tmp_path / "common.pt")
    _with_fake_megatron_enum(path)
    state = load_pt(path)
    assert state["iteration"] == 3 and state["args"].num_layers == 2
    assert state["args"].params_dtype == torch.bfloat16
    backend = state["args"].attention_backend
    assert isinstance(backend, Opaque) and type(backend).__name__ == "AttnBackend" and backend.args == (5,)


def test_a_pickle_payload_is_refused_by_name_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": _Payload(marker)}, path)
    with pytest.raises(CheckpointError, match=r"model_optim_rng\.pt: the file's pickle names posix\.system, "
                                              r"which is not a type Megatron-LM stores"):
        load_pt(path)
    assert not marker.exists()


def test_a_truncated_file_is_named(tmp_path):
    path = str(tmp_path / "common.pt")
    torch.save({"iteration": 1, "w": torch.zeros(1000)}, path)
    with open(path, "r+b") as fh:
        fh.truncate(500)
    with pytest.raises(CheckpointCorrupt, match=r"common\.pt: truncated or not a torch file"):
        load_pt(path)


def _args(**over):
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8,
                group_query_attention=True, num_query_groups=2, kv_channels=8, seq_length=32,
                max_position_embeddings=32, position_embedding_type="rope", normalization="RMSNorm",
                norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True, padded_vocab_size=128, vocab_size=None,
                make_vocab_size_divisible_by=128)
    base.update(over)
    return argparse.Namespace(**base)


def test_megatron_args_map_to_megazero_settings():
    got = settings_from_args(_args())
    assert got["activation"] == "swiglu" and got["num_query_groups"] == 2 and got["vocab_size"] == 128
    assert {k: got[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "normalization")} == \
        dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, normalization="RMSNorm")
    plain = settings_from_args(_args(swiglu=False, group_query_attention=False, vocab_size=100))
    assert "activation" not in plain and "num_query_groups" not in plain and plain["vocab_size"] == 100
    assert settings_from_args(_args(swiglu=False, openai_gelu=True))["activation"] == "gelu"
    assert moe_settings_from_args(_args()) == {}
    moe = moe_settings_from_args(_args(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32))
    assert moe == dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)


@pytest.mark.parametrize("over,needle", [
    (dict(rotary_interleaved=True), "interleaved rotary embeddings"),
    (dict(multi_latent_attention=True), "multi-latent attention"),
    (dict(mtp_num_layers=1), "multi-token prediction"),
])
def test_what_the_reader_does_not_map_is_refused_by_name(over, needle):
    with pytest.raises(CheckpointError, match=f"has {needle} .*does not map yet"):
        settings_from_args(_args(**over))
    with pytest.raises(CheckpointError, match="--moe-layer-freq"):
        moe_settings_from_args(_args(num_experts=4, moe_layer_freq=[1, 0, 1, 0]))
