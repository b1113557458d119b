"""``--cpu-matmul auto``: oneDNN or PyTorch's BLAS for the model's fp32 CPU products, by measuring them.

Which library multiplies faster depends on the CPU (its vector width: oneDNN's kernels won on an
AVX-512 EPYC and lost on some products of an AVX2 one) and on the torch build, so ``auto`` times
both on this rank's own products (:func:`linear_products`: the forward ``x @ W^T`` and the input
gradient ``g @ W`` of every linear layer, the shapes the model will run; weight gradients stay on
``torch.mm`` either way) at start-up and keeps oneDNN only where it is at least ``1 - MARGIN``
faster over the whole step's products.  The answer is cached per machine (CPU model, the vector
instruction set torch, oneDNN and MKL dispatch to, intra-op threads) and torch build, and per set
of shapes, in ``cpu_matmul.json`` under ``$MEGAZERO_CACHE_DIR`` (default
``$XDG_CACHE_HOME/megazero``, else ``~/.cache/megazero``); delete the file to measure again.  Products below
:data:`megazero.tensor_parallel.layers.ONEDNN_MIN_MACS` never go to oneDNN and are not measured;
a model with none left needs no measurement.

Each product is timed on at most ``ROW_BUDGET_MACS`` multiply-adds (fewer rows of the same
weight shape, but at least ``MIN_ROWS``), the two libraries alternating, the fastest of ``REPS``
calls kept, and scaled back to the full row count.  ``timer(library, product, direction, fn)`` can
be replaced (the tests give a fake one).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import astuple, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

MARGIN = 0.03  # oneDNN must be at least 3 % faster: a tie or noise keeps PyTorch's BLAS
ROW_BUDGET_MACS = 1 << 29
MIN_ROWS = 128  # fewer rows would time matrix-vector-like kernels, not the ones the model runs
REPS = 3
CACHE_FILE = "cpu_matmul.json"
# environment variables that change which kernels oneDNN or MKL dispatch to
DISPATCH_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


@dataclass(frozen=True)
class Product:
    """``count`` linear layers with a ``[out, inp]`` weight applied to ``rows`` rows."""
    rows: int
    out: int
    inp: int
    count: int = 1

    @property
    def macs(self) -> int:
        return self.rows * self.out * self.inp


Timer = Callable[[str, Product, str, Callable[[], object]], float]


def linear_products(cfg, tp: int, cp: int = 1) -> List[Product]:
    """The fp32 products of one micro-batch through one rank's transformer layers and output head, at
    tensor-parallel size ``tp`` and context-parallel size ``cp`` (``cfg`` validated); empty when the
    model does not compute in fp32."""
    from megazero.optim.precision import compute_dtype
    if compute_dtype(cfg) != torch.float32:
        return []
    m = cfg.model
    rows = cfg.training.micro_batch_size * m.seq_length // cp  # sequence parallelism gathers them back
    layers = m.num_layers // cfg.parallel.pipeline_model_parallel_size
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
    gated = 2 if m.activation in ("swiglu", "geglu") else 1
    out = [Product(rows, qkv // tp, m.hidden_size, layers),
           Product(rows, m.hidden_size, m.num_attention_heads * m.kv_channels // tp, layers)]
    if getattr(m, "multi_latent_attention", False):  # MLA's projections (models/mla.py) instead
        out = _mla_products(cfg, rows, tp, layers)
    out += [Product(rows, m.ffn_hidden_size // tp, m.hidden_size, gated * layers),
            Product(rows, m.hidden_size, m.ffn_hidden_size // tp, layers),
            Product(rows, m.padded_vocab_size // tp, m.hidden_size, 1)]
    merged: Dict[Tuple[int, int, int], int] = {}
    for p in out:
        merged[(p.rows, p.out, p.inp)] = merged.get((p.rows, p.out, p.inp), 0) + p.count
    return [Product(*shape, count) for shape, count in sorted(merged.items())]


def _mla_products(cfg, rows: int, tp: int, layers: int) -> List[Product]:
    """Multi-latent attention's products: the replicated down-projections on this rank's tokens (its
    part of the sequence under sequence parallelism), the up-projections (or the one query projection)
    and the output projection of this rank's heads."""
    m, h = cfg.model, cfg.model.hidden_size
    n, rq, rkv, dr = m.num_attention_heads // tp, m.q_lora_rank, m.kv_lora_rank, m.qk_pos_emb_head_dim
    local = rows // tp if cfg.parallel.sequence_parallel else rows
    dq = m.qk_head_dim + dr
    query = [Product(local, rq, h, layers), Product(rows, n * dq, rq, layers)] if rq else \
        [Product(rows, n * dq, h, layers)]
    return query + [Product(local, rkv + dr, h, layers),
                    Product(rows, n * (m.qk_head_dim + m.v_head_dim), rkv, layers),
                    Product(rows, h, n * m.v_head_dim, layers)]


def machine_key() -> str:
    """What the answer depends on besides the shapes: the CPU, its instruction set as torch uses it,
    the intra-op threads and the torch build."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                         model)
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    limits = " ".join(f"{k}={os.environ[k]}" for k in DISPATCH_VARIABLES if os.environ.get(k))
    return (f"{model} | {capability}{' ' + limits if limits else ''} | {torch.get_num_threads()} threads | "
            f"torch {torch.__version__}")


def cache_path() -> str:
    base = os.environ.get("MEGAZERO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "megazero")
    return os.path.join(base, CACHE_FILE)


def wall_timer(library: str, product: Product, direction: str, fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (the default timer)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _calls(product: Product, rows: int) -> Dict[Tuple[str, str], Callable[[], object]]:
    """The four calls of one product on ``rows`` rows: (library, direction) -> a function."""
    from megazero.tensor_parallel.layers import _onednn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, product.inp, generator=gen)
    w = torch.randn(product.out, product.inp, generator=gen)
    g = torch.randn(rows, product.out, generator=gen)
    return {("onednn", "forward"): lambda: _onednn(x, w),
            ("torch", "forward"): lambda: torch.nn.functional.linear(x, w),
            ("onednn", "input grad"): lambda: _onednn(g, w.t()),
            ("torch", "input grad"): lambda: g.mm(w)}


def measure(products: Sequence[Product], timer: Timer = wall_timer, reps: int = REPS,
            detail: Optional[Dict[Tuple[str, str], float]] = None) -> Dict[str, float]:
    """Estimated seconds per step of each library over ``products`` (forward and input gradient);
    ``detail``, when given, gets the seconds of each (library, direction)."""
    total = {"onednn": 0.0, "torch": 0.0}
    for p in products:
        rows = min(p.rows, max(MIN_ROWS, ROW_BUDGET_MACS // (p.out * p.inp)))
        calls = _calls(p, rows)
        best: Dict[Tuple[str, str], float] = {}
        for rep in range(reps + 1):  # the first round warms up (oneDNN builds its kernels)
            order = sorted(calls) if rep % 2 else sorted(calls, reverse=True)  # alternate who goes first
            for key in order:
                seconds = timer(key[0], p, key[1], calls[key])
                if rep:
                    best[key] = min(best.get(key, seconds), seconds)
        for (library, direction), seconds in best.items():
            per_step = seconds * p.count * p.rows / rows
            total[library] += per_step
            if detail is not None:
                detail[library, direction] = detail.get((library, direction), 0.0) + per_step
    return total


def decide(seconds: Dict[str, float]) -> bool:
    """oneDNN when it is at least ``MARGIN`` faster than PyTorch's BLAS."""
    return seconds["onednn"] <= (1.0 - MARGIN) * seconds["torch"]


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (best effort: a read-only home just measures again next time)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read(path)
        data[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def choose_onednn(products: Sequence[Product], timer: Optional[Timer] = None,
                  path: Optional[str] = None) -> bool:
    """Whether oneDNN should run ``products`` (those under the oneDNN threshold left out): the cached
    answer for this machine, torch build and shapes, or a fresh measurement, cached."""
    from megazero.tensor_parallel import layers
    big = [p for p in products if p.macs >= layers.ONEDNN_MIN_MACS]
    if not big:
        return True  # nothing would go to oneDNN: the choice changes nothing
    path = path or cache_path()
    key = f"{machine_key()} | " + " ".join("x".join(map(str, astuple(p))) for p in big)
    cached = _read(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("onednn"), bool):
        return cached["onednn"]
    seconds = measure(big, timer or wall_timer)
    choice = decide(seconds)
    _write(path, key, {"onednn": choice, "onednn_s": seconds["onednn"], "torch_s": seconds["torch"]})
    return choice


def resolve_cpu_matmul(choice: str, products=None, timer=None) -> bool:
    """``--cpu-matmul`` to "use oneDNN": ``onednn`` (an error where unavailable), ``torch`` or ``auto``:
    where oneDNN is available, whichever library multiplies ``products`` (the model's fp32 CPU
    products, :func:`linear_products`) faster on this machine, measured once and cached
    (:func:`choose_onednn`; ``timer`` replaces its clock).  Without ``products`` (checking the flag)
    ``auto`` says whether oneDNN is available."""
    if choice == "torch":
        return False
    from megazero.tensor_parallel import layers
    available = layers.onednn_linear_available()
    if choice == "onednn" and not available:
        raise ValueError("--cpu-matmul onednn needs an x86 CPU build of PyTorch with oneDNN "
                         "(torch.backends.mkldnn); use --cpu-matmul torch or auto")
    if choice == "auto" and available and products is not None:
        return choose_onednn(products, timer)
    return available
