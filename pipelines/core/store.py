"""The `Store` interface the stages read and write through, and what its implementations share.

A `Store` is a root URI plus the few operations the stages need, addressed by keys relative to that
root: paginated sorted listing, whole-object reads, streamed reads, atomic writes, deletes, and a
pyarrow filesystem for Parquet readers. A read raises `TransientStorageError` when its cause may pass,
`StoreAccessError` when the store refuses this process whatever the object (credentials, bucket), and
a plain `StorageError` when the object itself is missing or forbidden.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipelines.core.errors import ObjectTooLarge, StorageError
from pipelines.core.s3 import storage_error

__all__ = ["TMP_PREFIX", "Entry", "Store", "check_size", "is_hidden"]

TMP_PREFIX = ".tmp-vitpipe-"

Entry = tuple[str, int, str]  # a listed object: key, size in bytes, version (ETag or mtime)


class Store:
    """A storage root; keys are relative to it and use "/" separators."""

    uri: str

    def list_pages(self, prefix: str = "", page_size: int = 1000, *, hidden: bool = False) -> Iterator[list[str]]:
        """Keys under `prefix` in lexicographic order, a page at a time.

        Names starting with "." (editor files, our own temporary files) are skipped unless `hidden`.
        """
        for page in self.list_entries(prefix, page_size, hidden=hidden):
            yield [key for key, _, _ in page]

    def list_entries(self, prefix: str = "", page_size: int = 1000, *, hidden: bool = False) -> Iterator[list[Entry]]:
        """Like `list_pages`, with each key's size and version (S3: the ETag; local: mtime in ns):
        what tells a reread object from a replaced one, at no cost beyond the listing."""
        raise NotImplementedError

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes. Raises `ObjectTooLarge` (before reading the body) over `max_bytes`, and
        otherwise the errors of the module docstring."""
        raise NotImplementedError

    def write(self, key: str, data: bytes) -> None:
        """Write an object atomically: readers see the old object, the new one, or nothing."""
        with self.atomic_path(key) as path, open(path, "wb") as f:
            f.write(data)

    @contextmanager
    def atomic_path(self, key: str) -> Iterator[str]:
        """A local file path to write; when the block ends without error it becomes `key` atomically."""
        raise NotImplementedError
        yield ""

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise a one-line `StorageError` when the root cannot be reached (missing bucket, bad credentials)."""
        raise NotImplementedError

    def arrow(self, key: str = "") -> tuple[Any, str]:
        """`(pyarrow filesystem, path)` for `key`, for Parquet readers."""
        raise NotImplementedError

    def child_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}" if key else self.uri

    def listed_key(self, key: str) -> str:
        """The key under which the listing holds the object a read of `key` reaches (S3: `key` itself;
        `a//b` is another object than `a/b` there)."""
        return key

    def error(self, exc: BaseException, key: str = "") -> StorageError:
        return storage_error(self.child_uri(key), exc, getattr(self, "settings", None))

    def open_input(self, key: str, *, seekable: bool = False) -> Any:
        """A byte stream of `key` (one GET on S3), or a seekable file of it. Its errors are the raw
        ones of the filesystem: `read_error` makes them this store's one-line `StorageError`."""
        fs, path = self.arrow(key)
        return fs.open_input_file(path) if seekable else fs.open_input_stream(path)

    def read_error(self, exc: BaseException, key: str) -> StorageError:
        """The one-line error of a failed read of `key`, with the cause the store names for it."""
        return self.error(exc, key)


def is_hidden(key: str) -> bool:
    """Whether a part of `key` starts with "." (editor files, our own temporary files)."""
    return any(part.startswith(".") for part in key.split("/"))


def check_size(uri: str, size: int, max_bytes: int | None) -> None:
    """Raise `ObjectTooLarge` when `size` is over `max_bytes` (no cap when None)."""
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLarge(f"{uri}: too large ({size} bytes > max_object_bytes {max_bytes})")
