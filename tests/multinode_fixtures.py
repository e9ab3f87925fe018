"""A real multi-node Ray cluster on this machine, for the proofs in tests/test_multinode.py.

`cluster/local_cluster.sh` starts a head (2 CPUs) and two worker nodes (2 CPUs each), each
node a raylet in a session of its own, with token authentication on and a 200 MB object
store per node. Every worker node holds one `train_slot` besides its own `worker_I`
resource, so a training worker that asks for a whole slot gets a worker node to itself.
The nodes read S3 (the session's moto server) with credentials of their own, as a cluster's
nodes would from an instance role; stages run in driver processes on the head
(`tests/multinode_driver.py`) or as jobs submitted through the Jobs API.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _free_port, _node_credentials
from tests.process_output import result_json

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "cluster" / "local_cluster.sh"
WORKER_NODES = 2


@dataclass(frozen=True)
class NodesCluster:
    """The running cluster: its addresses, and environments for its script and its clients."""

    gcs: str  # 127.0.0.1:PORT, what drivers connect to
    dashboard: str  # http://127.0.0.1:PORT, the Jobs API
    env: dict[str, str]  # the nodes' environment, and what the cluster script runs with
    driver_env: dict[str, str]  # a driver on the head: the nodes' environment plus RAY_ADDRESS

    def start_driver(self, stage: str, config: dict[str, Any]) -> subprocess.Popen:
        """Start `tests/multinode_driver.py` for one stage; it prints its result as one JSON line."""
        return subprocess.Popen([sys.executable, "-m", "tests.multinode_driver", stage, json.dumps(config)],
                                cwd=REPO, env=self.driver_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def drive(self, stage: str, config: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        """Run one stage to its end in a driver process; returns its printed result and worker placement."""
        return finish(self.start_driver(stage, config), timeout)

    def job_train_nodes(self, submission_id: str) -> list[str]:
        """The nodes (`worker_I`) of every Ray Train worker that the submitted job `submission_id` started."""
        done = subprocess.run([sys.executable, "-m", "tests.multinode_driver", "job-nodes", submission_id], cwd=REPO,
                              env=self.driver_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return result_json(done.stdout)["train_nodes"]

    def kill_node(self, node: str) -> None:
        """SIGKILL every process of worker node `node` (`worker_I`) at once."""
        self._script("kill-node", node.removeprefix("worker_"))

    def start_node(self, node: str) -> None:
        """Start worker node `node` (`worker_I`) again after `kill_node`: a new node with the same resources."""
        self._script("start-node", node.removeprefix("worker_"))

    def _script(self, *args: str) -> None:
        done = subprocess.run([str(SCRIPT), *args], env=self.env, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]


def finish(driver: subprocess.Popen, timeout: float = 600) -> dict[str, Any]:
    """Wait for a driver process; its result line, or an error holding its output."""
    try:
        output, _ = driver.communicate(timeout=timeout)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 0, output[-4000:]
    return result_json(output)


def train_worker_node(env: dict[str, str]) -> str:
    """The worker node (`worker_I`) whose raylet runs a Ray Train worker now, found in /proc.

    Ray titles a worker process after its actor (`ray::RayTrainWorker...`); its parent is its node's raylet,
    whose arguments hold the node's temp dir (`$RAY_TMP/worker-I/...`).
    """
    tmp = env["RAY_TMP"]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if not (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                continue
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            raylet = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # a process that ended while we looked
        for i in range(1, WORKER_NODES + 1):
            if f"={tmp}/worker-{i}/" in raylet:
                return f"worker_{i}"
    raise AssertionError("no Ray Train worker runs on a worker node")


def cluster_processes(ray_tmp: str) -> dict[int, str]:
    """The live processes of the local cluster whose temp dir is `ray_tmp` (each carries it in its
    arguments), with their executables."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # a process that ended while we looked
        if any(arg.endswith(ray_tmp.encode()) or f"={ray_tmp}/".encode() in arg for arg in argv):
            found[int(proc.name)] = argv[0].decode(errors="replace")
    return found


def wait_for_key(client: Any, bucket: str, prefix: str, suffix: str, timeout: float = 300) -> str:
    """The first key under `prefix` ending in `suffix`, polled until it appears."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith(suffix):
                    return item["Key"]
        time.sleep(0.5)
    raise AssertionError(f"no s3://{bucket}/{prefix}...{suffix} within {timeout:.0f}s")


@pytest.fixture(scope="module")
def nodes_cluster(s3_server, tmp_path_factory) -> NodesCluster:
    """Head + 2 worker nodes from `cluster/local_cluster.sh`, token auth on; stopped after the module."""
    tmp = tmp_path_factory.mktemp("nodes-cluster")
    token_file = tmp / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    port, dashboard = _free_port(), _free_port()
    drop = ("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH", "AWS_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file), RAY_PORT=str(port), DASHBOARD_PORT=str(dashboard),
        RAY_TMP=f"/tmp/vp-nodes-{port}", HEAD_CPUS="2", WORKER_CPUS="2", OBJECT_STORE_MB="200",
        WORKER_RESOURCES='{"train_slot": 1}', PYTHONPATH=str(REPO),
        # The nodes' own AWS chain (written by `s3_server`), as an instance role would give them.
        AWS_SHARED_CREDENTIALS_FILE=str(_node_credentials(tmp_path_factory)), AWS_CONFIG_FILE=os.devnull,
        # moto answers the presigned downloads that `mlflow server` offers with HTTP 500: go through the server.
        MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD="false",
        RAY_raylet_start_wait_time_s="300",  # a busy 2-core machine starts raylets slowly
    )
    started = subprocess.run([str(SCRIPT), "start", str(WORKER_NODES)], env=env, timeout=300, capture_output=True,
                             text=True)
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield NodesCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", env,
                           {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, timeout=120, capture_output=True)
