"""Process-group mesh: which ranks share a tensor-, pipeline- or data-parallel group.

`rank_groups` is the pure layout (no process group needed, unit-tested on its own);
`ParallelMesh` turns it into live `torch.distributed` groups and this rank's coordinates.

The default order is Megatron-LM's "tp-dp-pp": tp varies fastest, then dp, then pp, so
``rank = tp_rank + tp * dp_rank + tp * dp * pp_rank``.  An order string names the axes
from fastest to slowest; any permutation of ``tp``, ``dp`` and ``pp`` is accepted.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

AXES = ("tp", "dp", "pp")


def parse_rank_order(order: str) -> List[str]:
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(
            f"unknown axis {unknown[0]!r} in rank order {order!r}; use a permutation of tp, dp and pp "
            "such as 'tp-dp-pp' (Megatron-LM's default) or 'tp-pp-dp'")
    if sorted(tokens) != sorted(AXES):
        raise ValueError(f"rank order {order!r} must name each of tp, dp and pp exactly once, "
                         "e.g. 'tp-dp-pp'")
    return tokens


def rank_groups(world_size: int, tp: int = 1, pp: int = 1,
                order: str = "tp-dp-pp") -> Dict[str, List[List[int]]]:
    """Megatron-LM's process-group layout, as lists of rank lists.

    Returns a dict with keys ``"tp"``, ``"dp"``, ``"pp"``, ``"mp"`` (the tp x pp model-parallel
    group of each data-parallel replica) and ``"embedding"`` (first and last rank of each
    pipeline group; one rank when pp == 1).
    """
    for name, value in (("world size", world_size), ("tensor-model-parallel size", tp),
                        ("pipeline-model-parallel size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-model-parallel size {tp} x "
            f"pipeline-model-parallel size {pp} = {tp * pp}; choose sizes whose product divides the "
            "world size")
    sizes = {"tp": tp, "pp": pp, "dp": world_size // (tp * pp)}
    axes = parse_rank_order(order)
    # stride of each axis in the rank number: the first-named axis varies fastest
    strides, stride = {}, 1
    for a in axes:
        strides[a] = stride
        stride *= sizes[a]

    def rank_of(coord: Dict[str, int]) -> int:
        return sum(coord[a] * strides[a] for a in AXES)

    def groups_varying(varying: List[str]) -> List[List[int]]:
        fixed = [a for a in axes if a not in varying]
        out = []
        # iterate fixed axes with the fastest one innermost so groups come out in rank order
        for fixed_vals in itertools.product(*[range(sizes[a]) for a in reversed(fixed)]):
            base = dict(zip(reversed(fixed), fixed_vals))
            members = []
            for var_vals in itertools.product(*[range(sizes[a]) for a in reversed(varying)]):
                members.append(rank_of({**base, **dict(zip(reversed(varying), var_vals))}))
            out.append(sorted(members))
        return sorted(out)

    result = {"tp": groups_varying(["tp"]), "dp": groups_varying(["dp"]), "pp": groups_varying(["pp"]),
              "mp": groups_varying(["tp", "pp"])}
    result["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in result["pp"]]
    return result


def local_device_index(local_rank: Optional[str], device_count: int) -> int:
    """The GPU a process with ``$LOCAL_RANK`` = ``local_rank`` (None: unset) uses among ``device_count``."""
    return int(local_rank or 0) % device_count


def default_device() -> torch.device:
    """The device this process should compute on: its local CUDA device (``$LOCAL_RANK`` modulo the
    GPUs it sees) when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_device_index(os.environ.get("LOCAL_RANK"),
                                                       torch.cuda.device_count()))
    return torch.device("cpu")


def use_device(device: Optional[torch.device]) -> torch.device:
    """Resolve ``device`` (None: :func:`default_device`) and make a CUDA device the current one, so
    the collectives, the default generator and any ``"cuda"`` tensor of this process use it."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def warm_up(groups, device: torch.device) -> None:
    """One small all-reduce of a ``device`` tensor on each of ``groups`` (this rank's groups, in the
    same order on every rank): NCCL then has every communicator set up by a collective of all its
    ranks before a pipeline's first ``batch_isend_irecv``, which involves only two of them."""
    for group in groups:
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=device), group=group)


def backend_for(device: torch.device) -> str:
    """The collective backend that suits a device (NCCL for CUDA, gloo otherwise)."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class ParallelMesh:
    """The live process groups and this rank's place in them.

    Build it with :meth:`ParallelMesh.build` after ``torch.distributed`` is initialised, or with
    :meth:`ParallelMesh.single` for one process.  Everything that needs a group receives the
    mesh explicitly; there are no module-level globals.
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    order: str = "tp-dp-pp"
    tp_group: Optional[object] = None
    pp_group: Optional[object] = None
    dp_group: Optional[object] = None
    mp_group: Optional[object] = None
    embedding_group: Optional[object] = None
    world_group: Optional[object] = None
    tp_ranks: List[int] = field(default_factory=list)
    pp_ranks: List[int] = field(default_factory=list)
    dp_ranks: List[int] = field(default_factory=list)
    mp_ranks: List[int] = field(default_factory=list)
    embedding_ranks: List[int] = field(default_factory=list)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, order: str = "tp-dp-pp",
              device: Optional[torch.device] = None, timeout=None) -> "ParallelMesh":
        """Create every tp/dp/pp/mp/embedding group on the default process group (collective), each
        with ``timeout`` (a ``timedelta``; torch's default when None), named by its axis and warmed up
        by one collective.  ``device`` (default: this rank's local GPU by ``$LOCAL_RANK``, or the CPU)
        becomes the current CUDA device, so a caller that builds the mesh itself seeds and computes
        on the rank's own GPU."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh.build needs torch.distributed to be initialised first: call "
                "torch.distributed.init_process_group (torchrun sets the environment) or use "
                "ParallelMesh.single() for one process")
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = rank_groups(world, tp, pp, order)
        device = use_device(device)
        kwargs = {} if timeout is None else {"timeout": timeout}
        mine = {}
        for key in ("tp", "dp", "pp", "mp", "embedding"):
            for ranks in layout[key]:
                # every rank must take part in creating every group, in the same order
                group = dist.new_group(ranks, group_desc=key, **kwargs)
                if rank in ranks:
                    mine[key] = (group, ranks)
        warm_up([mine[key][0] for key in ("tp", "dp", "pp", "mp", "embedding") if key in mine], device)
        tp_ranks, pp_ranks, dp_ranks = mine["tp"][1], mine["pp"][1], mine["dp"][1]
        emb = mine.get("embedding", (None, []))
        return cls(world_size=world, rank=rank, tp_size=tp, pp_size=pp, dp_size=world // (tp * pp),
                   tp_rank=tp_ranks.index(rank), pp_rank=pp_ranks.index(rank), dp_rank=dp_ranks.index(rank),
                   device=torch.device(device), order=order,
                   tp_group=mine["tp"][0], pp_group=mine["pp"][0], dp_group=mine["dp"][0],
                   mp_group=mine["mp"][0], embedding_group=emb[0], world_group=dist.group.WORLD,
                   tp_ranks=tp_ranks, pp_ranks=pp_ranks, dp_ranks=dp_ranks, mp_ranks=mine["mp"][1],
                   embedding_ranks=emb[1])

    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelMesh":
        """A mesh of one process (no process groups; collectives become no-ops)."""
        return cls(world_size=1, rank=0, tp_size=1, pp_size=1, dp_size=1, tp_rank=0, pp_rank=0, dp_rank=0,
                   device=use_device(device), tp_ranks=[0], pp_ranks=[0], dp_ranks=[0],
                   mp_ranks=[0], embedding_ranks=[0])

    # ---- coordinates --------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks and self.pp_size > 1

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} "
                f"pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size} on {self.device}")

    def device_mesh(self):
        """A ``torch.distributed.device_mesh.DeviceMesh`` with dims ("pp", "dp", "tp") for DTensor/DCP
        interop (collective: every rank must call it)."""
        from torch.distributed.device_mesh import DeviceMesh
        axes = parse_rank_order(self.order)
        sizes = {"tp": self.tp_size, "dp": self.dp_size, "pp": self.pp_size}
        slow_to_fast = list(reversed(axes))
        ranks = torch.arange(self.world_size).reshape([sizes[a] for a in slow_to_fast])
        ranks = ranks.permute([slow_to_fast.index(a) for a in ("pp", "dp", "tp")])
        return DeviceMesh(self.device.type, ranks, mesh_dim_names=("pp", "dp", "tp"))
