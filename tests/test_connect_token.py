"""pipelines.core.cluster.connect joins a token-auth cluster at a given address with nothing but a token at hand.

A shell on a cluster node (or next to `cluster/local_cluster.sh`) has the token in ~/.ray/auth_token but no
RAY_AUTH_MODE: that was set for `ray start` only. Ray 2.60 itself turns token mode on for a cluster it finds,
not for an address it is given, so `RAY_ADDRESS=HEAD:6379 vitpipe run SPEC` was refused by the GCS."""

from __future__ import annotations

import os
import subprocess
import sys

_JOIN = (
    "import sys, ray; from pipelines.core.cluster import connect; "
    "connect(sys.argv[1] if len(sys.argv) > 1 else None); print(ray.get_runtime_context().gcs_address)"
)


def _join_without_auth_mode(*args: str, ray_address: str | None = None) -> str:
    # The session cluster runs in token mode and its token is where Ray's own tools look; only the mode is dropped.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    done = subprocess.run([sys.executable, "-c", _JOIN, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_connect_sends_the_token_to_a_given_address(ray_cluster) -> None:
    assert _join_without_auth_mode(ray_cluster.address) == ray_cluster.address


def test_connect_sends_the_token_to_ray_address(ray_cluster) -> None:
    assert _join_without_auth_mode(ray_address=ray_cluster.address) == ray_cluster.address
