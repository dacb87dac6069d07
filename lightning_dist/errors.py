"""lightning-dist's own exception classes, and which failures a restart of the job would only repeat.

The bottom layer: nothing here imports the rest of the package, so a strategy can raise these and the launcher
(:mod:`lightning_dist.run.launch`) can classify a rank's failure with them. Whether a failed job is started again
(``resilience.max_restarts``) is decided by the failing exception's *class* (:func:`restart_would_repeat`), never by
the text of its message.
"""

from __future__ import annotations

#: A job's exit code after it stopped for a signal and saved (EX_TEMPFAIL, "try again": a wrapper may requeue it).
#: Here rather than beside :class:`~lightning_dist.callbacks.preemption.Preemption`, so the launcher that returns it
#: does not import the callback's torch and Lightning.
PREEMPTED_EXIT_CODE = 75

#: Exception classes outside :class:`LightningDistError` whose failure a restart would only repeat: a bad value
#: found on a rank (a config value, a data path, a model that cannot be split) is just as bad on the next start.
REPEATING: tuple[type[BaseException], ...] = (ValueError,)


class LightningDistError(Exception):
    """Base class of lightning-dist's own errors."""

    #: Whether starting the job again from its newest checkpoint would only fail the same way.
    restart_would_repeat: bool = False


#: What a step whose gradient norm is NaN / Inf does (``resilience.on_nonfinite``): end the run, or drop the update
#: and train on (:mod:`lightning_dist.parallel.guard`).
NONFINITE_ACTIONS = ("stop", "skip")


class NonFiniteError(LightningDistError, RuntimeError):
    """A step's loss or gradient norm was NaN or Inf (``resilience.on_nonfinite=stop``).

    Restarting repeats it: the newest checkpoint precedes the step, and the same data and seed lead back to it.
    """

    restart_would_repeat = True


def restart_would_repeat(exc_type: type[BaseException]) -> bool:
    """Whether a rank that failed with an exception of class ``exc_type`` would fail the same way after a restart.

    A :class:`LightningDistError` says so itself (``restart_would_repeat``); otherwise the classes in
    :data:`REPEATING` (``ValueError`` and its subclasses) repeat, and anything else (a lost peer, an I/O error, a
    crash) may be transient, so it is restarted.
    """
    if issubclass(exc_type, LightningDistError):
        return exc_type.restart_would_repeat
    return issubclass(exc_type, REPEATING)


def first_line(err: BaseException) -> str:
    """The first non-empty line of ``err``'s message (``strerror`` for an ``OSError`` that has one), or its class's
    name when it has no message: what an error line may quote of an exception it did not make."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
