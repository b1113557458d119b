"""Shared by the engine's tests: tiny Hugging Face models from random configs (dropout 0), their data,
the single-process PyTorch loop that is the oracle, and the same loop through megazero's engine."""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, SEQ, TARGET = 64, 8, 6


def bert():
    """A 2-layer BertForMaskedLM (hidden 16; tied word embeddings and output head)."""
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)


def t5():
    """A T5ForConditionalGeneration of 2 + 2 layers (d_model 16; shared, tied embeddings)."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


MODELS = {"bert": bert, "t5": t5}


def batches(kind: str, n: int, mb: int, seed: int = 1):
    """``n`` micro-batches of ``mb`` sequences: keyword arguments for the model, loss included."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (mb, SEQ), generator=g)
        if kind == "t5":
            out.append({"input_ids": x, "labels": torch.randint(0, VOCAB, (mb, TARGET), generator=g)})
        else:
            out.append({"input_ids": x, "labels": x})
    return out


def oracle(kind: str, steps: int, per_step: int, mb: int, lr: float = 1e-3, wd: float = 0.01,
           clip: float = 1.0, init_state=None):
    """One process, plain PyTorch: AdamW, ``clip_grad_norm_``, each step accumulating ``per_step``
    micro-batches' mean losses (the global batch); returns (losses, gradient norms) per step.
    ``init_state``: start from these weights instead of the model's own."""
    model = MODELS[kind]()
    if init_state is not None:
        model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    data = batches(kind, steps * per_step, mb)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(per_step):
            loss = model(**data[s * per_step + i]).loss
            (loss / per_step).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(total / per_step)
    return losses, norms


def ds_config(stage: int, ga: int, mb: int = 2, lr: float = 1e-3, wd: float = 0.01, clip: float = 1.0,
              **zero):
    return {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga,
            "gradient_clipping": clip,
            "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def world() -> tuple:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def train(engine, kind: str, steps: int, first_step: int = 0, seed: int = 1):
    """DeepSpeed's loop on this rank's share of the oracle's micro-batches (micro-batch ``a`` of rank
    ``r`` in a step is the oracle's ``a * dp + r``); returns the global mean loss and the gradient
    norm of each step (the same on every rank)."""
    dp, rank = world()
    ga, mb = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    per_step = dp * ga
    data = batches(kind, (first_step + steps) * per_step, mb, seed)
    losses, norms = [], []
    for s in range(first_step, first_step + steps):
        total = torch.zeros(1, dtype=torch.float64)
        for a in range(ga):
            loss = engine(**data[s * per_step + a * dp + rank]).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        if dp > 1:
            dist.all_reduce(total)
        losses.append(float(total) / per_step)
        norms.append(engine.get_global_grad_norm())
    return losses, norms
