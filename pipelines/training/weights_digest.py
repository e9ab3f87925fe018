"""Starting weights named by their files' content, for the `init`s no MLflow run names.

A checkpoint folder or a published weights file can be replaced in place under the
same name; a stage's identity holds this digest instead, so new bytes are new work.
On a local disk the digest covers the bytes themselves (sha256); in a bucket, each
file's size and ETag (S3's own content hash), read from one listing: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import vit
from pipelines.core.registry import CHECKPOINT_FILES
from pipelines.core.storage import open_store
from pipelines.core.uris import is_s3_uri, strip_userinfo


def content_digest(kind: str, init: str, endpoint_url: str | None) -> str | None:
    """The digest of the files a `checkpoint` or `foreign` init reads; None for the other kinds."""
    if kind == "checkpoint":
        return _checkpoint_digest(init, endpoint_url)
    if kind == "foreign":
        return _foreign_digest(init)
    return None


def check_unchanged(kind: str, init: str, endpoint_url: str | None, digest: str | None) -> None:
    """A one-line ValueError when the files `init` names no longer have `digest`: they were replaced while
    they were read, and the weights read may be neither the old nor the new ones the identity names."""
    if digest is not None and content_digest(kind, init, endpoint_url) != digest:
        raise ValueError(f"init {strip_userinfo(init)}: its files changed while they were read; run again")


def foreign_path(init: str) -> Path:
    """The local path a published-weights `init` names, or a one-line ValueError when there is none."""
    path = Path(init.removeprefix("file://"))
    if not path.exists():
        raise ValueError(f"init {init}: no such file or directory (and not a run id, runs:/ or models:/ URI)")
    return path


def _files_digest(files: list[Path]) -> str:
    """sha256 over each file's name and bytes."""
    outer = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            outer.update(f"{f.name}\0{hashlib.file_digest(fh, 'sha256').hexdigest()}\n".encode())
    return "sha256:" + outer.hexdigest()


def _checkpoint_digest(init: str, endpoint_url: str | None) -> str:
    if not is_s3_uri(init):
        return _files_digest([Path(init.removeprefix("file://"), name) for name in CHECKPOINT_FILES])
    listed: dict[str, tuple[int, str]] = {}
    for page in open_store(init, endpoint_url=endpoint_url).list_entries():
        listed.update({key: (size, version) for key, size, version in page if key in CHECKPOINT_FILES})
        if len(listed) == len(CHECKPOINT_FILES):
            break
    missing = [name for name in CHECKPOINT_FILES if name not in listed]
    if missing:
        raise ValueError(f"init {strip_userinfo(init)}: not a vit checkpoint (no {missing[0]})")
    text = "".join(f"{name}\0{listed[name][0]}\0{listed[name][1]}\n" for name in CHECKPOINT_FILES)
    return "s3-etags:" + hashlib.sha256(text.encode()).hexdigest()


def _foreign_digest(init: str) -> str:
    try:
        return _files_digest(vit.weights_files(foreign_path(init)))
    except OSError as err:
        raise ValueError(f"init {init}: cannot read the weights: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(err if str(err).startswith("init ") else f"init {init}: {err}") from None


__all__ = ["check_unchanged", "content_digest", "foreign_path"]
