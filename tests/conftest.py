"""Test set-up: one intra-op thread in the parent so forking ranks is safe and cheap."""
import os
import sys

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
