"""The cluster configs in cluster/, the Dockerfile and the locks in requirements/: they parse, carry what
their tools require, run an existing spec, agree on one image, Ray and Python, install nothing when a
node starts, and hold no credentials (static checks; nothing is built or launched)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipelines.jobs import STOP_GRACE_S
from pipelines.spec_file import load_spec

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
YAMLS = ["aws.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"]
LOCKS = {"cpu": ROOT / "requirements" / "cpu.txt", "cuda": ROOT / "requirements" / "cuda.txt"}
# A command that installs software: none may run when a node or pod starts.
INSTALL = re.compile(r"\b(pip3?|uv pip|conda|mamba|apt(-get)?|yum|dnf)\s+install\b")
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


def test_aws_header_grants_every_ecr_action_an_image_pull_makes() -> None:
    # docker pull from ECR calls GetDownloadUrlForLayer once per layer, besides the token and the manifest.
    header = "".join(line for line in (CLUSTER / "aws.yaml").read_text().splitlines(keepends=True) if line.startswith("#"))
    pull = {"ecr:GetAuthorizationToken", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"}
    assert "AmazonEC2ContainerRegistryReadOnly" in header or {a for a in pull if a not in header} == set()


def test_aws_every_node_type_names_its_ami() -> None:
    # Without one Ray boots its default, an Ubuntu 18.04 Deep Learning AMI whose NVIDIA driver is far older than
    # the 580 that the image's CUDA 13 torch needs: GPU nodes would come up unable to train.
    from ray.autoscaler._private.aws.config import DEFAULT_AMI

    types = load("aws.yaml")["available_node_types"]
    amis = {name: str(t["node_config"].get("ImageId", "")) for name, t in types.items()}
    assert {n: a for n, a in amis.items() if not a.startswith("ami-") or a in DEFAULT_AMI.values()} == {}


def test_aws_launcher_starts_ray_with_token_auth_and_object_store_size() -> None:
    config = load("aws.yaml")
    for command in (config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]):
        assert "RAY_AUTH_MODE=token" in command and "--object-store-memory" in command


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


def test_rayjob_gives_its_stopped_job_vitpipes_stop_grace() -> None:
    runtime_env = yaml.safe_load(load("kuberay/rayjob.yaml")["spec"]["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == str(STOP_GRACE_S)


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


@pytest.mark.parametrize("name, path", [("kuberay/raycluster.yaml", ("spec",)), ("kuberay/rayjob.yaml", ("spec", "rayClusterSpec"))])
def test_kuberay_every_ray_pod_gets_the_same_credentials(name: str, path: tuple[str, ...]) -> None:
    # Any node may run a training rank 0 or a Tune trial driver, which log to MLflow and read S3 themselves:
    # jobs never carry credentials, so each pod needs them from the Secret.
    spec: Any = load(name)
    for key in path:
        spec = spec[key]
    def credentials(group: dict[str, Any]) -> set[str]:
        env = containers(group)[0].get("env", [])
        return {json.dumps(e, sort_keys=True) for e in env if SECRET_ENV.search(e["name"])}

    head = credentials(spec["headGroupSpec"])
    assert {g["groupName"]: credentials(g) for g in spec["workerGroupSpecs"]} == {
        g["groupName"]: head for g in spec["workerGroupSpecs"]}


@pytest.mark.parametrize("name", ["kuberay/raycluster.yaml", "kuberay/rayjob.yaml"])
def test_kuberay_header_creates_the_service_account_its_pods_run_as(name: str) -> None:
    # KubeRay never creates a ServiceAccount that the head pod names (with autoscaling on it stops reconciling
    # the cluster), and Kubernetes refuses pods that name a missing one: the steps must make it, IRSA or not.
    text = (CLUSTER / name).read_text()
    accounts = set(re.findall(r"serviceAccountName: (\S+)", text))
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert accounts and {a for a in accounts if f"kubectl create serviceaccount {a}" not in header} == set()


def test_raycluster_header_reads_the_token_from_the_secret_kuberay_makes() -> None:
    # KubeRay (authOptions: token) stores it in a Secret named after the cluster, under the key auth_token.
    text = (CLUSTER / "kuberay" / "raycluster.yaml").read_text()
    read = f"RAY_AUTH_TOKEN=$(kubectl get secret {load('kuberay/raycluster.yaml')['metadata']['name']} " \
           "-o jsonpath='{.data.auth_token}' | base64 -d)"
    header = [line for line in text.splitlines() if line.startswith("#")]
    reads = [i for i, line in enumerate(header) if read in line]
    submits = [i for i, line in enumerate(header) if "vitpipe submit" in line]
    assert reads and submits and reads[0] < submits[0]  # before the first submit that needs it


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


# --- One image: the Dockerfile, the locks and the configs agree -------------------------------------


def image_tag() -> str:
    """The image reference defined once, in cluster/image.sh."""
    done = subprocess.run(["bash", str(CLUSTER / "image.sh"), "tag"], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def locked(name: str) -> dict[str, str]:
    """`package: version` pinned by one lock file."""
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", LOCKS[name].read_text(), re.M)
    return {canonicalize_name(package): version for package, version in pins}


def lock_python() -> str:
    """The Python version the locks are compiled for (requirements/compile.sh)."""
    return re.search(r"--python-version (\d+\.\d+)", (ROOT / "requirements" / "compile.sh").read_text()).group(1)


def all_images() -> dict[str, str]:
    """Every container image the cluster configs name, by where it is named."""
    images = {"aws.yaml docker.image": load("aws.yaml")["docker"]["image"]}
    for name, path in (("kuberay/raycluster.yaml", ("spec",)), ("kuberay/rayjob.yaml", ("spec", "rayClusterSpec"))):
        spec: Any = load(name)
        for key in path:
            spec = spec[key]
        for i, container in enumerate(cluster_containers(spec)):
            images[f"{name} container {i} ({container['name']})"] = container["image"]
    return images


def test_every_config_names_the_image_that_image_sh_builds() -> None:
    tag = image_tag()
    assert {where: image for where, image in all_images().items() if image != tag} == {}, f"expected {tag}"


def test_image_tag_names_vitpipe_ray_python_and_cuda_of_the_dockerfile() -> None:
    args = dockerfile_args()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tag = image_tag().rsplit(":", 1)[1]
    assert tag == f"{version}-ray{args['RAY_VERSION']}-{args['PYTHON_TAG']}-{args['CUDA_TAG']}"


def test_dockerfile_stages_start_from_rays_gpu_image_of_its_versions() -> None:
    bases = re.findall(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert len(bases) >= 2  # multi-stage: the wheels are built apart from the runtime
    assert set(bases) == {"rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${CUDA_TAG}"}
    assert re.fullmatch(r"cu\d+", dockerfile_args()["CUDA_TAG"])  # a GPU image, not -cpu


def test_dockerfile_lock_and_kuberay_agree_on_ray() -> None:
    ray_version = dockerfile_args()["RAY_VERSION"]
    assert {name: locked(name)["ray"] for name in LOCKS} == {name: ray_version for name in LOCKS}
    manifests = [load("kuberay/raycluster.yaml")["spec"], load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]]
    assert [m["rayVersion"] for m in manifests] == [ray_version, ray_version]


def test_dockerfile_and_lock_agree_on_python() -> None:
    assert dockerfile_args()["PYTHON_TAG"] == "py" + lock_python().replace(".", "")


def test_locks_pin_the_ray_and_python_these_tests_run_on() -> None:
    assert locked("cpu")["ray"] == ray.__version__
    assert lock_python() == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_locks_differ_only_in_the_torch_build() -> None:
    cpu, cuda = locked("cpu"), locked("cuda")
    assert cpu["torch"].endswith("+cpu") and "+" not in cuda["torch"]  # PyPI's Linux torch is the CUDA build
    assert cpu["torch"].split("+")[0] == cuda["torch"]
    shared = set(cpu) & set(cuda) - {"torch"}
    assert {p: (cpu[p], cuda[p]) for p in shared if cpu[p] != cuda[p]} == {}
    cuda_only = set(cuda) - set(cpu)
    assert cuda_only and all(p.startswith(("nvidia-", "cuda-")) or p == "triton" for p in cuda_only), cuda_only
    assert set(cpu) <= set(cuda)


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_lock_pins_every_runtime_dependency_within_its_range(name: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [Requirement(r) for r in [*project["dependencies"], *extras["video"], *extras["bayes"]]]
    pins = locked(name)
    for requirement in wanted:
        pin = pins.get(canonicalize_name(requirement.name))
        assert pin is not None, f"{requirement.name} is not in {LOCKS[name].name}"
        assert requirement.specifier.contains(pin, prereleases=True), f"{requirement.name}=={pin} vs {requirement}"


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_lock_pins_carry_hashes(name: str) -> None:
    text = LOCKS[name].read_text()
    hashed = re.findall(r"^\S+==\S+ \\\n\s+--hash=sha256:[0-9a-f]{64}", text, re.M)
    assert len(hashed) == len(locked(name))


def test_dockerfile_installs_the_cuda_lock_with_hashes_offline() -> None:
    text = (ROOT / "Dockerfile").read_text()
    runtime = text[text.rindex("\nFROM "):]  # the last stage is the image
    assert "requirements/cuda.txt" in runtime
    install = re.search(r"pip install[^\n]*-r /tmp/cuda.txt", runtime)
    assert install and "--require-hashes" in install.group(0) and "--no-index" in install.group(0)


def test_dockerignore_lets_in_every_path_the_dockerfile_reads() -> None:
    text = (ROOT / "Dockerfile").read_text()
    sources = [s for line in re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+)$", text, re.M) for s in line.split()[:-1]]
    sources += re.findall(r"--mount=type=bind,source=([^,\s]+)", text)
    ignore = [s for s in (line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines())
              if s and not s.startswith("#")]
    assert ignore[0] == "*"  # an allow-list: nothing else gets in
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for source in sources:
        assert any(source == a or source.startswith(a + "/") for a in allowed), source
        assert (ROOT / source).exists(), source


def test_aws_launcher_config_matches_rays_schema() -> None:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(load("aws.yaml"), schema)


def _aws_commands(config: dict[str, Any]) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for k in keys for c in config.get(k) or []]
    for node_type in config["available_node_types"].values():
        commands += [c for k in ("initialization_commands", "worker_setup_commands") for c in node_type.get(k) or []]
    return commands


def test_aws_nodes_install_nothing_at_boot() -> None:
    config = load("aws.yaml")
    assert config["docker"]["image"]  # the image holds vitpipe, torch and Ray
    assert [c for c in _aws_commands(config) if INSTALL.search(c)] == []


@pytest.mark.parametrize("name, path", [("kuberay/raycluster.yaml", ("spec",)), ("kuberay/rayjob.yaml", ("spec", "rayClusterSpec"))])
def test_kuberay_pods_install_nothing_at_boot(name: str, path: tuple[str, ...]) -> None:
    manifest: Any = load(name)
    spec = manifest
    for key in path:
        spec = spec[key]
    started = [json.dumps([c.get("command"), c.get("args"), c.get("lifecycle")]) for c in cluster_containers(spec)]
    assert [s for s in started if INSTALL.search(s)] == []
    runtime_env = yaml.safe_load(manifest["spec"].get("runtimeEnvYAML") or "{}")
    assert not set(runtime_env) & {"pip", "uv", "conda"}  # a RayJob's runtime env would install per job


def test_rayjob_has_the_raycluster_cpu_ingest_group() -> None:
    groups = {g["groupName"]: g for g in load("kuberay/raycluster.yaml")["spec"]["workerGroupSpecs"]}
    job_groups = {g["groupName"]: g for g in load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert job_groups.get("cpu-ingest") == groups["cpu-ingest"]


def test_image_script_rejects_unknown_command() -> None:
    result = subprocess.run(["bash", str(CLUSTER / "image.sh"), "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr
