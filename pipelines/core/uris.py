"""URIs that are safe to show: the one place where credentials are scrubbed from a URI."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

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


def is_s3_uri(uri: str) -> bool:
    """Whether `uri` names S3 storage as `storage.parse_uri` reads it: `s3://` or Hadoop's `s3a://`, any case."""
    return "://" in uri and urlsplit(uri.strip()).scheme.lower() in ("s3", "s3a")


class Unprinted:
    """A value (a URI that may hold a password) that reaches Ray workers by pickle but reads `***`
    wherever it is printed: Ray Train shows each run's `train_loop_config` in its state API as text."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__
