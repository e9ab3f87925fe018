"""Every option the cluster configs give `ray start` is one Ray 2.60's `ray start` has: an unknown one stops the
node at boot ("No such option"), on AWS in a start command, on KubeRay as a rayStartParams key (`--KEY=VALUE`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.scripts.scripts import start

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
OPTIONS = {option for param in start.params for option in param.opts}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / name).read_text())


def ray_start_options(command: str) -> list[str]:
    """The options after `ray start` in a shell command (`$(...)` values are dropped with their option's value)."""
    words = shlex.split(re.sub(r"\$\(\(.*?\)\)|\$\(.*?\)", "X", command))
    at = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["ray", "start"])
    return [w.split("=", 1)[0] for w in words[at + 2:] if w.startswith("-")]


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_aws_start_command_uses_only_options_ray_start_has(key: str) -> None:
    used = ray_start_options(load("aws.yaml")[key][-1])
    assert used and [o for o in used if o not in OPTIONS] == []


def kuberay_start_params() -> list[tuple[str, dict[str, str]]]:
    specs = {"raycluster": load("kuberay/raycluster.yaml")["spec"],
             "rayjob": load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]}
    return [(f"{name}:{group.get('groupName', 'head')}", group.get("rayStartParams") or {})
            for name, spec in specs.items() for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]]


@pytest.mark.parametrize("where, params", kuberay_start_params(), ids=[w for w, _ in kuberay_start_params()])
def test_kuberay_start_params_are_options_ray_start_has(where: str, params: dict[str, str]) -> None:
    assert [k for k in params if f"--{k}" not in OPTIONS] == []


def test_option_check_refuses_a_misspelt_option() -> None:
    assert ray_start_options("RAY_AUTH_MODE=token ray start --head --object-store-memroy=1") == [
        "--head", "--object-store-memroy"]
    assert "--object-store-memroy" not in OPTIONS
