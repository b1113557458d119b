"""Context parallelism: the sequence split over a group of ranks (docs/context_parallel.md).

- :mod:`.split`: the load-balanced causal split (2N chunks, rank i holds chunks i and 2N-1-i) and
  the global positions of each rank's tokens;
- :mod:`.blockwise`: a memory-efficient attention kernel returning the output and the log-sum-exp,
  masked by global positions;
- :mod:`.ring_attention`: ring attention (``comm_type="p2p"``) and the dispatch to
  :mod:`.ulysses` (``"a2a"``);
- :mod:`.loss`: the per-token loss gathered over the CP group (the global token mean), with the
  gradient scaling that the dp x cp gradient average needs.
"""
from megazero.context_parallel.blockwise import blockwise_attention
from megazero.context_parallel.loss import gather_cp_loss
from megazero.context_parallel.ring_attention import CP_COMM_TYPES, check_comm_type, ring_attention
from megazero.context_parallel.split import (check_cp_seq_length, cp_chunk_bounds, cp_positions,
                                             gather_from_cp, split_for_cp)

__all__ = ["CP_COMM_TYPES", "blockwise_attention", "check_comm_type", "check_cp_seq_length",
           "cp_chunk_bounds", "cp_positions", "gather_cp_loss", "gather_from_cp", "ring_attention",
           "split_for_cp"]
