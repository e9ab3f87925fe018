"""pyproject.toml declares what the code imports: every third-party top-level import of pipelines/ and
vit/ comes from a distribution in [project] dependencies or a user extra, and every import of tests/
from one that `dev` brings. Checked over the ASTs (imports inside functions count) against the
distributions installed here."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SELF = canonicalize_name(PROJECT["name"])


def top_level_imports(folder: Path) -> dict[str, str]:
    """Absolute top-level module names imported anywhere under `folder`, each with one file importing it."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def declared(groups: list[str]) -> set[str]:
    """Distribution names that [project] dependencies plus the named extras bring, self-references followed."""
    names: set[str] = set()
    todo = [*PROJECT["dependencies"], *(r for g in groups for r in PROJECT["optional-dependencies"][g])]
    while todo:
        requirement = Requirement(todo.pop())
        name = canonicalize_name(requirement.name)
        if name == SELF:
            todo += [r for extra in requirement.extras for r in PROJECT["optional-dependencies"][extra]]
        else:
            names.add(name)
    return names


def undeclared(imports: dict[str, str], local: set[str], allowed: set[str]) -> list[str]:
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(imports.items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported in {where}) is not installed, so its distribution is unknown")
        elif not dists & allowed:
            problems.append(f"{module} (imported in {where}) comes from {sorted(dists)}, not declared")
    return problems


@pytest.mark.parametrize("package", ["pipelines", "vit"])
def test_every_third_party_import_of_the_code_is_declared(package: str) -> None:
    user_extras = [g for g in PROJECT["optional-dependencies"] if g != "dev"]
    assert undeclared(top_level_imports(ROOT / package), {"pipelines", "vit"}, declared(user_extras)) == []


def test_every_third_party_import_of_the_tests_is_declared_for_dev() -> None:
    local = {"pipelines", "vit", "tests", "benchmarks"} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    assert undeclared(top_level_imports(ROOT / "tests"), local, declared(["dev"])) == []


def test_video_and_bayes_are_extras_and_dev_includes_them() -> None:
    extras = PROJECT["optional-dependencies"]
    assert [Requirement(r).name for r in extras["video"]] == ["av"]
    assert [Requirement(r).name for r in extras["bayes"]] == ["optuna"]
    assert {"av", "optuna"} <= declared(["dev"])


def test_ray_is_bounded_to_the_tested_release() -> None:
    ray = next(Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "ray")
    tested = importlib.metadata.version("ray")
    assert ray.specifier.contains(tested)
    assert not ray.specifier.contains("2.51.0")  # no token authentication before 2.52
    major, minor = map(int, re.match(r"(\d+)\.(\d+)", tested).groups())
    assert not ray.specifier.contains(f"{major}.{minor + 1}.0")  # newer Ray is untested
