"""megazero: 3D-parallel (tensor x pipeline x data, ZeRO on the data axis) GPT pretraining."""
__version__ = "0.1.0"
