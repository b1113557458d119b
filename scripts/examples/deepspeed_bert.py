#!/usr/bin/env python
"""Train a BERT masked language model with DeepSpeed: a tutorial-style script, as DeepSpeed's own
"getting started" examples are written, except for one line: ``import megazero.deepspeed as deepspeed``
where DeepSpeed's has ``import deepspeed``.  The model is a small randomly initialised
``BertForMaskedLM`` and the data random tokens (no download), so it runs anywhere::

    python scripts/launch.py --standalone --nproc-per-node 2 scripts/examples/deepspeed_bert.py \\
        --deepspeed --deepspeed_config scripts/examples/ds_config_bert.json --steps 20 --save_dir /tmp/bert

and the saved checkpoint becomes one fp32 ``state_dict`` with
``python scripts/zero_to_fp32.py /tmp/bert /tmp/bert-fp32``.
"""
import argparse

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForMaskedLM

import megazero.deepspeed as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="BERT masked-LM")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed by the launcher")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--save_dir", type=str, default=None, help="save a checkpoint here at the end")
    parser.add_argument("--load_dir", type=str, default=None, help="resume from a checkpoint here first")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class RandomTokens(Dataset):
    """Random token sequences, the same on every rank; 15% of the positions are masked for the loss."""

    def __init__(self, n, seq, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(5, vocab, (n, seq), generator=g)
        self.masked = torch.rand(n, seq, generator=g) < 0.15

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = torch.where(self.masked[i], self.tokens[i], torch.full_like(self.tokens[i], -100))
        inputs = torch.where(self.masked[i], torch.full_like(self.tokens[i], 4), self.tokens[i])  # 4: [MASK]
        return {"input_ids": inputs, "labels": labels}


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    net = BertForMaskedLM(config)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = RandomTokens(4096, 32, config.vocab_size, args.seed)

    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    if args.load_dir:
        model_engine.load_checkpoint(args.load_dir)

    accumulation, running = model_engine.gradient_accumulation_steps(), 0.0
    for i, batch in enumerate(trainloader):
        batch = {k: v.to(model_engine.device) for k, v in batch.items()}
        loss = model_engine(**batch).loss
        model_engine.backward(loss)
        model_engine.step()  # the optimizer steps once every `accumulation` micro-batches
        running += loss.item()
        if (i + 1) % accumulation:
            continue
        if model_engine.global_rank == 0:
            print(f"step {model_engine.global_steps} loss {running / accumulation:.4f} "
                  f"lr {model_engine.get_lr()[0]:.3g}", flush=True)
        running = 0.0
        if model_engine.global_steps >= args.steps:
            break
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir)


if __name__ == "__main__":
    main()
