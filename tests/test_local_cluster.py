"""cluster/local_cluster.sh on this machine: two real head-only Ray clusters side by side, one `stop`ped.

A cluster's processes are found by the temp dir in their arguments, so `stop` must end those of its own
temp dir alone, also when another cluster's temp dir starts with the same characters.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _free_port
from tests.multinode_fixtures import SCRIPT, cluster_processes

pytestmark = pytest.mark.slow


def cluster_env(tmp: Path, ray_tmp: str) -> dict[str, str]:
    """The script's environment for a head-only cluster on free ports with temp dir `ray_tmp`."""
    token = tmp / "auth_token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
    drop = ("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH", "AWS_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_PORT=str(_free_port()),
               DASHBOARD_PORT=str(_free_port()), RAY_TMP=ray_tmp, HEAD_CPUS="1", OBJECT_STORE_MB="100",
               RAY_raylet_start_wait_time_s="300")
    return env


def script(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *command.split()], env=env, timeout=300, capture_output=True, text=True)


@pytest.fixture
def two_clusters(tmp_path) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """Head-only clusters whose temp dirs are `/tmp/vp-pfx-N` and `/tmp/vp-pfx-N0`; both stopped at the end."""
    base = f"/tmp/vp-pfx-{_free_port()}"
    short, long = cluster_env(tmp_path, base), cluster_env(tmp_path, base + "0")
    try:
        for env in (short, long):
            started = script("start 0", env)
            assert started.returncode == 0, started.stderr[-3000:]
        yield short, long
    finally:
        for env in (long, short):  # the longer name first: a `stop` of the shorter may reach its processes
            script("stop", env)


def test_stopping_a_cluster_leaves_one_whose_temp_dir_extends_its_name_running(two_clusters):
    short, long = two_clusters
    others = set(cluster_processes(long["RAY_TMP"]))
    assert others

    stopped = script("stop", short)
    assert stopped.returncode == 0, stopped.stderr
    assert not cluster_processes(short["RAY_TMP"])
    assert others <= set(cluster_processes(long["RAY_TMP"]))
