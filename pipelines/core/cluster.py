"""Joining the Ray cluster: the one place a stage, the runner or the CLI connects to Ray."""

from __future__ import annotations

import os


def connect(address: str | None = None) -> None:
    """Connect this process to Ray unless it already is: to `address`, else to `$RAY_ADDRESS`, else a local cluster."""
    import ray  # deferred: importing ray takes seconds; the CLI imports this module at start-up

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"))
