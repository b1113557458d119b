"""Real megatron-core on CPU for the tests: its GPTModel built, run and saved by its own code.

megatron-core 0.16.1 is pure Python (one small C++ helper for datasets, unused here); it is unpacked by
``scripts/fetch_megatron_core.sh`` into ``.venv/megatron_core`` (``$MEGATRON_CORE_DIR``) and put on
``sys.path`` inside the ranks that use it.  No triton, Transformer Engine or Apex: the model uses
Megatron-core's *local* layer spec (its own linear layers and attention, torch norms).

What the harness patches, inside each rank only (Megatron-core assumes CUDA in these places):

- ``torch.cuda.current_device`` returns ``"cpu"`` (tensors are moved "to the current device");
- ``torch.cuda.synchronize`` does nothing (the checkpoint writer syncs after its copies to the host);
- the CUDA RNG tracker's ``fork`` is a no-op context (dropout is 0, no generator is drawn);
- the MoE router's ``te_general_gemm``, which megatron-core 0.16.1 names without defining it when
  Transformer Engine is absent, is None (its torch path then runs);
- the torch_dist writer's results queue is a fork-context queue instead of a spawn-context manager
  (a forked test rank cannot start one) whose ``get_nowait`` waits for the item (a synchronous save
  puts its results and reads them back in the same process, and a fork-context queue hands an item
  over through a feeder thread, which a loaded machine may not have run yet), its memory probe
  returns 0 (psutil is not installed), and the rank is marked non-daemonic so the writer may fork
  its worker processes.

Megatron-LM (the training scripts around megatron-core) is not on PyPI; what it adds to a checkpoint
is written here as it does (``save_torch_dist``, ``save_legacy``): the tracker file, the ``iter_*``
directory, and its common items (``args``, ``checkpoint_version``, ``iteration``,
``opt_param_scheduler``), the model's part by megatron-core (``dist_checkpointing.save`` of
``sharded_state_dict()``; ``state_dict()`` for the legacy ``mp_rank_*`` files).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.queues
import os
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = "0.16.1"
# the models the tests build: GQA, SwiGLU, RMSNorm, RoPE, no biases, untied head (LLaMA-like)
SPEC = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
            vocab=64, seq_length=16)
# and a GPT-2-like one: LayerNorm, GELU, biases everywhere, learned positions, tied head, 4 query groups
GPT2_SPEC = dict(SPEC, num_query_groups=4, ffn_hidden_size=64, llama=False)
SPEC["llama"] = True
# and a mixture of experts: the LLaMA-like model with 4 SwiGLU experts a layer, top-2 routing
MOE_SPEC = dict(SPEC, num_layers=2, experts=4, topk=2, moe_ffn_hidden_size=24)


def site_dir() -> str:
    return os.environ.get("MEGATRON_CORE_DIR", os.path.join(ROOT, ".venv", "megatron_core"))


@pytest.fixture(scope="session")
def megatron_core():
    """The directory megatron-core is unpacked in (fetched once); the tests skip, saying why, when the
    package index cannot be reached."""
    site = site_dir()
    if not os.path.isfile(os.path.join(site, "megatron", "core", "__init__.py")):
        try:
            out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "fetch_megatron_core.sh")],
                                 capture_output=True, text=True, timeout=180,
                                 env=dict(os.environ, PYTHON=sys.executable, MEGATRON_CORE_DIR=site))
        except subprocess.TimeoutExpired:
            pytest.skip("megatron-core could not be fetched in 180 s (scripts/fetch_megatron_core.sh)")
        if out.returncode != 0:
            pytest.skip("megatron-core is not available: scripts/fetch_megatron_core.sh failed: "
                        + (out.stderr.strip().splitlines() or ["?"])[-1])
    return site


class _PatientQueue(multiprocessing.queues.Queue):
    """A fork-context queue whose ``get_nowait`` waits up to 120 s for the item already put."""

    def __init__(self):
        super().__init__(ctx=multiprocessing.get_context("fork"))

    def get_nowait(self):
        return self.get(timeout=120)


def results_queue() -> _PatientQueue:
    return _PatientQueue()


def patch_for_cpu() -> None:
    """The patches of the module docstring (call inside a rank, after megatron is importable)."""
    warnings.filterwarnings("ignore", module="megatron")
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mc_random
    mc_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # its router names it without Transformer Engine
        moe_utils.te_general_gemm = None
    filesystem_async._process_memory = lambda: 0
    filesystem_async._results_queue = results_queue()
    multiprocessing.current_process().daemon = False


def setup_rank(site: str, tp: int = 1, pp: int = 1) -> None:
    """In a forked gloo rank: megatron-core importable, patched, its parallel state initialised."""
    if site not in sys.path:
        sys.path.insert(0, site)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
    patch_for_cpu()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def build_gpt(seed: int = 0, spec=SPEC, stage: bool = False):
    """Megatron-core's GPTModel (local spec, fp32, dropout 0), logits gathered over TP ranks."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    llama = spec["llama"]
    norm = "RMSNorm" if llama else "LayerNorm"
    act = torch.nn.functional.silu if llama else torch.nn.functional.gelu
    cfg = TransformerConfig(num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
                            num_attention_heads=spec["num_attention_heads"],
                            num_query_groups=spec["num_query_groups"],
                            ffn_hidden_size=spec["ffn_hidden_size"],
                            normalization=norm, layernorm_epsilon=1e-5, gated_linear_unit=llama,
                            activation_func=act, add_bias_linear=not llama,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                            params_dtype=torch.float32, **_moe_config(spec), **_sizes())
    torch.manual_seed(seed)
    layer = get_gpt_layer_local_spec(normalization=norm, num_experts=spec.get("experts"),
                                     moe_grouped_gemm=False)
    model = GPTModel(cfg, layer, vocab_size=spec["vocab"],
                     max_sequence_length=spec["seq_length"],
                     position_embedding_type="rope" if llama else "learned_absolute",
                     share_embeddings_and_output_weights=not llama, parallel_output=False,
                     **(_stage_flags() if stage else {}))
    with torch.no_grad():  # norms start at ones, biases at zeros: perturb every tensor so that the
        for name, p in model.named_parameters():  # mapping of each is tested
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _sizes() -> dict:
    from megatron.core import parallel_state
    return dict(tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                pipeline_dtype=torch.float32)


def _stage_flags() -> dict:
    """This rank's pipeline stage: the embedding on the first, the head on the last."""
    from megatron.core import parallel_state
    return dict(pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage())


def load_torch_dist(model, path: str) -> None:
    """megatron-core's own loader: ``model`` (any TP/PP) takes the weights of torch_dist ``path``."""
    from megatron.core import dist_checkpointing
    loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
    missing, _ = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing


def _moe_config(spec) -> dict:
    if not spec.get("experts"):
        return {}
    return dict(num_moe_experts=spec["experts"], moe_router_topk=spec["topk"],
                moe_ffn_hidden_size=spec["moe_ffn_hidden_size"], moe_token_dispatcher_type="allgather",
                moe_aux_loss_coeff=0.0)


def forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Megatron-core's logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]``."""
    b, s = ids.shape
    position = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(1, 1, s, s).tril() < 0.5  # True where attention is masked
    with torch.no_grad():
        return model(ids, position, mask)


def megatron_args(tp: int, consumed: int, spec=SPEC) -> argparse.Namespace:
    """Megatron-LM's stored arguments for :func:`build_gpt`'s model (the fields its loader reads)."""
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
        ffn_hidden_size=spec["ffn_hidden_size"],
        num_attention_heads=spec["num_attention_heads"],
        group_query_attention=spec["num_query_groups"] != spec["num_attention_heads"],
        num_query_groups=spec["num_query_groups"],
        kv_channels=spec["hidden_size"] // spec["num_attention_heads"],
        seq_length=spec["seq_length"], max_position_embeddings=spec["seq_length"],
        position_embedding_type="rope" if spec["llama"] else "learned_absolute", rotary_base=10000,
        rotary_percent=1.0, normalization="RMSNorm" if spec["llama"] else "LayerNorm",
        norm_epsilon=1e-5, swiglu=spec["llama"], add_bias_linear=not spec["llama"], add_qkv_bias=False,
        untie_embeddings_and_output_weights=spec["llama"], padded_vocab_size=spec["vocab"], vocab_size=None,
        make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0, apply_layernorm_1p=False,
        qk_layernorm=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        consumed_train_samples=consumed, params_dtype=torch.float32, attention_backend=AttnBackend.auto,
        ckpt_format="torch_dist", num_experts=spec.get("experts"), moe_router_topk=spec.get("topk", 2),
        moe_ffn_hidden_size=spec.get("moe_ffn_hidden_size"), moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
        moe_layer_freq=1)


def _common(args, iteration: int, lr_samples: int) -> dict:
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
            "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 0.0, "num_steps": lr_samples,
                                    "warmup_steps": 0, "decay_steps": 1000, "decay_style": "constant"},
            "num_floating_point_operations_so_far": 0}


def _tracker(directory: str, iteration: int) -> None:
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    torch.distributed.barrier()


def save_torch_dist(model, directory: str, iteration: int, args, lr_samples: int) -> str:
    """Megatron-LM's torch_dist checkpoint of ``model`` (collective), written by megatron-core."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue = results_queue()  # one per save
    path = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    state = dict(_common(args, iteration, lr_samples), model=model.sharded_state_dict())
    dist_checkpointing.save(state, path)
    _tracker(directory, iteration)
    return path


def save_legacy(model, directory: str, iteration: int, args, lr_samples: int) -> str:
    """Megatron-LM's legacy (``--ckpt-format torch``) checkpoint: one file per TP rank and pipeline
    stage (``mp_rank_TT`` at PP 1, ``mp_rank_TT_PPP`` above), each stage's layers numbered from 0."""
    from megatron.core import parallel_state
    path = os.path.join(directory, f"iter_{iteration:07d}")
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    rank_dir = os.path.join(path, name)
    os.makedirs(rank_dir, exist_ok=True)
    state = dict(_common(args, iteration, lr_samples), model=model.state_dict())
    torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    _tracker(directory, iteration)
    return path


# ---- optimizer state (issue 45: a Megatron-LM run resumed with its Adam moments) -------------------
def megatron_optimizer(model, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8):
    """megatron-core's non-distributed optimizer for fp32 parameters (``FP32Optimizer``) around torch's
    AdamW, with the parameter groups megatron-core makes (weights, then biases and norms without weight
    decay).  Its ``__init__`` only adds a CUDA scale tensor to :class:`MegatronOptimizer`'s: that base
    initialiser is called and the scale made on the CPU."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=0.0, adam_beta1=betas[0],
                             adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0)
    adam = torch.optim.AdamW(_get_param_groups([model], config, None), lr=lr, betas=betas, eps=eps,
                             weight_decay=0.0)

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, adam, config, init_state_fn)
    opt._scale, opt.is_stub_optimizer = torch.tensor([1.0]), False
    return opt


def megatron_scheduler(opt, lr: float = 1e-3):
    """megatron-core's ``OptimizerParamScheduler`` as Megatron-LM makes it for a constant rate (its
    steps counted in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=0.0, lr_warmup_steps=0,
                                   lr_decay_steps=800, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=800, wd_incr_style="constant")


def train_steps(model, opt, sched, steps: int, batch: int = 8, seed: int = 3, spec=SPEC) -> None:
    """``steps`` training steps of megatron-core (its loss, its optimizer and scheduler) on random
    tokens (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    s = spec["seq_length"]
    position = torch.arange(s).unsqueeze(0).expand(batch, s)
    mask = torch.ones(1, 1, s, s).tril() < 0.5
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, spec["vocab"], (batch, s + 1), generator=g)
        opt.zero_grad()
        model(ids[:, :-1], position, mask, labels=ids[:, 1:]).float().mean().backward()
        opt.step()
        sched.step(increment=batch)
    model.eval()


def save_with_optimizer(model, opt, sched, directory: str, iteration: int, args, fmt: str) -> str:
    """Megatron-LM's checkpoint with its optimizer: torch_dist (``optimizer.sharded_state_dict`` of the
    whole state, ``optimizer.state.<moment>.<name>`` tensors sharded as the weights, the common step in
    ``common.pt``) or legacy (``optimizer.state_dict()`` in each rank's ``model_optim_rng.pt``, written by
    data-parallel rank 0); the scheduler's ``state_dict()`` as ``opt_param_scheduler``."""
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        filesystem_async._results_queue = results_queue()
        path = os.path.join(directory, f"iter_{iteration:07d}")
        os.makedirs(path, exist_ok=True)
        state = dict(_common(args, iteration, 0), model=model.sharded_state_dict())
        state["optimizer"] = opt.sharded_state_dict(state)
        state["opt_param_scheduler"] = sched.state_dict()
        dist_checkpointing.save(state, path)
        _tracker(directory, iteration)
        return path
    from megatron.core import parallel_state
    path = os.path.join(directory, f"iter_{iteration:07d}")
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if parallel_state.get_data_parallel_rank() == 0:  # one file per TP rank and stage, as Megatron-LM
        os.makedirs(os.path.join(path, name), exist_ok=True)
        state = dict(_common(args, iteration, 0), model=model.state_dict(), optimizer=opt.state_dict())
        state["opt_param_scheduler"] = sched.state_dict()
        torch.save(state, os.path.join(path, name, "model_optim_rng.pt"))
    _tracker(directory, iteration)
    return path


def optimizer_moments(model, opt) -> dict:
    """``{name: {exp_avg, exp_avg_sq, step}}`` of this rank's parameters (megatron-core's names)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.optimizer.state.items():
        out[names[id(p)]] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return out


def load_and_forward(site: str, path: str, ids: torch.Tensor, tp: int = 2, spec=SPEC):
    """In a forked rank (TP ``tp``): megatron-core's GPTModel of ``spec`` (other weights than any saved:
    seed 7) takes torch_dist ``path`` by its own loader; returns its logits of ``ids`` and the stored
    ``common.pt`` items (``iteration``, ``args``)."""
    setup_rank(site, tp=tp)
    from megatron.core import dist_checkpointing
    model = build_gpt(seed=7, spec=spec)
    load_torch_dist(model, path)
    common = dist_checkpointing.load_common_state_dict(path)
    return forward(model, ids), common["iteration"], vars(common["args"])


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """While megatron-core's DDP and ``DistributedOptimizer`` are built and run: tensors it asks for on
    ``device="cuda"`` are made on the CPU, ``Tensor.cuda()`` returns the tensor, and ``Tensor.type()``
    names a CPU float tensor ``torch.cuda.FloatTensor`` (its check that parameters are CUDA ones)."""
    names = ("tensor", "zeros", "empty", "ones", "full", "arange")
    saved = {n: getattr(torch, n) for n in names}
    saved_cuda, saved_type = torch.Tensor.cuda, torch.Tensor.type

    def on_cpu(fn):
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)
        return make

    def type_name(self, *args, **kwargs):
        if args or kwargs:
            return saved_type(self, *args, **kwargs)
        name = saved_type(self)
        return "torch.cuda." + name[len("torch."):] if ".cuda." not in name else name
    for n in names:
        setattr(torch, n, on_cpu(saved[n]))
    torch.Tensor.cuda, torch.Tensor.type = (lambda self, *a, **k: self), type_name
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)
        torch.Tensor.cuda, torch.Tensor.type = saved_cuda, saved_type


def megatron_distributed_optimizer(model, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                                   distributed: bool = True, bf16: bool = False, fp16: bool = False):
    """``(ddp, optimizer)``: megatron-core's DDP with its grad buffer and the optimizer
    ``get_megatron_optimizer`` makes for it (Adam): the ``DistributedOptimizer`` over the data-parallel
    ranks, or (``distributed=False``) the non-distributed one; ``bf16``: the model's weights in bf16 and
    fp32 main weights in the optimizer (``Float16OptimizerWithFloat16Params`` when not distributed);
    ``fp16``: the same in fp16, with megatron-core's dynamic loss scale starting at 2^16.  Call inside
    :func:`cuda_tensors_on_cpu`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    if bf16 or fp16:
        model.config.bf16, model.config.fp16 = bf16, fp16
        model.to(torch.bfloat16 if bf16 else torch.float16)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True,
                                            overlap_grad_reduce=False)
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=0.0, adam_beta1=betas[0],
                             adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0,
                             use_distributed_optimizer=distributed, bf16=bf16, fp16=fp16,
                             initial_loss_scale=2.0 ** 16)
    return ddp, get_megatron_optimizer(config, [ddp])


def train_steps_ddp(ddp, opt, sched, steps: int, batch: int, seed: int = 3, spec=SPEC) -> None:
    """``steps`` data-parallel steps: each rank its own ``batch`` of random tokens (cross-entropy of the
    gathered logits), gradients reduced by megatron-core's DDP, its optimizer and scheduler stepping."""
    g = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    s, vocab = spec["seq_length"], spec["vocab"]
    position = torch.arange(s).unsqueeze(0).expand(batch, s)
    mask = torch.ones(1, 1, s, s).tril() < 0.5
    ddp.module.train()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, s + 1), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(ids[:, :-1], position, mask)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
        sched.step(increment=batch * torch.distributed.get_world_size())
    ddp.module.eval()


def trained_with_ddp(model, steps: int, batch: int, lr: float, betas, eps: float, **optimizer):
    """``(optimizer, scheduler)`` after ``steps`` data-parallel steps of ``model`` under megatron-core's
    DDP with the optimizer :func:`megatron_distributed_optimizer` makes (``optimizer``: its
    ``distributed`` / ``bf16`` / ``fp16``) and :func:`megatron_scheduler`.  Call inside
    :func:`cuda_tensors_on_cpu`."""
    ddp, opt = megatron_distributed_optimizer(model, lr, betas, eps, **optimizer)
    sched = megatron_scheduler(opt, lr)
    train_steps_ddp(ddp, opt, sched, steps, batch)
    return opt, sched


def save_distributed_optimizer(model, opt, sched, directory: str, iteration: int, args, sharding: str) -> str:
    """Megatron-LM's torch_dist checkpoint of a run with the distributed optimizer, its state saved as
    ``sharding`` (``fully_reshardable``, ``fully_sharded_model_space``: ``optimizer.state.<kind>.<name>``
    in the model's space; ``dp_reshardable``: ``optimizer.distributed.*`` flat buffers)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue = results_queue()
    path = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    state = dict(_common(args, iteration, 0), model=model.sharded_state_dict())
    state["optimizer"] = opt.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": sharding})
    state["opt_param_scheduler"] = sched.state_dict()
    dist_checkpointing.save(state, path)
    _tracker(directory, iteration)
    return path


def save_legacy_distributed(model, opt, sched, directory: str, iteration: int, args) -> str:
    """Megatron-LM's legacy checkpoint of a distributed-optimizer run: each ``mp_rank_*`` directory's
    ``model_optim_rng.pt`` (the optimizer's parameter groups only) and ``distrib_optim.pt``
    (``save_parameter_state``: the flat buffers gathered on data-parallel rank 0)."""
    from megatron.core import parallel_state
    path = os.path.join(directory, f"iter_{iteration:07d}")
    rank_dir = os.path.join(path, f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}")
    os.makedirs(rank_dir, exist_ok=True)
    if parallel_state.get_data_parallel_rank() == 0:
        state = dict(_common(args, iteration, 0), model=model.state_dict(), optimizer=opt.state_dict())
        state["opt_param_scheduler"] = sched.state_dict()
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    opt.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    _tracker(directory, iteration)
    return path


def load_optimizer_state(site: str, path: str, tp: int = 1, spec=SPEC) -> dict:
    """In a forked rank (TP ``tp``): megatron-core's GPTModel of ``spec`` and its non-distributed fp32
    optimizer (:func:`megatron_optimizer`) take torch_dist ``path`` by megatron-core's loader, as
    Megatron-LM resumes (``model`` and ``optimizer`` of one sharded state dict, then each's
    ``load_state_dict``); returns :func:`optimizer_moments`."""
    setup_rank(site, tp=tp)
    from megatron.core import dist_checkpointing
    model = build_gpt(seed=7, spec=spec)
    opt = megatron_optimizer(model)
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(state, path)
    missing, _ = model.load_state_dict(loaded["model"], strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    opt.load_state_dict(loaded["optimizer"])
    return optimizer_moments(model, opt)


def distributed_optimizer_shards(model, opt) -> dict:
    """``{name: {kind: (start, end, values)}}``: the part of each parameter's main weight (``param``) and
    Adam moments this data-parallel rank's ``DistributedOptimizer`` owns, as its own range map and state
    accessors give them (the elements ``start:end`` of the flattened parameter)."""
    inner = getattr(opt, "chained_optimizers", [opt])
    out = {}
    for name, p in model.named_parameters():
        for o in inner:
            if p in getattr(o, "model_param_gbuf_map", {}):
                r = o._get_model_param_range_map(p)["param"]
                t = o._get_main_param_and_optimizer_states(p)
                out[name] = {k: (r.start, r.end, t[k].detach().float().clone().reshape(-1))
                             for k in ("param", "exp_avg", "exp_avg_sq")}
    return out
