"""NCCL's device rule, held on gloo: a collective takes only tensors on its group's device.

On NCCL a tensor in host memory handed to a collective is an error; gloo takes it, so CPU runs never
saw MoE exchange host-side token counts over groups that exist only on NCCL on GPUs.  Here the CPU
plays both places: :func:`strict_devices` marks the tensors a GPU run would hold in host memory,
those ``Tensor.cpu()`` returns and those the MoE layers read through
:class:`megazero.moe.comm.HostCopy` (the mark, :class:`HostTensor`, follows them through every op),
and every collective of ``torch.distributed`` raises unless each tensor it is handed is unmarked and
on the mesh's :attr:`~megazero.mesh.ParallelMesh.collective_device`.  A ``.to()`` onto that device
is the copy back (unmarked).  The MoE layers (EP 2 all-to-all, expert TP 2, EP 2 allgather) and
every scalar collective of the trainer run under it on 2 gloo ranks; the dispatcher that moved its
counts to the host with ``.cpu()`` before exchanging them fails here.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from megazero.process.local_ranks import run_ranks

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all",
               "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "broadcast", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv")


class HostTensor(torch.Tensor):
    """A tensor a GPU run would hold in host memory (torch's subclass rule keeps the mark on every
    result of an op that takes one)."""


class StrictDeviceError(RuntimeError):
    pass


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


@contextlib.contextmanager
def strict_devices(device: torch.device, seen: dict):
    """Inside: host tensors are marked and every collective checks its tensors against ``device``;
    ``seen["host_reads"]`` counts the :meth:`HostCopy.wait` calls."""
    from megazero.moe.comm import HostCopy
    cpu, to, wait = torch.Tensor.cpu, torch.Tensor.to, HostCopy.wait
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def marked_cpu(t, *args, **kwargs):
        return cpu(t, *args, **kwargs).as_subclass(HostTensor)

    def moving_to(t, *args, **kwargs):
        out = to(t, *args, **kwargs)
        named = {k: v for k, v in kwargs.items() if k != "copy"}
        target = torch._C._nn._parse_to(*args, **named)[0]
        if isinstance(out, HostTensor) and target is not None and target.type == device.type:
            out = out.as_subclass(torch.Tensor)  # the copy onto the device
        return out

    def marked_wait(copy):
        seen["host_reads"] = seen.get("host_reads", 0) + 1
        return wait(copy).as_subclass(HostTensor)

    def checked(name, fn):
        def collective(*args, **kwargs):
            for t in _tensors(list(args) + list(kwargs.values())):
                if isinstance(t, HostTensor) or t.device.type != device.type:
                    where = "host memory" if isinstance(t, HostTensor) else str(t.device)
                    raise StrictDeviceError(f"dist.{name} was handed a tensor in {where} over a group on "
                                            f"{device}: NCCL rejects it")
            return fn(*args, **kwargs)
        return collective

    torch.Tensor.cpu, torch.Tensor.to, HostCopy.wait = marked_cpu, moving_to, marked_wait
    for name, fn in originals.items():
        setattr(dist, name, checked(name, fn))
    try:
        yield seen
    finally:
        torch.Tensor.cpu, torch.Tensor.to, HostCopy.wait = cpu, to, wait
        for name, fn in originals.items():
            setattr(dist, name, fn)


# ---- the harness and the scalar collectives ------------------------------------------------------
def _scalar_rank():
    from megazero.checkpoint.comm import all_ok, on_rank0
    from megazero.optim.clip import global_norm_and_overflow
    from megazero.config import parse_args
    from megazero.mesh import ParallelMesh
    from megazero.moe.stats import reduce_step
    from megazero.resilience.stop import StopConditions
    from megazero.training.loop import _mean_loss
    from megazero.zero.nvme_tier import _node_bytes
    mesh = ParallelMesh.build()
    out = {}
    with strict_devices(mesh.collective_device, {}):
        try:
            dist.all_reduce(torch.ones(2).cpu(), group=mesh.world_group)
        except StrictDeviceError as err:
            out["rejected"] = str(err)
        moved = mesh.collective_tensor(torch.ones(2).cpu())  # the copy back onto the device
        dist.all_reduce(moved, group=mesh.world_group)
        out["moved"] = moved.tolist()
        res = parse_args(["--mock-data", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads",
                          "1", "--seq-length", "4", "--exit-duration-in-mins", "1000"], world_size=2)
        res = res.resilience
        out["values"] = [all_ok(mesh.rank == 0, mesh), on_rank0(lambda: "from 0", mesh),
                         _mean_loss([torch.tensor(2.0)], mesh),
                         global_norm_and_overflow(torch.tensor([9.0, 0.0]), mesh),
                         StopConditions(res, None).reason(1, mesh), _node_bytes(5, mesh),
                         reduce_step([], mesh, [1], 2, 1, 1)["dropped"].tolist()]
    return out


@pytest.mark.slow
def test_scalar_collectives_take_device_tensors_and_the_harness_rejects_host_ones():
    """The harness rejects a ``.cpu()`` tensor and takes it back moved by ``collective_tensor``; the
    trainer's scalar collectives (checkpoint agreement and broadcast, the loss, the gradient norm, the
    stop flags, the NVMe node bytes, the MoE step records) run under it, with their values."""
    for out in run_ranks(_scalar_rank, 2):
        assert "host memory" in out["rejected"] and "dist.all_reduce" in out["rejected"], out
        assert out["moved"] == [2.0, 2.0]
        assert out["values"][:3] == [False, "from 0", 2.0]
        assert out["values"][3] == (pytest.approx(18 ** 0.5), False)  # both ranks' 9
        assert out["values"][4:] == [None, (10, 2), [0.0]]


# ---- the MoE layers ------------------------------------------------------------------------------
LAYOUTS = {"ep2-alltoall": (["--expert-model-parallel-size", "2"], "alltoall"),
           "etp2-alltoall": (["--expert-tensor-parallel-size", "2"], "alltoall"),
           "ep2-allgather": (["--expert-model-parallel-size", "2"], "allgather")}


def _moe_rank(layout):
    from megazero.config import parse_args
    from megazero.mesh import ParallelMesh
    from megazero.moe import MoEStats
    from models.moe import MoELayer
    extra, kind = LAYOUTS[layout]
    cfg = parse_args(["--mock-data", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                      "--disable-bias-linear", "--num-experts", "4", "--moe-ffn-hidden-size", "12",
                      "--seq-length", "8", "--moe-token-dispatcher-type", kind, "--moe-router-topk", "2",
                      "--moe-aux-loss-coeff", "0.01", *extra], world_size=2)
    moe = cfg.moe
    mesh = ParallelMesh.build(ep=moe.expert_model_parallel_size, etp=moe.expert_tensor_parallel_size)
    layer = MoELayer(cfg, mesh, 1, MoEStats([1], 4, mesh.device))
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(mesh.rank), requires_grad=True)
    seen = {}
    with strict_devices(mesh.collective_device, seen):
        out = layer(x)
        out.square().sum().backward()
    return seen["host_reads"], float(x.grad.abs().sum()), float(layer.experts.fc1_weight.grad.abs().sum())


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_layers_exchange_counts_on_the_device(layout):
    """Forward and backward of an MoE layer on 2 ranks: every collective takes device tensors, and the
    layer reads its counts on the host once (one HostCopy), gradients reaching input and experts."""
    for host_reads, x_grad, expert_grad in run_ranks(_moe_rank, 2, layout):
        assert host_reads == 1
        assert x_grad > 0 and expert_grad > 0


def test_a_host_tensor_stays_marked_through_ops():
    """The mark follows a ``.cpu()`` tensor through ops (what the old dispatcher did: ``empty_like``
    of its host counts) and leaves with ``.to()`` onto the device."""
    with strict_devices(torch.device("cpu"), {}):
        host = torch.arange(4).cpu()
        assert isinstance(torch.empty_like(host), HostTensor) and isinstance(host + 1, HostTensor)
        assert not isinstance(host.to("cpu"), HostTensor) and not isinstance(torch.arange(4), HostTensor)
        assert isinstance(host.to(torch.float64), HostTensor)  # no device named: still on the host
    assert not isinstance(torch.arange(2).cpu(), HostTensor)  # patches undone
