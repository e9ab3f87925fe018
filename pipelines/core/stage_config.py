"""How every stage reads its config: a YAML/JSON file or a dict, `--set KEY=VALUE`
overrides, validation at the edge, and one-line errors naming the stage and field; and
the parts stage configs share: the checks of stages that turn one stage's output into
another (`DataToOutput`), the fields of every ingest (`ShardedIngestConfig`), a name to
register a model under (`RegistryName`).

Stage configs import this module, pydantic and nothing heavy (no torch, Ray or
MLflow), so a config is validated before any of them loads."""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from yaml.constructor import ConstructorError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipelines.core.storage import Location, parse_uri
from pipelines.core.uris import is_s3_uri, pattern_root, strip_userinfo

ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _checked_uri(value: str | None) -> str | None:
    """`value` unchanged if it parses as a storage URI (or is None), else `parse_uri`'s ValueError naming it."""
    if value is not None:
        parse_uri(value)
    return value


def _arrow_uri(value: str | None) -> str | None:
    """`_checked_uri`, and refused with an empty folder name on S3 (`s3://b/out//x`): ordinary in a key, but
    pyarrow, which reads and writes shards, manifests and label tables, cannot address it."""
    _checked_uri(value)
    if value is not None and is_s3_uri(value) and "//" in value.strip().split("://", 1)[1].rstrip("/"):
        raise ValueError(f"{strip_userinfo(value)}: an empty folder name ('//') is refused here: pyarrow cannot "
                         "address it")
    return value


class DataToOutput(BaseModel):
    """Base of a stage config that reads an ingested output (`data`) and writes its own (`output`)."""

    data: str
    output: str

    _valid_uris = field_validator("data", "output")(_arrow_uri)

    def check_output_apart(self, what: str) -> None:
        """One line if `output` is `data`'s own location (writing `what` there would mix them into the input) or
        holds it (`data: ./shards`, `output: .`): the output's stale shards, everything under its `shards/` this
        run does not write, would be the data's own files, deleted at the end."""
        data, output = parse_uri(self.data).uri.rstrip("/"), parse_uri(self.output).uri.rstrip("/")
        if data == output:
            raise ValueError(f"output: {self.output} is the data's own location; {what} go elsewhere")
        if data.startswith(output + "/"):
            raise ValueError(f"output: {strip_userinfo(self.output)} holds the data ({strip_userinfo(self.data)}); "
                             f"{what} go elsewhere")


# MLflow refuses '/' and ':' in a registered model's name; quotes would break our version search.
_NAME_BAD = ("/", ":", "'", '"')


def check_registry_name(name: str | None) -> str | None:
    """`name` for registering a model under, or a ValueError naming what MLflow's registry cannot take."""
    if name is None:
        return None
    if not name.strip():
        raise ValueError("registry_model must not be empty")
    bad = [c for c in _NAME_BAD if c in name]
    if bad:
        raise ValueError(f"registry_model {name!r}: a registered model's name cannot contain "
                         f"{' or '.join(map(repr, bad))}")
    return name


RegistryName = Annotated[str | None, AfterValidator(check_registry_name)]


# Config fields that do not change the shards written, so they stay out of the output's fingerprint.
INGEST_NOT_IDENTITY = {
    "output", "endpoint_url",  # where the shards go and which endpoint serves the objects
    "concurrency", "io_threads", "list_concurrency",  # how fast
    "max_reject_fraction",  # how strict: it decides whether the stage fails, not what it writes
}


class ShardedIngestConfig(BaseModel):
    """Fields every ingest stage shares (`pipelines.image.ingest`, `pipelines.video.ingest`): where the
    objects are, where the shards go, splits, sharding, strictness. Holds no credentials."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str  # s3://bucket/prefix or a local directory
    output: str  # s3://bucket/prefix or a local directory
    manifest: str | None = None  # CSV/Parquet with columns key,label[,split]; keys relative to source
    endpoint_url: str | None = None  # S3-compatible endpoint; default AWS_ENDPOINT_URL(_S3) or AWS
    val_fraction: float = Field(0.1, ge=0.0, le=1.0)
    test_fraction: float = Field(0.0, ge=0.0, le=1.0)
    max_reject_fraction: float = Field(0.01, ge=0.0, le=1.0)
    seed: int = 0
    shard_size: int = Field(512, ge=1)
    mix_window: int = Field(8, ge=1)  # shards whose keys are shuffled together
    concurrency: int | None = Field(None, ge=1)  # shard tasks at once; None: as many as CPUs allow
    io_threads: int = Field(8, ge=1, le=64)  # objects fetched or in flight per shard task, at most
    list_concurrency: int = Field(16, ge=1, le=256)  # S3 class folders listed at once, by Ray tasks
    max_object_bytes: int = Field(64 * 2**20, ge=1)  # larger objects are rejected without being read
    compression: Literal["none", "snappy", "lz4", "zstd"] = "lz4"

    _valid_source = field_validator("source")(_checked_uri)  # listed and read through boto3: any key
    _valid_uris = field_validator("output", "manifest")(_arrow_uri)

    @model_validator(mode="after")
    def _consistent_splits_and_paths(self) -> ShardedIngestConfig:
        if self.val_fraction + self.test_fraction > 1.0:
            raise ValueError(f"val_fraction + test_fraction = {self.val_fraction + self.test_fraction} exceeds 1")
        source, output = parse_uri(pattern_root(self.source)), parse_uri(self.output)
        if source.uri.rstrip("/") == output.uri.rstrip("/"):
            raise ValueError(f"output {self.output} must differ from source")
        if _inside(output, source):
            raise ValueError(f"output {self.output} is inside source {self.source}: its shards would be read as input")
        return self

    def identity(self) -> dict[str, Any]:
        """The fields that decide the output's content (not how fast or how strictly it is made)."""
        return self.model_dump(mode="json", exclude=INGEST_NOT_IDENTITY)


def _inside(inner: Location, outer: Location) -> bool:
    """Whether `inner` lies under `outer` (same bucket or filesystem; local paths with links resolved)."""
    if (inner.scheme, inner.bucket) != (outer.scheme, outer.bucket):
        return False
    if inner.scheme == "file":
        return os.path.realpath(inner.path).startswith(os.path.realpath(outer.path).rstrip("/") + "/")
    return not outer.path or inner.path.startswith(outer.path.rstrip("/") + "/")


class _OneKeyEach(yaml.SafeLoader):
    # PyYAML keeps the last of a key given twice in one mapping: a stage written twice would vanish silently.
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for k, _ in node.value:  # a merged anchor's (`<<: *a`) keys may be overridden: not its own
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if seen.setdefault(self.construct_object(k), k) is not k:
                    raise ConstructorError(None, None, f"key {k.value!r} appears twice in one mapping", k.start_mark)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """`text` parsed as YAML (safe types only); a key given twice in one mapping is a `yaml.YAMLError`."""
    return yaml.load(text, Loader=_OneKeyEach)  # noqa: S506  (a SafeLoader)


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


def _set_path(data: dict[str, Any], key: str, value: Any, stage: str) -> None:
    """`data[a][b] = value` for `--set a.b=value`: a dotted key sets one key of a mapping field, the rest kept."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{stage} config: --set {key}: '{part}' is not a mapping")
    node[last] = value


def load_stage_config(
    model: type[ConfigT], stage: str, source: str | os.PathLike[str] | dict[str, Any], overrides: dict[str, Any]
) -> ConfigT:
    """Validate `source` (a file path or a dict) plus `overrides` as `model`; errors are one line."""
    if isinstance(source, dict):
        data = copy.deepcopy(source)  # a nested --set must not write into the caller's mapping
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{stage} config {path} does not exist")
        try:
            data = load_yaml(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{stage} config {path}: {yaml_syntax_error(err)}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{stage} config {path} must be a mapping, got {type(data).__name__}")
    for key, value in overrides.items():
        _set_path(data, key, value, stage)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        message = error_message(first)
        if not where or message.startswith(where):  # the validator already named the field
            raise ValueError(f"{stage} config: {message}") from None
        raise ValueError(f"{stage} config: {where}: {message}") from None

