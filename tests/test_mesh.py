import pytest
import torch
import torch.distributed as dist

from megazero.mesh import ParallelMesh, axis_groups, rank_groups
from megazero.process.local_ranks import RankError, run_ranks


def test_rank_groups_megatron_8_tp2_pp2():
    g = rank_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_groups_megatron_16_tp2_pp4():
    # Megatron-LM's documented example (16 GPUs, tp 2, pp 4 => dp 2)
    g = rank_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (4, 1, 1), (4, 4, 1), (4, 1, 4), (12, 2, 3), (16, 4, 2)])
@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp"])
def test_rank_groups_partition_and_formula(world, tp, pp, order):
    g = rank_groups(world, tp, pp, order)
    dp = world // (tp * pp)
    for key, size, count in (("tp", tp, world // tp), ("dp", dp, world // dp), ("pp", pp, world // pp),
                             ("mp", tp * pp, dp)):
        groups = g[key]
        assert len(groups) == count and all(len(x) == size for x in groups)
        assert sorted(r for x in groups for r in x) == list(range(world))  # a partition
    # each tp group and each pp group meet in exactly one rank, and mp = union of a dp-slice
    for t in g["tp"]:
        for p in g["pp"]:
            assert len(set(t) & set(p)) <= 1
    if order == "tp-dp-pp":
        for r in range(world):
            tp_rank, rest = r % tp, r // tp
            dp_rank, pp_rank = rest % dp, rest // dp
            assert r == tp_rank + tp * dp_rank + tp * dp * pp_rank
            assert next(x for x in g["pp"] if r in x).index(r) == pp_rank


def test_rank_groups_tp_pp_dp_order():
    g = rank_groups(8, tp=2, pp=2, order="tp-pp-dp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("args,msg", [
    ((8, 3, 1), "not divisible by tensor-model-parallel size 3"),
    ((8, 2, 3), "world size 8 is not divisible"),
    ((0, 1, 1), "world size must be a positive integer"),
    ((8, 0, 1), "tensor-model-parallel size must be a positive integer"),
    ((8, 1, -1), "pipeline-model-parallel size must be a positive integer"),
])
def test_rank_groups_errors(args, msg):
    with pytest.raises(ValueError, match=msg):
        rank_groups(*args)


def test_rank_groups_unknown_order():
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        rank_groups(8, 2, 2, order="tp-xp-pp")
    with pytest.raises(ValueError, match="does not name axis 'dp', whose size is 2"):
        rank_groups(8, 2, 2, order="tp-ep-pp")
    with pytest.raises(ValueError, match="exactly once"):
        rank_groups(8, 2, 2, order="tp-tp-pp")


def test_mesh_needs_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelMesh.build(tp=1)


def _mesh_probe():
    m = ParallelMesh.build(tp=2, pp=2)
    out = {}
    for key in ("tp", "dp", "pp", "mp"):
        x = torch.tensor([float(m.rank)])
        dist.all_reduce(x, group=m.group(*{"mp": ("tp", "pp")}.get(key, (key,))))
        out[key] = x.item()
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=m.group("embedding"))
    out["embedding"] = x.item()
    return dict(out, coords=(m.coord("tp"), m.coord("pp"), m.coord("dp")), first=m.is_first_stage,
                last=m.is_last_stage,
                next=m.next_rank, prev=m.prev_rank, backend=m.backend, dp_size=m.size("dp"))


def test_parallel_mesh_8_ranks():
    res = run_ranks(_mesh_probe, 8)
    layout = rank_groups(8, 2, 2)
    for r, out in enumerate(res):
        for key in ("tp", "dp", "pp", "mp"):
            group = next(g for g in layout[key] if r in g)
            assert out[key] == sum(group), (r, key)  # the live group is the layout's group
        assert out["embedding"] == 2.0
        tp_rank, dp_rank, pp_rank = r % 2, (r // 2) % 2, r // 4
        assert out["coords"] == (tp_rank, pp_rank, dp_rank)
        assert out["first"] == (pp_rank == 0) and out["last"] == (pp_rank == 1)
        assert out["next"] == (r + 4 if pp_rank == 0 else None)
        assert out["prev"] == (r - 4 if pp_rank == 1 else None)
        assert out["backend"] == "gloo" and out["dp_size"] == 2


def _mesh_bad():
    ParallelMesh.build(tp=3)


def test_parallel_mesh_bad_world_raises_on_every_rank():
    with pytest.raises(RankError, match="not divisible by tensor-model-parallel size 3"):
        run_ranks(_mesh_bad, 4)


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on one rank")
    x = torch.ones(1)
    dist.all_reduce(x)  # rank 0 would wait forever for rank 1
    return x.item()


def test_harness_reports_rank_exception_without_hanging():
    with pytest.raises(RankError, match="boom on one rank"):
        run_ranks(_raise_on_rank1, 2, timeout=60)


def _sleep_forever():
    import time
    time.sleep(100)


def test_harness_times_out():
    with pytest.raises(RankError, match="timed out"):
        run_ranks(_sleep_forever, 2, timeout=1)


def _device_mesh():
    m = ParallelMesh.build(tp=2, pp=2)
    dm = m.device_mesh()
    return dm["tp"].get_local_rank(), dm["dp"].get_local_rank(), dm["pp"].get_local_rank()


def test_device_mesh_interop():
    res = run_ranks(_device_mesh, 8)
    assert res == [(r % 2, (r // 2) % 2, r // 4) for r in range(8)]


# ---- named axes with context parallelism, against Megatron-core's rule -------------------------
def megatron_rule(world, sizes, order, masked):
    """Megatron-core's RankGenerator as its docstring states it (generate_masked_orthogonal_rank_groups):
    with the axes in ``order`` fastest first, ``global_rank = sum(coord[a] * prod(size of the axes
    before a))``; the group of the masked axes for group index ``gi`` (the unmasked coordinates, first
    unmasked axis fastest) lists ``rank_in_group`` = the masked coordinates, first masked axis fastest.
    Written out here by enumerating coordinates, independently of megazero.mesh."""
    names = order.split("-")
    names += [a for a in ("tp", "cp", "ep", "dp", "pp") if a not in names]
    shape = [sizes.get(a, 1) for a in names]

    def coords(index, dims):  # mixed radix, first dim fastest
        out = {}
        for d in dims:
            out[d] = index % shape[d]
            index //= shape[d]
        return out
    masked_dims = [i for i, a in enumerate(names) if a in masked]
    other_dims = [i for i, a in enumerate(names) if a not in masked]
    group_size = 1
    for d in masked_dims:
        group_size *= shape[d]
    groups = []
    for gi in range(world // group_size):
        fixed = coords(gi, other_dims)
        group = []
        for ri in range(group_size):
            c = {**fixed, **coords(ri, masked_dims)}
            rank, stride = 0, 1
            for d in range(len(names)):
                rank += c[d] * stride
                stride *= shape[d]
            group.append(rank)
        groups.append(group)
    return groups


def test_megatron_docstring_example():
    # generate_masked_orthogonal_rank_groups' own example: [tp, dp, pp] = [2, 3, 4], the dp group
    groups = axis_groups({"tp": 2, "dp": 3, "pp": 4}, "tp-dp-pp", ["dp"])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]


def test_cp_layout_tp2_cp2_dp2_by_hand():
    g = rank_groups(8, tp=2, pp=1, cp=2)  # order tp-cp-ep-dp-pp: rank = tp + 2 cp + 4 dp
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["mp"] == g["tp"] and g["pp"] == [[r] for r in range(8)]


@pytest.mark.parametrize("world,tp,cp,pp,order", [
    (8, 2, 2, 2, "tp-cp-ep-dp-pp"),
    (16, 2, 4, 1, "tp-cp-ep-dp-pp"),
    (16, 1, 2, 2, "tp-cp-ep-pp-dp"),
    (24, 2, 3, 2, "cp-tp-dp-pp"),
    (32, 2, 2, 4, "tp-pp-cp-dp"),
])
def test_cp_layouts_equal_megatron_rank_generator(world, tp, cp, pp, order):
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": world // (tp * cp * pp)}
    g = rank_groups(world, tp=tp, pp=pp, order=order, cp=cp)
    for key, masked in (("tp", ["tp"]), ("cp", ["cp"]), ("dp", ["dp"]), ("pp", ["pp"]), ("mp", ["tp", "pp"]),
                        ("dp-cp", ["dp", "cp"]), ("tp-cp", ["tp", "cp"])):
        assert g[key] == megatron_rule(world, sizes, order, masked), key
    assert axis_groups(sizes, order, ["tp", "cp", "dp", "pp"]) == [list(range(world))]


def test_order_must_name_axes_of_size_above_one():
    assert rank_groups(8, tp=2, pp=2, order="tp-dp-pp") == rank_groups(8, tp=2, pp=2)  # cp 1: old strings
    with pytest.raises(ValueError, match="does not name axis 'cp', whose size is 2"):
        rank_groups(8, tp=2, pp=1, cp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match="context-parallel size 3 x"):
        rank_groups(8, tp=2, pp=1, cp=3)


def test_single_mesh_named_lookup():
    m = ParallelMesh.single(torch.device("cpu"))
    assert m.size("tp") == m.size("dp", "cp") == 1 and m.coord("pp") == 0 and m.ranks("dp", "cp") == [0]
    assert m.group("cp") is None and m.is_first_stage and m.is_last_stage
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'"):
        m.size("xp")


def _cp_mesh_probe():
    m = ParallelMesh.build(tp=2, pp=2, cp=2)
    out = {}
    for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("tp", "pp")):
        x = torch.tensor([float(m.rank)])
        dist.all_reduce(x, group=m.group(*axes))
        out["-".join(axes)] = (x.item(), m.size(*axes), m.coord(*axes))
    return out


@pytest.mark.slow
def test_parallel_mesh_with_cp_8_ranks():
    res = run_ranks(_cp_mesh_probe, 8)
    layout = rank_groups(8, 2, 2, cp=2)
    for r, out in enumerate(res):
        for key, layout_key in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp-cp", "dp-cp"),
                                ("tp-pp", "mp")):
            group = next(g for g in layout[layout_key] if r in g)
            assert out[key] == (sum(group), len(group), group.index(r)), (r, key)


# ---- the expert decomposition (etp x ep x edp x pp), against Megatron-core's rule ----------------
@pytest.mark.parametrize("world,tp,cp,pp,ep,etp,order", [
    (8, 2, 1, 2, 2, 2, "tp-cp-ep-dp-pp"),   # EP 2 x TP 2 x PP 2: edp 1
    (8, 1, 1, 1, 4, 1, "tp-cp-ep-dp-pp"),   # EP 4 x DP 2
    (8, 2, 1, 2, 2, 1, "tp-cp-ep-dp-pp"),   # expert TP 1 under TP 2
    (16, 2, 2, 1, 4, 1, "tp-cp-ep-dp-pp"),  # CP folds into expert DP
    (16, 4, 1, 2, 2, 2, "tp-cp-ep-dp-pp"),
    (16, 2, 1, 2, 2, 2, "tp-ep-dp-pp"),
    (8, 2, 1, 1, 2, 2, "tp-cp-ep-pp-dp"),
])
def test_expert_layouts_equal_megatron_rank_generator(world, tp, cp, pp, ep, etp, order):
    edp = world // (etp * ep * pp)
    esizes = {"tp": etp, "ep": ep, "dp": edp, "pp": pp, "cp": 1}
    g = rank_groups(world, tp=tp, pp=pp, order=order, cp=cp, ep=ep, etp=etp)
    for key, masked in (("etp", ["tp"]), ("ep", ["ep"]), ("edp", ["dp"]), ("etp-ep", ["tp", "ep"])):
        assert g[key] == megatron_rule(world, esizes, order, masked), key
    # the dense groups are unchanged by the expert sizes, and both decompositions share the pp groups
    dense = {"tp": tp, "cp": cp, "pp": pp, "dp": world // (tp * cp * pp)}
    assert g["dp-cp"] == megatron_rule(world, dense, order, ["dp", "cp"])
    assert megatron_rule(world, esizes, order, ["pp"]) == g["pp"]
    # every expert group family partitions the world
    for key in ("etp", "ep", "edp", "etp-ep"):
        assert sorted(r for grp in g[key] for r in grp) == list(range(world))


def test_expert_layout_by_hand_ep2_tp2_pp2():
    # etp 2, ep 2, pp 2 on 8 ranks: expert rank = etp + 2 ep + 4 pp (edp 1)
    g = rank_groups(8, tp=2, pp=2, ep=2)
    assert g["etp"] == g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["ep"] == g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["edp"] == [[r] for r in range(8)]
    assert g["etp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # expert TP 1 under TP 2: the EP group takes the TP pair, expert DP the DP pair
    g = rank_groups(8, tp=2, pp=2, ep=2, etp=1)
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(world_size=8, tp=2, pp=2, ep=4), "not divisible by --expert-tensor-parallel-size 2 x "
                                           "--expert-model-parallel-size 4"),
    (dict(world_size=8, tp=1, pp=1, ep=0), "--expert-model-parallel-size must be a positive integer"),
    (dict(world_size=8, tp=2, pp=2, ep=2, order="tp-dp-pp"), "does not name axis 'ep'"),
    (dict(world_size=8, tp=2, pp=2, ep=1, etp=1, order="tp-pp-dp"), "other pipeline groups"),
])
def test_expert_layout_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        rank_groups(**kwargs)


def test_single_mesh_expert_lookup():
    m = ParallelMesh.single(torch.device("cpu"))
    assert m.size("ep") == m.size("etp", "ep") == m.size("edp") == 1 and m.ranks("edp") == [0]
    with pytest.raises(ValueError, match="not an axis of the expert layers"):
        m.group("tp", "ep")


def _expert_mesh_probe():
    m = ParallelMesh.build(tp=2, pp=2, ep=2, etp=1)
    out = {}
    for axes in (("etp",), ("ep",), ("edp",), ("etp", "ep"), ("dp", "cp")):
        x = torch.tensor([float(m.rank)])
        dist.all_reduce(x, group=m.group(*axes))
        out["-".join(axes)] = (x.item(), m.size(*axes), m.coord(*axes))
    return out


@pytest.mark.slow
def test_parallel_mesh_expert_groups_8_ranks():
    res = run_ranks(_expert_mesh_probe, 8)
    layout = rank_groups(8, 2, 2, ep=2, etp=1)
    for r, out in enumerate(res):
        for key in ("etp", "ep", "edp", "etp-ep", "dp-cp"):
            group = next(g for g in layout[key] if r in g)
            assert out[key] == (sum(group), len(group), group.index(r)), (r, key)
