"""megazero: 3D-parallel (tensor x pipeline x data, ZeRO on the data axis) GPT pretraining, and
DeepSpeed's engine for any model (:func:`initialize`)."""
__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """DeepSpeed's ``initialize`` for any ``nn.Module``: :func:`megazero.engine.initialize` (imported
    on first use, so ``import megazero`` stays light)."""
    from megazero.engine import initialize as _initialize
    return _initialize(*args, **kwargs)


def __getattr__(name):
    """``megazero.zero.Init`` etc. after a plain ``import megazero``: the subpackage on first use."""
    if name in ("zero", "engine", "deepspeed"):
        import importlib
        return importlib.import_module(f"megazero.{name}")
    raise AttributeError(f"module 'megazero' has no attribute {name!r}")
