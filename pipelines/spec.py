"""A pipeline spec: one YAML file describing ingest → pretrain → fine-tune → evaluate stages.

    name: demo
    storage: {root: ./vitpipe-work, endpoint_url: null}   # or s3://bucket/prefix
    tracking_uri: sqlite:///mlflow.db                     # optional, see resolve_tracking_uri
    defaults: {finetune: {model: ViT-Ti/4}}               # per stage kind, under each stage's fields
    stages:
      corpus:   {kind: ingest, source: ./corpus, image_size: 16, patch_size: 4}
      pretrain: {kind: pretrain, inputs: [corpus], steps: 1200}

A stage is `kind`, `inputs` (upstream stage names, or MLflow run ids / `runs:/` / `models:/` URIs) and the fields of
its kind's config model; the stage registry (`pipelines.stages`) says which field each input fills (e.g. fine-tune's
`init` from its pretrain input). The pipeline fills `tracking_uri`/`experiment` for every stage and, unless a stage
sets them, `endpoint_url`, ingest's and embed's `output` (`<root>/data/<stage>`; no two stages write one) and
pretrain/fine-tune's `storage` (`<root>/runs`). `load_spec` (`pipelines.spec_file`) checks it all before anything
runs: a problem is one `SpecError` line naming the file, the stage and the field.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from graphlib import CycleError, TopologicalSorter
from typing import Any, Literal, NamedTuple, NoReturn

from pydantic import (
    BaseModel, ConfigDict, Field, PrivateAttr, SerializerFunctionWrapHandler, ValidationError, ValidationInfo,
    field_validator, model_serializer, model_validator,
)

from pipelines.core.errors import VitpipeError
from pipelines.core.storage import parse_uri
from pipelines.core.uris import Location, resolve_tracking_uri
from pipelines.stages import KINDS, RUN, STAGES, Fill

Kind = Literal[KINDS]  # type: ignore[valid-type]  # the registry's kinds
# Fields the pipeline owns (one tracking store and experiment, the runner's parent run): not per stage.
PIPELINE_OWNED = ("tracking_uri", "experiment", "parent_run_id", "ingest_run_id")
TOP_KEYS = ("name", "storage", "tracking_uri", "experiment", "defaults", "stages")
_STAGE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")  # no dots: `--set STAGE.FIELD=VALUE` splits on them
_RUN_REF = re.compile(r"^([0-9a-f]{32}|runs:/[0-9a-f]{32}(/.*)?|models:/.+)$")


class SpecError(VitpipeError):
    """A spec problem, as one line: `spec FILE: stage 'S' field 'F': cause`."""


def is_run_ref(ref: str) -> bool:
    """True for an existing MLflow run id, `runs:/<id>[/path]` or `models:/...` (an input that is not a stage)."""
    return bool(_RUN_REF.match(ref))


class InputRef(NamedTuple):
    """One resolved input of a stage."""

    ref: str  # as written: a stage name or a run reference
    kind: str  # the upstream stage's kind, or RUN
    fill: Fill


class StorageSpec(BaseModel):
    """Where stage outputs go: a local folder or `s3://bucket/prefix` (credentials from the AWS chain)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: str
    endpoint_url: str | None = None

    @field_validator("root")
    @classmethod
    def _uri(cls, value: str) -> str:
        parse_uri(value)  # refuses other schemes and credentials in the URI
        return value.rstrip("/")


class StageSpec(BaseModel):
    """A stage as written: its kind, its inputs, and its own config fields (everything else in its mapping)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    inputs: list[str] = Field(default_factory=list)
    fields: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        own = {k: v for k, v in data.items() if k not in ("kind", "inputs")}
        return {**{k: data[k] for k in ("kind", "inputs") if k in data}, "fields": own}

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)  # dumped as written in YAML: kind, inputs, then the fields
        return {"kind": out["kind"], "inputs": out["inputs"], **out["fields"]}


class PipelineSpec(BaseModel):
    """A validated pipeline: build it with `load_spec` (or `parse_spec`), never half-checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    storage: StorageSpec
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = Field("vitpipe", min_length=1)
    defaults: dict[Kind, dict[str, Any]] = Field(default_factory=dict)
    stages: dict[str, StageSpec] = Field(min_length=1)
    _source: str = PrivateAttr("<spec>")  # the file, for messages

    @field_validator("storage", mode="before")
    @classmethod
    def _root_only(cls, value: Any) -> Any:
        return {"root": value} if isinstance(value, str) else value  # `storage: s3://b/p` shorthand

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> PipelineSpec:
        if info.context and "source" in info.context:
            self._source = str(info.context["source"])
        for kind, values in self.defaults.items():
            for key in values:
                self._check_key(kind, key, f"defaults '{kind}' field '{key}'")
        for name in self.stages:
            if not _STAGE_NAME.match(name) or name in TOP_KEYS:
                self._fail(f"stage '{name}'", "a stage name is letters, digits, _ or -, starting with a letter, "
                           f"and not one of {', '.join(TOP_KEYS)}")
        for name, stage in self.stages.items():
            for ref in stage.inputs:  # missing stages first, then cycles, then kinds (the registry's inputs alone are acyclic)
                self._input_kind(name, ref)
        self.order()
        for name in self.stages:
            self.inputs_of(name)
        for name in self.stages:
            self._validate_stage(name)
        self._check_outputs()
        return self

    # ------------------------------------------------------------ public API

    def order(self) -> list[str]:
        """Stage names in dependency order; among stages ready together, file order."""
        graph = TopologicalSorter({n: [i for i in s.inputs if i in self.stages] for n, s in self.stages.items()})
        try:
            graph.prepare()
        except CycleError as err:
            cycle = [str(n) for n in err.args[1]]  # each an input of the next
            self._fail(f"stage '{cycle[-1]}' field 'inputs'", f"dependency cycle: {' -> '.join(cycle)} (each an input of the next)")
        rank = {n: i for i, n in enumerate(self.stages)}
        out: list[str] = []
        while graph.is_active():
            ready = sorted(graph.get_ready(), key=rank.__getitem__)
            out.extend(ready)
            graph.done(*ready)
        return out

    def upstream(self, name: str) -> list[str]:
        """The stages `name` reads from (its stage inputs, not run references)."""
        return [r.ref for r in self.inputs_of(name) if r.kind != RUN]

    def inputs_of(self, name: str) -> list[InputRef]:
        """Each input of stage `name` with its kind and the field it fills (checked against the registry's inputs)."""
        stage = self.stages[name]
        allowed = STAGES[stage.kind].inputs
        out: list[InputRef] = []
        where = f"stage '{name}' field 'inputs'"
        for ref in stage.inputs:
            kind = self._input_kind(name, ref)
            if kind not in allowed:
                takes = ", ".join("MLflow run ids" if k == RUN else f"{k} stages" for k in allowed) or "no inputs"
                what = "an MLflow run" if kind == RUN else f"{_a(kind)} stage"
                self._fail(where, f"'{ref}' is {what}; {_a(stage.kind)} stage takes {takes}")
            fill = allowed[kind]
            clash = next((r for r in out if r.fill.field == fill.field), None)
            if clash is not None:
                self._fail(where, f"'{clash.ref}' and '{ref}' both give field '{fill.field}'")
            if fill.field in stage.fields:
                self._fail(f"stage '{name}' field '{fill.field}'", f"set here and by input '{ref}'; keep one")
            out.append(InputRef(ref, kind, fill))
        return out

    def resolved_tracking_uri(self) -> str:
        """The tracking URI every stage (and the parent run) uses."""
        return resolve_tracking_uri(self.tracking_uri)

    def resolved_config(self, name: str) -> dict[str, Any]:
        """Stage `name`'s config fields: kind defaults, under its own fields (overrides applied), plus what the
        pipeline decides (storage, endpoint, tracking) and run-reference inputs. Fields filled from upstream
        stages' outputs are absent: the runner adds them (`config_for`)."""
        stage = self.stages[name]
        fields = set(STAGES[stage.kind].config_model.model_fields)
        config = {**copy.deepcopy(self.defaults.get(stage.kind, {})), **copy.deepcopy(stage.fields)}
        root = self.storage.root  # a local one made absolute: Ray workers run in other directories
        root = root if "://" in root else os.path.abspath(os.path.expanduser(root))
        placed = {"output": f"{root}/data/{name}", "storage": f"{root}/runs",  # shards; Ray Train's checkpoints
                  "endpoint_url": self.storage.endpoint_url}
        for key, value in placed.items():
            if key in fields and config.get(key) is None and value is not None:
                config[key] = value
        if "tracking_uri" in fields:
            config["tracking_uri"] = self.resolved_tracking_uri()
            config["experiment"] = self.experiment
        for ref in self.inputs_of(name):
            if ref.kind == RUN:
                config[ref.fill.field] = ref.ref
            else:  # a default for it gives way to the upstream output
                config.pop(ref.fill.field, None)
        return config

    def config_for(self, name: str, outputs: Mapping[str, Any]) -> BaseModel:
        """Stage `name`'s validated config model, with its inputs filled from `outputs`
        (upstream stage name -> its result object or dict), as the runner calls it."""
        config = self.resolved_config(name)
        for ref in self.inputs_of(name):
            if ref.kind != RUN:
                result = outputs[ref.ref]
                value = result[ref.fill.source] if isinstance(result, Mapping) else getattr(result, ref.fill.source)
                config[ref.fill.field] = value
        return self._validate(name, config)

    # ------------------------------------------------------------ checks

    def _input_kind(self, name: str, ref: str) -> str:
        if ref in self.stages:
            return self.stages[ref].kind
        if is_run_ref(ref):
            return RUN
        self._fail(f"stage '{name}' field 'inputs'",
                   f"no stage '{ref}'{suggest(ref, self.stages)}, and not an MLflow run id, runs:/ or models:/ URI")

    def _validate_stage(self, name: str) -> None:
        stage = self.stages[name]
        for key in stage.fields:
            self._check_key(stage.kind, key, f"stage '{name}' field '{key}'")
        config = self.resolved_config(name)
        model = STAGES[stage.kind].config_model
        filled = {r.fill.field for r in self.inputs_of(name)}
        for kind, fill in STAGES[stage.kind].inputs.items():
            if fill.field not in config and fill.field not in filled and model.model_fields[fill.field].is_required():
                hint = f"an {kind} stage in inputs" if STAGES[kind].shards else "a pretrain stage or run id in inputs"
                self._fail(f"stage '{name}' field '{fill.field}'", f"required: set it or name {hint}")
        self._check_labels(name, stage.kind, config)
        for ref in self.inputs_of(name):
            if ref.kind != RUN:  # a stand-in: the real value exists only once the upstream stage ran
                config[ref.fill.field] = f"<{ref.fill.source} of stage {ref.ref}>"
        self._validate(name, config)

    def _validate(self, name: str, config: dict[str, Any]) -> BaseModel:
        try:
            return STAGES[self.stages[name].kind].config_model.model_validate(config)
        except ValidationError as err:
            first = err.errors()[0]
        # Raised outside the `except`: chained, pydantic's error (which echoes the value) would reach the log.
        field = ".".join(str(p) for p in first["loc"])
        where = f"stage '{name}'" + (f" field '{field}'" if field else "")
        self._fail(where, str(first["msg"]).removeprefix("Value error, "))

    def _check_labels(self, name: str, kind: str, config: dict[str, Any]) -> None:
        # Else found deep in the stage's workers, after its upstream stages ran, as an out-of-bounds target.
        off = [r for r in self.inputs_of(name) if r.kind != RUN and self.resolved_config(r.ref).get("labeled") is False]
        if off and STAGES[kind].needs_labels(config):
            mae = " (objective: mae needs none)" if "objective" in STAGES[kind].config_model.model_fields else ""
            self._fail(f"stage '{name}' field 'inputs'", f"{off[0].kind} stage '{off[0].ref}' is unlabeled "
                       f"(labeled: false), and {_a(kind)} stage needs labels{mae}")

    def _check_outputs(self) -> None:
        # A second stage writing to one place replaces the first's shards: its dependents read the other's data.
        writers: dict[tuple[str | None, Location], str] = {}
        for name in self.stages:
            config = self.resolved_config(name)
            if config.get("output") is not None:
                key = _place(config["output"], config)
                if key in writers:
                    self._fail(f"stage '{name}' field 'output'",
                               f"{key[1].uri} is also the output of stage '{writers[key]}'; each stage needs its own")
                writers[key] = name
        for name in self.stages:
            self._check_data_paths(name, writers)

    def _check_data_paths(self, name: str, writers: Mapping[tuple[str | None, Location], str]) -> None:
        # A path to another stage's output, not named in inputs, is not ordered after that stage: it read
        # whatever the folder held then (nothing yet, or a stale run's shards), and no reuse saw the change.
        kind, config = self.stages[name].kind, self.resolved_config(name)
        for field in {fill.field for fill in STAGES[kind].inputs.values() if fill.source == "output"}:
            value = config.get(field)
            key = _place(value, config) if isinstance(value, str) and not is_run_ref(value) else None
            writer = writers.get(key) if key else None
            if writer is None or writer == name or key is None:  # data in its own output: the config refuses it
                continue
            other, where = self.stages[writer].kind, f"stage '{name}' field '{field}'"
            if STAGES[kind].inputs.get(other, Fill("", "")).field == field:
                self._fail(where, f"{key[1].uri} is the output of stage '{writer}'; name '{writer}' in inputs "
                           "instead, so that it runs first")
            self._fail(where, f"{key[1].uri} is the output of stage '{writer}', {_a(other)} stage, which "
                       f"{_a(kind)} stage cannot read")

    def _check_key(self, kind: str, key: str, where: str) -> None:
        if key in PIPELINE_OWNED:
            self._fail(where, "set by the pipeline for every stage (top-level tracking_uri/experiment), not per stage")
        known = STAGES[kind].config_model.model_fields
        if key not in known:
            self._fail(where, f"unknown key for {_a(kind)} stage{suggest(key, known)}")

    def _fail(self, where: str, message: str) -> NoReturn:
        raise SpecError(f"spec {self._source}: {where}: {message}")


def _place(uri: str, config: Mapping[str, Any]) -> tuple[str | None, Location]:
    """Where `uri` is, as two stages' paths compare: one bucket and prefix on two S3 endpoints are two places."""
    where = parse_uri(uri)
    return (config.get("endpoint_url") if where.scheme == "s3" else None, where)


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def suggest(word: str, choices: Iterable[str]) -> str:
    """A hint naming the closest of `choices` to `word` (" (did you mean 'X'?)"), or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_forced(spec: PipelineSpec, force: Iterable[str]) -> set[str]:
    """The stage names given to `--force`, each checked to be a stage of `spec`."""
    names = set(force)
    unknown = sorted(names - set(spec.stages))
    if unknown:
        raise VitpipeError(f"--force {unknown[0]}: pipeline {spec.name!r} has no such stage; "
                           f"its stages are {', '.join(spec.stages)}")
    return names


__all__ = ["PIPELINE_OWNED", "TOP_KEYS", "InputRef", "Kind", "PipelineSpec", "SpecError", "StageSpec", "StorageSpec",
           "check_forced", "is_run_ref", "suggest"]

