"""Orbax's and tensorstore's noise around a failed save, kept out of a run's output.

When an orbax save fails (a full disk, a killed writer), its writer threads still in
flight fail too and each logs its traceback, and tensorstore's writes call back into the
event loop the save has closed, which Python prints as ignored exceptions: hundreds of
lines around the one error the caller gets from the save itself. ``store.Store`` drops
exactly those, and nothing else (each function below says which records).

Example:
    >>> import logging
    >>> with errors_raised_not_logged():
    ...     logging.getLogger("absl").error("a writer failed")  # dropped: raised instead
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading


@contextlib.contextmanager
def errors_raised_not_logged():
    """Orbax's writer threads log each failure with its traceback (hundreds of lines on
    a full disk) before the save raises it; the caller gets it once, as the raise."""

    def below_error(record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR

    logger = logging.getLogger("absl")
    logger.addFilter(below_error)
    try:
        yield
    finally:
        logger.removeFilter(below_error)


def join_writers(timeout: float = 60.0) -> None:
    """Waits for orbax's writer threads: after a failed save some still write into its
    unfinished folder (orbax's own ``close`` does not wait for them). Their ``join``
    raises what failed them: the save has raised it already."""
    for thread in threading.enumerate():
        orbax = type(thread).__module__.startswith("orbax.")
        if orbax and thread is not threading.current_thread():
            with contextlib.suppress(Exception):
                thread.join(timeout)


def quiet_failed_writers() -> None:
    """Drops, from here on, what a failed save's writers print after it has raised.

    After an orbax save fails, its writer threads still in flight fail too and log
    each failure with its traceback, and tensorstore's writes call back into the event
    loop the save has closed, which Python prints as ignored exceptions: dozens of
    lines around the one error the caller gets. Only those two are dropped (the absl
    records of orbax's failed writer threads, and ``RuntimeError("Event loop is
    closed")`` in ``sys.unraisablehook``); everything else is printed as before."""
    quiet_closed_loops()
    if not getattr(quiet_failed_writers, "done", False):
        logging.getLogger("absl").addFilter(_not_a_failed_writer)
        quiet_failed_writers.done = True


def _not_a_failed_writer(record: logging.LogRecord) -> bool:
    return "_SignalingThread.run() raised an exception" not in str(record.msg)


def _closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def quiet_closed_loops() -> None:
    """Drops ``RuntimeError("Event loop is closed")`` from the hooks Python prints
    uncaught errors of callbacks with (``sys.unraisablehook``, ``sys.excepthook``):
    tensorstore's writes still in flight when an orbax save fails raise it from their
    own threads (installed once, at a checkpointer's first save; every other error is
    printed as before)."""
    if getattr(sys.unraisablehook, "quiet_closed_loops", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def on_unraisable(info) -> None:
        if not _closed_loop(info.exc_value):
            unraisable(info)

    def on_uncaught(kind, value, trace) -> None:
        if not _closed_loop(value):
            excepthook(kind, value, trace)

    on_unraisable.quiet_closed_loops = True
    sys.unraisablehook, sys.excepthook = on_unraisable, on_uncaught
