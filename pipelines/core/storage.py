"""Object storage for the stages: local folders and `s3://` (AWS or any S3-compatible endpoint).

The `Store` interface is `pipelines.core.store`; local folders are `pipelines.core.local_store`;
this module holds S3 and picks a store for a URI.
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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipelines.core.errors import ObjectTooLarge, StorageError, TransientStorageError
from pipelines.core.local_store import LocalStore
from pipelines.core.s3 import S3Settings, storage_error
from pipelines.core.s3_file import open_object
from pipelines.core.store import TMP_PREFIX, Entry, Store, check_size, is_hidden
from pipelines.core.uris import Location, join_key, parse_uri

__all__ = [
    "Entry", "LocalStore", "Location", "S3Settings", "S3Store", "Store",
    "join_key", "open_store", "parse_uri", "ray_storage", "storage_error",
]


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
                    and (hidden or not is_hidden(obj["Key"][strip:]))
                ]
                folders = [p["Prefix"][strip:] for p in page.get("CommonPrefixes", [])
                           if hidden or not is_hidden(p["Prefix"][strip:-1])]
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
                    check_size(self.child_uri(key), int(response["ContentLength"]), max_bytes)
                    return body.read()
            except Exception as exc:
                err = self.error(exc, key)
                if not isinstance(err, TransientStorageError) or attempt >= self.settings.max_attempts:
                    raise err from None
            time.sleep(random.uniform(0, min(20.0, 2.0 ** (attempt - 1))))
        raise AssertionError("itertools.count never ends")

    def open_input(self, key: str, *, seekable: bool = False) -> Any:
        if "" in self._key(key).split("/"):
            # pyarrow refuses an empty path component ("a//b.tar"), an ordinary key on S3: such a key
            # is read as a seekable file of ranged GETs, whose errors are already one-line.
            return open_object(self.client, self.bucket, self._key(key), lambda exc: self.error(exc, key))
        return super().open_input(key, seekable=seekable)

    def read_error(self, exc: BaseException, key: str) -> StorageError:
        # S3 answers a HEAD's 403 without a body, so pyarrow's opening HEAD reads an unknown key or a
        # wrong secret (the whole store) as this file's "access denied". A GET names the cause; it
        # stops at its headers (a byte cap of 0), so no body is read.
        err = self.error(exc, key)
        if type(err) is not StorageError:
            return err
        try:
            self.read(key, max_bytes=0)
        except ObjectTooLarge:
            pass  # readable now: the first error stands
        except StorageError as cause:
            return cause
        return err

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
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX)
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
