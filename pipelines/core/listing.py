"""A source's listing, in key order, listed by prefix in parallel on the Ray cluster.

One `list_objects_v2` stream costs a round trip per 1,000 keys: ImageNet-21k's 14 M
objects are some 14,000 calls in a row before the first decode. Here the source's
first level is listed with `Delimiter="/"` (its class folders, a page of 1,000 at a
time), and each folder is listed in a thread of a Ray actor (a few actors, eight
threads each; a streaming generator of the folder's pages). At most `width` folders are in flight; their pages are consumed
in folder order, so the entries come out exactly as one sequential listing would
give them (the shard plans and their fingerprints do not change), while the caller
holds only the pages in flight (each folder runs at most two pages ahead).

Local sources are listed in this process: another node cannot see the directory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from pipelines.core.errors import find_vitpipe_error
from pipelines.core.storage import Entry, S3Store, Store

# Pages a folder's listing may run ahead of the consumer.
_PAGES_AHEAD = 2
# Folders one lister actor lists at once (threads; boto3 clients are thread-safe).
_THREADS = 8


def source_entries(source: Store, *, width: int, page_size: int = 1000) -> Iterator[list[Entry]]:
    """Every object under `source` (hidden names skipped), in key order, a page at a time.

    S3 sources are listed folder by folder, `width` folders at once, by Ray actors (the
    caller must be connected to Ray); a root without folders is its first-level listing.
    """
    if not isinstance(source, S3Store):
        yield from source.list_entries(page_size=page_size)
        return
    import ray

    # A few processes, many threads: a LIST call mostly waits on the network, and a process per
    # folder in flight would cost Ray a worker start for each (seconds of CPU on a small node).
    actor = ray.remote(_Lister).options(
        num_cpus=0, max_concurrency=_THREADS, scheduling_strategy="SPREAD", max_restarts=0
    )
    listers = [actor.remote(source, page_size) for _ in range(-(-width // _THREADS))]
    queue: deque[Any] = deque()  # folders' page generators and first-level objects, in key order
    in_flight = 0
    try:
        for page in source.list_level(page_size):
            objects: list[Entry] = []
            for unit in page:
                if isinstance(unit, str):
                    if objects:
                        queue.append(objects)
                        objects = []
                    lister = listers[in_flight % len(listers)]
                    queue.append(lister.folder.options(_generator_backpressure_num_objects=_PAGES_AHEAD).remote(unit))
                    in_flight += 1
                else:
                    objects.append(unit)
            if objects:
                queue.append(objects)
            while in_flight >= width:
                unit = queue.popleft()
                in_flight -= not isinstance(unit, list)
                yield from _drain(unit)
        while queue:
            yield from _drain(queue.popleft())
    except Exception as exc:  # a folder's listing failed: its own one-line error, not Ray's traceback
        known = find_vitpipe_error(exc)
        if known is None:
            raise
        raise known from None
    finally:
        for lister in listers:  # also stops the folders nobody will read (the consumer stopped early)
            ray.kill(lister)


def _drain(unit: Any) -> Iterator[list[Entry]]:
    """The pages of one queued unit: a list of first-level objects, or a folder's generator."""
    import ray

    if isinstance(unit, list):
        yield unit
        return
    for ref in unit:
        yield ray.get(ref)


class _Lister:
    """Lists folders of one source in a Ray actor, `_THREADS` at once, with one boto3 client."""

    def __init__(self, source: S3Store, page_size: int) -> None:
        self.source = source
        self.page_size = page_size

    def folder(self, folder: str) -> Iterator[list[Entry]]:
        """A folder's pages (keys relative to the source)."""
        yield from self.source.list_entries(folder, self.page_size)
