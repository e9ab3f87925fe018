"""Stopping a vitpipe process: a SIGTERM or Ctrl-C ends its runs KILLED, resumable, and says so.

A scheduler stops a driver with SIGTERM (`ray job stop`, a Kubernetes pod's
deletion, a preempted node); a person with Ctrl-C. Either reaches vitpipe as an
exception unwinding the stage:

- SIGTERM raises `Stopped` in the main thread (vitpipe's handler; `ray.init`
  installs Ray's `sys.exit(15)` over it, so `pipelines.core.cluster.connect`
  installs it again). Inside `ray.get`, Ray turns it into a SystemExit(1), so
  the handler also records the signal;
- Ctrl-C raises KeyboardInterrupt, except during Ray Train's `fit`, whose own
  handler aborts the training run and then calls `sys.exit(0)`. Ray leaves that
  handler installed after `fit` (holding the run's controller actor alive, and
  swallowing the next two Ctrl-Cs); Tune's `fit` stops a sweep on Ctrl-C or
  SIGUSR1 and leaves its handler too, so `signal_handlers_restored` puts the old
  ones back around both.

A run that such an exception leaves ends KILLED (`pipelines.core.stage_run`),
and the same command resumes it. The CLI reports the stop in one line and exits
with 128 + the signal's number, as a shell does for a process a signal ended.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Stopped(SystemExit):
    """The process was asked to stop by `signum`; its exit status is 128 + `signum`."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum)


_received: signal.Signals | None = None  # the stop signal this process got, if any


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = signal.Signals(signum)
    raise Stopped(signum)


def handle_sigterm() -> None:
    """Make SIGTERM raise `Stopped` in the main thread (a no-op elsewhere: only it may set handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_stopped)


# Ray Train's `fit` and Ray Tune's `Tuner.fit` install these and leave them installed when they return.
_RAY_SET = tuple(getattr(signal, name) for name in ("SIGINT", "SIGUSR1") if hasattr(signal, name))


@contextlib.contextmanager
def signal_handlers_restored() -> Iterator[None]:
    """Put back the SIGINT and SIGUSR1 handlers the block started with (main thread only: only it may set them).

    Ray Train's `fit` leaves a Ctrl-C handler that closes over its controller actor: the controller (and its
    dataset actors) would live on until the next `fit`, and Ctrl-C during a later stage would abort that
    finished run instead of stopping the process. Ray Tune's leaves one that would swallow the next Ctrl-C
    (and every SIGUSR1) to stop a sweep that has already ended.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in _RAY_SET}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def is_stop(err: BaseException | None) -> bool:
    """True when `err` is a request to stop the process rather than a failure of the work."""
    return isinstance(err, (KeyboardInterrupt, SystemExit))


def stop_signal(err: BaseException) -> signal.Signals:
    """The signal behind a stop (`is_stop(err)`)."""
    if isinstance(err, Stopped):
        return err.signal
    if _received is not None:  # `Stopped` raised inside `ray.get` comes out as Ray's own SystemExit(1)
        return _received
    return signal.SIGINT  # KeyboardInterrupt, or Ray Train's Ctrl-C handler (sys.exit(0) once it aborted the run)


__all__ = ["Stopped", "handle_sigterm", "is_stop", "signal_handlers_restored", "stop_signal"]
