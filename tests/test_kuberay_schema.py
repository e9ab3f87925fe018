"""The KubeRay manifests in cluster/kuberay/ against KubeRay's own CRD schemas (v1.5.1, the oldest release they
claim), as `kubectl apply` checks them: an unknown field, a wrong type or a wrong nesting fails here instead of on
the cluster. The CRDs embed Kubernetes' core/v1 pod template, so containers, resources, env and volumes are
checked too. tests/data/kuberay/trim_crd.py says where the schemas come from and how they were trimmed."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = Path(__file__).resolve().parent / "data" / "kuberay"
MANIFESTS = {"kuberay/raycluster.yaml": "rayclusters", "kuberay/rayjob.yaml": "rayjobs"}


def crd_schema(plural: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((SCHEMAS / f"{plural}-v1.5.1.schema.json.gz").read_bytes()))


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "cluster" / name).read_text())


def errors(document: dict[str, Any], plural: str) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema(plural))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_matches_kuberay_crd(name: str) -> None:
    assert errors(manifest(name), MANIFESTS[name]) == []


def test_crd_schema_refuses_a_misspelt_pod_field() -> None:
    # The trimmed schema must stay strict, or the test above would pass anything.
    cluster = copy.deepcopy(manifest("kuberay/raycluster.yaml"))
    container = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    assert any("'volumeMount' was unexpected" in e for e in errors(cluster, "rayclusters"))


def test_crd_schema_refuses_a_malformed_quantity() -> None:
    cluster = copy.deepcopy(manifest("kuberay/raycluster.yaml"))
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "32 GB"
    assert any(e.startswith("spec.headGroupSpec.template.spec.containers.0.resources.limits.memory")
               for e in errors(cluster, "rayclusters"))


def test_crd_schema_refuses_an_unknown_ray_cluster_field() -> None:
    job = copy.deepcopy(manifest("kuberay/rayjob.yaml"))
    job["spec"]["rayClusterSpec"]["authOption"] = job["spec"]["rayClusterSpec"].pop("authOptions")
    assert any("'authOption' was unexpected" in e for e in errors(job, "rayjobs"))
