"""Joining the Ray cluster: the one place a stage, the runner or the CLI connects to Ray."""

from __future__ import annotations

import os


def connect(address: str | None = None, *, object_store_bytes: int | None = None) -> None:
    """Connect this process to Ray unless it already is: to `address`, else to `$RAY_ADDRESS`, else a local cluster.

    `object_store_bytes` sizes the object store of a cluster this call starts (`address="local"`); Ray refuses
    it when joining a running cluster, whose size its head decided.
    """
    import ray  # deferred: importing ray takes seconds; the CLI imports this module at start-up

    if not ray.is_initialized():
        sized = {"object_store_memory": object_store_bytes} if object_store_bytes else {}
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), **sized)
