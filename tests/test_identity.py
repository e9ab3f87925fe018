"""Every field of every stage config is part of the stage's identity, unless its stage lists it as not.

For each registered stage (`pipelines.stages.STAGES`) every field of its config model is changed to
another valid value, one at a time, and the identity the stage reuses work by must change, or, for a
field on the stage's commented `NOT_IDENTITY` list (where to record, how fast, how to retry), must not.
Identities are functions of the config and the input's manifest, so no Ray and no training run here;
the fake manifest's content hash follows the `data` URI, as different data would have different content.
"""

from __future__ import annotations

import hashlib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, SecretStr, ValidationError

import vit
from pipelines.core import tracking
from pipelines.core.stage_config import INGEST_NOT_IDENTITY
from pipelines.image import embed, evaluate, finetune, pretrain
from pipelines.image.configs import EmbedConfig, EvaluateConfig, FinetuneConfig, IngestConfig, PretrainConfig
from pipelines.stages import STAGES
from pipelines.training.starting_weights import Origin, init_kind
from pipelines.training.step import resolve_precision
from pipelines.video import features, train as video_train
from pipelines.video.configs import VideoFeaturesConfig, VideoIngestConfig, VideoTrainConfig

RUN_A, RUN_B = "a" * 32, "b" * 32
TINY = {"depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}
# Values every stage's dict of model fields gets, each alone: architecture fields whose names hold "token".
TOKEN_OVERRIDES = [{"class_token": True, "pool": "gap"}, {"global_tokens": 4}]
# Valid changed values for fields whose type alone does not give one (each must change the identity).
SPECIFIC: dict[str, list[Any]] = {
    "model": ["ViT-S/16"],
    "backbone": ["ViT-S/4"],
    "metric": ["val_loss"],
    "mode": ["min"],
    "vtn": [{"window": 4}],
    "search_space": [{"lr": {"grid": [0.01, 0.1]}, "steps": 500}],
    "shots": [[1, 5, 10, 25, 50]],
    "eval_modes": [["full_video"]],
    "model_overrides": TOKEN_OVERRIDES,
    "backbone_overrides": [{"class_token": True, "pool": "gap"}, {"layer_norm_eps": 1e-5}],
}


def manifest_of(config: BaseModel) -> dict[str, Any]:
    """A stand-in for the input's manifest: its content hash follows `data`."""
    data = getattr(config, "data", "")
    return {"content_hash": "sha256:" + hashlib.sha256(data.encode()).hexdigest(), "classes": ["a", "b", "c"]}


def origin_of(init: str | None) -> Origin:
    """What a starting-weights reference names, as `starting_origin` would report it for a bare run id or a
    checkpoint whose files are left unread here."""
    kind = init_kind(init)
    return Origin(kind, init or "none", init if kind == "run" else None)


def features_identity(config: VideoFeaturesConfig) -> dict[str, Any]:
    manifest = manifest_of(config)
    initial, backbone = features.load_backbone(config, manifest)
    bf16 = resolve_precision(config.precision, torch.device("cpu")) is not None
    return features.run_identity(config, manifest, backbone, initial.frame_size, bf16)


def embed_identity(config: EmbedConfig) -> dict[str, Any]:
    """The embed stage's identity, with stand-ins for what it resolves: the weights' hash (following `init`,
    or the scratch model's fields), the model's config, the resolution, device and precision."""
    drawn = config.init or f"scratch:{config.model}:{sorted(config.model_overrides.items())}:{config.seed}"
    weights = "sha256:" + hashlib.sha256(drawn.encode()).hexdigest()
    model_config = {"name": config.model, **config.model_overrides}
    device = "cuda" if config.num_gpus else "cpu"
    precision = "bf16" if config.precision == "bf16" else "fp32"
    return embed.run_identity(config, manifest_of(config), weights, model_config, config.resolution or 16,
                              precision, device)


@dataclass
class Case:
    """A stage's config model, a valid base config, its identity function and its non-identity list."""

    model: type[BaseModel]
    base: dict[str, Any]
    identity: Callable[[Any], dict[str, Any]]
    not_identity: set[str]
    unused: Callable[[Any], set[str]] = lambda config: set()  # fields the base config's mode ignores


def _other_sampling_fields(config: VideoIngestConfig) -> set[str]:
    """The video ingest's sampling fields that belong to the mode the config does not use."""
    other = config.model_copy(update={"sampling": "clips" if config.sampling == "full" else "full"})
    return set(other.sampling_settings()) - set(config.sampling_settings())


def cases() -> dict[str, list[Case]]:
    """Per stage kind, the base configs whose every field is perturbed."""
    ingest_id = lambda c: c.identity()  # noqa: E731 — the fingerprint is a hash of it
    vingest = dict(source="/src", output="/out", frame_size=16, shard_size=2)
    video = {"data": "/videos", "backbone": "ViT-Ti/4", "backbone_overrides": TINY, "frame_size": 8}
    return {
        "ingest": [Case(IngestConfig, dict(source="/src", output="/out", image_size=16, patch_size=4),
                        ingest_id, INGEST_NOT_IDENTITY)],
        "video_ingest": [Case(VideoIngestConfig, {**vingest, "sampling": mode}, ingest_id, INGEST_NOT_IDENTITY,
                              _other_sampling_fields) for mode in ("full", "clips")],
        "pretrain": [Case(PretrainConfig,
                          {"data": "/data", "steps": 10, "warmup_steps": 1, "model": "ViT-Ti/16", "model_overrides": TINY},
                          lambda c: pretrain.run_identity(c, manifest_of(c)), pretrain.NOT_IDENTITY)],
        "finetune": [Case(FinetuneConfig, {"data": "/data", "init": RUN_A, "model": "ViT-Ti/16",
                                                    "model_overrides": {"dropout": 0.1}},
                          lambda c: finetune.run_identity(c, manifest_of(c), origin_of(c.init)), finetune.NOT_IDENTITY)],
        "evaluate": [Case(EvaluateConfig, {"data": "/data", "init": RUN_A},
                          lambda c: evaluate.run_identity(c, manifest_of(c), origin_of(c.init), c.resolution or 16),
                          evaluate.NOT_IDENTITY)],
        "embed": [Case(EmbedConfig, {"data": "/data", "output": "/embeddings", "model": "ViT-Ti/16",
                                           "model_overrides": TINY}, embed_identity, embed.NOT_IDENTITY)],
        "video_train": [Case(VideoTrainConfig, {**video, "steps": 10, "warmup_steps": 1},
                             lambda c: video_train.run_identity(c, manifest_of(c), origin_of(c.init)), video_train.NOT_IDENTITY)],
        "video_features": [Case(VideoFeaturesConfig, {**video, "output": "/features"}, features_identity,
                                features.NOT_IDENTITY)],
    }


def candidates(name: str, annotation: Any, value: Any, checkpoint: str) -> tuple[list[Any], str]:
    """Changed values for a field, and which of them must change the identity: "each" (all valid), "any"
    (a literal's choices: "auto" may resolve to the same one), or "first" (the first valid one)."""
    if name in SPECIFIC:
        return SPECIFIC[name], "each"
    if name == "init":
        return [checkpoint if value is None else RUN_B], "first"
    choices = _literal_choices(annotation)
    if choices:
        return [c for c in choices if c != value], "any"
    if isinstance(value, bool) or annotation is bool:
        return [not value], "first"
    if isinstance(value, int) or _allows(annotation, int):
        base = value if isinstance(value, int) else 0
        return [v for v in (base + 1, base * 2, base + 2, base - 1, 8, 64, 256) if v != value], "first"
    if isinstance(value, float) or _allows(annotation, float):
        base = value if isinstance(value, float) else 0.5
        return [v for v in (base + 0.05, base * 0.5, base + 1e-5, base * 2 + 0.1, 0.25) if v != value], "first"
    if isinstance(value, tuple):
        return [tuple(v * 0.9 for v in value)], "first"
    if isinstance(value, dict) or _allows(annotation, dict):
        return [{**(value or {}), "CPU": 2.0}, {"x": 1}], "first"
    if isinstance(value, str) or _allows(annotation, str):
        # A path for the fields that take one, else a plain name (a registered model's cannot hold '/').
        return ([f"{value}-2"] if value else ["/elsewhere", "elsewhere"]), "first"
    raise AssertionError(f"field {name}: no changed value for {annotation!r}; add one to SPECIFIC")


def _literal_choices(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    return [c for a in args for c in _literal_choices(a)]


def _allows(annotation: Any, kind: type) -> bool:
    """True when `annotation` is `kind` (or `kind[...]`), alone or as a member of a union."""
    if annotation is kind or typing.get_origin(annotation) is kind:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_allows(a, kind) for a in typing.get_args(annotation))
    return False


def _digest(case: Case, field: str, value: Any) -> str | None:
    """The identity hash of the base config with `field` set to `value`; None when the config or the stage
    (building its backbone) refuses the value."""
    try:
        return tracking.config_hash(case.identity(case.model.model_validate({**case.base, field: value})))
    except (ValidationError, ValueError):
        return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A project checkpoint directory another backbone can start from."""
    model = vit.create_model("ViT-Ti/4", image_size=8, num_classes=3, **TINY)
    return str(vit.save_checkpoint(model, Path(tmp_path_factory.mktemp("ckpt")) / "ckpt"))


def test_every_registered_stage_has_a_case_and_its_non_identity_fields_exist():
    all_cases = cases()
    assert set(all_cases) == set(STAGES)
    for kind, stage_cases in all_cases.items():
        for case in stage_cases:
            assert case.model is STAGES[kind].config_model
            assert case.not_identity <= set(case.model.model_fields), kind


@pytest.mark.parametrize("kind", list(STAGES))
def test_every_field_of_a_stage_config_changes_its_identity_unless_listed_as_not(kind, checkpoint):
    for case in cases()[kind]:
        base = case.model.model_validate(case.base)
        digest = tracking.config_hash(case.identity(base))
        for field, info in case.model.model_fields.items():
            if field in case.unused(base):
                continue
            values, rule = candidates(field, info.annotation, getattr(base, field), checkpoint)
            valid = [(v, d) for v in values if (d := _digest(case, field, v)) is not None]
            assert valid, f"{kind}.{field}: none of {values!r} is a valid value"
            if rule == "each":
                assert len(valid) == len(values), f"{kind}.{field}: not every one of {values!r} is valid"
            if rule == "first" or field in case.not_identity:
                valid = valid[:1]
            same = [v for v, d in valid if d == digest]
            if field in case.not_identity:
                assert same, f"{kind}.{field} is listed as not identity, but {valid[0][0]!r} changes the identity"
            elif rule == "any":
                assert len(same) < len(valid), f"{kind}.{field}: no other choice of {values!r} changes the identity"
            else:
                assert not same, f"{kind}.{field}: {same!r} leave(s) the identity unchanged"


def test_class_token_and_global_tokens_overrides_reach_the_identity_and_the_params():
    base = pretrain.load_config({"data": "/data", "steps": 10, "warmup_steps": 1, "model_overrides": TINY})
    digest = tracking.config_hash(pretrain.run_identity(base, manifest_of(base)))
    for extra in ({"class_token": False, "pool": "gap"}, {"global_tokens": 4}):
        changed = base.model_copy(update={"model_overrides": {**TINY, **extra}})
        assert tracking.config_hash(pretrain.run_identity(changed, manifest_of(changed))) != digest
        params = tracking.flatten(tracking.redact(changed.model_dump(mode="json")))
        assert all(f"model_overrides.{k}" in params for k in extra)


def test_credentials_are_scrubbed_by_exact_name_and_by_secret_type():
    tree = {"aws_secret_access_key": "S", "AWS_SESSION_TOKEN": "T", "token": "t", "password": "p",
            "api_key": "k", "db": {"secret": SecretStr("x"), "key": SecretStr("y")},
            "class_token": True, "global_tokens": 4, "secret_sauce_depth": 2, "tokenizer": "bpe"}
    assert tracking.redact(tree) == {"db": {}, "class_token": True, "global_tokens": 4, "secret_sauce_depth": 2,
                                     "tokenizer": "bpe"}


def test_a_pretrain_field_added_later_keeps_earlier_runs_identity_at_its_default():
    base = pretrain.load_config({"data": "/data", "steps": 10, "warmup_steps": 1, "model_overrides": TINY})
    assert not set(pretrain.LATER_FIELDS) & set(pretrain.run_identity(base, manifest_of(base)))
    on_device = base.model_copy(update={"augment_on": "device"})
    assert pretrain.run_identity(on_device, manifest_of(on_device))["augment_on"] == "device"


# The stages that start from weights `init` names, each with a base config and its identity given an origin.
STARTING = {
    "finetune": (lambda: FinetuneConfig(data="/data", init=RUN_A, model="ViT-Ti/16"),
                 lambda c, o: finetune.run_identity(c, manifest_of(c), o)),
    "evaluate": (lambda: EvaluateConfig(data="/data", init=RUN_A),
                 lambda c, o: evaluate.run_identity(c, manifest_of(c), o, 16)),
    "video_train": (lambda: VideoTrainConfig(data="/videos", init=RUN_A, steps=10, warmup_steps=1),
                    lambda c, o: video_train.run_identity(c, manifest_of(c), o)),
}


@pytest.mark.parametrize("kind", list(STARTING))
def test_an_init_that_now_names_another_run_changes_the_identity(kind):
    """`models:/name@champion` or `/latest` moving to another version: the same string, other weights."""
    make, identity = STARTING[kind]
    config = make().model_copy(update={"init": "models:/vit@champion"})
    before, after = (Origin("registry", "models:/vit@champion", run) for run in (RUN_A, RUN_B))
    assert tracking.config_hash(identity(config, before)) != tracking.config_hash(identity(config, after))


@pytest.mark.parametrize("kind", list(STARTING))
def test_a_checkpoint_whose_files_changed_changes_the_identity(kind):
    make, identity = STARTING[kind]
    config = make().model_copy(update={"init": "s3://bucket/ckpt"})
    before, after = (Origin("checkpoint", "s3://bucket/ckpt", None, digest) for digest in ("s3-etags:1", "s3-etags:2"))
    assert tracking.config_hash(identity(config, before)) != tracking.config_hash(identity(config, after))


@pytest.mark.parametrize("kind", list(STARTING))
def test_a_run_named_start_keeps_the_identity_it_had_before_files_were_digested(kind):
    """Runs are immutable, so a start from a run adds no digest: its finished runs stay reusable."""
    make, identity = STARTING[kind]
    assert "init_content" not in identity(make(), Origin("run", RUN_A, RUN_A))


def test_a_video_run_from_a_run_id_or_from_scratch_keeps_the_identity_recorded_before_origins():
    """A run id already pins its run; only an alias, `latest` or files add to a video run's identity."""
    config = STARTING["video_train"][0]()
    scratch = config.model_copy(update={"init": None, "backbone": "ViT-Ti/4", "backbone_overrides": TINY})
    for c, origin in ((config, Origin("run", RUN_A, RUN_A)), (scratch, Origin("scratch", "none", None))):
        identity = video_train.run_identity(c, manifest_of(c), origin)
        assert not {"init_source_run", "init_content"} & set(identity)
