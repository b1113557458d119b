import pytest
import torch
import torch.distributed as dist

from megazero.mesh import ParallelMesh, rank_groups
from megazero.local_ranks import RankError, run_ranks


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
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
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
        dist.all_reduce(x, group=getattr(m, f"{key}_group"))
        out[key] = x.item()
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=m.embedding_group)
    out["embedding"] = x.item()
    return dict(out, coords=(m.tp_rank, m.pp_rank, m.dp_rank), first=m.is_first_stage, last=m.is_last_stage,
                next=m.next_rank, prev=m.prev_rank, backend=m.backend, dp_size=m.dp_size)


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
