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


def _join(cluster_address: str, *args: str, ray_address: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
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
