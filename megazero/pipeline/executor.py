"""Run a pipeline schedule: forward and backward of this rank's model chunks, with p2p in between.

The executor walks this stage's action list (from :mod:`megazero.pipeline.schedules`): a compute
action runs one chunk on one micro-batch, a group of communication actions is one batched
exchange (:class:`~megazero.pipeline.p2p.StageComm`).  The same loop runs every schedule, and
``pp == 1`` is the degenerate schedule (forward, backward per micro-batch, no messages), so the
trainer always goes through here.

Chunks follow docs/internals.md: ``chunk(input, labels=None, loss_mask=None)``; the first stage's
first chunk takes token ids, the last stage's last chunk returns the per-token loss when given
labels.  The micro-batch loss is ``(loss * mask).sum() / mask.sum()``; backward runs on
``loss / num_micro_batches * loss_scale``.

Memory: a chunk's input is kept from its forward until its backward (1F1B bounds how many).
Its output is needed after the send only for its ``grad_fn``, so once the send has completed
(:meth:`StageComm.exchange` returns only after waiting on every send) the output's storage is
swapped for a one-element placeholder (Megatron's ``deallocate_output_tensor``) and its backward
calls the autograd engine directly (:func:`_backward_deallocated`), which checks the gradient
against the shape recorded in the graph instead of the (now empty) ``.data``.

This is safe because nothing reads the output's values after the send: the chunk output is made
by the last transformer layer's residual add (whose backward saves nothing) or by recompute's
custom Function (which saves its inputs).  :func:`_can_deallocate` skips outputs for which that
assumption may fail or freeing gains nothing: no ``grad_fn`` (a leaf, e.g. a chunk without layers
returning its input), a view (``_base`` set: the storage belongs to another tensor, and views'
backward may need it), or an output its own ``grad_fn`` saved for backward (e.g. ``tanh``/``exp``
as the last op): the engine keeps its own reference to the storage, so nothing would be freed.
Only outputs sent to a next chunk are deallocated; the last chunk's output is the loss.
``PipelineTimer`` reports the activation bytes held (``peak_*_bytes``).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

from torch.autograd.variable import Variable

from megazero.pipeline.p2p import StageComm
from megazero.pipeline.schedules import Action, build_schedule, steps


@dataclass
class PipelineTimer:
    """Wall time one rank spends computing vs waiting in p2p during :func:`run_schedule`.

    Pass one in as ``timer=``; the executor adds to it (so one timer can cover several steps).
    ``as_dict()`` gives the measured bubble ``1 - compute / total``, comparable with
    :func:`megazero.pipeline.schedules.bubble_fraction`.

    It also records the activation memory the executor holds, measured after every step as the
    bytes of the distinct storages of: every kept chunk output (``peak_output_bytes``; includes
    an output between its forward and its send, and the last chunk's loss scalars), the outputs
    already sent and waiting for their backward (``peak_sent_output_bytes``: about zero with
    output deallocation), and the received inputs (``peak_input_bytes``).  The peaks are maxima
    over everything the timer covered.
    """
    compute_s: float = 0.0
    p2p_s: float = 0.0
    total_s: float = 0.0
    peak_output_bytes: int = 0
    peak_sent_output_bytes: int = 0
    peak_input_bytes: int = 0

    def as_dict(self) -> Dict[str, float]:
        other = self.total_s - self.compute_s - self.p2p_s
        return {"compute_s": self.compute_s, "p2p_wait_s": self.p2p_s, "other_s": other,
                "total_s": self.total_s,
                "bubble": 1.0 - self.compute_s / self.total_s if self.total_s > 0 else 0.0,
                "peak_output_bytes": self.peak_output_bytes,
                "peak_sent_output_bytes": self.peak_sent_output_bytes,
                "peak_input_bytes": self.peak_input_bytes}


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several counts once)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _saved_by_producer(out: torch.Tensor) -> bool:
    """Whether ``out.grad_fn`` saved a tensor on ``out``'s storage for its backward (e.g. the
    result of ``tanh``/``exp``, or ``ctx.save_for_backward(output)`` in a custom Function)."""
    fn, ptr = out.grad_fn, out.untyped_storage().data_ptr()
    names = [n for n in dir(fn) if n.startswith("_saved_")]
    if hasattr(fn, "saved_tensors"):  # custom autograd.Function
        names.append("saved_tensors")
    for name in names:
        try:
            value = getattr(fn, name)
        except RuntimeError:  # already freed, or not a tensor slot
            continue
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() == ptr:
                return True
    return False


def _can_deallocate(out: torch.Tensor) -> bool:
    """Whether ``out``'s storage may be dropped while keeping its graph (see the module doc)."""
    return (out.grad_fn is not None and out._base is None and out.untyped_storage().nbytes() > 0
            and not _saved_by_producer(out))


def _deallocate(out: torch.Tensor) -> None:
    """Replace ``out``'s storage by a one-element placeholder; ``out.grad_fn`` stays."""
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _backward_deallocated(out: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from an output whose ``.data`` was deallocated (Megatron's ``custom_backward``).

    ``torch.autograd.backward`` checks ``grad`` against ``out.shape`` (now ``[1]``); the engine
    itself checks it against the shape the graph recorded for ``out``, so call it directly."""
    Variable._execution_engine.run_backward(
        (out,), (grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


def _take(micro_batches: Iterable[dict], m: int) -> List[dict]:
    mbs = list(itertools.islice(iter(micro_batches), m))
    if len(mbs) < m:
        raise ValueError(f"the pipeline needs {m} micro-batches (num_micro_batches) but got {len(mbs)}")
    return mbs


def _check_chunks(chunks, mesh) -> None:
    pp, r, vp = mesh.pp_size, mesh.pp_rank, len(chunks)
    for v, chunk in enumerate(chunks):
        pre, post = r == 0 and v == 0, r == pp - 1 and v == vp - 1
        if bool(getattr(chunk, "pre_process", pre)) != pre or \
                bool(getattr(chunk, "post_process", post)) != post:
            raise ValueError(f"pipeline stage {r} chunk {v} of {vp}: expected pre_process={pre}, "
                             f"post_process={post} (embedding on the first stage's first chunk, loss on the "
                             "last stage's last chunk)")


def run_schedule(chunks: Sequence[torch.nn.Module], mesh, micro_batches: Iterable[dict], *,
                 schedule: Union[str, Sequence[Action]] = "1f1b", num_micro_batches: int,
                 tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32, grad_sync=None,
                 loss_scale: float = 1.0, timer: Optional[PipelineTimer] = None,
                 forward_only: bool = False, deallocate_outputs: bool = True) -> List[torch.Tensor]:
    """Run forward and backward of ``num_micro_batches`` micro-batches through the pipeline.

    ``chunks``: this rank's model chunks (one per virtual stage).  ``micro_batches``: dicts with
    ``"tokens"``, ``"labels"``, ``"loss_mask"`` (``[b, s]``; the first stage reads tokens, the last
    labels and mask).  ``schedule``: "gpipe", "1f1b", "interleaved" or this stage's action list.
    ``grad_sync.prepare_backward(chunk_index, is_last_microbatch)`` is called before each backward
    (never ``finish_grad_sync``).  Gradients accumulate into ``.grad``.
    ``deallocate_outputs``: free each sent output's storage until its backward (module doc).

    Returns, on the last stage, each micro-batch's mean token loss ``(loss * mask).sum() /
    mask.sum()`` as a detached fp32 scalar (the step loss is their mean); ``[]`` elsewhere.
    """
    m, vp = num_micro_batches, len(chunks)
    _check_chunks(chunks, mesh)
    if isinstance(schedule, str):
        actions = build_schedule(schedule, mesh.pp_size, m, vp, forward_only)[mesh.pp_rank]
    else:
        actions = list(schedule)
    mbs = _take(micro_batches, m)
    last_bwd = {a.chunk: a.microbatch for a in actions if a.kind == "bwd"}  # last backward of each chunk
    comm = StageComm(mesh, tensor_shape, dtype, vp)
    dev = mesh.device
    inputs: Dict[tuple, torch.Tensor] = {}    # received activations (leaves; grad = what we send back)
    outputs: Dict[tuple, torch.Tensor] = {}   # chunk outputs kept for backward / send
    sent = set()                               # keys of outputs already sent (awaiting backward)
    freed = set()                              # keys of outputs whose storage was deallocated
    out_grads: Dict[tuple, torch.Tensor] = {}  # received gradients of our outputs
    to_send: Dict[Action, torch.Tensor] = {}
    losses: List[torch.Tensor] = []
    clock = time.perf_counter
    timed_cuda = timer is not None and dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if timed_cuda else (lambda: None)
    start = clock()

    def forward(mb: int, v: int) -> None:
        chunk, batch, key = chunks[v], mbs[mb], (mb, v)
        x = batch["tokens"].to(dev) if chunk.pre_process else inputs[key]
        if chunk.post_process:
            mask = batch["loss_mask"].to(dev, torch.float32)
            per_token = chunk(x, labels=batch["labels"].to(dev), loss_mask=mask)
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)  # all masked: 0, not NaN
            losses.append(loss.detach())
            if not forward_only:
                outputs[key] = loss / m
        else:
            outputs[key] = chunk(x)
        if forward_only:
            inputs.pop(key, None)

    def backward(mb: int, v: int) -> None:
        key = (mb, v)
        if grad_sync is not None:
            grad_sync.prepare_backward(v, mb == last_bwd[v])
        out = outputs.pop(key)
        sent.discard(key)
        if chunks[v].post_process:
            (out * loss_scale if loss_scale != 1.0 else out).backward()
        elif key in freed:
            freed.discard(key)
            _backward_deallocated(out, out_grads.pop(key))
        else:
            torch.autograd.backward(out, grad_tensors=out_grads.pop(key))
        x = inputs.pop(key, None)
        if x is not None:  # not the model's first chunk: send the input's gradient back
            to_send[Action("send_bwd", mb, v)] = x.grad if x.grad is not None else torch.zeros_like(x)

    def measure() -> None:
        timer.peak_output_bytes = max(timer.peak_output_bytes, held_bytes(outputs.values()))
        timer.peak_sent_output_bytes = max(timer.peak_sent_output_bytes,
                                           held_bytes(outputs[k] for k in sent))
        timer.peak_input_bytes = max(timer.peak_input_bytes, held_bytes(inputs.values()))

    for step in steps(actions):
        if timer is not None:
            measure()
        if isinstance(step, Action):
            t0 = clock()
            if step.kind == "fwd":
                with torch.set_grad_enabled(not forward_only):
                    forward(step.microbatch, step.chunk)
            else:
                backward(step.microbatch, step.chunk)
            if timer is not None:
                sync()
                timer.compute_s += clock() - t0
            continue
        t0 = clock()
        for a in step:
            if a.kind == "send_fwd":
                key = (a.microbatch, a.chunk)
                to_send[a] = outputs.pop(key) if forward_only else outputs[key]
        received = comm.exchange(step, to_send)  # returns once every send has completed
        for a in step:
            to_send.pop(a, None)
            if a.kind == "send_fwd" and not forward_only:
                key = (a.microbatch, a.chunk)
                sent.add(key)
                if deallocate_outputs and _can_deallocate(outputs[key]):
                    _deallocate(outputs[key])
                    freed.add(key)
        for a, t in received.items():
            if a.kind == "recv_fwd":
                inputs[(a.microbatch, a.chunk)] = t if forward_only else t.requires_grad_()
            else:
                out_grads[(a.microbatch, a.chunk)] = t
        if timer is not None:
            timer.p2p_s += clock() - t0
    if timer is not None:
        measure()
        sync()
        timer.total_s += clock() - start
    if outputs or out_grads or (inputs and not forward_only):
        raise RuntimeError(f"pipeline stage {mesh.pp_rank}: the schedule left work undone "
                           f"(outputs {sorted(outputs)}, gradients {sorted(out_grads)}, "
                           f"inputs {sorted(inputs)})")
    return losses


def run_forward_only(chunks: Sequence[torch.nn.Module], mesh, micro_batches: Iterable[dict], *,
                     num_micro_batches: int, tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32,
                     schedule: str = "1f1b", timer: Optional[PipelineTimer] = None) -> List[torch.Tensor]:
    """Forward only (evaluation), no autograd graph: the last stage's per-micro-batch mean losses."""
    if len(chunks) > 1:
        schedule = "interleaved"
    return run_schedule(chunks, mesh, micro_batches, schedule=schedule, num_micro_batches=num_micro_batches,
                        tensor_shape=tensor_shape, dtype=dtype, timer=timer, forward_only=True)
