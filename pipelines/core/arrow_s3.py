"""A pyarrow S3 filesystem whose retry strategy survives pickling (into Ray tasks and Ray Train's storage)."""

from __future__ import annotations

from typing import Any

import pyarrow.fs as pafs


class RetryingS3FileSystem(pafs.S3FileSystem):
    """`pyarrow.fs.S3FileSystem` retrying up to `max_attempts` times, here and in every process it is pickled to.

    pyarrow pickles an S3 filesystem without its retry strategy, so each copy a Ray worker received
    fell back to pyarrow's default of 3 attempts, whatever `AWS_MAX_ATTEMPTS` said. This one is
    rebuilt from its arguments, which hold no credentials: each process resolves its own.
    """

    def __init__(self, max_attempts: int, **kwargs: Any) -> None:
        super().__init__(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts), **kwargs)
        self._arguments = (max_attempts, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, self._arguments


def _rebuild(max_attempts: int, kwargs: dict[str, Any]) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(max_attempts, **kwargs)


__all__ = ["RetryingS3FileSystem"]
