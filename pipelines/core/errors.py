"""Errors a user can act on.

A `VitpipeError` carries the one line the user sees: the CLI prints it without
a traceback and exits non-zero. Its message names the thing at fault (a URI, a
config field) and the cause, e.g. ``s3://bucket/prefix: bucket does not exist``.
"""

from __future__ import annotations

import re

from pipelines.core.uris import scrub_userinfo


class VitpipeError(Exception):
    """An error whose message is the single line shown to the user."""

    def __init__(self, message: str) -> None:
        # Keep the message on one line whatever the cause text contained.
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return str(self.args[0])


class StorageError(VitpipeError):
    """Object storage (local or S3) could not be read or written."""


class TransientStorageError(StorageError):
    """A read or write kept failing, after retries, for a cause that may pass (throttling, a 5xx,
    a dropped connection, a timeout, expired credentials): the task fails and may be retried,
    the object is never recorded as bad."""


class StoreAccessError(StorageError):
    """The store refuses this client, whatever the object: no or unknown credentials, a wrong
    secret, no such bucket. A task fails on it; it is never recorded as one object's rejection."""


class ObjectTooLarge(StorageError):
    """An object is larger than the configured cap; it was not read."""


class IngestError(VitpipeError):
    """The ingest stage refused its input (too many rejected objects, a bad manifest)."""


class RunInUse(VitpipeError):
    """A run is being executed by another live vitpipe process (see `pipelines.core.run_owner`)."""


def find_vitpipe_error(exc: BaseException) -> VitpipeError | None:
    """The `VitpipeError` behind `exc`, looking through Ray's wrappers and exception chains.

    Ray re-raises a worker's exception wrapped (`RayTaskError`); the original sits
    in `.cause` or the `__cause__` chain. Ray Data's `UserCodeException` keeps
    neither, only the remote traceback text: as a last resort the error is rebuilt
    from its `pipelines.core.errors.<Class>: <message>` line there.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        cause = getattr(err, "cause", None)
        if isinstance(err, VitpipeError) and not isinstance(cause, BaseException):
            return err
        todo.extend([err.__context__, err.__cause__])
        if isinstance(cause, BaseException):
            todo.append(cause)
    found = _TRACEBACK_LINE.findall(str(exc))
    if found:
        name, message = found[-1]
        return error_class(name)(message)
    return None


def error_class(name: str) -> type[VitpipeError]:
    """The error class of this module named `name` (`VitpipeError` when none is): errors that
    travel from Ray workers as text or data come back as the class they left as."""
    return _CLASSES.get(name, VitpipeError)


_TRACEBACK_LINE = re.compile(r"^pipelines\.core\.errors\.(\w+): (.+)$", re.MULTILINE)
_CLASSES: dict[str, type[VitpipeError]] = {
    c.__name__: c for c in (VitpipeError, StorageError, TransientStorageError, StoreAccessError, ObjectTooLarge,
                             IngestError, RunInUse)
}


# Ray's wrapping exceptions: their own lines never name the cause.
_WRAPPERS = ("RayTaskError", "TrainingFailedError", "TuneError", "WorkerGroupError", "RayActorError", "ControllerError")


def error_line(error: object) -> str:
    """One line for an error from Ray (a failed trial, a training run, a task): the innermost `Type: message`
    of its traceback, not Ray's wrappers; a `VitpipeError` behind them is given as it is. No URL in it keeps
    its `user:password@`: the line is printed, logged and tagged on MLflow runs."""
    if error is None:
        return "unknown error"
    ours = find_vitpipe_error(error) if isinstance(error, BaseException) else None
    if ours is not None:
        return scrub_userinfo(f"{type(ours).__name__}: {ours}")
    text = scrub_userinfo(str(error))  # before the cut at 300 characters, which could part a password from its @
    found = re.findall(r"(?:^|\s)([A-Za-z_][\w.]*(?:Error|Exception)): (.+)", text)
    inner = [(kind, msg) for kind, msg in found if not kind.rsplit(".", 1)[-1].startswith(_WRAPPERS)]
    if inner:
        kind, message = inner[-1]
        return f"{kind.rsplit('.', 1)[-1]}: {' '.join(message.split())}"[:300]
    first = " ".join((text.strip().splitlines() or [""])[0].split())
    kind = type(error).__name__
    if isinstance(error, BaseException) and not kind.startswith(_WRAPPERS):  # raised here, not wrapped by Ray
        return f"{kind}: {first}"[:300] if first else kind
    return (first or kind)[:300]
