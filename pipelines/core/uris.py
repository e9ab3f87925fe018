"""URIs: the one place where credentials are scrubbed from a URI, where a storage URI is parsed
(`parse_uri`, re-exported by `pipelines.core.storage`), where a tracking URI is resolved, and
where a source URI's brace range (`s3://bucket/train/{000000..000999}.tar`) is recognised.

No MLflow here: `vitpipe run` validates a spec, tracking URI included, before it imports MLflow.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"

# `scheme://` (or a bare `//`), then an authority whose userinfo ends at its last `@`; an authority
# ends at the first `/`, `?` or `#`, as `urllib.parse.urlsplit` cuts it.
_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)[^/?#]*@")


def strip_userinfo(uri: str) -> str:
    """`uri` without any `user:password@` part; everything else exactly as written, other strings unchanged.

    Used on every URI that is logged, tagged or put in an error message, so it never raises
    (not on a bad port nor on an unclosed IPv6 bracket) and keeps the host as written (case,
    IPv6 brackets, port).
    """
    return _USERINFO.sub(r"\1", uri, count=1)


# The same, wherever a URL stands in a text (an error message, a traceback, a command line): the scheme
# must be named, and white space ends the authority.
_USERINFO_ANYWHERE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s@]*(?:@[^/?#\s@]*)*@")


def scrub_userinfo(text: str) -> str:
    """`text` with the `user:password@` of every `scheme://` URL in it removed; the rest exactly as written.

    For free text that may quote a URL anywhere (a library's error message, a log line), where
    `strip_userinfo` takes one URI as a whole.
    """
    return _USERINFO_ANYWHERE.sub(r"\1", text)


def is_s3_uri(uri: str) -> bool:
    """Whether `uri` names S3 storage as `parse_uri` reads it: `s3://` or Hadoop's `s3a://`, any case."""
    return "://" in uri and urlsplit(uri.strip()).scheme.lower() in ("s3", "s3a")


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class Location:
    """A parsed storage URI: `s3` with bucket and key prefix, or `file` with an absolute path."""

    scheme: str  # "s3" or "file"
    bucket: str  # "" for local paths
    path: str  # s3: key prefix without surrounding "/"; file: absolute path

    @property
    def uri(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return self.path


def parse_uri(uri: str) -> Location:
    """Parse `s3://bucket/prefix`, `file:///path` or a plain local path.

    Raises ValueError for other schemes, malformed bucket names and URIs that
    embed credentials (`s3://key:secret@bucket`): those belong in the AWS chain.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError("storage URI must be a non-empty string")
    uri = uri.strip()
    if "://" not in uri:
        return Location("file", "", os.path.abspath(os.path.expanduser(uri)))
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return Location("file", "", os.path.abspath(parts.path or "/"))
    if not is_s3_uri(uri):
        raise ValueError(f"{strip_userinfo(uri)}: unsupported scheme {scheme!r} (use s3://bucket/prefix or a local path)")
    # Cut by hand, not by `urlsplit`: `#` and `?` are key characters on S3, not a fragment or a query.
    bucket, _, path = uri.split("://", 1)[1].partition("/")
    if "@" in bucket:
        raise ValueError(f"{strip_userinfo(uri)}: credentials in the URI are refused; use the AWS environment or profile")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"{uri}: {bucket!r} is not a valid bucket name")
    return Location("s3", bucket, path.strip("/"))


def join_key(*parts: str) -> str:
    """Join key parts with "/" (no leading, trailing or doubled separators)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Unprinted:
    """A value (a URI that may hold a password) that reaches Ray workers by pickle but reads `***`
    wherever it is printed: Ray Train shows each run's `train_loop_config` in its state API as text."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The tracking URI a stage uses: the config's, else `MLFLOW_TRACKING_URI`, else a local SQLite store.

    A relative SQLite path is made absolute: Ray workers run in other directories.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.abspath(uri[len(prefix):])
    return uri


# A source's numbered range of names, `{000..999}`: read by `pipelines.core.sources.name_filter`.
BRACE_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def pattern_root(uri: str) -> str:
    """The folder a brace-range source lists (`.../{000..009}.tar` → `...`), else `uri` itself."""
    head, sep, name = uri.rstrip("/").rpartition("/")
    return head if sep and BRACE_RANGE.search(name) else uri
