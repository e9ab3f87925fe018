"""How every stage reads its config: a YAML/JSON file or a dict, `--set KEY=VALUE`
overrides, validation at the edge, and one-line errors naming the stage and field; and
the checks shared by stages that turn one stage's output into another (`DataToOutput`)."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError, field_validator

from pipelines.core.storage import parse_uri

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class DataToOutput(BaseModel):
    """Base of a stage config that reads an ingested output (`data`) and writes its own (`output`)."""

    data: str
    output: str

    @field_validator("data", "output")
    @classmethod
    def _valid_uri(cls, value: str) -> str:
        parse_uri(value)  # raises ValueError naming the URI
        return value

    def check_output_apart(self, what: str) -> None:
        """One line if `output` is `data`'s own location: writing `what` there would mix them into the input."""
        if parse_uri(self.data).uri.rstrip("/") == parse_uri(self.output).uri.rstrip("/"):
            raise ValueError(f"output: {self.output} is the data's own location; {what} go elsewhere")


def yaml_syntax_error(err: yaml.YAMLError) -> str:
    """A YAML parse error as a few words with its place: `YAML syntax error at line 2, column 7: <problem>`."""
    mark = getattr(err, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"YAML syntax error{at}: {getattr(err, 'problem', None) or err}"


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`["lr=0.1", "model=ViT-S/16"]` -> `{"lr": 0.1, "model": "ViT-S/16"}` (values parsed as JSON when they can be)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def error_message(error: Mapping[str, Any]) -> str:
    """One pydantic error's message for a user; for a value outside a fixed set, also what was written."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "literal_error":  # pydantic names the choices, not the value it refused
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        close = difflib.get_close_matches(str(error["input"]), choices, n=1)
        message += f"; got {error['input']!r}" + (f" (did you mean '{close[0]}'?)" if close else "")
    return message


def load_stage_config(
    model: type[ConfigT], stage: str, source: str | os.PathLike[str] | dict[str, Any], overrides: dict[str, Any]
) -> ConfigT:
    """Validate `source` (a file path or a dict) plus `overrides` as `model`; errors are one line."""
    if isinstance(source, dict):
        data = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{stage} config {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{stage} config {path}: {yaml_syntax_error(err)}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{stage} config {path} must be a mapping, got {type(data).__name__}")
    data.update(overrides)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        message = error_message(first)
        if not where or message.startswith(where):  # the validator already named the field
            raise ValueError(f"{stage} config: {message}") from None
        raise ValueError(f"{stage} config: {where}: {message}") from None

