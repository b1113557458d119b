"""Point-to-point exchange of activations and their gradients between pipeline stages.

Every message has the same shape ``[seq (/ tp under sequence parallelism), micro_batch, hidden]``
and the compute dtype, both known from the config, so no shapes are exchanged.  The sends and
receives that a schedule groups together (see :func:`megazero.pipeline.schedules.steps`) are
posted as one ``batch_isend_irecv`` and waited on together; the schedule simulator checks that
the two ends of every pair of ranks post their messages in the same order, so no tags are needed
(NCCL ignores them anyway).

With virtual chunks the last stage's chunk ``v`` sends to the first stage's chunk ``v + 1`` and
the first stage's chunk ``v + 1`` sends gradients back (wrap-around).  With one stage and several
chunks a "message" to oneself is handed over locally.
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megazero.pipeline.schedules import Action, peer


def p2p_tensor_shape(cfg) -> Tuple[int, int, int]:
    """Shape of the tensor sent between stages, from a validated config."""
    seq = cfg.model.seq_length // cfg.parallel.context_parallel_size
    if cfg.parallel.sequence_parallel:
        seq //= cfg.parallel.tensor_model_parallel_size
    return (seq, cfg.training.micro_batch_size, cfg.model.hidden_size)


def peer_rank(mesh, action: Action, vp: int = 1) -> int:
    """Global rank at the other end of a communication action of this rank."""
    stage, _ = peer(action, mesh.coord("pp"), mesh.size("pp"), vp)
    return mesh.ranks("pp")[stage]


class StageComm:
    """Posts the batched sends and receives of one pipeline rank and waits for them lazily.

    ``exchange(batch, outgoing)`` posts a send of ``outgoing[action]`` for every ``send_*`` action
    of the batch and a receive into a fresh tensor for every ``recv_*`` action, and returns
    ``{recv action: tensor}`` at once.  A received tensor may be used only after
    :meth:`wait_received` for its action (the executor calls it just before the compute that
    consumes it), so a receive needed later in the schedule (the backward's gradient in the
    interleaved steady state) arrives while the forward before it computes.  Sends are waited for
    at the next exchange or by :meth:`complete_sends`, which returns the send actions that have
    completed: only then may the caller free or overwrite what was sent (the executor deallocates
    sent outputs).  On NCCL "completed" means ordered before later work on the current stream,
    which is what the caching allocator needs before reusing the memory; a batch is one coalesced
    group there, so waiting for any of its operations waits for all of them.
    """

    def __init__(self, mesh, tensor_shape: Sequence[int], dtype: torch.dtype, vp: int = 1):
        self.mesh, self.vp = mesh, vp
        self.shape, self.dtype = torch.Size(tensor_shape), dtype
        self._to_self: deque = deque()  # one stage with several chunks: messages to oneself
        self._recvs: Dict[Action, list] = {}  # receive action -> works to wait for before use
        self._sends: List[Tuple[Action, list, torch.Tensor]] = []  # in flight, with the tensor sent

    def exchange(self, batch: Sequence[Action],
                 outgoing: Dict[Action, torch.Tensor]) -> Dict[Action, torch.Tensor]:
        ops, actions, received = [], [], {}
        for a in batch:
            other = peer_rank(self.mesh, a, self.vp)
            if a.kind.startswith("send"):
                t = self._checked(a, outgoing[a]).detach().contiguous()
                if other == self.mesh.rank:
                    self._to_self.append(t.clone())
                    self._sends.append((a, [], t))
                else:
                    ops.append(dist.P2POp(dist.isend, t, other, self.mesh.group("pp")))
                    actions.append((a, t))
            elif other == self.mesh.rank:
                received[a] = self._to_self.popleft()
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.mesh.device)
                ops.append(dist.P2POp(dist.irecv, buf, other, self.mesh.group("pp")))
                actions.append((a, buf))
                received[a] = buf
        if ops:
            works = dist.batch_isend_irecv(ops)
            per_op = len(works) == len(ops)  # gloo: one per operation; NCCL: one for the batch
            for k, (a, t) in enumerate(actions):
                mine = [works[k]] if per_op else list(works)
                if a.kind.startswith("send"):
                    self._sends.append((a, mine, t))
                else:
                    self._recvs[a] = mine
        return received

    def _checked(self, a: Action, t: torch.Tensor) -> torch.Tensor:
        if t.shape != self.shape or t.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline stage {self.mesh.coord('pp')} {a}: tensor {tuple(t.shape)} {t.dtype} does not "
                f"match the configured p2p shape {tuple(self.shape)} {self.dtype} "
                "([seq (/tp with sequence parallel), micro batch, hidden] in the compute dtype)")
        return t

    def wait_received(self, action: Action) -> None:
        """Block until receive ``action`` has landed (a no-op if it has been waited for)."""
        for work in self._recvs.pop(action, ()):
            work.wait()

    def complete_sends(self) -> List[Action]:
        """Wait for every send in flight; returns their actions (their tensors are released)."""
        done = []
        for a, works, _ in self._sends:
            for work in works:
                work.wait()
            done.append(a)
        self._sends.clear()
        return done

    def close(self) -> List[Action]:
        """End of the schedule: every send completed (returned, as :meth:`complete_sends`), and no
        receive left unused."""
        if self._recvs:
            raise RuntimeError(f"pipeline stage {self.mesh.coord('pp')}: receives "
                               f"{sorted(map(str, self._recvs))} were posted but never used")
        return self.complete_sends()
