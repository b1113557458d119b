"""scripts/generate.py on mixture-of-experts checkpoints under tensor parallelism: the same tokens and,
within fp32 rounding, the same logits as one process (it used to demand --sequence-parallel, a flag
generate.py does not have)."""
import importlib.util
import os

import pytest
import torch

from megazero.config import config_from_dict
from megazero.process.local_ranks import run_ranks
from tolerance import C_FWD, fp32_bound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [3, 4, 5, 9, 1]


def _generate_script():
    spec = importlib.util.spec_from_file_location("_generate", os.path.join(ROOT, "scripts", "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KINDS = {  # 4 experts split over 2 TP ranks (EP 2, biased); 3 experts whole on each (EP 1), allgather
    "ep2-alltoall-shared": dict(num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=32),
    "ep1-allgather-swiglu": dict(num_experts=3, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                                 activation="swiglu", add_bias_linear=False),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def checkpoint(request, tmp_path_factory):
    import models
    from megazero.training import train
    out = str(tmp_path_factory.mktemp("moe") / "ckpt")
    cfg = config_from_dict(dict(KINDS[request.param], mock_data=True, num_layers=2, hidden_size=32,
                                num_attention_heads=4, seq_length=16, vocab_size=64, micro_batch_size=1,
                                global_batch_size=2, train_iters=1, lr=1e-2, save=out, log_interval=100,
                                hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2))
    train(cfg, models.build_chunks)
    return out


def _run(load):
    """On every rank: generate.py's greedy and sampled ids, the prompt's last logits, and whether the
    MoE layers refuse to train without sequence parallelism."""
    from megazero.mesh import ParallelMesh
    from models.checkpoint import load_model
    from models.layers import KVCache
    gen = _generate_script()
    greedy = gen.run(gen.parse_args(["--load", load, "--prompt-ids", ",".join(map(str, PROMPT)),
                                     "--max-new-tokens", "8"]))
    sampled = gen.run(gen.parse_args(["--load", load, "--prompt-ids", ",".join(map(str, PROMPT)),
                                      "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "20",
                                      "--seed", "3"]))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = gen._expert_layout(gen.parse_args(["--load", load, "--prompt-ids", "1"]), world)
    mesh = ParallelMesh.build(tp=world, **layout) if world > 1 else ParallelMesh.single()
    model, _ = load_model(load, None, mesh)
    with torch.no_grad():
        logits = model.decode(torch.tensor([PROMPT]), KVCache())[0, -1]
    refused = None
    if world > 1:
        try:
            with torch.enable_grad():
                model(torch.tensor([PROMPT]))
        except ValueError as err:
            refused = str(err)
    return greedy["ids"], sampled["ids"], logits, refused


def test_tensor_parallel_moe_generation_equals_one_process(checkpoint):
    greedy, sampled, logits, _ = _run(checkpoint)
    assert greedy[:len(PROMPT)] == PROMPT and len(greedy) == len(PROMPT) + 8
    for rank, (g, s, lg, refused) in enumerate(run_ranks(_run, 2, checkpoint)):
        assert g == greedy and s == sampled, rank
        torch.testing.assert_close(lg, logits, **fp32_bound(logits, C_FWD))
        assert refused and "--sequence-parallel" in refused  # training under TP still needs SP
