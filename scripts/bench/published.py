"""Published large training runs against the planner's prediction for the published layout.

Each row gives the model, cluster, layout, batch and recomputation as its source reports them, the
throughput the source reports, and how the source counts it:

- ``hw_tflops``: teraFLOP/s per GPU with recomputation's extra forward counted,
  ``96 B s l h^2 (1 + s / 6h + V / 16lh)`` (Narayanan et al. 2021, eq. 3);
- ``mfu``: model FLOPs utilisation without recomputation, ``72 B s l h^2 (1 + s / 6h + V / 12lh)``
  over peak (Korthikanti et al. 2022);
- ``model_tflops``: model teraFLOP/s per GPU (megazero's count, :mod:`megazero.planning.flops`).

Sources (tables transcribed by hand; the papers are the authority):

- ``narayanan21``: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, Table 1 (weak scaling, A100 80GB, full recomputation,
  vocabulary 51200, sequence 2048).
- ``korthikanti22``: V. Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", MLSys 2023, Tables 3 and 5 (A100 80GB, selective recomputation + sequence
  parallelism, micro-batch 1).
- ``mtnlg22``: S. Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
  2022, Table 2 (A100 80GB, 280 / 350 / 420 DGX nodes, TP 8, PP 35, global batch 1920).
- ``llama3``: A. Grattafiori et al., "The Llama 3 Herd of Models", 2024, Table 4 (405B on H100,
  8192 and 16384 GPUs, sequence 8192).

The MT-NLG rows are shown apart and not used: the model predicts them 26-32% above what was
reported.  They ran the same model on the same GPUs as Narayanan et al.'s 530B row (163 TFLOP/s,
predicted within 1%) under DeepSpeed's pipeline engine at 113-126 TFLOP/s; the model has no term
for that engine's overheads, and a constant fitted to absorb them would be a fudge, not a model.

Not published, so assumed: micro-batch 1 where the table gives none; the non-interleaved schedule
in the 2021-22 Megatron rows; Llama 3's interleaving (4 virtual stages of 2 layers).  Llama 3's 126
layers sit in 128 layer slots (16 stages of 8, one fewer on the first and the last stage for the
embedding and the head); the time is modelled with 128 even layers, the FLOPs counted for 126.
These rows time Llama 3's own run, which needed no recomputation; megazero's planner plans the
real split (``--decoder-first/last-pipeline-num-layers 7``, no virtual stages) and, by megazero's
memory model, fits it only with full recomputation (docs/planning.md, "Llama 3 405B on 16,384
H100s"; tests/test_planner_scale.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

GPT3_VOCAB = 51200


@dataclass(frozen=True)
class Run:
    source: str
    name: str
    gpu: str
    gpus: int
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    batch: int
    reported: float
    metric: str  # hw_tflops | mfu | model_tflops
    fit: bool  # used to fit the constants; otherwise held out
    seq: int = 2048
    vocab: int = GPT3_VOCAB
    recompute: str = "full"
    sp: bool = False
    attention: str = "unfused"
    extra: Sequence[str] = ()
    cp: int = 1
    used: bool = True  # False: shown apart, outside what the model claims (module docstring)


def _nar(name, layers, hidden, heads, tp, pp, gpus, batch, tflops, fit):
    return Run("narayanan21", name, "A100", gpus, layers, hidden, heads, tp, pp, batch, tflops, "hw_tflops",
               fit)


LLAMA3 = ("--ffn-hidden-size", "53248", "--group-query-attention", "--num-query-groups", "8", "--swiglu",
          "--position-embedding-type", "rope", "--normalization", "RMSNorm",
          "--untie-embeddings-and-output-weights",
          "--disable-bias-linear", "--use-distributed-optimizer", "--attention-dropout", "0",
          "--hidden-dropout", "0")

RUNS: List[Run] = [
    _nar("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, True),
    _nar("3.6B", 30, 3072, 32, 2, 1, 64, 512, 138, False),
    _nar("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142, True),
    _nar("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135, False),
    _nar("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138, True),
    _nar("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140, False),
    _nar("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148, True),
    _nar("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155, False),
    _nar("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163, True),
    _nar("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 163, False),
    Run("korthikanti22", "22B", "A100", 8, 48, 6144, 64, 8, 1, 4, 0.415, "mfu", False,
        recompute="selective", sp=True),
    Run("korthikanti22", "175B", "A100", 64, 96, 12288, 96, 8, 8, 64, 0.514, "mfu", False,
        recompute="selective", sp=True),
    Run("korthikanti22", "530B", "A100", 280, 105, 20480, 128, 8, 35, 280, 0.560, "mfu", False,
        recompute="selective", sp=True),
    Run("korthikanti22", "1T", "A100", 512, 128, 25600, 160, 8, 64, 512, 0.563, "mfu", False,
        recompute="selective", sp=True),
    Run("mtnlg22", "530B 280 nodes", "A100", 2240, 105, 20480, 128, 8, 35, 1920, 126, "hw_tflops", False,
        used=False),
    Run("mtnlg22", "530B 350 nodes", "A100", 2800, 105, 20480, 128, 8, 35, 1920, 121, "hw_tflops", False,
        used=False),
    Run("mtnlg22", "530B 420 nodes", "A100", 3360, 105, 20480, 128, 8, 35, 1920, 113, "hw_tflops", False,
        used=False),
    Run("llama3", "405B 8192 GPUs", "H100", 8192, 128, 16384, 128, 8, 16, 2048, 430, "model_tflops", True,
        seq=8192, vocab=128256, recompute="none", sp=True, attention="flash", extra=LLAMA3),
    Run("llama3", "405B 16384 GPUs", "H100", 16384, 128, 16384, 128, 8, 16, 2048, 400, "model_tflops", False,
        seq=8192, vocab=128256, recompute="none", sp=True, attention="flash", extra=LLAMA3),
    Run("llama3", "405B 16384 GPUs CP 16", "H100", 16384, 128, 16384, 128, 8, 16, 128, 380, "model_tflops",
        True, seq=131072, vocab=128256, recompute="none", sp=True, attention="flash",
        extra=LLAMA3, cp=16),
]


def run_flags(run: Run) -> List[str]:
    """``pretrain_gpt.py`` flags of a published run (validated with ``--dry-run`` by the tests)."""
    out = ["--num-layers", str(run.layers), "--hidden-size", str(run.hidden), "--num-attention-heads",
           str(run.heads), "--seq-length", str(run.seq), "--max-position-embeddings", str(run.seq),
           "--vocab-size", str(run.vocab), "--make-vocab-size-divisible-by", "128",
           "--global-batch-size", str(run.batch), "--micro-batch-size", "1",
           "--tensor-model-parallel-size", str(run.tp), "--pipeline-model-parallel-size", str(run.pp),
           "--context-parallel-size", str(run.cp), "--bf16", *run.extra,
           "--no-delay-wgrad-compute"]  # Megatron-LM's default, under which these ran
    if run.recompute != "none":
        out += ["--recompute-granularity", run.recompute]
    if run.sp:
        out.append("--sequence-parallel")
    if run.source == "llama3":
        out += ["--num-layers-per-virtual-pipeline-stage", "2"]
    return out


@functools.lru_cache(maxsize=None)
def config(run: Run):
    from megazero.config import parse_args
    from megazero_models.presets import PRESETS
    return parse_args(run_flags(run), presets=PRESETS, world_size=run.gpus, check_data=False)


def metric(run: Run, cfg, step_s: float, peak: float) -> float:
    """The predicted step time in the source's own unit."""
    B, s, l, h, V = run.batch, run.seq, run.layers, run.hidden, run.vocab
    if run.metric == "hw_tflops":
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)) / step_s / run.gpus / 1e12
    if run.metric == "mfu":
        return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)) / step_s / run.gpus / peak
    return _model_flops(run) / step_s / run.gpus / 1e12


@functools.lru_cache(maxsize=None)
def _model_flops(run: Run) -> float:
    from megazero.config import parse_args
    from megazero.planning.flops import model_flops_per_iteration
    from megazero_models.presets import PRESETS
    flags = run_flags(run)
    if run.source == "llama3":  # 126 real layers in 128 slots (module docstring)
        flags[flags.index("--num-layers") + 1] = "126"
    flags = flags[:flags.index("--tensor-model-parallel-size")] + list(run.extra)  # one process counts
    return model_flops_per_iteration(parse_args(flags, presets=PRESETS, world_size=1, check_data=False))


def predict(run: Run, gpu_types: Optional[Dict[str, object]] = None, knee: Optional[float] = None) -> float:
    """The planner's figure for one published run (``gpu_types``/``knee``: override the constants)."""
    from megazero.planning import gpu_model
    from megazero.planning.planner import Hardware, step_time
    gpu = (gpu_types or gpu_model.GPU_TYPES)[run.gpu]
    hw = Hardware.for_gpu(gpu, gpus_per_node=8, attention=run.attention,
                          knee=gpu_model.KNEE if knee is None else knee)
    cfg = config(run)
    return metric(run, cfg, step_time(cfg, hw, saved=_saved())["step_time_s"], gpu.peak_tflops * 1e12)


def log_error(runs: Sequence[Run], gpu_types, knee: float) -> float:
    """Sum of squared log ratios predicted / published over ``runs``."""
    return sum(math.log(predict(r, gpu_types, knee) / r.reported) ** 2 for r in runs)


def fit(runs: Sequence[Run] = RUNS):
    """Least-squares fit (log ratios, over the rows marked ``fit``) of the shared GEMM knee, each GPU
    type's ``gemm_max`` and, where its rows can tell, its ``attn_eff`` (:func:`_fit_maxima`).
    Returns ``(gpu_types, knee)``."""
    from megazero.planning import gpu_model
    types = dict(gpu_model.GPU_TYPES)
    rows = [r for r in runs if r.fit]
    knee = gpu_model.KNEE
    for _ in range(2):  # alternate: the knee with every gemm_max fitted, until it settles
        best = None
        for k in [0.1 * 1.12 ** i for i in range(15)]:
            trial = _fit_maxima(rows, types, k)
            err = log_error(rows, trial, k)
            if best is None or err < best[0]:
                best = (err, k, trial)
        _, knee, types = best
    return types, knee


def _fit_maxima(rows, types, knee):
    """Each GPU type's ``gemm_max`` on its fit rows, and its ``attn_eff`` too where two or more of
    them run the flash kernel (one of them at a long sequence, where attention weighs): coordinate
    descent on grids."""
    out = dict(types)
    grids = {"gemm_max": [0.3 + 0.005 * i for i in range(141)],
             "attn_eff": [0.2 + 0.01 * i for i in range(61)]}
    for name in {r.gpu for r in rows}:
        mine = [r for r in rows if r.gpu == name]
        fields = ["gemm_max"] + (["attn_eff"] if sum(r.attention == "flash" for r in mine) >= 2 else [])
        for _ in range(3 if len(fields) > 1 else 1):
            for f in fields:
                errs = [(log_error(mine, {**out, name: replace(out[name], **{f: g})}, knee), g)
                        for g in grids[f]]
                out[name] = replace(out[name], **{f: min(errs)[1]})
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / den if den else 0.0


def table(gpu_types=None, knee=None) -> Dict[str, object]:
    """Every row with its prediction, and per source the largest error, the rank correlation
    between published and predicted throughput (sources of three rows or more) and how many model
    sizes its rows span (the weak-scaling trend is the correlation of a source of several sizes)."""
    rows = [{"run": r, "predicted": predict(r, gpu_types, knee)} for r in RUNS]
    for row in rows:
        row["error"] = row["predicted"] / row["run"].reported - 1
    sources = {}
    for src in dict.fromkeys(r.source for r in RUNS if r.used):
        mine = [x for x in rows if x["run"].source == src]
        rho = spearman([x["run"].reported for x in mine], [x["predicted"] for x in mine])
        sizes = {(x["run"].layers, x["run"].hidden) for x in mine}
        sources[src] = {"max_error": max(abs(x["error"]) for x in mine),
                        "spearman": rho if len(mine) >= 3 else None, "sizes": len(sizes)}
    return {"rows": rows, "sources": sources}


def report(gpu_types=None, knee=None) -> str:
    """The side-by-side table ``bench_planner.py --published`` prints (Markdown)."""
    from megazero.planning import gpu_model
    t = table(gpu_types, knee)
    types, k = gpu_types or gpu_model.GPU_TYPES, gpu_model.KNEE if knee is None else knee
    unit = {"hw_tflops": "TFLOP/s (hw)", "mfu": "MFU", "model_tflops": "TFLOP/s (model)"}
    lines = ["| source | run | GPUs | layout | unit | published | predicted | error | role |",
             "|---|---|---:|---|---|---:|---:|---:|---|"]
    for used in (True, False):
        for x in (x for x in t["rows"] if x["run"].used == used):
            r = x["run"]
            role = ("fit" if r.fit else "held out") if used else "not used"
            fmt = "{:.3f}" if r.metric == "mfu" else "{:.0f}"
            layout = f"TP {r.tp} PP {r.pp}{' SP' if r.sp else ''}, {r.recompute}"
            lines.append(f"| {r.source} | {r.name} | {r.gpus} | {layout} | {unit[r.metric]} | "
                         f"{fmt.format(r.reported)} | {fmt.format(x['predicted'])} | {x['error']:+.1%} | "
                         f"{role} |")
    lines.append("")
    for src, v in t["sources"].items():
        rho = "" if v["spearman"] is None else f", Spearman published vs predicted {v['spearman']:.2f}"
        rho += f" over {v['sizes']} model sizes" if v["sizes"] > 1 else " (one model)"
        lines.append(f"- {src}: largest error {v['max_error']:.1%}{rho}")
    held = [abs(x["error"]) for x in t["rows"] if x["run"].used and not x["run"].fit]
    fitted = [abs(x["error"]) for x in t["rows"] if x["run"].used and x["run"].fit]
    lines.append(f"- rows fitted: {len(fitted)}, largest error {max(fitted):.1%}; held out: {len(held)}, "
                 f"largest error {max(held):.1%}")
    lines.append(f"- constants: knee {k:.3g}; " + ", ".join(
        f"{n} gemm_max {types[n].gemm_max:.3g} attn_eff {types[n].attn_eff:.3g}" for n in ("A100", "H100")))
    return "\n".join(lines)


def _saved():
    """The model's declaration (what it saves, its parameters) that the estimator reads."""
    from megazero_models import saved_activations
    return saved_activations
