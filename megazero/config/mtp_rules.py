"""The rules of multi-token prediction's settings (``--mtp-num-layers``, models/mtp.py), checked at
start-up by :func:`megazero.config.validate`, each error naming the flags.  Pure Python."""
from __future__ import annotations


def check_mtp(cfg) -> None:
    """ValueError naming the flags unless ``--mtp-num-layers`` combines with the other settings."""
    m = cfg.model
    n = m.mtp_num_layers
    if n is None:
        return
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--mtp-num-layers must be a positive integer, got {n!r}")
    if m.mtp_loss_scaling_factor < 0:
        raise ValueError(f"--mtp-loss-scaling-factor must be >= 0, got {m.mtp_loss_scaling_factor}")
    for flag, on in (("--position-embedding-type learned_absolute",
                      m.position_embedding_type == "learned_absolute"),
                     ("--window-size", bool(m.window_size) and m.window_size[0] >= 0),
                     ("--no-rope-freq", m.no_rope_freq is not None),
                     ("--reset-attention-mask", cfg.data.reset_attention_mask),
                     ("--reset-position-ids", cfg.data.reset_position_ids),
                     ("--hybrid-layer-pattern", bool(getattr(m, "hybrid_layer_pattern", None)))):
        if on:
            raise ValueError(f"--mtp-num-layers with {flag} is not implemented; leave one of them out")
