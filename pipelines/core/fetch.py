"""Reading a shard's objects: a bounded window of parallel reads, and what counts as a rejection.

Only a property of the object rejects it: missing, forbidden, larger than the cap, a local
file name that is not UTF-8 (and, in the decoders, empty or undecodable bytes). A read that
kept failing for a cause that may pass (throttling, a reset, a 5xx, a timeout, expired
credentials) raises `TransientStorageError` after botocore's retries: the shard task fails,
Ray runs it again, and no object is lost as "unreadable".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pipelines.core.errors import StorageError, StoreAccessError, TransientStorageError
from pipelines.core.storage import S3Store, Store


def fetch_planned(
    plan: dict[str, Any], source: Store, rejected: list[dict[str, str]], *, io_threads: int, max_bytes: int | None
) -> Iterator[tuple[int, bytes]]:
    """`(position in plan, bytes)` of the plan's objects, in plan order, read a few at a time.

    At most `io_threads` objects are held at once: the one the caller is working on (it must
    drop it before asking for the next) and the reads in flight. Objects the planner refused
    and objects rejected on reading (missing, forbidden, over `max_bytes`, an undecodable file
    name) are appended to `rejected` with their reason instead. A read that kept failing for a cause that may pass raises
    `TransientStorageError`: the shard fails, it does not lose the object.
    """
    todo = iter([i for i, reason in enumerate(plan["reasons"]) if not reason])
    rejected.extend({"key": plan["keys"][i], "reason": r} for i, r in enumerate(plan["reasons"]) if r)
    # Remote reads wait on the network, so keep several in flight; local reads need only run ahead.
    threads = io_threads if isinstance(source, S3Store) else min(2, io_threads)
    window: deque[tuple[int, Future[bytes | str]]] = deque()
    with ThreadPoolExecutor(threads) as pool:
        while True:
            while len(window) < threads and (i := next(todo, None)) is not None:
                window.append((i, pool.submit(fetch, source, plan["keys"][i], max_bytes)))
            if not window:
                return
            i, future = window.popleft()
            data = future.result()
            if isinstance(data, str):
                rejected.append({"key": printable(plan["keys"][i]), "reason": data})
                continue
            yield i, data
            del data  # before the next read starts, so the bound holds


def fetch(source: Store, key: str, max_bytes: int | None = None) -> bytes | str:
    """An object's bytes, or the reason it is rejected (missing, forbidden, too large, a file name
    that is not UTF-8). Raises `TransientStorageError` when the read kept failing for a cause that
    may pass, and `StoreAccessError` when the store refuses this worker whatever the object
    (credentials, bucket): neither is a property of the object."""
    if printable(key) != key:
        return "file name is not valid UTF-8"
    try:
        return source.read(key, max_bytes)
    except (TransientStorageError, StoreAccessError):
        raise
    except StorageError as exc:
        return exc.message.removeprefix(f"{source.child_uri(key)}: ")


def printable(key: str) -> str:
    """`key` as text: bytes of a local file name that are not UTF-8 shown as `\\xNN`."""
    return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# Rejections that say nothing of the object's content, which a rerun may read once they are mended:
# "unreadable" (what versions before transient errors were retried recorded), a refused permission.
_MAY_READ_LATER = ("unreadable", "access denied", "permission denied")


def reusable(summary: dict[str, Any]) -> bool:
    """Whether a shard written earlier may be kept: not when it rejected an object the object's
    version does not account for (a permission since granted does not change its version tag)."""
    return not any(r["reason"].startswith(_MAY_READ_LATER) for r in summary["rejected"])
