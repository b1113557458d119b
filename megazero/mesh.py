"""Process-group mesh of named axes: which ranks share a tensor-, context-, data- or pipeline-parallel
group, or any product of them.

`rank_groups` / `axis_groups` are the pure layout (no process group needed, unit-tested on their own);
`ParallelMesh` turns it into live `torch.distributed` groups and this rank's coordinates, handed
out by axis name: ``mesh.size("tp")``, ``mesh.coord("pp")``, ``mesh.group("dp", "cp")``,
``mesh.ranks("pp")``.

The layout is Megatron-core's ``RankGenerator``: an order string names the axes from fastest to
slowest (default ``tp-cp-ep-dp-pp``). An axis of size 1 may be left out of the string (it is
appended), so the older ``tp-dp-pp`` style strings keep working; an axis of size > 1 must be named.
With strides ``stride[a]`` the product of the sizes of the axes named before ``a``,
``rank = sum(coord[a] * stride[a])``. The group of a set of axes holds the ranks that differ only in
those axes, listed with the first-named axis varying fastest (Megatron's
``generate_masked_orthogonal_rank_groups``); groups are listed by the remaining axes' coordinates,
again first-named fastest.

Two decompositions of the same world, as in Megatron-core:

- dense layers (attention, dense MLPs, embeddings, norms, routers): ``tp x cp x dp x pp`` (the order's
  ``ep`` slot has size 1 there);
- expert layers (the routed experts of a mixture of experts): ``etp x ep x edp x pp``, Megatron-core's
  ``expert_decoder_rank_generator``: the same order string read with ``tp`` = expert tensor parallel
  (``--expert-tensor-parallel-size``, default the TP size), ``ep`` = expert parallel
  (``--expert-model-parallel-size``), ``dp`` = expert data parallel = world / (etp x ep x pp) and
  ``cp`` = 1.  Its pipeline groups must be the dense ones.

Groups of the expert decomposition are named ``etp``, ``ep``, ``edp`` and ``etp-ep`` (never mixed
with the dense axes in one name): ``mesh.group("ep")`` is the group the tokens travel in,
``mesh.group("edp")`` the one expert gradients are reduced and sharded over.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
EMBEDDING = "embedding"
# the groups a live mesh creates: every axis, the model-parallel tp x pp group, the dp x cp group
# that reduces gradients and shards the distributed optimizer, and tp x cp
MESH_GROUPS = (("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp"), ("dp", "cp"), ("tp", "cp"))
# the expert decomposition's axes and the name of each in Megatron-core's RankGenerator
EXPERT_AXES = ("etp", "ep", "edp")
EXPERT_GENERATOR_NAMES = {"etp": "tp", "ep": "ep", "edp": "dp"}
# the expert groups a live mesh creates: expert TP (tokens gathered for the sharded experts), EP (the
# all-to-all), expert DP (gradient reduction of expert weights) and expert TP x EP (the allgather
# dispatcher's group)
EXPERT_GROUPS = (("etp",), ("ep",), ("edp",), ("etp", "ep"))


def parse_rank_order(order: str, sizes: Optional[Dict[str, int]] = None) -> List[str]:
    """The axes of ``order``, fastest first, completed with the axes it leaves out (which must then
    be of size 1 in ``sizes``; no check without ``sizes``)."""
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(
            f"unknown axis {unknown[0]!r} in rank order {order!r}; name the axes tp, cp, ep, dp and pp "
            "from fastest to slowest, such as 'tp-cp-ep-dp-pp' (Megatron-LM's default) or 'tp-dp-pp'")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"rank order {order!r} must name each axis at most once (each of tp, dp and pp "
                         "exactly once), e.g. 'tp-cp-ep-dp-pp'")
    for axis in AXES:
        if axis in tokens:
            continue
        if sizes is not None and sizes.get(axis, 1) != 1:
            raise ValueError(f"--rank-order {order!r} does not name axis {axis!r}, whose size is "
                             f"{sizes[axis]}; name every axis of size > 1, e.g. 'tp-cp-ep-dp-pp'")
        tokens.append(axis)
    return tokens


def axis_sizes(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
               etp: Optional[int] = None) -> Dict[str, int]:
    """The one derivation of the sizes that follow from the world: ``dp`` = world / (tp x cp x pp) and
    the expert decomposition's ``etp`` (``tp`` unless given), ``ep`` and ``edp`` = world / (etp x ep x
    pp), without checks (at least 1 each): :func:`rank_groups` and the mesh check divisibility first,
    ``megazero.config.derive`` reads settings not yet validated."""
    etp = tp if etp is None else etp
    ones = [max(1, v) if isinstance(v, int) else 1 for v in (tp, pp, cp, ep, etp)]
    tp, pp, cp, ep, etp = ones
    return {"dp": max(1, world_size // (tp * pp * cp)), "etp": etp, "ep": ep,
            "edp": max(1, world_size // (etp * ep * pp))}


def _check_sizes(world_size: int, tp: int, pp: int, cp: int) -> Dict[str, int]:
    for name, value in (("world size", world_size), ("tensor-model-parallel size", tp),
                        ("pipeline-model-parallel size", pp), ("context-parallel size", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-model-parallel size {tp} x "
            f"pipeline-model-parallel size {pp} = {tp * pp}; choose sizes whose product divides the "
            "world size")
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-model-parallel size {tp} x "
            f"context-parallel size {cp} x pipeline-model-parallel size {pp} = {tp * cp * pp}; choose "
            "sizes whose product divides the world size")
    return {"tp": tp, "cp": cp, "ep": 1, "dp": axis_sizes(world_size, tp, pp, cp)["dp"], "pp": pp}


def expert_sizes(world_size: int, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> Dict[str, int]:
    """The expert decomposition's sizes ``{"etp", "ep", "edp"}`` (``etp`` defaults to ``tp``, as in
    Megatron-LM); ValueError when etp x ep x pp does not divide the world."""
    etp = tp if etp is None else etp
    for name, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}; "
            "choose expert sizes whose product with the pipeline size divides the world size")
    sizes = axis_sizes(world_size, tp, pp, ep=ep, etp=etp)
    return {k: sizes[k] for k in ("etp", "ep", "edp")}


def _generator_sizes(experts: Dict[str, int], pp: int) -> Dict[str, int]:
    """The expert decomposition as Megatron-core's RankGenerator sizes (tp, cp, ep, dp, pp)."""
    out = {EXPERT_GENERATOR_NAMES[a]: n for a, n in experts.items()}
    return dict(out, cp=1, pp=pp)


def expert_layouts(world_size: int, tp: int, pp: int, order: str, cp: int = 1, ep: int = 1,
                   etp: Optional[int] = None) -> Dict[Tuple[str, ...], List[List[int]]]:
    """The groups of :data:`EXPERT_GROUPS` (keyed by their axes) of the expert decomposition; with
    expert parallelism (``ep`` > 1 or ``etp`` != ``tp``) checks Megatron-core's two rules that tie it to
    the dense one: the same pipeline groups, and with the pipeline axis not last in the order, the same
    data-parallel size."""
    dense = _check_sizes(world_size, tp, pp, cp)
    experts = expert_sizes(world_size, tp, pp, ep, etp)
    gen = _generator_sizes(experts, pp)
    try:
        parse_rank_order(order, gen)
    except ValueError as err:
        raise ValueError(f"expert layers: {err}") from None
    layouts = {axes: axis_groups(gen, order, [EXPERT_GENERATOR_NAMES[a] for a in axes])
               for axes in EXPERT_GROUPS}
    if experts["ep"] == 1 and experts["etp"] == tp:  # no expert parallelism: nothing to tie
        return layouts
    if axis_groups(gen, order, ["pp"]) != axis_groups(dense, order, ["pp"]):
        raise ValueError(
            f"--expert-tensor-parallel-size {experts['etp']} x --expert-model-parallel-size {experts['ep']} "
            f"with --rank-order {order!r} gives the expert layers other pipeline groups than the dense "
            "layers (Megatron-core requires the same); put pp last in the order or use "
            "--expert-tensor-parallel-size equal to --tensor-model-parallel-size")
    if pp > 1 and not order.lower().endswith("pp") and experts["edp"] != dense["dp"]:
        raise ValueError(f"--rank-order {order!r} does not end with pp: the expert data-parallel size "
                         f"{experts['edp']} must then equal the data-parallel size {dense['dp']} "
                         "(Megatron-core's rule); put pp last")
    return layouts


def axis_groups(sizes: Dict[str, int], order: str, axes: Sequence[str]) -> List[List[int]]:
    """The rank groups of the product of ``axes`` (Megatron-core's masked orthogonal groups): each
    group holds the ranks whose coordinates differ only along ``axes``."""
    names = parse_rank_order(order, sizes)
    bad = [a for a in axes if a not in AXES]
    if bad:
        raise ValueError(f"unknown mesh axis {bad[0]!r}; the axes are {', '.join(AXES)}")
    shape = [sizes.get(a, 1) for a in names]
    strides = [1]
    for s in shape[:-1]:
        strides.append(strides[-1] * s)
    inside = [i for i, a in enumerate(names) if a in axes]
    outside = [i for i, a in enumerate(names) if a not in axes]

    def offsets(dims):  # every combination of coordinates along dims, first dim fastest
        out = [0]
        for i in dims:
            out = [base + c * strides[i] for c in range(shape[i]) for base in out]
        return out
    members = offsets(inside)
    return [[start + m for m in members] for start in offsets(outside)]


def _layouts(world_size: int, tp: int, pp: int, order: str, cp: int, ep: int, etp: Optional[int]):
    """``(sizes, {group key: rank lists})`` of every group a mesh holds (:data:`MESH_GROUPS`, the
    embedding group, :data:`EXPERT_GROUPS`)."""
    sizes = _check_sizes(world_size, tp, pp, cp)
    parse_rank_order(order, sizes)
    layouts = {_key(axes): axis_groups(sizes, order, axes) for axes in MESH_GROUPS}
    layouts[(EMBEDDING,)] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in layouts[("pp",)]]
    layouts.update(expert_layouts(world_size, tp, pp, order, cp, ep, etp))
    return sizes, layouts


def rank_groups(world_size: int, tp: int = 1, pp: int = 1, order: str = DEFAULT_ORDER,
                cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> Dict[str, List[List[int]]]:
    """Megatron-LM's process-group layout, as lists of rank lists.

    Returns a dict with keys ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``, ``"mp"`` (the tp x pp
    model-parallel group), ``"dp-cp"`` (the gradient-reduction group), ``"tp-cp"`` and
    ``"embedding"`` (first and last rank of each pipeline group; one rank when pp == 1), and the
    expert decomposition's ``"etp"``, ``"ep"``, ``"edp"`` and ``"etp-ep"`` (``ep`` experts-parallel
    ranks, ``etp`` expert-tensor-parallel ranks, default ``tp``).
    """
    sizes = _check_sizes(world_size, tp, pp, cp)
    result = {"-".join(axes): axis_groups(sizes, order, axes) for axes in MESH_GROUPS}
    result["mp"] = result.pop("tp-pp")
    result[EMBEDDING] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in result["pp"]]
    result.update({"-".join(k): v for k, v in expert_layouts(world_size, tp, pp, order, cp, ep, etp).items()})
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


def collective_device(device: torch.device, group=None) -> torch.device:
    """The device whose tensors a collective over ``group`` (None: the default group) takes: ``device``
    (NCCL takes only tensors on the rank's GPU), or the CPU where the group is gloo's (a gloo group
    on a GPU machine: gloo takes CPU tensors everywhere) or there is no process group."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(device)


def _key(axes: Sequence[str]) -> Tuple[str, ...]:
    """The canonical name of a group: ``("embedding",)``, its axes in ``AXES`` order, or expert axes
    (any of ``etp``, ``ep``, ``edp``: the expert decomposition) in ``EXPERT_AXES`` order."""
    if tuple(axes) == (EMBEDDING,):
        return (EMBEDDING,)
    if not axes:
        raise ValueError("name at least one mesh axis, e.g. mesh.group('dp', 'cp')")
    bad = [a for a in axes if a not in AXES and a not in EXPERT_AXES]
    if bad:
        raise ValueError(f"unknown mesh axis {bad[0]!r}; the axes are {', '.join(AXES)}, the expert axes "
                         f"{', '.join(EXPERT_AXES)} (and the {EMBEDDING!r} group)")
    if any(a in EXPERT_AXES for a in axes):
        dense = [a for a in axes if a not in EXPERT_AXES]
        if dense:
            raise ValueError(f"mesh axis {dense[0]!r} is not an axis of the expert layers' decomposition "
                             f"({', '.join(EXPERT_AXES)}); name expert and dense groups separately")
        return tuple(a for a in EXPERT_AXES if a in axes)
    return tuple(a for a in AXES if a in axes)


@dataclass
class ParallelMesh:
    """The live process groups and this rank's place in them, by axis name.

    Build it with :meth:`ParallelMesh.build` after ``torch.distributed`` is initialised, or with
    :meth:`ParallelMesh.single` for one process.  Everything that needs a group receives the
    mesh explicitly; there are no module-level globals.  ``sizes`` maps each axis of ``AXES`` to
    its size; ``groups`` maps a canonical group name (:func:`_key`) to ``(process group or None,
    ranks)`` of this rank's group.  ``sizes`` are the dense decomposition's (its ``ep`` is 1);
    ``expert_sizes`` maps ``etp``, ``ep`` and ``edp`` to the expert decomposition's sizes.
    """

    world_size: int
    rank: int
    device: torch.device
    order: str = DEFAULT_ORDER
    sizes: Dict[str, int] = field(default_factory=lambda: {a: 1 for a in AXES})
    groups: Dict[Tuple[str, ...], Tuple[Optional[object], List[int]]] = field(default_factory=dict)
    world_group: Optional[object] = None
    expert_sizes: Dict[str, int] = field(default_factory=lambda: {a: 1 for a in EXPERT_AXES})

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, order: str = DEFAULT_ORDER,
              device: Optional[torch.device] = None, timeout=None, cp: int = 1, ep: int = 1,
              etp: Optional[int] = None) -> "ParallelMesh":
        """Create every group of ``MESH_GROUPS``, the embedding group and the expert groups of
        ``EXPERT_GROUPS`` (``ep`` expert-parallel ranks, ``etp`` expert tensor-parallel ranks, default
        ``tp``) on the default process group (collective), each with ``timeout`` (a ``timedelta``;
        torch's default when None), named by its axes and warmed up by one collective; a group equal to
        one already made (an axis of size 1) reuses it.  ``device`` (default: this rank's local GPU by
        ``$LOCAL_RANK``, or the CPU) becomes the current CUDA device, so a caller that builds the mesh
        itself seeds and computes on the rank's own GPU."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh.build needs torch.distributed to be initialised first: call "
                "torch.distributed.init_process_group (torchrun sets the environment) or use "
                "ParallelMesh.single() for one process")
        world, rank = dist.get_world_size(), dist.get_rank()
        sizes, layouts = _layouts(world, tp, pp, order, cp, ep, etp)
        device = use_device(device)
        kwargs = {} if timeout is None else {"timeout": timeout}
        mine, made = {}, {}
        for key, layout in layouts.items():
            signature = tuple(tuple(g) for g in layout)
            if signature in made:  # same groups as an earlier key: share them
                mine[key] = mine[made[signature]]
                continue
            made[signature] = key
            for ranks in layout:
                # every rank must take part in creating every group, in the same order
                group = dist.new_group(ranks, group_desc="-".join(key), **kwargs)
                if rank in ranks:
                    mine[key] = (group, ranks)
            # the embedding groups leave out the middle pipeline stages: no group there
            mine.setdefault(key, (None, []))
        warm_up([mine[key][0] for key in made.values()], device)
        return cls(world_size=world, rank=rank, device=torch.device(device), order=order, sizes=sizes,
                   groups=mine, world_group=dist.group.WORLD,
                   expert_sizes=expert_sizes(world, tp, pp, ep, etp))

    @classmethod
    def layout(cls, world_size: int, rank: int, tp: int = 1, pp: int = 1, order: str = DEFAULT_ORDER,
               cp: int = 1, ep: int = 1, etp: Optional[int] = None,
               device: torch.device = torch.device("meta")) -> "ParallelMesh":
        """Rank ``rank``'s place in a layout of ``world_size`` ranks, without process groups (every group
        is None): what a model built on the meta device needs to know of its shard (sizes and
        coordinates), for the memory estimator's parameter list.  Nothing here may communicate."""
        sizes, layouts = _layouts(world_size, tp, pp, order, cp, ep, etp)
        groups = {key: (None, next((g for g in layout if rank in g), [])) for key, layout in layouts.items()}
        return cls(world_size=world_size, rank=rank, device=torch.device(device), order=order, sizes=sizes,
                   groups=groups, expert_sizes=expert_sizes(world_size, tp, pp, ep, etp))

    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelMesh":
        """A mesh of one process (no process groups; collectives become no-ops)."""
        keys = [_key(axes) for axes in MESH_GROUPS + EXPERT_GROUPS] + [(EMBEDDING,)]
        return cls(world_size=1, rank=0, device=use_device(device), groups={k: (None, [0]) for k in keys})

    # ---- lookup by axis name ------------------------------------------------------------
    def _entry(self, axes: Sequence[str]) -> Tuple[Optional[object], List[int]]:
        key = _key(axes)
        if key not in self.groups:
            made = ", ".join("-".join(k) for k in self.groups)
            raise KeyError(f"this mesh has no {'-'.join(key)} group; it holds {made}")
        return self.groups[key]

    def size(self, *axes: str) -> int:
        """The size of an axis, or of the product of several (``size("dp", "cp")``)."""
        if tuple(axes) == (EMBEDDING,):
            return len(self.ranks(EMBEDDING))
        key = _key(axes)
        sizes = self.expert_sizes if key[0] in EXPERT_AXES else self.sizes
        out = 1
        for a in key:
            out *= sizes[a]
        return out

    def coord(self, *axes: str) -> int:
        """This rank's index in its group of ``axes`` (its coordinate along one axis)."""
        return self.ranks(*axes).index(self.rank)

    def group(self, *axes: str):
        """This rank's process group of ``axes`` (None in a one-process mesh)."""
        return self._entry(axes)[0]

    def ranks(self, *axes: str) -> List[int]:
        """The global ranks of this rank's group of ``axes``, in group order."""
        return self._entry(axes)[1]

    # ---- conveniences -------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.coord("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord("pp") == self.size("pp") - 1

    @property
    def next_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.ranks("pp")[self.coord("pp") + 1]

    @property
    def prev_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.ranks("pp")[self.coord("pp") - 1]

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.ranks(EMBEDDING) and self.size("pp") > 1

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    @property
    def collective_device(self) -> torch.device:
        """The device of the tensors this mesh's collectives take (:func:`collective_device`): its own
        device under NCCL (a GPU mesh) or in one process, the CPU under gloo."""
        if not self.is_distributed:
            return self.device
        return collective_device(self.device, self.world_group)

    def collective_tensor(self, data, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``data`` (a number, a list of numbers or a tensor) as a tensor on :attr:`collective_device`
        (a tensor already there is returned as it is), for a scalar or metadata collective: every such
        tensor megazero builds from host values (flags, counts, numbers) comes from here, so none hands
        NCCL a host tensor (``tests/test_strict_device.py`` holds the collectives to this)."""
        if isinstance(data, torch.Tensor):
            return data.to(device=self.collective_device, dtype=dtype or data.dtype)
        return torch.tensor(data, dtype=dtype, device=self.collective_device)

    def describe(self) -> str:
        shown = [a for a in ("tp", "cp", "pp", "dp", "ep", "etp") if a in ("tp", "pp", "dp")
                 or (a in ("cp", "ep") and self.size(a) > 1)
                 or (a == "etp" and self.size(a) != self.size("tp"))]
        coords = " ".join(f"{a} {self.coord(a)}/{self.size(a)}" for a in shown)
        return f"rank {self.rank}/{self.world_size}: {coords} on {self.device}"

    def device_mesh(self):
        """A ``torch.distributed.device_mesh.DeviceMesh`` with dims ("pp", "dp", "cp", "tp") for
        DTensor/DCP interop (collective: every rank must call it)."""
        from torch.distributed.device_mesh import DeviceMesh
        axes = parse_rank_order(self.order, self.sizes)
        slow_to_fast = list(reversed(axes))
        ranks = torch.arange(self.world_size).reshape([self.sizes[a] for a in slow_to_fast])
        dims = ("pp", "dp", "cp", "tp")
        ranks = ranks.permute([slow_to_fast.index(a) for a in dims + ("ep",)]).squeeze(-1)
        return DeviceMesh(self.device.type, ranks, mesh_dim_names=dims)
