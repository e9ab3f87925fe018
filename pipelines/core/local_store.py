"""Local folders as a `Store`: sorted walks like an S3 listing, and writes renamed into place."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipelines.core.errors import StorageError
from pipelines.core.store import TMP_PREFIX, Entry, Store, check_size
from pipelines.core.uris import join_key

__all__ = ["LocalStore"]


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # cannot tell: listed as a file, whose read then names the cause
        return False


def _size_and_version(entry: os.DirEntry[str]) -> tuple[int, str]:
    """A listed file's size and version (its mtime). One that cannot be examined (a dangling symlink, a
    file removed since) is listed without a version, as S3 lists a key its GET then fails on: its read
    rejects it with its cause, and once readable its new version rereads it."""
    try:
        stat = entry.stat()
    except OSError:
        return 0, ""
    return stat.st_size, str(stat.st_mtime_ns)


class LocalStore(Store):
    """A local directory; writes go to a temporary name and are renamed into place."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.uri = root

    def listed_key(self, key: str) -> str:
        # A read joins the parts of `key`, so `./a.jpg` and `cat//a.jpg` reach `a.jpg` and `cat/a.jpg`.
        return "/".join(part for part in key.split("/") if part not in ("", "."))

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise StorageError(f"{self.child_uri(key)}: key escapes the storage root")
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def list_entries(self, prefix: str = "", page_size: int = 1000, *, hidden: bool = False) -> Iterator[list[Entry]]:
        page: list[Entry] = []
        start = self._path(prefix)
        if prefix and not os.path.isdir(start) and os.path.isdir(self.root):
            return  # like S3: an absent sub-prefix lists nothing
        for key, entry in self._walk(start, prefix, hidden, set()):
            page.append((key, *_size_and_version(entry)))
            if len(page) >= page_size:
                yield page
                page = []
        if page:
            yield page

    def _walk(self, directory: str, rel: str, hidden: bool, seen: set[str]) -> Iterator[tuple[str, os.DirEntry[str]]]:
        # Sort each directory by the key its entries produce ("a/..." after "a.txt"),
        # so the walk yields keys in the same order as an S3 listing.
        real = os.path.realpath(directory)
        if real in seen:  # a symlink loop
            return
        seen.add(real)
        try:  # a folder that cannot be read fails the listing in its own name: its files are unknown
            with os.scandir(directory) as it:
                entries = [(e.name + "/" if _is_dir(e) else e.name, e) for e in it if hidden or not e.name.startswith(".")]
        except OSError as exc:
            raise self.error(exc, rel) from None
        for sort_key, entry in sorted(entries, key=lambda t: t[0]):
            key = join_key(rel, entry.name)
            if sort_key.endswith("/"):
                yield from self._walk(entry.path, key, hidden, seen)
            else:
                yield key, entry

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                check_size(self.child_uri(key), os.fstat(f.fileno()).st_size, max_bytes)
                return f.read()
        except OSError as exc:
            raise self.error(exc, key) from None

    @contextmanager
    def atomic_path(self, key: str) -> Iterator[str]:
        path = self._path(key)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}-{name}")
        try:
            os.makedirs(directory, exist_ok=True)
            yield tmp
            os.replace(tmp, path)  # atomic on POSIX within one filesystem
        except OSError as exc:
            raise self.error(exc, key) from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self.error(exc, key) from None

    def check(self) -> None:
        if not os.path.isdir(self.root):
            raise StorageError(f"{self.root}: {'is not a directory' if os.path.exists(self.root) else 'does not exist'}")

    def arrow(self, key: str = "") -> tuple[Any, str]:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem(), self._path(key)
