"""Object storage for the stages: local folders and `s3://` (AWS or any S3-compatible endpoint).

A `Store` is a root URI plus the few operations the stages need, addressed by
keys relative to that root: paginated sorted listing, whole-object reads,
atomic writes, deletes, and a pyarrow filesystem for Parquet readers.
Endpoints and retries are `pipelines.core.s3.S3Settings` (re-exported here); credentials
come from each process's own AWS chain. A read raises `TransientStorageError` when its
cause may pass, `StoreAccessError` when the store refuses this process whatever the object
(credentials, bucket), and a plain `StorageError` when the object itself is missing or forbidden.
"""

from __future__ import annotations

import itertools
import os
import random
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipelines.core.errors import ObjectTooLarge, StorageError, TransientStorageError
from pipelines.core.s3 import S3Settings, storage_error
from pipelines.core.s3_file import open_object
from pipelines.core.uris import Location, join_key, parse_uri

__all__ = [
    "Entry", "LocalStore", "Location", "S3Settings", "S3Store", "Store",
    "join_key", "open_store", "parse_uri", "ray_storage", "storage_error",
]

_TMP_PREFIX = ".tmp-vitpipe-"

Entry = tuple[str, int, str]  # a listed object: key, size in bytes, version (ETag or mtime)


# ---------------------------------------------------------------- stores


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


def _is_hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


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
                _check_size(self.child_uri(key), os.fstat(f.fileno()).st_size, max_bytes)
                return f.read()
        except OSError as exc:
            raise self.error(exc, key) from None

    @contextmanager
    def atomic_path(self, key: str) -> Iterator[str]:
        path = self._path(key)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f"{_TMP_PREFIX}{uuid.uuid4().hex}-{name}")
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


class S3Store(Store):
    """A bucket and key prefix on AWS S3 or an S3-compatible endpoint."""

    def __init__(self, location: Location, settings: S3Settings) -> None:
        self.bucket = location.bucket
        self.prefix = location.path
        self.uri = location.uri
        self.settings = settings
        self._client: Any = None
        self._filesystem: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = state["_filesystem"] = None  # clients do not pickle; each process makes its own
        return state

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self.settings.boto3_client("s3")
        return self._client

    def _key(self, key: str) -> str:
        # Only joined, never normalised: `p//a.jpg` lists as `/a.jpg`, and `p/a.jpg` is another object.
        return f"{self.prefix}/{key}" if self.prefix and key else self.prefix or key

    def list_entries(self, prefix: str = "", page_size: int = 1000, *, hidden: bool = False) -> Iterator[list[Entry]]:
        if prefix.endswith("/"):  # a folder a delimiter listing named ("a/", even "/"): listed as is
            base = f"{self.prefix}/{prefix}" if self.prefix else prefix
        else:
            base = f"{self._key(prefix)}/" if self._key(prefix) else ""
        for entries, _ in self._pages(base, page_size, hidden, delimiter=False):
            if entries:
                yield entries

    def list_level(self, page_size: int = 1000, *, hidden: bool = False) -> Iterator[list[Entry | str]]:
        """The root's first level in key order, a page at a time: its objects as entries, and its
        folders as relative prefixes ending in "/" (one `Delimiter="/"` listing; nothing deeper)."""
        for entries, folders in self._pages(f"{self.prefix}/" if self.prefix else "", page_size, hidden, delimiter=True):
            # One page holds a stretch of the key order; its objects and folders interleave within it.
            units: list[Entry | str] = sorted([*entries, *folders], key=lambda u: u if isinstance(u, str) else u[0])
            if units:
                yield units

    def _pages(
        self, prefix: str, page_size: int, hidden: bool, *, delimiter: bool
    ) -> Iterator[tuple[list[Entry], list[str]]]:
        """Each LIST call's objects (folder markers: the root's own and empty `.../` objects, and, unless
        `hidden`, hidden names skipped) and folders. A `.../` object with bytes is listed: an input."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        extra = {"Delimiter": "/"} if delimiter else {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}, **extra
            )
            for page in pages:
                entries = [
                    (obj["Key"][strip:], int(obj.get("Size", 0)), str(obj.get("ETag", "")))
                    for obj in page.get("Contents", [])
                    if obj["Key"][strip:] and not (obj["Key"].endswith("/") and not obj.get("Size"))
                    and (hidden or not _is_hidden(obj["Key"][strip:]))
                ]
                folders = [p["Prefix"][strip:] for p in page.get("CommonPrefixes", [])
                           if hidden or not _is_hidden(p["Prefix"][strip:-1])]
                yield entries, folders
        except Exception as exc:  # botocore raises several unrelated types
            raise self.error(exc, prefix[strip:]) from None

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        # botocore retries a request until its response headers arrive; a body cut off after
        # that is fetched again here, within the same attempt budget and with a jittered backoff.
        for attempt in itertools.count(1):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            except Exception as exc:  # botocore has already retried what it could
                raise self.error(exc, key) from None
            try:
                with response["Body"] as body:
                    _check_size(self.child_uri(key), int(response["ContentLength"]), max_bytes)
                    return body.read()
            except Exception as exc:
                err = self.error(exc, key)
                if not isinstance(err, TransientStorageError) or attempt >= self.settings.max_attempts:
                    raise err from None
            time.sleep(random.uniform(0, min(20.0, 2.0 ** (attempt - 1))))
        raise AssertionError("itertools.count never ends")

    def open_input(self, key: str) -> Any:
        """The object as a seekable, buffered binary file read with ranged GETs: for the keys pyarrow
        refuses (`a//b`); errors are this store's one-line `StorageError`s."""
        return open_object(self.client, self.bucket, self._key(key), lambda exc: self.error(exc, key))

    def write(self, key: str, data: bytes) -> None:
        # A PUT is atomic: the object appears whole or not at all.
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:
            raise self.error(exc, key) from None

    @contextmanager
    def atomic_path(self, key: str) -> Iterator[str]:
        # Staged in a local file, then uploaded: a single PUT, or a multipart upload that
        # only becomes visible when it completes.
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX)
        os.close(fd)
        try:
            yield tmp
            self.client.upload_file(tmp, self.bucket, self._key(key))
        except Exception as exc:
            raise self.error(exc, key) from None
        finally:
            os.unlink(tmp)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self.error(exc, key) from None
        except Exception as exc:
            raise self.error(exc, key) from None

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            raise self.error(exc, key) from None

    def check(self) -> None:
        try:
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except Exception as exc:
            raise self.error(exc) from None

    def arrow(self, key: str = "") -> tuple[Any, str]:
        # One filesystem per store: each new one sets up its own AWS client (~10 ms), once per shard in a loop.
        if self._filesystem is None:
            self._filesystem = self.settings.arrow_filesystem()
        return self._filesystem, f"{self.bucket}/{self._key(key)}"


def _check_size(uri: str, size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLarge(f"{uri}: too large ({size} bytes > max_object_bytes {max_bytes})")


def open_store(uri: str, settings: S3Settings | None = None, *, endpoint_url: str | None = None) -> Store:
    """The `Store` for `uri`; S3 settings are resolved from the environment unless given."""
    location = parse_uri(uri)
    if location.scheme == "file":
        return LocalStore(location.path)
    return S3Store(location, settings or S3Settings.resolve(endpoint_url))


def ray_storage(uri: str, *, endpoint_url: str | None = None) -> tuple[str, Any]:
    """`(storage_path, storage_filesystem)` for Ray Train's `RunConfig`.

    Local: `(absolute path, None)`. S3: `("bucket/prefix", S3FileSystem)`.
    """
    location = parse_uri(uri)
    if location.scheme == "file":
        return location.path, None
    settings = S3Settings.resolve(endpoint_url)
    return join_key(location.bucket, location.path), settings.arrow_filesystem()
