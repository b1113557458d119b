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
from typing import Dict, Sequence, Tuple

import torch
import torch.distributed as dist

from megazero.pipeline.schedules import Action, peer


def p2p_tensor_shape(cfg) -> Tuple[int, int, int]:
    """Shape of the tensor sent between stages, from a validated config."""
    seq = cfg.model.seq_length
    if cfg.parallel.sequence_parallel:
        seq //= cfg.parallel.tensor_model_parallel_size
    return (seq, cfg.training.micro_batch_size, cfg.model.hidden_size)



def peer_rank(mesh, action: Action, vp: int = 1) -> int:
    """Global rank at the other end of a communication action of this rank."""
    stage, _ = peer(action, mesh.pp_rank, mesh.pp_size, vp)
    return mesh.pp_ranks[stage]


class StageComm:
    """Posts the batched sends and receives of one pipeline rank.

    ``exchange(batch, outgoing)`` sends ``outgoing[action]`` for every ``send_*`` action of the
    batch, receives a fresh tensor for every ``recv_*`` action, waits for all of them, and
    returns ``{recv action: tensor}``.

    When it returns every send has completed (its handle was waited on; a message to oneself
    is a copy) and no reference to the sent tensors is kept, so the caller may free or
    overwrite their storage (the executor deallocates sent outputs).  On NCCL "completed"
    means ordered before later work on the current stream, which is what the caching
    allocator needs before reusing the memory.
    """

    def __init__(self, mesh, tensor_shape: Sequence[int], dtype: torch.dtype, vp: int = 1):
        self.mesh, self.vp = mesh, vp
        self.shape, self.dtype = torch.Size(tensor_shape), dtype
        self._to_self: deque = deque()  # one stage with several chunks: messages to oneself

    def exchange(self, batch: Sequence[Action],
                 outgoing: Dict[Action, torch.Tensor]) -> Dict[Action, torch.Tensor]:
        ops, received = [], {}
        mesh = self.mesh
        for a in batch:
            other = peer_rank(mesh, a, self.vp)
            if a.kind.startswith("send"):
                t = outgoing[a]
                if t.shape != self.shape or t.dtype != self.dtype:
                    raise RuntimeError(
                        f"pipeline stage {mesh.pp_rank} {a}: tensor {tuple(t.shape)} {t.dtype} does not "
                        f"match the configured p2p shape {tuple(self.shape)} {self.dtype} "
                        "([seq (/tp with sequence parallel), micro batch, hidden] in the compute dtype)")
                t = t.detach().contiguous()
                if other == mesh.rank:
                    self._to_self.append(t.clone())
                else:
                    ops.append(dist.P2POp(dist.isend, t, other, mesh.pp_group))
            elif other == mesh.rank:
                received[a] = self._to_self.popleft()
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=mesh.device)
                ops.append(dist.P2POp(dist.irecv, buf, other, mesh.pp_group))
                received[a] = buf
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # before returning: the caller may free what was sent
            ops.clear()
        return received
