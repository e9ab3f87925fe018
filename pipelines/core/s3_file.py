"""One S3 object as a seekable, buffered binary file, read with ranged GETs through boto3.

For the keys pyarrow's S3 filesystem refuses ("Empty path component"): `a//b.tar`, or `/b.tar`
under a prefix (the object `prefix//b.tar`). They are ordinary keys on S3, and a WebDataset tar
or a Parquet table stored under one is read here instead, as a stream or with seeks.

Not smart_open's reader (Ray brings it): its reads raise botocore's and urllib3's errors as they are, where
the store's one-line errors are wanted, and it does not hold a read to one version of the object.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from pipelines.core.errors import StorageError

# Bytes one GET asks for when a reader reads less: a tar is read in 10 KiB records.
CHUNK_BYTES = 8 << 20


class _RangedObject(io.RawIOBase):
    """The raw file: each `readinto` is one ranged GET; errors are the store's one-line errors."""

    def __init__(self, client: Any, bucket: str, key: str, error: Callable[[BaseException], StorageError]) -> None:
        super().__init__()
        self._client, self._bucket, self._key, self._error = client, bucket, key, error
        self._position = 0
        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:  # botocore raises several unrelated types
            raise error(exc) from None
        self._size = int(head["ContentLength"])
        self._etag = head.get("ETag", "")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._size - self._position)
        if count <= 0:
            return 0
        end = self._position + count - 1
        try:
            # IfMatch: an object replaced while it is read fails the read instead of mixing two versions.
            response = self._client.get_object(Bucket=self._bucket, Key=self._key, IfMatch=self._etag,
                                               Range=f"bytes={self._position}-{end}")
            with response["Body"] as body:
                data = body.read()
        except Exception as exc:
            raise self._error(exc) from None
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def open_object(client: Any, bucket: str, key: str, error: Callable[[BaseException], StorageError]) -> io.BufferedReader:
    """Object `key` of `bucket` as a buffered binary file (`read`, `seek`, `tell`), GETs of `CHUNK_BYTES` or more.

    Raises `error(exc)` (a `StorageError`) when the object cannot be examined or a read fails."""
    return io.BufferedReader(_RangedObject(client, bucket, key, error), buffer_size=CHUNK_BYTES)
