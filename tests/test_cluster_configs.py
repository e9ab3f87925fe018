"""The cluster configs in cluster/: they parse, carry what their tools require, run an existing spec,
and hold no credentials (static checks; nothing is launched)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
YAMLS = ["aws.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"]
SECRET_ENV = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIAL)", re.I)
SECRET_LITERALS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # an AWS access key id
    re.compile(r"(?i)secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+]{30,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)(RAY_AUTH_TOKEN|auth_token)\s*[:=]\s*['\"]?[A-Za-z0-9_\-+/]{16,}"),
    re.compile(r"(?i)(password|token)\s*:\s*['\"]?[A-Za-z0-9_\-+/]{12,}"),
]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / name).read_text())


def containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_template["template"]["spec"]["containers"]


def cluster_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in containers(g)]


@pytest.mark.parametrize("name", YAMLS)
def test_yaml_parses_to_a_mapping(name: str) -> None:
    assert isinstance(load(name), dict)


def test_aws_launcher_has_required_keys() -> None:
    config = load("aws.yaml")
    for key in ("cluster_name", "max_workers", "provider", "auth", "available_node_types", "head_node_type",
                "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in config, key
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]


def test_aws_launcher_has_autoscaled_gpu_workers_and_instance_profiles() -> None:
    types = load("aws.yaml")["available_node_types"]
    gpu = [t for t in types.values() if t["node_config"]["InstanceType"].split(".")[0] in ("p4d", "p5", "g5", "g6")]
    assert gpu and all(0 <= t["min_workers"] <= t["max_workers"] for t in gpu)
    assert all("IamInstanceProfile" in t["node_config"] for t in types.values())  # S3 through roles, not keys


def test_aws_launcher_starts_ray_with_token_auth_and_object_store_size() -> None:
    config = load("aws.yaml")
    for command in (config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]):
        assert "RAY_AUTH_MODE=token" in command and "--object-store-memory" in command
    assert any("torch" in c and "download.pytorch.org/whl/cu" in c for c in config["setup_commands"])


@pytest.mark.parametrize("name, kind", [("kuberay/raycluster.yaml", "RayCluster"), ("kuberay/rayjob.yaml", "RayJob")])
def test_kuberay_manifest_is_a_v1_resource(name: str, kind: str) -> None:
    manifest = load(name)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", kind)
    assert manifest["metadata"]["name"]


def test_raycluster_has_head_and_gpu_worker_group() -> None:
    spec = load("kuberay/raycluster.yaml")["spec"]
    assert containers(spec["headGroupSpec"])
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for g in spec["workerGroupSpecs"] for c in containers(g)]
    assert any(gpus)
    assert spec["authOptions"]["mode"] == "token"


def test_rayjob_runs_an_existing_spec_that_loads() -> None:
    job = load("kuberay/rayjob.yaml")["spec"]
    words = job["entrypoint"].split()
    assert words[:2] == ["vitpipe", "run"]
    spec = load_spec(ROOT / words[2])
    assert any(s.kind == "pretrain" for s in spec.stages.values())


def test_rayjob_cluster_has_gpu_workers_and_shuts_down() -> None:
    job = load("kuberay/rayjob.yaml")["spec"]
    workers = job["rayClusterSpec"]["workerGroupSpecs"]
    assert any(c["resources"]["limits"].get("nvidia.com/gpu") for g in workers for c in containers(g))
    assert job["shutdownAfterJobFinishes"] is True


@pytest.mark.parametrize("name, path", [("kuberay/raycluster.yaml", ("spec",)), ("kuberay/rayjob.yaml", ("spec", "rayClusterSpec"))])
def test_kuberay_credentials_come_from_secrets(name: str, path: tuple[str, ...]) -> None:
    spec: Any = load(name)
    for key in path:
        spec = spec[key]
    secret_vars = [e for c in cluster_containers(spec) for e in c.get("env", []) if SECRET_ENV.search(e["name"])]
    assert secret_vars
    for var in secret_vars:
        assert "value" not in var and "secretKeyRef" in var["valueFrom"], var["name"]


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in CLUSTER.rglob("*") if p.is_file()))
def test_no_secret_literals(path: str) -> None:
    text = (ROOT / path).read_text()
    for pattern in SECRET_LITERALS:
        assert not pattern.search(text), f"{path}: {pattern.pattern}"


def test_local_cluster_script_is_valid_bash() -> None:
    script = CLUSTER / "local_cluster.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "--node-ip-address" in text and "RAY_AUTH_MODE=token" in text and "--include-dashboard=true" in text


def test_local_cluster_script_rejects_unknown_command() -> None:
    result = subprocess.run(["bash", str(CLUSTER / "local_cluster.sh"), "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr
