"""The checkpoint errors; every other checkpoint module may import them (this one imports only the
shared base, :class:`megazero.errors.MegazeroError`)."""
from megazero.errors import EXIT_FAILURE, EXIT_USAGE, MegazeroError


class CheckpointError(MegazeroError, RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the path or parameter.
    Raised alike on every rank (the collectives of :mod:`megazero.checkpoint.comm` see to it).  One
    that cannot be *used* is a usage error, exit status 2, like an invalid flag (the trainer's and the
    engine's alike); a failed save is not (:class:`CheckpointSaveError`)."""

    exit_status = EXIT_USAGE


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is missing, truncated or altered (the message names it)."""


class CheckpointSaveError(CheckpointError):
    """Writing or publishing a checkpoint failed (a full disk, an I/O error, a non-finite model,
    another writer): the run fails, exit status 1.  A checkpoint that cannot be *used* (any other
    :class:`CheckpointError`: at load, or a ``--save`` directory refused at start-up) is a usage
    error, exit status 2."""

    exit_status = EXIT_FAILURE
