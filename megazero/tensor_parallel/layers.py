"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Every weight is created as its full (unsharded) tensor on the CPU from a generator seeded by
``(seed, global layer index, parameter name)`` (:func:`init_full`) and this rank keeps its slice,
so TP = N shards concatenate exactly to the TP = 1 weight.  Built under ``torch.device("meta")``
(the trainer), the layers create *deferred* parameters instead, whose value is computed only when
the optimizer takes them, one bucket at a time (:mod:`megazero.tensor_parallel.deferred`).
Parameters carry the attributes that the optimizer, clipping and checkpoints read (see
``docs/internals.md``):

- ``tensor_model_parallel = True`` and ``partition_dim``: sharded along that dim over TP
  (set at every TP size, TP = 1 included, so checkpoints know how to reshard);
- ``vocab_parallel = True``: additionally padded along dim 0 to the padded vocabulary (rows
  ``>= vocab_size`` are zero);
- ``sequence_parallel = True``: replicated, but with a partial gradient under sequence
  parallelism (summed over TP before the data-parallel reduction);
- ``linear_weight = True``: used once per forward, by :func:`linear` only, so the optimizer may
  give it a ``write_grad`` (below);
- ``grad_arrivals = 2`` (the word embedding tied to the output head in one chunk): used by the
  lookup and by :func:`linear`; the optimizer gives it a ``write_grad`` too, so that the head's part
  of its gradient arrives (and, in a bucket of its own, is reduced) as soon as the head's backward
  computes it, and the lookup's part arrives through ``.grad`` at the end of backward (sparse, the
  rows looked up, where the ZeRO-2/3 reducer has set ``sparse_grad``).  The ``write`` handed to
  ``write_grad`` also computes rows ``[a, e)`` alone (``write.rows(a, e, out)``; ``write.shape``),
  so that a reducer can take the head's part a piece of rows at a time.

Every linear layer's product goes through :func:`linear`, which adds two things to ``F.linear``:

- weight-gradient fusion (Megatron-LM's ``--gradient-accumulation-fusion``): when the optimizer
  has set ``weight.write_grad`` (a gradient buffer of the weight's dtype), the backward computes
  the weight gradient with one matrix product straight into the weight's slice of the flat
  gradient buffer (``mm(..., out=)`` for the step's first micro-batch, ``addmm_`` after it) instead
  of returning it: no ``.grad`` tensor is allocated, accumulated, copied into the buffer and freed.
  With bf16/fp16 weights and fp32 main gradients (``--grad-reduce-dtype fp32``, the default) the
  product runs in the weight's dtype and is added into (the first micro-batch: copied into) the fp32
  slice: the same numbers as through ``.grad``, without the autograd accumulation, the hook's copy
  and the half-precision ``.grad`` living until it;
- ``--cpu-matmul``: fp32 products on the CPU (forward and input gradient) by oneDNN rather than
  PyTorch's BLAS (MKL on x86 builds), which on an AVX-512 AMD EPYC was 9-30 % faster for the
  model's shapes and on an AVX2 one up to 1.39x slower for some (weight gradients: no faster, so
  they stay on ``torch.mm``); products under ``ONEDNN_MIN_MACS`` multiply-adds stay on
  ``F.linear``.  ``auto`` (the default) measures both on the model's own products at start-up and
  caches the answer per machine (:func:`megazero.tensor_parallel.cpu_matmul.resolve_cpu_matmul`).
"""
from __future__ import annotations

import platform
import zlib
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                               reduce_scatter_to_sp, scatter_to_tp)

InitFn = Callable[[Sequence[int]], torch.Tensor]


def init_full(shape: Sequence[int], seed: int, layer_idx: int, name: str, std: float) -> torch.Tensor:
    """A full fp32 CPU tensor ~ N(0, std^2), the same for the same ``(seed, layer_idx, name)``
    in every process and at every parallel layout (seeded by a CRC32 of the key)."""
    key = zlib.crc32(f"{seed}/{layer_idx}/{name}".encode())
    gen = torch.Generator(device="cpu").manual_seed(key)
    return torch.empty(tuple(shape), dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)


def normal_init(seed: int, layer_idx: int, name: str, std: float) -> InitFn:
    """An ``InitFn`` (full shape -> full tensor) for :func:`init_full` with this key."""
    return lambda shape: init_full(shape, seed, layer_idx, name, std)


def shard_shape(shape: Sequence[int], mesh, dim: int) -> Tuple[int, ...]:
    """The shape of this TP rank's slice of a ``shape`` tensor split along ``dim``."""
    if shape[dim] % mesh.size("tp"):
        raise ValueError(f"cannot split dimension {dim} of size {shape[dim]} over "
                         f"{mesh.size('tp')} tensor-parallel ranks")
    return tuple(n // mesh.size("tp") if d == dim else n for d, n in enumerate(shape))


def shard(full: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``full`` along ``dim``."""
    shard_shape(full.shape, mesh, dim)
    return full.chunk(mesh.size("tp"), dim=dim)[mesh.coord("tp")].contiguous()


def pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """``full`` with zero rows appended up to ``rows`` (the padded vocabulary)."""
    if full.shape[0] > rows:
        raise ValueError(f"tensor has {full.shape[0]} rows, more than the padded size {rows}")
    if rows == full.shape[0]:
        return full
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> nn.Parameter:
    """Tag a parameter as sharded over TP along ``partition_dim``."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    return param


def onednn_linear_available() -> bool:
    """Whether :func:`linear` can run fp32 CPU products through oneDNN: an x86 CPU build of PyTorch
    with oneDNN and its ``mkldnn::_linear_pointwise`` operator."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except RuntimeError:
        return False


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN's matrix product."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


# Below about 8M multiply-adds oneDNN's fixed cost per call (~11 us more than MKL's) outweighs its
# faster kernel (measured: 4.2M 1.04x MKL's time, 8.4M 1.00x, 16.8M 0.95x, 67M 0.87-0.90x).
ONEDNN_MIN_MACS = 1 << 23


def _fits_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 on the CPU, large enough (``ONEDNN_MIN_MACS``), outside CPU autocast (where ``F.linear``
    would run in the autocast dtype)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS and not torch.is_autocast_enabled("cpu"))


class _Linear(torch.autograd.Function):
    """``F.linear`` by oneDNN (``onednn``) and/or with the weight gradient handed to ``write_grad``
    (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, write_grad, onednn):
        ctx.save_for_backward(x, weight)
        ctx.write_grad, ctx.onednn, ctx.has_bias = write_grad, onednn, bias is not None
        return _onednn(x, weight, bias) if onednn else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2d, x2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad2d, weight.t()) if ctx.onednn else grad2d.mm(weight)
            grad_x = grad_x.view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1] and ctx.write_grad is not None:
            def write(dst: torch.Tensor, accumulate: bool) -> None:
                dst = dst.view(weight.shape)
                if dst.dtype != grad2d.dtype:  # bf16/fp16 weights, fp32 main gradients: no .grad
                    product = grad2d.t().mm(x2d)
                    dst.add_(product) if accumulate else dst.copy_(product)
                    return
                dst.addmm_(grad2d.t(), x2d) if accumulate else torch.mm(grad2d.t(), x2d, out=dst)
            # rows [a, e) of the weight gradient alone, for a reducer that takes it in pieces
            write.rows = lambda a, e, out: torch.mm(grad2d[:, a:e].t(), x2d, out=out)
            write.shape = weight.shape
            ctx.write_grad(write)
        elif ctx.needs_input_grad[1]:
            grad_weight = grad2d.t().mm(x2d)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad2d.sum(0)
        return grad_x, grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           onednn: bool = False) -> torch.Tensor:
    """``F.linear``; fp32 products on the CPU by oneDNN when ``onednn``, and the weight gradient
    written into the optimizer's buffer where it has set ``weight.write_grad`` (the module docstring)."""
    # under torch.compile Inductor picks the CPU product itself (its lowering rejects this direct call)
    onednn = onednn and _fits_onednn(x, weight) and not torch.compiler.is_compiling()
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    write_grad = getattr(weight, "write_grad", None) if training and weight.requires_grad else None
    if training and (onednn or write_grad is not None):
        return _Linear.apply(x, weight, bias, write_grad, onednn)
    return _onednn(x, weight, bias) if onednn else F.linear(x, weight, bias)


def _sharded_param(init: InitFn, shape: Sequence[int], mesh, dim: int,
                   rows: Optional[int] = None) -> nn.Parameter:
    """This TP rank's slice along ``dim`` of the full weight ``init(shape)`` (zero rows appended up
    to ``rows`` first), as a parameter that may be deferred
    (:func:`megazero.tensor_parallel.deferred.new_param`)."""
    padded = (rows, *shape[1:]) if rows is not None else tuple(shape)

    def make() -> torch.Tensor:
        full = init(shape)
        return shard(pad_rows(full, rows) if rows is not None else full, mesh, dim)
    return mark_tensor_parallel(new_param(shard_shape(padded, mesh, dim), make, mesh.device), dim)


def _zeros_param(n: int, mesh) -> nn.Parameter:
    return new_param((n,), lambda: torch.zeros(n, device="cpu"), mesh.device)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by rows (output features) over TP.

    Input: full features (``[s, b, in]``; ``[s / tp, b, in]`` under sequence parallelism, gathered
    here). Output: this rank's ``out / tp`` features, or all of them with ``gather_output``.
    ``init`` maps the full weight shape ``[out, in]`` to the full weight.
    """

    def __init__(self, in_features: int, out_features: int, mesh, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, init: Optional[InitFn] = None,
                 onednn: bool = False):
        super().__init__()
        self.mesh, self.gather_output, self.sequence_parallel = mesh, gather_output, sequence_parallel
        self.onednn = onednn
        self.in_features, self.out_features = in_features, out_features
        init = init or normal_init(0, 0, "weight", 0.02)
        self.weight = _sharded_param(init, (out_features, in_features), mesh, 0)
        self.weight.linear_weight = True
        self.bias = mark_tensor_parallel(_zeros_param(out_features // mesh.size("tp"), mesh), 0) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.mesh) if self.sequence_parallel else copy_to_tp(x, self.mesh)
        y = linear(x, self.weight, self.bias, self.onednn)
        return gather_from_tp(y, self.mesh) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by columns (input features) over TP.

    Input: this rank's ``in / tp`` features (or the full input, split here, when
    ``input_is_parallel=False``). The partial products are summed over TP (reduce-scattered along
    the sequence under sequence parallelism) and the bias is added after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, mesh, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init: Optional[InitFn] = None, onednn: bool = False):
        super().__init__()
        self.mesh, self.input_is_parallel, self.sequence_parallel = mesh, input_is_parallel, sequence_parallel
        self.onednn = onednn
        self.in_features, self.out_features = in_features, out_features
        init = init or normal_init(0, 0, "weight", 0.02)
        self.weight = _sharded_param(init, (out_features, in_features), mesh, 1)
        self.weight.linear_weight = True
        self.bias = _zeros_param(out_features, mesh) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.mesh)
        y = linear(x, self.weight, onednn=self.onednn)
        y = reduce_scatter_to_sp(y, self.mesh) if self.sequence_parallel else reduce_from_tp(y, self.mesh)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split over TP.

    The full ``[vocab_size, dim]`` weight is initialised, padded with zero rows to
    ``padded_vocab_size`` and sliced by rows. Each rank looks up the ids in its range (zeros
    elsewhere) and the partial embeddings are summed over TP, or reduce-scattered along dim 0
    (the sequence: pass ids as ``[seq, batch]``) with ``reduce_scatter=True``.
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, dim: int, mesh, *,
                 reduce_scatter: bool = False, init: Optional[InitFn] = None):
        super().__init__()
        self.mesh, self.reduce_scatter = mesh, reduce_scatter
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.per_rank = padded_vocab_size // mesh.size("tp")
        self.vocab_start = mesh.coord("tp") * self.per_rank
        init = init or normal_init(0, 0, "weight", 0.02)
        if padded_vocab_size < vocab_size:
            raise ValueError(f"tensor has {vocab_size} rows, more than the padded size {padded_vocab_size}")
        self.weight = _sharded_param(init, (vocab_size, dim), mesh, 0, rows=padded_vocab_size)
        self.weight.vocab_parallel = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        sparse = bool(getattr(self.weight, "sparse_grad", False))  # set by the optimizer: rows, not dense
        if self.mesh.size("tp") == 1:
            return F.embedding(ids, self.weight, sparse=sparse)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, sparse=sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(out, self.mesh) if self.reduce_scatter else reduce_from_tp(out, self.mesh)
