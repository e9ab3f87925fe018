"""Joining the Ray cluster: the one place a stage, the runner or the CLI connects to Ray."""

from __future__ import annotations

import os
from typing import Any

from pipelines.core import stopping


def connect(address: str | None = None, **local: Any) -> None:
    """Connect this process to Ray unless it already is: to `address`, else to `$RAY_ADDRESS`, else (Ray's own
    rule) to a cluster `ray start` left running on this machine, else to a new local one.

    `local` are `ray.init` arguments for a cluster this call starts (`address="local"`), such as
    `object_store_memory`; Ray refuses them when joining a running cluster, whose head decided them.
    """
    import ray  # deferred: importing ray takes seconds; the CLI imports this module at start-up

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), **local)
        stopping.handle_sigterm()  # ray.init put Ray's `sys.exit(15)` in its place
