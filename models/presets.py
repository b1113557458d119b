"""Named model architectures: ``PRESETS[name]`` maps ModelConfig field names to values.

Used by ``--model NAME`` (``megazero.config.parse_args(presets=PRESETS)``); flags override them.
"""
from __future__ import annotations

from typing import Any, Dict

from megazero.config import ConfigError

_GPT2 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", activation="gelu",
             add_bias_linear=True, untie_embeddings_and_output_weights=False, vocab_size=50257,
             seq_length=1024, max_position_embeddings=1024, norm_epsilon=1e-5,
             hidden_dropout=0.1, attention_dropout=0.1)
_LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
              add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
              attention_dropout=0.0)

PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512,
                 position_embedding_type="learned_absolute", normalization="LayerNorm", activation="gelu"),
    "tiny-llama": dict(_LLAMA, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=192, seq_length=64, vocab_size=512, norm_epsilon=1e-6),
    "gpt2-small": dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-medium": dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
    "gpt2-large": dict(_GPT2, num_layers=36, hidden_size=1280, num_attention_heads=20),
    "gpt2-xl": dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25),
    "llama2-7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                      seq_length=4096, max_position_embeddings=4096, vocab_size=32000, norm_epsilon=1e-5),
    "llama3-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, seq_length=8192, max_position_embeddings=8192, vocab_size=128256,
                      rotary_base=500000.0, norm_epsilon=1e-5),
}
PRESETS["llama-7b"] = PRESETS["llama2-7b"]  # the name the design notes use


def get_preset(name: str) -> Dict[str, Any]:
    """A copy of preset ``name``'s ModelConfig overrides; ConfigError naming the known ones otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
