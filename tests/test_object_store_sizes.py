"""Ray's object store fits in the /dev/shm of every node the cluster configs start, by Ray 2.60's own rules.

`ray start` refuses an object store larger than /dev/shm once it passes 10 GB ("exceeds /dev/shm size") and
below that moves it to disk with a warning; either way a node is broken or slow. The sizes come from Ray's
code (the launcher's --shm-size, the default object store), so these tests follow Ray if its rules change."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import ray._private.utils as ray_utils
import yaml
from ray.autoscaler._private.command_runner import DockerCommandRunner

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
# Memory of the EC2 instance types aws.yaml names (GiB, AWS's published sizes).
INSTANCE_GIB = {"m6i.4xlarge": 64, "p4d.24xlarge": 1152, "g5.12xlarge": 192, "c6i.8xlarge": 64}
UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
KUBERNETES_DEFAULT_SHM = 64 * 2**20  # a container's /dev/shm without a memory-backed volume there


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / name).read_text())


def meminfo(total_bytes: int) -> str:
    # A booted node has less available than it has in total; 90% keeps the launcher's /dev/shm on the small side.
    return f"MemTotal: {total_bytes // 1024} kB\nMemAvailable: {total_bytes * 9 // 10 // 1024} kB\n"


class _Host:
    """The ssh runner the launcher asks for the host's /proc/meminfo."""

    def __init__(self, text: str) -> None:
        self.text = text

    def run(self, cmd: str, with_output: bool = False, **_: Any) -> bytes:
        assert "/proc/meminfo" in cmd
        return self.text.encode()


def launcher_shm_bytes(docker: dict[str, Any], head: bool, host_meminfo: str) -> float:
    """The --shm-size the cluster launcher gives the node's container (DockerCommandRunner.run_init's rule)."""
    runner = DockerCommandRunner.__new__(DockerCommandRunner)
    runner.docker_config, runner.ssh_command_runner = docker, _Host(host_meminfo)
    options = docker.get("run_options", []) + docker.get("head_run_options" if head else "worker_run_options", [])
    size = [o for o in runner._auto_configure_shm(options) if "--shm-size" in o][-1]
    number, unit = re.search(r"--shm-size[= ]'?([\d.]+)([bkmg]?)", size).groups()
    return float(number) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit]


def started_object_store(command: str, host_meminfo: str, tmp_path: Path) -> int:
    """--object-store-memory as the start command computes it on a node with `host_meminfo`."""
    fake = tmp_path / "meminfo"
    fake.write_text(host_meminfo)
    stubs = ('ray() { printf "%s\\n" "$@"; }\n'  # prints its arguments instead of starting Ray
             'awk() { command awk "${@//\\/proc\\/meminfo/$FAKE_MEMINFO}"; }\n')  # reads the node's meminfo
    done = subprocess.run(["bash", "-c", stubs + command], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "FAKE_MEMINFO": str(fake), "RAY_HEAD_IP": "10.0.0.1"})
    return int(re.search(r"^--object-store-memory=(\d+)$", done.stdout, re.M).group(1))


AWS_TYPES = sorted(load("aws.yaml")["available_node_types"])


@pytest.mark.parametrize("node_type", AWS_TYPES)
def test_aws_object_store_fits_the_launchers_dev_shm(node_type: str, tmp_path: Path) -> None:
    config = load("aws.yaml")
    head = node_type == config["head_node_type"]
    instance = config["available_node_types"][node_type]["node_config"]["InstanceType"]
    host = meminfo(INSTANCE_GIB[instance] * 2**30)
    commands = config["head_start_ray_commands" if head else "worker_start_ray_commands"]
    store = started_object_store(commands[-1], host, tmp_path)
    shm = launcher_shm_bytes(config["docker"], head, host)
    assert store <= shm, f"{instance}: object store {store / 1e9:.0f} GB > /dev/shm {shm / 1e9:.0f} GB"


def quantity(text: str | int) -> int:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([kMGT]i?)?", str(text)).groups()
    return int(float(number) * UNITS[unit or ""])


def kuberay_groups() -> list[tuple[str, dict[str, Any]]]:
    specs = {"raycluster": load("kuberay/raycluster.yaml")["spec"],
             "rayjob": load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]}
    return [(f"{name}:{group.get('groupName', 'head')}", group) for name, spec in specs.items()
            for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]]


def dev_shm_bytes(pod: dict[str, Any]) -> int:
    """The size of the Ray container's /dev/shm: its memory-backed volume's sizeLimit."""
    mounts = {m["name"] for m in pod["containers"][0].get("volumeMounts", []) if m["mountPath"] == "/dev/shm"}
    volumes = [v["emptyDir"] for v in pod.get("volumes", []) if v["name"] in mounts and "emptyDir" in v]
    memory_backed = [v for v in volumes if v.get("medium") == "Memory" and "sizeLimit" in v]
    return quantity(memory_backed[0]["sizeLimit"]) if memory_backed else KUBERNETES_DEFAULT_SHM


@pytest.mark.parametrize("where, group", kuberay_groups(), ids=[w for w, _ in kuberay_groups()])
def test_kuberay_object_store_fits_the_pods_dev_shm(where: str, group: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pod = group["template"]["spec"]
    shm = dev_shm_bytes(pod)
    given = group.get("rayStartParams", {}).get("object-store-memory")
    if given is None:  # Ray's default, from the container's memory limit (an upper bound of what it sees free)
        monkeypatch.setattr(ray_utils, "get_shared_memory_bytes", lambda: shm)
        memory = quantity(pod["containers"][0]["resources"]["limits"]["memory"])
        given = ray_utils.resolve_object_store_memory(memory)
    assert int(given) <= shm, f"{where}: object store {int(given) / 1e9:.1f} GB > /dev/shm {shm / 1e9:.1f} GB"


def test_an_unknown_instance_type_needs_its_memory_here() -> None:
    types = load("aws.yaml")["available_node_types"].values()
    assert {t["node_config"]["InstanceType"] for t in types} <= set(INSTANCE_GIB)
