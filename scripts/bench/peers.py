#!/usr/bin/env python
"""megazero against its torch-native peer, layout by layout, on the same model, ranks and batch.

Every layout runs megazero and its peer in one set of forked gloo ranks (one intra-op thread
each, :func:`megazero.process.local_ranks.run_ranks`).  After warm-up, each round times one training step of
each, in an order that alternates between
rounds, each step from a barrier to a barrier, so load changes on a shared machine hit both alike.
megazero's step is the trainer's own (``megazero.training.loop._step``: the learning rate, zero grad,
loading this rank's micro-batches of the next global batch, forward and backward of every
micro-batch, gradient sync, clipping to 1.0, AdamW with weight decay off norms, the loss averaged
over the world and the iteration's metrics row), so the ratios include everything a user pays; the
peer's step is zero grad, forward and backward, its gradient sync, clipping, AdamW and the local loss
on the host.  Both see the same samples in the first step; after it megazero reads the next samples
of the stream, as in training, and the peer repeats its batch.
The table shows the median step times, their ratio (megazero / peer; below 1 megazero is
faster) and the model-state bytes per rank (parameters + gradients + optimizer state, held after a
step) next to docs/design.md's ZeRO formula for megazero's stage.  Both sides start from the same
weights (the peer loads megazero's), and the first step's loss of each is shown as a check that
they compute the same thing.

| layout | peer |
|---|---|
| one process | a plain ``nn.Module`` GPT (``scripts/bench/peer_models.py``) + ``torch.optim.AdamW`` |
| DP, ZeRO-0/1/2 | ``DistributedDataParallel`` (``gradient_as_bucket_view``) |
| DP, ZeRO-3 | FSDP2 ``fully_shard`` on every block and the root |
| TP (+ SP) | DTensor ``parallelize_module`` (the TP plan, below) + ``loss_parallel`` |
| PP 1F1B / interleaved | ``torch.distributed.pipelining`` ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` |
| TP x PP x DP | ``DeviceMesh`` + the TP plan + FSDP2 over DP (resharding below) + ``Schedule1F1B`` |
| CP 2 / CP 4 | a plain ring attention from torch primitives (``scripts/bench/cp_peer.py``: torch's own
  ``context_parallel`` does not run on CPUs) in the PlainGPT, gradients summed over the CP group |

The TP plan: ``ColwiseParallel``/``RowwiseParallel``, vocab-parallel embedding and head,
``SequenceParallel`` norms.  Under TP x PP x DP, FSDP2's ``reshard_after_forward`` is off for
ZeRO-0 and on for ZeRO-3, as torchtitan.

The peers' AdamW is PyTorch's default implementation (``--peer-optimizer`` picks foreach or fused).
megazero runs with its default ``--cpu-matmul auto`` (oneDNN products on x86 CPUs; the peers use
PyTorch's BLAS); ``--cpu-matmul torch`` gives megazero the peers' BLAS, for a like-for-like overhead
comparison.  Each rank sets glibc's thresholds as the trainer does (``--host-malloc``, default
``auto``: on CPUs, memory that tensors free is reused by the next step, except under ZeRO-3); both
sides share the process, so the peer runs under the same setting.

    python scripts/bench_peers.py                       # every layout, 3.7M-parameter GPT, ~10 min on 2 cores
    python scripts/bench_peers.py --layouts one dp2-zero1 --rounds 40
    python scripts/bench_peers.py --quick               # tiny model, two rounds: a smoke test
    python scripts/bench_peers.py --json results.json
    python scripts/bench_peers.py --layouts cp2 cp4 --seq-length 1024   # context parallelism
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional


import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import write_json
from bench.timing import interleaved_rounds
from megazero.offload.element_bytes import FP32
from megazero.errors import EXIT_OK
from megazero.offload.host_memory import HOST_MALLOC
from megazero.process.local_ranks import run_ranks
from megazero.process.threads import set_rank_threads
from megazero.zero import optimizer_bytes_per_param, zero_model_state_bytes

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1024)
QUICK_MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=128)
BASE = dict(untie_embeddings_and_output_weights=True, add_bias_linear=False, optimizer="adam", lr=1e-4,
            lr_decay_style="constant", weight_decay=0.01, clip_grad=1.0, global_batch_size=8, mock_data=True,
            make_vocab_size_divisible_by=64, hidden_dropout=0.0, attention_dropout=0.0,
            activation="gelu")  # as the peers: no dropout, the tanh GELU


@dataclass
class Layout:
    """One row: megazero's settings, the world size and the peer (``kind`` and options)."""
    name: str
    world: int
    settings: dict
    peer: str
    peer_opts: dict = field(default_factory=dict)

    @property
    def zero_stage(self) -> int:
        return self.settings.get("zero_stage", 0)


LAYOUTS = {
    "one": Layout("one process", 1, {}, "plain"),
    "dp2-zero0": Layout("DP 2, ZeRO-0", 2, {"zero_stage": 0}, "ddp"),
    "dp2-zero1": Layout("DP 2, ZeRO-1", 2, {"zero_stage": 1}, "ddp"),
    "dp2-zero2": Layout("DP 2, ZeRO-2", 2, {"zero_stage": 2}, "ddp"),
    "dp2-zero3": Layout("DP 2, ZeRO-3", 2, {"zero_stage": 3}, "fsdp2"),
    "dp4-zero3": Layout("DP 4, ZeRO-3", 4, {"zero_stage": 3}, "fsdp2"),
    "tp2": Layout("TP 2 (vocab-parallel)", 2, {"tensor_model_parallel_size": 2}, "tp"),
    "tp2-sp": Layout("TP 2 + SP", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, "tp",
                     {"sp": True}),
    "pp2-1f1b": Layout("PP 2, 1F1B", 2, {"pipeline_model_parallel_size": 2, "micro_batch_size": 2}, "pp"),
    "pp2-interleaved": Layout("PP 2, interleaved (2 chunks)", 2,
                              {"pipeline_model_parallel_size": 2, "micro_batch_size": 2,
                               "num_layers_per_virtual_pipeline_stage": 1}, "pp", {"vp": 2}),
    "cp2": Layout("CP 2 (ring attention)", 2, {"context_parallel_size": 2}, "cp"),
    "cp4": Layout("CP 4 (ring attention)", 4, {"context_parallel_size": 4}, "cp"),
    "3d-zero0": Layout("TP2 x PP2 x DP2, ZeRO-0", 8,
                       {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                        "micro_batch_size": 2, "zero_stage": 0}, "3d", {"reshard": False}),
    "3d-zero3": Layout("TP2 x PP2 x DP2, ZeRO-3", 8,
                       {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                        "micro_batch_size": 2, "zero_stage": 3}, "3d", {"reshard": True}),
}


# ---- megazero ------------------------------------------------------------------------------
def _megazero(layout: Layout, model: dict):
    """Build megazero for ``layout`` on this rank: ``(step, memory, numel, full weights, cfg, mesh)``."""
    import megazero_models as models
    from megazero.config import config_from_dict, validate
    from megazero.data import build_data, stage_keys
    from megazero.data.loader import StepBatches
    from megazero.offload.host_memory import host_malloc_policy, set_host_malloc
    from megazero.mesh import ParallelMesh
    from megazero.planning.flops import hardware_flops_per_iteration, model_flops_per_iteration
    from megazero.training.loop import Position, _step
    from megazero.zero import build_optimizer
    from megazero_models.gpt import full_state_dict
    world = layout.world
    settings = dict(BASE, **model, **layout.settings)
    if "micro_batch_size" not in layout.settings:  # one micro-batch of this DP rank's share, as the peer
        tp, pp, cp = (settings.get(f"{axis}_parallel_size", 1)
                      for axis in ("tensor_model", "pipeline_model", "context"))
        settings["micro_batch_size"] = settings["global_batch_size"] // (world // (tp * pp * cp))
    cfg = validate(config_from_dict(settings), world)
    # as the trainer's start-up does; process-wide, so the peer (in this process) runs under it too
    set_host_malloc(host_malloc_policy(cfg, "cpu"))
    par = cfg.parallel
    mesh = (ParallelMesh.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                               device=torch.device("cpu"), cp=par.context_parallel_size)
            if world > 1 else ParallelMesh.single(torch.device("cpu")))
    chunks = models.build_chunks(cfg, mesh)
    weights = {}
    for c in chunks:
        weights.update(full_state_dict(c))  # before ZeRO-3 shards them
    opt = build_optimizer(chunks, mesh, cfg)
    pos = Position()
    data = StepBatches(build_data(cfg), cfg.training.micro_batch_size, mesh.coord("dp"), mesh.size("dp"),
                       mesh.device, stage_keys(chunks))  # this stage's tensors, as the trainer reads them
    work = (model_flops_per_iteration(cfg), hardware_flops_per_iteration(cfg), None)

    def step() -> Optional[float]:  # the trainer's own step: everything a user pays, metrics included
        return _step(cfg, chunks, opt, data, mesh, pos, cfg.training.global_batch_size, work)[2]

    return step, opt.memory_bytes, opt.num_parameters(), weights, cfg, mesh


# ---- the peers -----------------------------------------------------------------------------
def _peer_model(cfg, weights, layers: range, first: bool, last: bool):
    """A PlainGPT holding ``layers`` (global indices), with megazero's weights."""
    from bench.peer_models import PlainGPT, copy_from_megazero
    m = cfg.model
    net = PlainGPT(m.vocab_size, m.hidden_size, m.num_attention_heads, len(layers), m.seq_length,
                   ffn=m.ffn_hidden_size, first=first, last=last)
    copy_from_megazero(net, weights, first_layer=layers.start, vocab=m.vocab_size)
    return net


def _peer_optimizer(params, how: str):
    """AdamW as in megazero: weight decay 0.01 on matrices, none on norms and biases."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    kw = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[how]
    return torch.optim.AdamW(groups, lr=1e-4, **kw)


def _share(cfg, mesh):
    """This DP rank's samples of the first global batch: ``(tokens, labels)``, ``[share, seq]``."""
    from megazero.data import build_data, sample_range
    ids = build_data(cfg).get_tokens(list(sample_range(0, cfg.training.global_batch_size, mesh.coord("dp"),
                                                       mesh.size("dp"))))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _flat_peer(layout: Layout, cfg, mesh, weights, how: str):
    """One process, DDP or FSDP2 on the whole model; one micro-batch of this rank's share."""
    from bench.peer_models import clip_peer_grads
    net = _peer_model(cfg, weights, range(cfg.model.num_layers), True, True)
    if layout.peer == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
    elif layout.peer == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in net.layers:
            fully_shard(block)
        fully_shard(net)
    opt = _peer_optimizer(net.parameters(), how)
    tokens, labels = _share(cfg, mesh)
    params = list(net.parameters())

    def step() -> float:
        opt.zero_grad()
        loss = net(tokens, labels)
        loss.backward()
        if layout.peer == "fsdp2":
            clip_peer_grads(params, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    return step, lambda: _local_bytes(params, opt)


def tp_plan(model, sp: bool) -> dict:
    """DTensor tensor-parallel plan of a PlainGPT (stage): vocab-parallel embedding and head,
    column-parallel QKV/fc1, row-parallel proj/fc2; with ``sp`` the norms and the activations between
    blocks are split along the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    seq = Shard(1) if sp else Replicate()
    plan = {}
    if model.first:
        plan["word_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    for i in range(len(model.layers)):
        pre = f"layers.{i}."
        plan.update({pre + "qkv": ColwiseParallel(input_layouts=seq),
                     pre + "proj": RowwiseParallel(output_layouts=seq),
                     pre + "fc1": ColwiseParallel(input_layouts=seq),
                     pre + "fc2": RowwiseParallel(output_layouts=seq)})
        if sp:
            plan[pre + "input_norm"] = SequenceParallel()
            plan[pre + "post_attention_norm"] = SequenceParallel()
    if model.last:
        if sp:
            plan["final_norm"] = SequenceParallel()
        plan["output_layer"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                               use_local_output=False)
    return plan


def _tp_peer(layout: Layout, cfg, mesh, weights, how: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from bench.peer_models import clip_peer_grads
    sp = layout.peer_opts.get("sp", False)
    tp_mesh = init_device_mesh("cpu", (mesh.size("tp"),))
    net = _peer_model(cfg, weights, range(cfg.model.num_layers), True, True)
    parallelize_module(net, tp_mesh, tp_plan(net, sp))
    if sp:
        net.sequence_shard = (mesh.coord("tp"), mesh.size("tp"))
    opt = _peer_optimizer(net.parameters(), how)
    tokens, labels = _share(cfg, mesh)
    params = list(net.parameters())
    position = net.position_embeddings.weight

    def step() -> float:
        opt.zero_grad()
        with loss_parallel():
            loss = net(tokens, labels)
            loss.backward()
        if sp:  # each rank saw its part of the sequence: sum the replicated position table's gradient
            dist.all_reduce(position.grad)
        clip_peer_grads(params, 1.0)
        opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    return step, lambda: _local_bytes(params, opt)


def _stage_layers(cfg, index: int, stages: int) -> range:
    per = cfg.model.num_layers // stages
    return range(index * per, (index + 1) * per)


def _pipeline_step(schedules, stages_first_last, opt, params, tokens, labels, micro, pp_group, context):
    """One pipelining step: the schedule over ``micro`` micro-batches, then clipping and AdamW."""
    from bench.peer_models import clip_peer_grads
    first, last = stages_first_last

    def step() -> Optional[float]:
        opt.zero_grad()
        losses: List[torch.Tensor] = []
        with context():
            if first:
                schedules.step(tokens, target=labels, losses=losses)
            else:
                schedules.step(target=labels, losses=losses)
        clip_peer_grads(params, 1.0, pp_group=pp_group)
        opt.step()
        if not last:
            return None
        vals = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]
        return float(sum(v.detach() for v in vals) / len(vals))

    return step


def _loss_fn(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))


def _pp_peer(layout: Layout, cfg, mesh, weights, how: str):
    """``torch.distributed.pipelining`` over the pipeline group: 1F1B, or interleaved with ``vp`` stages
    per rank (stage ``v * pp + rank``, as megazero's chunks)."""
    import contextlib
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    vp, pp = layout.peer_opts.get("vp", 1), mesh.size("pp")
    total = vp * pp
    mods, stages = [], []
    for v in range(vp):
        index = v * pp + mesh.coord("pp")
        net = _peer_model(cfg, weights, _stage_layers(cfg, index, total), index == 0, index == total - 1)
        mods.append(net)
        stages.append(PipelineStage(net, index, total, torch.device("cpu"), group=mesh.group("pp")))
    micro = cfg.training.num_micro_batches
    sched = (ScheduleInterleaved1F1B(stages, micro, loss_fn=_loss_fn) if vp > 1
             else Schedule1F1B(stages[0], micro, loss_fn=_loss_fn))
    params = [p for m in mods for p in m.parameters()]
    opt = _peer_optimizer(params, how)
    tokens, labels = _share(cfg, mesh)
    ends = (mesh.coord("pp") == 0, mesh.coord("pp") == pp - 1)
    step = _pipeline_step(sched, ends, opt, params, tokens, labels, micro, mesh.group("pp"),
                          contextlib.nullcontext)
    return step, lambda: _local_bytes(params, opt)


def _3d_peer(layout: Layout, cfg, mesh, weights, how: str):
    """DeviceMesh (pp, dp, tp) + the TP plan + FSDP2 over dp + Schedule1F1B over pp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    dm = init_device_mesh("cpu", (mesh.size("pp"), mesh.size("dp"), mesh.size("tp")),
                          mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, pp = dm["pp"].get_local_rank(), mesh.size("pp")
    dp_rank = dm["dp"].get_local_rank()
    net = _peer_model(cfg, weights, _stage_layers(cfg, pp_rank, pp), pp_rank == 0, pp_rank == pp - 1)
    parallelize_module(net, dm["tp"], tp_plan(net, False))
    reshard = layout.peer_opts.get("reshard", True)
    for block in net.layers:
        fully_shard(block, mesh=dm["dp"], reshard_after_forward=reshard)
    fully_shard(net, mesh=dm["dp"], reshard_after_forward=reshard)
    stage = PipelineStage(net, pp_rank, pp, torch.device("cpu"), group=dm["pp"].get_group())
    micro = cfg.training.num_micro_batches
    sched = Schedule1F1B(stage, micro, loss_fn=_loss_fn)
    params = list(net.parameters())
    opt = _peer_optimizer(params, how)
    from megazero.data import build_data, sample_range
    share = cfg.training.global_batch_size // mesh.size("dp")
    ids = build_data(cfg).get_tokens(
        list(sample_range(0, cfg.training.global_batch_size, dp_rank, mesh.size("dp"))))
    assert ids.shape[0] == share
    step = _pipeline_step(sched, (pp_rank == 0, pp_rank == pp - 1), opt, params, ids[:, :-1].contiguous(),
                          ids[:, 1:].contiguous(), micro, dm["pp"].get_group(), loss_parallel)
    return step, lambda: _local_bytes(params, opt)


def _cp_peer(layout: Layout, cfg, mesh, weights, how: str):
    """The PlainGPT with every block's attention a plain ring (``bench/cp_peer.py``) over the CP
    group; each rank embeds its tokens at their global positions, and the gradients (of the local
    tokens' share of the global mean loss) are summed over the group."""
    import functools
    from bench.cp_peer import balanced_positions, plain_ring_attention
    net = _peer_model(cfg, weights, range(cfg.model.num_layers), True, True)
    n, rank, group = mesh.size("cp"), mesh.coord("cp"), mesh.group("cp")
    seq = cfg.model.seq_length
    positions = [balanced_positions(seq, n, r) for r in range(n)]
    mine = positions[rank]

    def attention(block, x):
        b, s = x.shape[:2]
        q, k, v = block.qkv(x).view(b, s, -1, 3, block.head_dim).permute(3, 0, 2, 1, 4)
        y = plain_ring_attention(q, k, v, group, positions)
        return block.proj(y.transpose(1, 2).reshape(b, s, -1))
    for block in net.layers:
        block.attention = functools.partial(attention, block)
    opt = _peer_optimizer(net.parameters(), how)
    tokens, labels = _share(cfg, mesh)
    tokens, local_labels = tokens[:, mine], labels[:, mine]
    params = list(net.parameters())

    def step() -> float:
        opt.zero_grad()
        x = net.word_embeddings(tokens) + net.position_embeddings(mine)
        for block in net.layers:
            x = block(x)
        logits = net.output_layer(net.final_norm(x))
        loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        for p in params:
            dist.all_reduce(p.grad, group=group)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total.item()

    return step, lambda: _local_bytes(params, opt)


PEERS: Dict[str, Callable] = {"plain": _flat_peer, "ddp": _flat_peer, "fsdp2": _flat_peer, "tp": _tp_peer,
                              "pp": _pp_peer, "3d": _3d_peer, "cp": _cp_peer}


def _local_bytes(params, opt) -> Dict[str, int]:
    """Parameter, gradient and optimizer-state bytes this rank holds (DTensors: the local shard;
    each storage once)."""
    seen = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"param_bytes": nbytes(params), "grad_bytes": nbytes(p.grad for p in params),
            "optim_bytes": nbytes(state)}


# ---- timing --------------------------------------------------------------------------------
def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _mean_over_ranks(value: Optional[float]) -> Optional[float]:
    """Mean of the non-None values every rank holds (DP shares are equal, so the global mean loss)."""
    if not dist.is_initialized():
        return value
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def _run_layout(layout: Layout, model: dict, rounds: int, warmup: int, how: str,
                also_torch: bool = False) -> dict:
    """On every rank: build both sides, warm up, then time ``rounds`` rounds of one step each;
    ``also_torch``: a third side, megazero with ``--cpu-matmul torch``, in the same rounds."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(0)
    mz_step, mz_memory, numel, weights, cfg, mesh = _megazero(layout, model)
    peer_step, peer_memory = PEERS[layout.peer](layout, cfg, mesh, weights, how)
    del weights
    modes = {"megazero": mz_step, "peer": peer_step}
    if also_torch:
        modes["megazero_torch"] = _megazero(layout, dict(model, cpu_matmul="torch"))[0]
    first = {k: _mean_over_ranks(step()) for k, step in modes.items()}  # the first step, from equal weights
    for _ in range(warmup - 1):
        for step in modes.values():
            step()
    times = interleaved_rounds(modes, rounds, _barrier)
    return {"times": times, "first_loss": first, "numel": numel, "dp": mesh.size("dp"),
            "megazero_bytes": {k: v for k, v in mz_memory().items()
                               if k in ("param_bytes", "grad_bytes", "optim_bytes")},
            "peer_bytes": peer_memory()}


def _summary(key: str, layout: Layout, per_rank: List[dict]) -> dict:
    """Medians and ratio from rank 0's times (each step is barrier to barrier: the same on every
    rank); bytes from the rank holding the most (megazero) and its peer."""
    res = per_rank[0]
    mz, peer = statistics.median(res["times"]["megazero"]), statistics.median(res["times"]["peer"])
    worst = max(per_rank, key=lambda r: sum(r["megazero_bytes"].values()))
    formula = zero_model_state_bytes(worst["numel"], layout.zero_stage, worst["dp"], FP32, FP32,
                                     optimizer_bytes_per_param("adam", mixed_precision=False))["total_bytes"]
    return {"layout": key, "name": layout.name, "world": layout.world, "peer": layout.peer,
            "megazero_ms": mz * 1e3, "peer_ms": peer * 1e3, "ratio": mz / peer,
            "megazero_min_ms": min(res["times"]["megazero"]) * 1e3,
            "peer_min_ms": min(res["times"]["peer"]) * 1e3,
            "megazero_mb": sum(worst["megazero_bytes"].values()) / 2 ** 20,
            "peer_mb": sum(worst["peer_bytes"].values()) / 2 ** 20, "formula_mb": formula / 2 ** 20,
            "first_loss": res["first_loss"], "rounds": len(res["times"]["megazero"]),
            **_torch_side(res["times"], peer)}


def _torch_side(times: Dict[str, List[float]], peer: float) -> dict:
    """``--also-torch``: megazero's median with ``--cpu-matmul torch`` and its ratio to the peer."""
    if "megazero_torch" not in times:
        return {}
    median = statistics.median(times["megazero_torch"])
    return {"megazero_torch_ms": median * 1e3, "torch_ratio": median / peer}


def _print_table(rows: List[dict], params: int, load0, load1, args) -> None:
    print(f"{params / 1e6:.2f}M-parameter GPT ({args.model_desc}), global batch 8, fp32 AdamW; "
          f"{args.rounds} rounds after {args.warmup} warm-up steps; peer AdamW: {args.peer_optimizer}; "
          f"megazero --cpu-matmul {args.cpu_matmul}, --host-malloc {args.host_malloc} (both sides)")
    print(f"load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} after, on {os.cpu_count()} CPUs")
    print(f"{'layout':30} {'peer':6} {'megazero ms':>11} {'peer ms':>8} {'ratio':>6} {'MB/rank':>8} "
          f"{'peer MB':>8} {'formula MB':>10} {'first loss (mz / peer)':>23}"
          + (f" {'torch ms':>8} {'torch ratio':>11}" if args.also_torch else ""))
    for r in rows:
        fl = r["first_loss"]
        loss = f"{fl['megazero']:.4f} / {fl['peer']:.4f}" if None not in fl.values() else "-"
        print(f"{r['name']:30} {r['peer']:6} {r['megazero_ms']:11.1f} {r['peer_ms']:8.1f} {r['ratio']:6.2f} "
              f"{r['megazero_mb']:8.2f} {r['peer_mb']:8.2f} {r['formula_mb']:10.2f} {loss:>23}"
              + (f" {r['megazero_torch_ms']:8.1f} {r['torch_ratio']:11.2f}" if args.also_torch else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each side per round)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first (>= 1)")
    p.add_argument("--peer-optimizer", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--cpu-matmul", choices=["auto", "onednn", "torch"], default="auto",
                   help="megazero's --cpu-matmul (torch: PyTorch's BLAS, as the peers)")
    p.add_argument("--host-malloc", choices=list(HOST_MALLOC), default="auto",
                   help="the trainer's --host-malloc, set in every rank (both sides share the process)")
    p.add_argument("--also-torch", action="store_true",
                   help="also time megazero with --cpu-matmul torch, in the same interleaved rounds")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model and two rounds: checks that everything runs")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH ('-': stdout)")
    p.add_argument("--seq-length", type=int, help="the model's sequence length (default 128; --quick 16)")
    args = p.parse_args(argv)
    model = dict(QUICK_MODEL if args.quick else MODEL, cpu_matmul=args.cpu_matmul,
                 host_malloc=args.host_malloc)
    if args.seq_length:
        model["seq_length"] = args.seq_length
    if args.quick:
        args.rounds, args.warmup = min(args.rounds, 2), 1
    args.warmup = max(1, args.warmup)
    args.model_desc = (f"{model['num_layers']} layers, hidden {model['hidden_size']}, "
                       f"{model['num_attention_heads']} heads, seq {model['seq_length']}, "
                       f"vocab {model['vocab_size']}, untied, no biases")
    set_rank_threads()
    if torch.__version__ < "2.13":  # a TorchVersion: compares as a version
        print(f"warning: the peers are tested on torch 2.13; with {torch.__version__} (2.6 here) the "
              "interleaved pipelining peer lost a rank", file=sys.stderr)
    load0 = os.getloadavg()
    rows = []
    for key in args.layouts:
        layout = LAYOUTS[key]
        per_rank = run_ranks(_run_layout, layout.world, layout, model, args.rounds, args.warmup,
                             args.peer_optimizer, args.also_torch, timeout=3600)
        rows.append(_summary(key, layout, per_rank))
        print(f"  {layout.name}: megazero {rows[-1]['megazero_ms']:.1f} ms, "
              f"peer {rows[-1]['peer_ms']:.1f} ms", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    params = sum(_params_of(model))
    _print_table(rows, params, load0, load1, args)
    if args.json:
        out = {"model": model, "rounds": args.rounds, "load_average": [load0[0], load1[0]], "rows": rows}
        write_json(out, args.json)
    return EXIT_OK


def _params_of(model: dict):
    from bench.peer_models import gpt_params
    yield gpt_params(model["vocab_size"], model["hidden_size"], model["num_layers"], model["seq_length"])


if __name__ == "__main__":
    main()
