"""The CUDA path against the CPU oracle (marked ``gpu``: run by ``scripts/gpu_check.sh``; skipped
without CUDA).  The one-GPU tests ran on one H200 (docs/performance.md, "The GPU path"); the
layouts of 2, 4 and 8 GPUs over NCCL have not run (no machine with several GPUs was lent), nor have
the MoE layouts (one GPU; EP 2 all-to-all, expert TP 2 and EP 2 allgather over NCCL), added since.

Every run is a subprocess (``python`` or ``torchrun`` on ``scripts/pretrain_gpt.py`` with
``--metrics-file``), so this pytest process never initialises CUDA and the forked CPU ranks of
the rest of the suite stay unaffected.  The oracle is one CPU process in fp32
(``CUDA_VISIBLE_DEVICES=""``).  Tolerances: fp32 on a GPU sums in other orders than on a CPU
(relative differences ~1e-6 per reduction), so after three Adam steps losses agree to 1e-4 and
gradient norms to 1e-3; bf16 rounds activations to 8 mantissa bits (relative 4e-3 per value),
so its loss agrees to 2e-2.  Matrix products run in full fp32 (PyTorch's default: TF32 off).
"""
import json
import os
import subprocess
import sys
import tempfile
from functools import lru_cache

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs an NVIDIA GPU (torch sees none)")]

FLAGS = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--optimizer", "adam",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1", "--seed", "7",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # no dropout: devices and layouts compare


def _env(cpu: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _pretrain(tmp, name: str, flags, nproc: int = 0, cpu: bool = False):
    """Run pretrain_gpt.py (``nproc`` > 0: under torchrun) and return its metrics and stdout."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    launcher = [sys.executable] if not nproc else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.run(launcher + [SCRIPT, *FLAGS, *flags, "--metrics-file", metrics], env=_env(cpu),
                          capture_output=True, text=True, timeout=900, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(metrics) as f:
        return [json.loads(line) for line in f], proc.stdout


@lru_cache(maxsize=None)
def _oracle(tmp, name: str = "oracle-cpu", flags: tuple = ()) -> tuple:
    got, _ = _pretrain(tmp, name, list(flags), cpu=True)
    return tuple((m["loss"], m["grad_norm"]) for m in got)


def _matches(got, oracle, rel_loss=1e-4, rel_norm=1e-3):
    assert len(got) == len(oracle) == 3
    for m, (loss, norm) in zip(got, oracle):
        assert m["loss"] == pytest.approx(loss, rel=rel_loss)
        assert m["grad_norm"] == pytest.approx(norm, rel=rel_norm)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu"))


def test_one_process_on_cuda_matches_the_cpu_oracle(tmp):
    got, out = _pretrain(tmp, "cuda-fp32", [])
    assert "on cuda:0" in out
    _matches(got, _oracle(tmp))
    assert got[-1]["max_memory_allocated"] > 0


@pytest.mark.parametrize("name,flags", [
    ("recompute-full", ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    ("recompute-selective", ["--recompute-granularity", "selective"]),
    ("zero2-offload", ["--zero-stage", "2", "--offload-optimizer"]),  # pinned, non_blocking, per bucket
    ("compile", ["--compile"]),  # Inductor's Triton kernels for each layer
])
def test_one_process_variants_on_cuda_match_the_cpu_oracle(tmp, name, flags):
    got, _ = _pretrain(tmp, name, flags)
    _matches(got, _oracle(tmp))


def test_bf16_on_cuda_is_close_to_the_fp32_oracle(tmp):
    got, _ = _pretrain(tmp, "cuda-bf16", ["--bf16"])
    for m, (loss, _) in zip(got, _oracle(tmp)):
        assert m["loss"] == pytest.approx(loss, rel=2e-2)
    assert all(m["tflops"] > 0 for m in got)


LAYOUTS = [  # (name, GPUs, flags)
    ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
    ("tp2-sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2-1f1b", 2, ["--pipeline-model-parallel-size", "2"]),
    ("pp2-interleaved", 2, ["--pipeline-model-parallel-size", "2",
                            "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("dp2-zero1", 2, ["--zero-stage", "1"]),  # parameter all-gather overlapped with the next forward
    ("dp2-zero2-k1", 2, ["--zero-stage", "2", "--max-reductions-in-flight", "1"]),
    ("dp2-zero3-recompute", 2, ["--zero-stage", "3", "--recompute-granularity", "full"]),
    ("pp4", 4, ["--pipeline-model-parallel-size", "4"]),  # 4 stages: the first p2p involves 2 of 4 ranks
    ("tp2-pp2-zero2", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--zero-stage", "2", "--sequence-parallel"]),
    ("tp2-pp2-dp2-zero3", 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--zero-stage", "3"]),
]


@pytest.mark.parametrize("name,gpus,flags", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_nccl_layouts_match_the_cpu_oracle(tmp, name, gpus, flags):
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, torch sees {GPUS}")
    got, out = _pretrain(tmp, name, flags, nproc=gpus)
    assert "on cuda:0" in out  # rank 0 prints; each rank takes cuda:LOCAL_RANK
    _matches(got, _oracle(tmp))


# every layer an MoE layer (4 experts, top 2); the token counts stay on the GPU, exchanged over NCCL
# and read on the host once per layer from pinned memory (docs/moe.md)
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--disable-bias-linear",
       "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall")
MOE_LAYOUTS = [  # (name, GPUs, flags)
    ("moe-one-gpu", 1, []),
    ("moe-one-gpu-grouped-gemm", 1, ["--moe-grouped-gemm"]),  # torch's grouped_mm
    ("moe-ep2-alltoall", 2, ["--expert-model-parallel-size", "2"]),  # counts and tokens all-to-all
    ("moe-etp2-alltoall", 2, ["--expert-tensor-parallel-size", "2"]),  # counts all-gathered
    ("moe-ep2-allgather", 2, ["--expert-model-parallel-size", "2",
                              "--moe-token-dispatcher-type", "allgather"]),
]


@pytest.mark.parametrize("name,gpus,flags", MOE_LAYOUTS, ids=[x[0] for x in MOE_LAYOUTS])
def test_moe_layouts_on_cuda_match_the_cpu_oracle(tmp, name, gpus, flags):
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, torch sees {GPUS}")
    got, out = _pretrain(tmp, name, [*MOE, *flags], nproc=gpus if gpus > 1 else 0)
    assert "on cuda:0" in out
    _matches(got, _oracle(tmp, "oracle-cpu-moe", MOE))


def _python(code: str, nproc: int = 0) -> str:
    """Run ``code`` in a fresh interpreter (under torchrun with ``nproc`` processes); its stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snippet.py")
        with open(path, "w") as f:
            f.write(code)
        launcher = [sys.executable] if not nproc else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        proc = subprocess.run(launcher + [path], env=_env(False), capture_output=True, text=True, timeout=300,
                              cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_mesh_built_by_the_caller_takes_the_local_rank_gpu():
    """ParallelMesh.build without a device: cuda:LOCAL_RANK becomes current, and seeding reaches it."""
    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    out = _python("""
import torch, torch.distributed as dist
from megazero.mesh import ParallelMesh
from megazero.tensor_parallel.rng import seed_default_generators
dist.init_process_group("nccl")  # no device chosen: the mesh picks cuda:LOCAL_RANK
mesh = ParallelMesh.build(pp=2)
seed_default_generators(3, mesh)
x = torch.randn(4, device=mesh.device)
print("RANK", dist.get_rank(), mesh.device, torch.cuda.current_device(), float(x.sum()))
dist.destroy_process_group()
""", nproc=2)
    lines = sorted(line.split() for line in out.splitlines() if line.startswith("RANK"))
    assert [(r[2], r[3]) for r in lines] == [("cuda:0", "0"), ("cuda:1", "1")]
    assert lines[0][4] != lines[1][4]  # stage seeds differ (seed + 100 * pp_rank)


def test_gradient_norm_on_cuda_uses_foreach_and_matches_the_cpu():
    out = _python("""
import torch
from megazero.optim.clip import local_square_sums
g = torch.Generator().manual_seed(0)
pieces = [(torch.randn(n, generator=g), i % 2 == 0) for i, n in enumerate((70000, 3, 1 << 20, 5))]
cpu = local_square_sums(pieces)
gpu = local_square_sums([(t.cuda(), c) for t, c in pieces]).cpu()
print("REL", float(((gpu - cpu).abs() / cpu).max()))
inf = local_square_sums([(torch.tensor([1.0, float("inf")]).cuda(), False)])
print("INF", float(inf[1]))
""")
    rel = float(next(line.split()[1] for line in out.splitlines() if line.startswith("REL")))
    assert rel < 1e-5
    assert "INF inf" in out


def test_pytorch_profiler_trace_on_cuda_keeps_every_slice_in_perfetto(tmp):
    """``--profile --use-pytorch-profiler`` on a GPU: the trace has the CUDA kernels, and none of its
    slices is one Perfetto's importer would drop (crossing its parent on a track)."""
    from test_profile import _dropped_by_perfetto
    where = os.path.join(tmp, "traces")
    _, out = _pretrain(tmp, "profile", ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                                        "--profile-step-end", "3", "--profile-dir", where])
    assert f"{where}/trace_rank<R>_iters2-3.json" in out
    with open(os.path.join(where, "trace_rank0_iters2-3.json")) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the GPU's own track
    assert _dropped_by_perfetto(events) == []
