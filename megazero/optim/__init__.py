"""What every optimizer path shares, below ZeRO and the engine: the compute dtype and loss scaler
(:mod:`.precision`) and the global gradient norm and clipping over TP x PP x DP (:mod:`.clip`).
Tensor parallelism reads the compute dtype from here, so these sit under :mod:`megazero.zero`
rather than inside it."""
