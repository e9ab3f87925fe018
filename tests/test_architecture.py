"""The architecture as rules: imports point down, no cycles, small modules and functions.

    top (cli, demo, runner, jobs, spec, stages)
      -> pipelines.image | pipelines.video | pipelines.corpora
      -> pipelines.training -> pipelines.core -> vit

The layer contracts live in pyproject.toml ([tool.importlinter]); `lint-imports` checks them.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "vit")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# Third-party packages that a function may import itself, and why: each loads in 0.3-3 s (or is an optional
# extra), and the CLI, config validation and spec checks must start without them.
DEFERRABLE = {
    "ray": "starts a runtime and loads ~2 s of modules",
    "mlflow": "loads SQLAlchemy, Flask and friends",
    "torch": "~1.5 s; configs and the CLI validate without it",
    "pyarrow": "only where shards are read or written",
    "boto3": "only where S3 is reached", "botocore": "only where S3 is reached", "urllib3": "botocore's transport",
    "matplotlib": "only where a figure is drawn",
    "av": "the optional 'video' extra",
    "sklearn": "only where the digits corpus is exported",
    "transformers": "reference models in benchmarks", "optuna": "the optional 'bayes' searcher",
    "safetensors": "only where checkpoints are read or written",
    "PIL": "only where images are decoded",
}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _lint_imports(cwd: Path, env_path: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(lint.parent), "PYTHONPATH": str(env_path)})


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(ROOT, ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(("module", "wrong_import", "contract"), [
    ("pipelines/core/errors.py", "import pipelines.image.ingest", "Layers: imports point down"),
    ("pipelines/video/decode.py", "import pipelines.image.patches", "never import each other"),
    ("vit/patches.py", "import mlflow", "vit is plain PyTorch"),
    ("pipelines/image/evaluate.py", "import pipelines.image.finetune", "never imports another stage module"),
])
def test_an_import_against_the_rules_breaks_a_contract(tmp_path: Path, module: str, wrong_import: str,
                                                       contract: str) -> None:
    for name in (*PACKAGES, "pyproject.toml"):
        source = ROOT / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, tmp_path / name)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{wrong_import}  # against the rules, on purpose\n")
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.rstrip().endswith("BROKEN")]
    assert [line for line in broken if contract in line], result.stdout[-3000:]


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.find_modules_directly_imported_by(node) & modules:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.find_modules_directly_imported_by(node):
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_there_are_no_import_cycles_counting_imports_inside_functions() -> None:
    graph = grimp.build_graph(*PACKAGES)  # grimp reads every import statement, function bodies included
    modules = {m for m in graph.modules if m.split(".")[0] in PACKAGES}
    assert _cycles(graph, modules) == []


def test_imports_inside_functions_only_defer_heavy_dependencies() -> None:
    """A function may import a heavy third-party package (DEFERRABLE); anything else it imports at module top,
    or says on the line why it is deferred (`# deferred: ...`)."""
    offenders = []
    for path, tree in _modules():
        lines = path.read_text().splitlines()
        for function in _functions(tree):
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                relative = isinstance(node, ast.ImportFrom) and node.level > 0
                heavy = not relative and all(n.split(".")[0] in DEFERRABLE for n in names)
                said = "# deferred:" in lines[node.lineno - 1] or "# deferred:" in lines[node.lineno - 2]
                if not (heavy or said):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def test_no_module_is_longer_than_one_sitting() -> None:
    long = {str(p.relative_to(ROOT)): n for p, _ in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_longer_than_one_screen() -> None:
    long = {
        f"{path.relative_to(ROOT)}:{f.name}": f.end_lineno - f.lineno + 1
        for path, tree in _modules() for f in _functions(tree) if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_every_pipelines_logger_is_under_vitpipe_whose_handlers_scrub_credentials() -> None:
    # A logger outside "vitpipe" reaches only the root logger: a tracking URI's password in an error
    # it logs is printed as it is, and the record never reaches the command log.
    outside = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "logging.getLogger" and node.args:
                name = node.args[0]
                if not (isinstance(name, ast.Constant) and str(name.value).split(".")[0] in ("vitpipe", "mlflow", "ray")):
                    outside.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert outside == []
