"""S3 settings: endpoint, region and credentials from the standard AWS chain; one-line errors.

Credentials are resolved once by `S3Settings.resolve` on the driver (environment,
shared profile, instance role) and travel to Ray workers inside the pickled
settings; they are never part of a repr, a written config or an error message.
The endpoint (MinIO, a local test server) comes from the caller or
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pipelines.core.errors import StorageError
from pipelines.core.uris import strip_userinfo

DEFAULT_REGION = "us-east-1"


class Credentials:
    """AWS credentials resolved on the driver; the repr never shows the secret parts."""

    __slots__ = ("access_key", "secret_key", "token")

    def __init__(self, access_key: str, secret_key: str, token: str | None = None) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self.token = token

    def __repr__(self) -> str:
        return f"Credentials(access_key={self.access_key[:4]}…, secret_key=***)"

    def __getstate__(self) -> tuple[str, str, str | None]:
        return self.access_key, self.secret_key, self.token

    def __setstate__(self, state: tuple[str, str, str | None]) -> None:
        self.access_key, self.secret_key, self.token = state


@dataclass(frozen=True)
class S3Settings:
    """Where S3 requests go and with which credentials.

    `credentials=None` lets each process use its own AWS chain. `public()` is
    the part that may be written to configs and tracking.
    """

    endpoint_url: str | None = None
    region: str = DEFAULT_REGION
    credentials: Credentials | None = field(default=None, repr=False, compare=False)

    @classmethod
    def resolve(cls, endpoint_url: str | None = None, region: str | None = None) -> S3Settings:
        """Settings from the arguments, the environment and the AWS credential chain."""
        import boto3

        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        if endpoint is not None:
            endpoint = _validate_endpoint(endpoint)
        session = boto3.Session()
        found = session.get_credentials()
        creds = None
        if found is not None:
            frozen = found.get_frozen_credentials()
            creds = Credentials(frozen.access_key, frozen.secret_key, frozen.token)
        return cls(endpoint, region or session.region_name or DEFAULT_REGION, creds)

    def public(self) -> dict[str, Any]:
        """The credential-free description (safe for manifests, logs and MLflow)."""
        return {"endpoint_url": strip_userinfo(self.endpoint_url) if self.endpoint_url else None, "region": self.region}

    def secrets(self) -> list[str]:
        """The strings that must never appear in output (for `redact`)."""
        if self.credentials is None:
            return []
        return [s for s in (self.credentials.secret_key, self.credentials.token) if s]

    def boto3_client(self, service: str = "s3") -> Any:
        """A boto3 client for `service` with these settings (bounded retries and timeouts)."""
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=32,
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        kwargs: dict[str, Any] = {"region_name": self.region, "config": config}
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.credentials is not None:
            kwargs.update(
                aws_access_key_id=self.credentials.access_key,
                aws_secret_access_key=self.credentials.secret_key,
                aws_session_token=self.credentials.token,
            )
        # A fresh session: the default one caches the AWS config files and profile of its first use.
        return boto3.session.Session().client(service, **kwargs)

    def arrow_filesystem(self) -> Any:
        """A `pyarrow.fs.S3FileSystem` with these settings."""
        import pyarrow.fs as pafs

        kwargs: dict[str, Any] = {
            "region": self.region,
            "connect_timeout": 5,
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
        }
        if self.endpoint_url:
            parts = urlsplit(self.endpoint_url)
            kwargs["endpoint_override"] = parts.netloc
            kwargs["scheme"] = parts.scheme
        if self.credentials is not None:
            kwargs.update(
                access_key=self.credentials.access_key,
                secret_key=self.credentials.secret_key,
                session_token=self.credentials.token,
            )
        return pafs.S3FileSystem(**kwargs)


def _validate_endpoint(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"endpoint URL {strip_userinfo(endpoint)!r} must look like http(s)://host:port")
    return endpoint.rstrip("/")


def redact(text: str, settings: S3Settings | None) -> str:
    """`text` with any secret of `settings` replaced by `***`."""
    for secret in settings.secrets() if settings else []:
        text = text.replace(secret, "***")
    return text


# ---------------------------------------------------------------- error translation


_S3_CAUSES = {
    "NoSuchBucket": "bucket does not exist",
    "InvalidAccessKeyId": "the access key is not known to this endpoint (check the AWS credentials)",
    "SignatureDoesNotMatch": "the request signature does not match (check the AWS secret key)",
    "AccessDenied": "access denied",
    "InvalidBucketName": "invalid bucket name",
    "NoSuchKey": "object not found",
    "404": "not found",
    "403": "access denied (check the AWS credentials)",
    "ExpiredToken": "the AWS session token has expired",
}


def storage_error(uri: str, exc: BaseException, settings: S3Settings | None = None) -> StorageError:
    """Turn a botocore / pyarrow / OS error into a one-line `StorageError` naming `uri`."""
    from botocore import exceptions as bce

    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        cause = _S3_CAUSES.get(code) or f"S3 error {code}: {err.get('Message', '')}".strip()
    elif isinstance(exc, (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ConnectionClosedError)):
        endpoint = settings.public()["endpoint_url"] if settings and settings.endpoint_url else "the S3 endpoint"
        cause = f"cannot connect to {endpoint}"
    elif isinstance(exc, bce.NoCredentialsError):
        cause = "no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
    elif isinstance(exc, bce.BotoCoreError):
        cause = str(exc)
    elif isinstance(exc, FileNotFoundError):
        cause = "does not exist"
    elif isinstance(exc, NotADirectoryError):
        cause = "is not a directory"
    elif isinstance(exc, PermissionError):
        cause = "permission denied"
    elif isinstance(exc, OSError) and "AWS Error" in str(exc):
        cause = _arrow_cause(str(exc))
    else:
        cause = f"{type(exc).__name__}: {exc}"
    return StorageError(redact(f"{strip_userinfo(uri)}: {cause}", settings))


def _arrow_cause(text: str) -> str:
    for marker, cause in (
        ("NO_SUCH_BUCKET", "bucket does not exist"),
        ("ACCESS_DENIED", "access denied (check the AWS credentials)"),
        ("INVALID_ACCESS_KEY_ID", _S3_CAUSES["InvalidAccessKeyId"]),
        ("SIGNATURE_DOES_NOT_MATCH", _S3_CAUSES["SignatureDoesNotMatch"]),
        ("NETWORK_CONNECTION", "cannot connect to the S3 endpoint"),
    ):
        if marker in text:
            return cause
    return text.splitlines()[0]
