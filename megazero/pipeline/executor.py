"""Run a pipeline schedule: forward and backward of this rank's model chunks, with p2p in between.

The executor walks this stage's action list (from :mod:`megazero.pipeline.schedules`): a compute
action runs one chunk on one micro-batch, a group of communication actions is one batched
exchange (:class:`~megazero.pipeline.p2p.StageComm`).  The same loop runs every schedule, and
``pp == 1`` is the degenerate schedule (forward, backward per micro-batch, no messages), so the
trainer always goes through here.

Chunks follow docs/internals.md: ``chunk(input, labels=None, loss_mask=None)``; the first stage's
first chunk takes token ids, the last stage's last chunk returns the per-token loss when given
labels.  A later chunk whose ``needs_tokens`` is set (packed documents) also gets ``tokens=``.
The micro-batch loss is ``(loss * mask).sum() / mask.sum()``; backward runs on
``loss / num_micro_batches * loss_scale``.  The auxiliary losses of MoE layers (on any stage) get the
same factor as their gradient (``chunk.moe_stats.backward_scale``, :mod:`megazero.moe.stats`).

Memory: a chunk's input is kept from its forward until its backward (1F1B bounds how many).
Its output is needed after the send only for its ``grad_fn``, so once the send is posted (the
in-flight send keeps its own reference to the data until it completes, see
:class:`~megazero.pipeline.p2p.StageComm`) the output's storage is
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

``delay_wgrad`` (``--delay-wgrad-compute``): a backward whose input gradient goes to a previous
stage queues its linear layers' weight-gradient products (``grad_sync.defer_weight_grads``) and
computes them (``compute_deferred_weight_grads``) only once that gradient is on its way: right
after the exchange that posts its send, while the exchange's receives are in flight, or at the
latest before the next compute action.  The previous stage, which waits for that gradient, starts
its backward one weight-gradient pass earlier (the split of backward into B and W of zero-bubble
pipelines, without changing the schedule).  The numbers do not change: the same products, in the
same order of micro-batches, into the same buffers.

Communication never blocks more than the schedule requires: a batch's receives are waited for
just before the compute action that consumes them (in the interleaved steady state the backward's
gradient arrives while the forward before it runs) and its sends at the next batch, so a stage
computes while its last outputs are still on their way.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Union

import torch

from torch.autograd.variable import Variable

from megazero.moe.stats import set_backward_scale
from megazero.pipeline.p2p import StageComm
from megazero.pipeline.schedules import Action, stage_schedule, steps

if TYPE_CHECKING:
    from megazero.zero.reducers import GradSync


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
    pp, r, vp = mesh.size("pp"), mesh.coord("pp"), len(chunks)
    for v, chunk in enumerate(chunks):
        pre, post = r == 0 and v == 0, r == pp - 1 and v == vp - 1
        if bool(getattr(chunk, "pre_process", pre)) != pre or \
                bool(getattr(chunk, "post_process", post)) != post:
            raise ValueError(f"pipeline stage {r} chunk {v} of {vp}: expected pre_process={pre}, "
                             f"post_process={post} (embedding on the first stage's first chunk, loss on the "
                             "last stage's last chunk)")


def needs_tokens(chunk) -> bool:
    """Whether ``chunk`` takes the micro-batch's token ids beside its hidden-state input (a chunk
    after the first, with ``--reset-attention-mask`` or ``--reset-position-ids``)."""
    return not getattr(chunk, "pre_process", True) and bool(getattr(chunk, "needs_tokens", False))


class _Stage:
    """What this rank holds while it runs a schedule, and the compute and bookkeeping of each action.

    ``inputs``: received activations (leaves; their grad is what goes back); ``outputs``: chunk
    outputs kept for the send and the backward; ``sent``/``freed``: outputs already sent / whose
    storage was deallocated; ``out_grads``: received gradients of our outputs; ``to_send``: what
    the next exchange sends; ``losses``: the last stage's micro-batch losses.  Keys are
    ``(micro-batch, chunk)``."""

    def __init__(self, chunks, mesh, mbs: List[dict], actions: Sequence[Action], grad_sync, loss_scale: float,
                 forward_only: bool, deallocate_outputs: bool, delay_wgrad: bool = False):
        self.chunks, self.mbs, self.dev, self.pp_rank = chunks, mbs, mesh.device, mesh.coord("pp")
        self.grad_sync, self.loss_scale = grad_sync, loss_scale
        self.delay_wgrad = delay_wgrad and hasattr(grad_sync, "defer_weight_grads")
        self.wgrad_queued = False
        self.forward_only, self.deallocate_outputs = forward_only, deallocate_outputs
        self.last_backward = {a.chunk: a.microbatch for a in actions if a.kind == "bwd"}
        self.inputs: Dict[tuple, torch.Tensor] = {}
        self.outputs: Dict[tuple, torch.Tensor] = {}
        self.sent, self.freed = set(), set()
        self.out_grads: Dict[tuple, torch.Tensor] = {}
        self.to_send: Dict[Action, torch.Tensor] = {}
        self.losses: List[torch.Tensor] = []

    def compute(self, action: Action) -> None:
        if action.kind == "fwd":
            with torch.set_grad_enabled(not self.forward_only):
                self.forward(action.microbatch, action.chunk)
        else:
            self.backward(action.microbatch, action.chunk)

    def forward(self, mb: int, v: int) -> None:
        chunk, batch, key = self.chunks[v], self.mbs[mb], (mb, v)
        x = batch["tokens"].to(self.dev) if chunk.pre_process else self.inputs[key]
        # packed documents: a chunk after the first finds them in the token ids (megazero.data.documents)
        kw = {"tokens": batch["tokens"].to(self.dev)} if needs_tokens(chunk) else {}
        if chunk.post_process:
            mask = batch["loss_mask"].to(self.dev, torch.float32)
            per_token = chunk(x, labels=batch["labels"].to(self.dev), loss_mask=mask, **kw)
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)  # all masked: 0, not NaN
            self.losses.append(loss.detach())
            if not self.forward_only:
                self.outputs[key] = loss / len(self.mbs)
        else:
            self.outputs[key] = chunk(x, **kw)
        if self.forward_only:
            self.inputs.pop(key, None)

    def backward(self, mb: int, v: int) -> None:
        key = (mb, v)
        if self.grad_sync is not None:
            self.grad_sync.prepare_backward(v, mb == self.last_backward[v])
        out = self.outputs.pop(key)
        self.sent.discard(key)
        if self.delay_wgrad and key in self.inputs:  # its input gradient is sent: weight gradients after
            self.grad_sync.defer_weight_grads()
            self.wgrad_queued = True
        if self.chunks[v].post_process:
            (out * self.loss_scale if self.loss_scale != 1.0 else out).backward()
        elif key in self.freed:
            self.freed.discard(key)
            _backward_deallocated(out, self.out_grads.pop(key))
        else:
            torch.autograd.backward(out, grad_tensors=self.out_grads.pop(key))
        x = self.inputs.pop(key, None)
        if x is not None:  # not the model's first chunk: send the input's gradient back
            self.to_send[Action("send_bwd", mb, v)] = x.grad if x.grad is not None else torch.zeros_like(x)

    def compute_queued_wgrads(self) -> None:
        """The weight gradients the last backward queued (``delay_wgrad``), if any."""
        if self.wgrad_queued:
            self.wgrad_queued = False
            self.grad_sync.compute_deferred_weight_grads()

    def outgoing(self, step: Sequence[Action]) -> Dict[Action, torch.Tensor]:
        """The tensors the exchange of ``step`` sends (forward outputs added to the pending gradients)."""
        for a in step:
            if a.kind == "send_fwd":
                key = (a.microbatch, a.chunk)
                self.to_send[a] = self.outputs.pop(key) if self.forward_only else self.outputs[key]
        return self.to_send

    def after_exchange(self, step: Sequence[Action], received: Dict[Action, torch.Tensor]) -> None:
        """The sends of ``step`` are posted: the in-flight send holds the sent data from now on (a
        tensor of its own on the same storage, released when it completes), so a sent output's
        storage is swapped for a placeholder here; keep what is being received."""
        for a in step:
            self.to_send.pop(a, None)
            if a.kind == "send_fwd" and not self.forward_only:
                key = (a.microbatch, a.chunk)
                self.sent.add(key)
                if self.deallocate_outputs and _can_deallocate(self.outputs[key]):
                    _deallocate(self.outputs[key])
                    self.freed.add(key)
        for a, t in received.items():
            if a.kind == "recv_fwd":
                self.inputs[(a.microbatch, a.chunk)] = t if self.forward_only else t.requires_grad_()
            else:
                self.out_grads[(a.microbatch, a.chunk)] = t

    def check_done(self) -> None:
        if self.outputs or self.out_grads or (self.inputs and not self.forward_only):
            raise RuntimeError(f"pipeline stage {self.pp_rank}: the schedule left work undone "
                               f"(outputs {sorted(self.outputs)}, gradients {sorted(self.out_grads)}, "
                               f"inputs {sorted(self.inputs)})")


class _Clock:
    """Adds compute, p2p and total time and the held activation bytes to a :class:`PipelineTimer`
    (does nothing without one).  On CUDA it synchronises so kernels are counted where they run."""

    def __init__(self, timer: Optional[PipelineTimer], device: torch.device):
        self.timer = timer
        timed_cuda = timer is not None and device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(device)) if timed_cuda else (lambda: None)
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def timing(self, field_name: str):
        if self.timer is None:
            yield
            return
        t0 = time.perf_counter()
        yield
        if field_name == "compute_s":
            self.sync()
        setattr(self.timer, field_name, getattr(self.timer, field_name) + time.perf_counter() - t0)

    def measure(self, stage: _Stage) -> None:
        timer = self.timer
        if timer is None:
            return
        timer.peak_output_bytes = max(timer.peak_output_bytes, held_bytes(stage.outputs.values()))
        timer.peak_sent_output_bytes = max(timer.peak_sent_output_bytes,
                                           held_bytes(stage.outputs[k] for k in stage.sent))
        timer.peak_input_bytes = max(timer.peak_input_bytes, held_bytes(stage.inputs.values()))

    def finish(self, stage: _Stage) -> None:
        if self.timer is not None:
            self.measure(stage)
            self.sync()
            self.timer.total_s += time.perf_counter() - self.start


def run_schedule(chunks: Sequence[torch.nn.Module], mesh, micro_batches: Iterable[dict], *,
                 schedule: Union[str, Sequence[Action]] = "1f1b", num_micro_batches: int,
                 tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32,
                 grad_sync: Optional[GradSync] = None, loss_scale: float = 1.0,
                 timer: Optional[PipelineTimer] = None, forward_only: bool = False,
                 deallocate_outputs: bool = True, delay_wgrad: bool = False) -> List[torch.Tensor]:
    """Run forward and backward of ``num_micro_batches`` micro-batches through the pipeline.

    ``chunks``: this rank's model chunks (one per virtual stage).  ``micro_batches``: dicts with
    ``"tokens"``, ``"labels"``, ``"loss_mask"`` (``[b, s]``; the first stage reads tokens, the last
    labels and mask).  ``schedule``: "gpipe", "1f1b", "interleaved" or this stage's action list.
    ``grad_sync.prepare_backward(chunk_index, is_last_microbatch)`` is called before each backward
    (never ``finish_grad_sync``).  Gradients accumulate into ``.grad``, or, for a weight whose
    ``write_grad`` the optimizer has set, straight into its flat gradient buffer.
    ``deallocate_outputs``: free each sent output's storage until its backward (module doc).
    ``delay_wgrad``: weight gradients after the input gradient's send (module doc).

    Returns, on the last stage, each micro-batch's mean token loss ``(loss * mask).sum() /
    mask.sum()`` as a detached fp32 scalar (the step loss is their mean); ``[]`` elsewhere.
    """
    m, vp = num_micro_batches, len(chunks)
    _check_chunks(chunks, mesh)
    if not forward_only:  # MoE layers' auxiliary losses: the gradient a micro-batch's loss gets
        set_backward_scale(chunks, loss_scale / m)
    if isinstance(schedule, str):  # cached: the same schedule every iteration
        stage_steps = stage_schedule(schedule, mesh.size("pp"), m, vp, forward_only, mesh.coord("pp"))
        actions = [a for step in stage_steps for a in ((step,) if isinstance(step, Action) else step)]
    else:
        actions = list(schedule)
        stage_steps = tuple(steps(actions))
    stage = _Stage(chunks, mesh, _take(micro_batches, m), actions, grad_sync, loss_scale, forward_only,
                   deallocate_outputs, delay_wgrad)
    comm = StageComm(mesh, tensor_shape, dtype, vp)
    clock = _Clock(timer, mesh.device)
    for step in stage_steps:
        clock.measure(stage)
        if isinstance(step, Action):
            with clock.timing("compute_s"):  # queued weight gradients whose send no exchange posted
                stage.compute_queued_wgrads()
            with clock.timing("p2p_s"):  # this compute's input: received only now if still in flight
                comm.wait_received(Action("recv_fwd" if step.kind == "fwd" else "recv_bwd", step.microbatch,
                                          step.chunk))
            with clock.timing("compute_s"):
                stage.compute(step)
            continue
        with clock.timing("p2p_s"):
            comm.complete_sends()  # the previous batch's sends, which had a compute step to complete
            received = comm.exchange(step, stage.outgoing(step))  # posted, not waited for
            stage.after_exchange(step, received)
        with clock.timing("compute_s"):  # the gradient they waited for is on its way
            stage.compute_queued_wgrads()
    with clock.timing("compute_s"):
        stage.compute_queued_wgrads()
    with clock.timing("p2p_s"):
        comm.close()
    clock.finish(stage)
    stage.check_done()
    return stage.losses


def run_forward_only(chunks: Sequence[torch.nn.Module], mesh, micro_batches: Iterable[dict], *,
                     num_micro_batches: int, tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32,
                     schedule: str = "1f1b", timer: Optional[PipelineTimer] = None) -> List[torch.Tensor]:
    """Forward only (evaluation), no autograd graph: the last stage's per-micro-batch mean losses."""
    if len(chunks) > 1:
        schedule = "interleaved"
    return run_schedule(chunks, mesh, micro_batches, schedule=schedule, num_micro_batches=num_micro_batches,
                        tensor_shape=tensor_shape, dtype=dtype, timer=timer, forward_only=True)
