"""A spec file read: its YAML parsed, `--set` overrides applied, and the result validated into a `PipelineSpec`.

Every problem is one `SpecError` line naming the file and, where there is one, the stage and the field.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipelines.core.stage_config import error_message, load_yaml, parse_overrides, yaml_syntax_error
from pipelines.spec import TOP_KEYS, PipelineSpec, SpecError, suggest


def _where(loc: Sequence[Any]) -> str:
    """A pydantic error location in spec terms."""
    parts = [str(p) for p in loc if p != "[key]"]
    if len(parts) >= 2 and parts[0] == "stages":
        field = [p for p in parts[2:] if p != "fields"]
        return f"stage '{parts[1]}'" + (f" field '{'.'.join(field)}'" if field else "")
    if len(parts) >= 2 and parts[0] == "defaults":
        return f"defaults '{parts[1]}'" + (f" field '{'.'.join(parts[2:])}'" if parts[2:] else "")
    return f"field '{'.'.join(parts)}'" if parts else "top level"


def _apply_overrides(data: dict[str, Any], overrides: Sequence[str], source: str) -> None:
    """`--set STAGE.FIELD[.KEY...]=VALUE` (or a top-level key such as `storage.root=...`) into the raw spec.

    `--set STAGE.FIELD.KEY=V` on a mapping the stage takes from `defaults` starts from a copy of that default
    (a stage's own mapping replaces the default as a whole): one key changes, the default's others stay."""
    try:
        values = parse_overrides(overrides)
    except ValueError as err:
        raise SpecError(f"spec {source}: {err}") from None
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    defaults = data.get("defaults") if isinstance(data.get("defaults"), dict) else {}
    for key, value in values.items():
        path = key.split(".")
        if path[0] in stages:
            node, rest = stages[path[0]], path[1:]
            kind = node.get("kind") if isinstance(node, dict) else None
            default = defaults.get(kind, {}) if isinstance(kind, str) else {}  # that of the stage's kind
        elif path[0] in TOP_KEYS:
            node, rest, default = data, path, {}
        else:
            raise SpecError(f"spec {source}: --set {key}: no stage '{path[0]}'{suggest(path[0], stages)}")
        if not rest or not isinstance(node, dict):
            raise SpecError(f"spec {source}: --set {key}: expected STAGE.FIELD=VALUE")
        for part in rest[:-1]:
            default = default.get(part) if isinstance(default, dict) else None
            node = node.setdefault(part, copy.deepcopy(default) if isinstance(default, dict) else {})
            if not isinstance(node, dict):
                raise SpecError(f"spec {source}: --set {key}: '{part}' is not a mapping")
        node[rest[-1]] = value


def parse_spec(data: Any, source: str = "<spec>", overrides: Sequence[str] = ()) -> PipelineSpec:
    """Validate a spec given as a mapping (e.g. parsed YAML); `source` names it in messages."""
    if not isinstance(data, dict):
        raise SpecError(f"spec {source}: must be a mapping of {', '.join(TOP_KEYS)}, got {type(data).__name__}")
    data = copy.deepcopy(data)
    _apply_overrides(data, overrides, source)
    try:
        return PipelineSpec.model_validate(data, context={"source": source})
    except ValidationError as err:
        first = err.errors()[0]
        message = "unknown key" if first["type"] == "extra_forbidden" else error_message(first)
        raise SpecError(f"spec {source}: {_where(first['loc'])}: {message}") from None


def load_spec(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> PipelineSpec:
    """Read, override (`--set STAGE.FIELD=VALUE`) and validate a spec file; `SpecError` on any problem."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        cause = "no such file" if isinstance(err, FileNotFoundError) else f"cannot read ({err.strerror})"
        raise SpecError(f"spec {source}: {cause}") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as err:
        raise SpecError(f"spec {source}: {yaml_syntax_error(err)}") from None
    return parse_spec(data, source, overrides)


__all__ = ["load_spec", "parse_spec"]
