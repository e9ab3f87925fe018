"""Turns a KubeRay CRD into the trimmed JSON schema that tests/test_kuberay_schema.py validates manifests against.

The vendored files here came from ray-project/kuberay at tag v1.5.1 (commit 9e8a2c085b7b7c96cf7cc5d857787bc2d78406c6),
the oldest release the manifests claim to support (authOptions first appears in it):

    git -C kuberay show v1.5.1:ray-operator/config/crd/bases/ray.io_rayclusters.yaml > rayclusters.yaml
    python tests/data/kuberay/trim_crd.py rayclusters.yaml tests/data/kuberay/rayclusters-v1.5.1.schema.json.gz
    (the same for ray.io_rayjobs.yaml -> rayjobs-v1.5.1.schema.json.gz)

Source sha256: rayclusters 9b5ada939fdfd0edb5a6cf48f24a63bd792254c264967dd0930155a3941c2557,
rayjobs 7825ddddb04eb775d6cf6c2fd4ad4d8eeff3cb7122dac95218ca1525fd85c91f.

What changes: the `v1` version's openAPIV3Schema is kept with its descriptions and `x-kubernetes-*` hints dropped
(a 900 kB CRD becomes an 8 kB gzip). Every object schema that lists its properties and says nothing about others
gets `additionalProperties: false`, because `kubectl apply` (strict field validation, the default) refuses
fields the schema does not know, and a non-strict server drops them silently. The CRD embeds Kubernetes' own
core/v1 PodTemplateSpec, so containers, resources, env and volumes are checked too. CEL rules
(`x-kubernetes-validations`) are not evaluated; in v1.5.1 they only concern managedBy and deletionStrategy.
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any

import yaml


def strict(node: Any) -> Any:
    """`node` without descriptions or Kubernetes hints, and closed to unknown fields where it lists its own."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "description" or (key.startswith("x-kubernetes-") and key != "x-kubernetes-preserve-unknown-fields"):
            continue
        # `properties` maps field names to schemas: trim the schemas, never drop a field (one may be named "description")
        out[key] = {name: strict(schema) for name, schema in value.items()} if key == "properties" else strict(value)
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def trimmed_schema(crd: dict[str, Any]) -> dict[str, Any]:
    [v1] = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


if __name__ == "__main__":
    source, target = sys.argv[1:3]
    with open(source) as f:
        schema = trimmed_schema(yaml.safe_load(f))
    # mtime=0: the same CRD always gives the same bytes
    data = gzip.compress(json.dumps(schema, separators=(",", ":"), sort_keys=True).encode(), 9, mtime=0)
    with open(target, "wb") as f:
        f.write(data)
