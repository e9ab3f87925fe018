"""Joining the Ray cluster (the one place a stage, the runner or the CLI connects to Ray), and passing Ray Data
the task options it takes only as remote args."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
        address = address or os.environ.get("RAY_ADDRESS")
        if address not in (None, "auto", "local"):
            # Ray 2.60 turns token mode on by itself (with a token at hand, RAY_AUTH_MODE unset) for a cluster it
            # finds, never for a given address, whose GCS then refuses this process after 20 s of retries.
            send_token_when_at_hand()
        ray.init(address=address, **local)
        stopping.handle_sigterm()  # ray.init put Ray's `sys.exit(15)` in its place


def send_token_when_at_hand() -> None:
    """Ray's token mode for this process when `RAY_AUTH_MODE` is unset and a token is where Ray's tools look
    (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`): Ray's own rule, which also reloads the
    config Ray cached at first use (`RAY_AUTH_MODE` set by hand after that is not seen). Its warning that
    token mode is on is kept off stderr, where vitpipe's errors are one line."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    ray_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = ray_logger.level
    ray_logger.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        ray_logger.setLevel(level)


@contextmanager
def ray_remote_args() -> Iterator[None]:
    """Build Ray Data operators that take task options (retries, generator backpressure) as remote args.

    Ray 2.60 names no parameter for them and flags remote args as deprecated for Ray 2.64, once per call
    site; pyproject keeps Ray below 2.61, so that warning is nothing a user of vitpipe can act on.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        yield
