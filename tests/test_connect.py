"""pipelines.core.cluster.connect: the one way to join Ray, against the session's real local cluster."""

from __future__ import annotations

import os
import subprocess
import sys

from pipelines.core.cluster import connect

# A fresh process that joins through `connect` and prints the GCS address it ended up on.
_JOIN = (
    "import sys, ray; from pipelines.core.cluster import connect; "
    "connect(sys.argv[1] if len(sys.argv) > 1 else None); print(ray.get_runtime_context().gcs_address)"
)


def _join(cluster_address: str, *args: str, ray_address: str | None = None, auth_mode: bool = True) -> str:
    # Without `auth_mode`: a shell on a node holds the token (~/.ray/auth_token) but no RAY_AUTH_MODE, which
    # was set for `ray start` only; the session cluster's token is where Ray's own tools look.
    dropped = ("RAY_ADDRESS",) if auth_mode else ("RAY_ADDRESS", "RAY_AUTH_MODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    done = subprocess.run([sys.executable, "-c", _JOIN, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_connect_joins_the_given_address(ray_cluster) -> None:
    assert _join(ray_cluster.address, ray_cluster.address, ray_address="127.0.0.1:1") == ray_cluster.address


def test_connect_without_an_address_joins_ray_address(ray_cluster) -> None:
    assert _join(ray_cluster.address, ray_address=ray_cluster.address) == ray_cluster.address


def test_connect_leaves_a_connected_process_where_it_is(ray_cluster) -> None:
    import ray

    connect("127.0.0.1:1")  # nothing listens there: joining it would fail
    assert ray.get_runtime_context().gcs_address == ray_cluster.address


def test_connect_sends_the_token_to_a_given_address_without_ray_auth_mode(ray_cluster) -> None:
    # Ray 2.60 turns token mode on by itself for a cluster it finds, not for an address it is given.
    assert _join(ray_cluster.address, ray_cluster.address, auth_mode=False) == ray_cluster.address


def test_connect_sends_the_token_to_ray_address_without_ray_auth_mode(ray_cluster) -> None:
    assert _join(ray_cluster.address, ray_address=ray_cluster.address, auth_mode=False) == ray_cluster.address
