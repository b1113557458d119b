"""The base class of the errors megazero expects, each carrying how it ends a run.

The subsystems derive their errors from :class:`MegazeroError` (``CheckpointError``,
``LossScaleError``, the resilience errors), so :mod:`megazero.resilience.errors` reports any of
them from its ``kind`` alone, without importing the subsystem that raised it.  :class:`ConfigError`
is defined here (and re-exported by :mod:`megazero.config`) because the data and planning code
raise it too, and the config imports them.  This module imports nothing.

Kinds:

* ``"config"``: an invalid setting, raised alike on every rank; global rank 0 prints it and the
  exit status is :data:`EXIT_USAGE` (2);
* ``"everywhere"``: raised alike on every rank (a checkpoint problem, a diverged run); global rank
  0 prints it, the exit status is :data:`EXIT_FAILURE` (1);
* ``"local"``: seen by one rank only (a collective that timed out, bad data in this rank's batch);
  that rank prints it, prefixed with its rank.

Any other exception is a bug and keeps its traceback.

The exit statuses themselves (:data:`EXIT_OK`, :data:`EXIT_FAILURE`, :data:`EXIT_USAGE`) live here
too, the one source for every program, and so does the rule that maps an error to its status
(:func:`exit_status_of`); the shell launchers restate them in comments only.
"""

CONFIG = "config"
EVERYWHERE = "everywhere"
LOCAL = "local"

# The exit statuses of every megazero program (pretrain_gpt.py, the launcher, the tools and benchmarks):
EXIT_OK = 0  #: done, or stopped cleanly (a signal, a time or iteration limit)
EXIT_FAILURE = 1  #: the run failed (divergence, a collective that timed out, a save that failed, a bug)
EXIT_USAGE = 2  #: an invalid flag or setting, or a checkpoint that cannot be used (argparse's status too)


class MegazeroError(Exception):
    """An expected failure that ends the run with one message and no traceback; ``kind`` (a class
    attribute) says which rank reports it, and with it the exit status (:func:`exit_status_of`) unless
    ``exit_status`` names another."""

    kind = EVERYWHERE
    exit_status = None  # None: EXIT_USAGE for a "config" error, EXIT_FAILURE for the others


class ConfigError(MegazeroError, ValueError):
    """An inconsistent or invalid setting; the message names the flag and how to fix it."""

    kind = CONFIG


def exit_status_of(err: BaseException) -> int:
    """The exit status ``err`` ends a program with, for every front end (the trainer, the engine, the
    tools): the error's own ``exit_status``, else :data:`EXIT_USAGE` for a configuration error and
    :data:`EXIT_FAILURE` for any other error, a bug included."""
    status = getattr(err, "exit_status", None) if isinstance(err, MegazeroError) else None
    if status is not None:
        return int(status)
    return EXIT_USAGE if isinstance(err, MegazeroError) and err.kind == CONFIG else EXIT_FAILURE
