"""Process plumbing below every subsystem: forked gloo ranks for tests and CPU benchmarks
(:mod:`.local_ranks`), threads per rank (:mod:`.threads`), one run per path (:mod:`.run_lock`) and
the collectives under their current torch names (:mod:`.distributed`).  Imports only
:mod:`megazero.errors`."""
