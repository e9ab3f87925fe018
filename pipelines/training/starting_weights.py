"""Where a transfer stage's starting weights come from.

`init` in a fine-tune, evaluate, embed or video config names one of:

* nothing (`None` / "none"): a fresh model of `model` (from-scratch baseline);
* an MLflow run: `runs:/<run_id>/<artifact path>` or a bare run id, meaning its
  `checkpoints/final` (what the pretrain stage logs);
* a registered model version: `models:/<name>/<version>`, `models:/<name>/latest`
  or `models:/<name>@<alias>` (e.g. `@champion`);
* a logged model, `models:/<model id>`: the `model_uri` a fine-tune hands on (a pipeline's evaluate or
  embed stage starts from it);
* a project checkpoint directory (`model.safetensors` + `config.json`), local or
  `s3://bucket/prefix` — e.g. a Ray Train checkpoint of the pretrain stage;
* a published timm or Hugging Face ViT weights file or directory on local disk,
  read through `vit.load_pretrained` into the architecture `model` names.

Three steps, each reading no more than it needs:

* `starting_origin`: what names the weights, from metadata alone — the MLflow run
  behind a run or registered version (the version an alias named, pinned), or a
  digest of a folder's or file's bytes (ETags on S3). A stage's identity holds it.
* `starting_config`: the model's config, from a checkpoint's `config.json` alone.
* `fetch_starting_weights`: the in-memory ViT. From a run, a registered version or
  a checkpoint directory it reads exactly two files, `config.json` and
  `model.safetensors` (`vit.load_checkpoint`): nothing found there is unpickled
  or run, whatever else the folder holds.

Runs, registered versions and logged models are looked up in `pipelines.training.tracked_weights`.
"""

from __future__ import annotations

import json
import pickle
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import vit
from vit.weights import one_line
from pipelines.core.registry import CHECKPOINT_FILES
from pipelines.core.storage import open_store
from pipelines.core.uris import is_s3_uri, strip_userinfo
from pipelines.training.tracked_weights import (check_run, registered_version, registry_files, run_and_artifact,
                                               run_files)
from pipelines.training.weights_digest import check_unchanged, content_digest, foreign_path

Kind = Literal["scratch", "run", "registry", "checkpoint", "foreign"]
# Fields that decide the weights' shapes; image_size and num_classes are what transfer changes.
ARCH_FIELDS = (
    "patch_size", "in_channels", "embed_dim", "depth", "num_heads", "mlp_dim", "pool",
    "class_token", "pos_embed", "representation_size", "qkv_bias", "hybrid",
)
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Origin:
    """Where starting weights come from, known without fetching them."""

    kind: Kind
    source: str  # the `init` as given (userinfo stripped), "none" for scratch
    run_id: str | None  # the MLflow run that produced the weights, when known
    content: str | None = None  # a digest of the weights' files, where no MLflow run names them
    version: str | None = None  # "name/N": the registered version an alias or `latest` named when looked up


def starting_origin(init: str | None, tracking_uri: str, endpoint_url: str | None = None) -> Origin:
    """Classify `init` and find what names its weights without downloading them: the MLflow run behind a run
    or registered version, or a digest of a checkpoint's or weights file's bytes (its ETags on S3). All that
    a stage's identity needs, so that a finished run is found before any checkpoint is fetched, and a folder
    or alias that now holds other weights is never taken for the one a finished run started from."""
    kind = init_kind(init)
    run_id = version = None
    if kind == "run":
        run_id = run_and_artifact(str(init))[0]
        check_run(run_id, tracking_uri)
    elif kind == "registry":
        found = registered_version(str(init), tracking_uri)
        run_id, version = found.run_id, found.pin
    content = content_digest(kind, str(init), endpoint_url)
    return Origin(kind, "none" if kind == "scratch" else strip_userinfo(str(init)), run_id, content, version)


def origin_identity(origin: Origin) -> dict[str, str | None]:
    """What a stage's run identity holds of its starting weights: the run that produced them and, where no
    run names them, the digest of their files."""
    return {"init_source_run": origin.run_id, **({"init_content": origin.content} if origin.content else {})}


@dataclass
class StartingWeights:
    """A starting model and where it came from."""

    origin: Origin
    model: Any  # a vit.VisionTransformer

    @property
    def kind(self) -> Kind:
        """What `init` named (`init_kind`)."""
        return self.origin.kind

    @property
    def source(self) -> str:
        """The `init` as given (userinfo stripped), "none" for scratch."""
        return self.origin.source

    @property
    def source_run_id(self) -> str | None:
        """The MLflow run that produced the weights, when known."""
        return self.origin.run_id


def init_kind(init: str | None) -> Kind:
    """Classify an `init` string without touching any storage or server."""
    if init is None or init.strip().lower() in ("", "none", "scratch"):
        return "scratch"
    if init.startswith("runs:/") or _RUN_ID.match(init):
        return "run"
    if init.startswith("models:/"):
        return "registry"
    if is_s3_uri(init):
        return "checkpoint"
    path = Path(init.removeprefix("file://"))
    return "checkpoint" if path.is_dir() and _is_project_checkpoint(path) else "foreign"


def built_at(init: str | None, overrides: dict[str, Any], image_size: int) -> dict[str, Any]:
    """`overrides` for the model `init` names: one built here (from scratch, or for published weights) reads
    `image_size` unless the overrides name one; a checkpoint keeps its own."""
    overrides = dict(overrides)
    if init_kind(init) in ("scratch", "foreign"):
        overrides.setdefault("image_size", image_size)
    return overrides


def _is_project_checkpoint(directory: Path) -> bool:
    config = directory / "config.json"
    if not (config.is_file() and (directory / "model.safetensors").is_file()):
        return False
    try:
        return "arch" in json.loads(config.read_text())
    except ValueError:
        return False


def check_architecture(model: Any, model_name: str, overrides: dict[str, Any], source: str) -> None:
    """Raise a one-line ValueError when `model`'s shapes differ from the requested `model_name` + overrides."""
    wanted = vit.preset_config(model_name, **{k: v for k, v in overrides.items() if k != "num_classes"})
    have = model.config
    diffs = [f"{f} {getattr(have, f)!r} (checkpoint) vs {getattr(wanted, f)!r} (requested)"
             for f in ARCH_FIELDS if getattr(have, f) != getattr(wanted, f)]
    if diffs:
        raise ValueError(f"init {source}: checkpoint architecture does not match model {model_name!r}: {'; '.join(diffs)}")


def _load_files(local: Path, source: str, read: Callable[[Path], Any] = vit.load_checkpoint) -> Any:
    """`read` (`vit.load_checkpoint`) of downloaded files, any failure (not safetensors, wrong config) as one line."""
    try:
        return read(local)
    except Exception as err:  # safetensors' own error type, torch's RuntimeError on a wrong shape, ValueError
        # vit names the folder it read, here a temporary one: the file's own name is what the user can find
        where = re.compile(rf"(checkpoint )?{re.escape(str(local))}/?:? ?")
        cause = where.sub("", one_line(err))[:200] or type(err).__name__
        raise ValueError(f"init {source}: not a loadable vit checkpoint (config.json + model.safetensors): {cause}") from None


def _storage_files(init: str, tmp: str, endpoint_url: str | None, files: tuple[str, ...]) -> tuple[Path, str]:
    store = open_store(init, endpoint_url=endpoint_url)
    source = strip_userinfo(init)
    for name in CHECKPOINT_FILES:
        if not store.exists(name):
            raise ValueError(f"init {source}: not a vit checkpoint (no {name})")
    for name in files:
        Path(tmp, name).write_bytes(store.read(name))
    return Path(tmp), source


def _checkpoint_files(origin: Origin, init: str, tmp: str, tracking_uri: str, endpoint_url: str | None,
                      files: tuple[str, ...] = CHECKPOINT_FILES) -> tuple[Path, str]:
    """A run's, a registered version's or a checkpoint folder's `files`, downloaded into `tmp`, and the
    name an error gives them. A registered version is the one `origin` found, though its alias moved since:
    the weights are those of the run the stage's identity names."""
    if origin.kind == "run":
        return run_files(init, tmp, tracking_uri, files)
    if origin.kind == "registry":
        return registry_files(f"models:/{origin.version}" if origin.version else init, tmp, tracking_uri, files)
    return _storage_files(init, tmp, endpoint_url, files)


def _architecture(origin: Origin, model_name: str | None) -> str:
    """The architecture a fresh model or published weights are built as: `model`, which they need."""
    if not model_name:
        if origin.kind == "scratch":
            raise ValueError("model: required when training from scratch (init is none)")
        raise ValueError(f"init {origin.source}: a timm/Hugging Face weights file needs `model` to name its architecture")
    return model_name


def _from_foreign(init: str, model_name: str, overrides: dict[str, Any]) -> Any:
    path = foreign_path(init)
    model = vit.create_model(model_name, **overrides)
    try:
        vit.load_pretrained(model, path, skip_head=True)
    except ValueError as err:  # vit names a few keys or shapes and counts the rest: no cut mid-word
        raise ValueError(f"init {init}: does not fit model {model_name!r}: {one_line(err)}") from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met something other than tensors
        raise ValueError(f"init {init}: refused: the pickle holds objects other than tensors, "
                         "and vitpipe never runs code from a weights file") from None
    return model


def fetch_starting_weights(
    init: str | None,
    *,
    model_name: str | None,
    model_overrides: dict[str, Any],
    tracking_uri: str,
    endpoint_url: str | None = None,
    seed: int = 0,
    origin: Origin | None = None,
) -> StartingWeights:
    """Load the starting ViT that `init` names (see the module docstring).

    `model_name` + `model_overrides` build the model for "none" and foreign
    files; for the other sources they are optional and, when given, must match
    the checkpoint's architecture (a one-line ValueError names the fields).
    A from-scratch model's random weights are drawn from `seed`. `origin`: `starting_origin`'s answer for
    this `init`, when the caller already has it (runs are not looked up again). Files named by their digest
    are digested once more once read: replaced meanwhile, they are refused in one line.
    """
    import torch

    origin = origin or starting_origin(init, tracking_uri, endpoint_url)
    kind, source = origin.kind, origin.source
    if kind == "scratch":
        with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG
            torch.manual_seed(seed)
            model = vit.create_model(_architecture(origin, model_name), **model_overrides)
    elif kind == "foreign":
        model = _from_foreign(str(init), _architecture(origin, model_name), model_overrides)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model = _load_files(*_checkpoint_files(origin, str(init), tmp, tracking_uri, endpoint_url))
    check_unchanged(kind, str(init), endpoint_url, origin.content)
    _check_vit(type(model).__name__, isinstance(model, vit.VisionTransformer), source)
    if model_name and kind in ("run", "registry", "checkpoint"):
        check_architecture(model, model_name, model_overrides, source)
    return StartingWeights(origin, model)


def starting_config(
    init: str | None,
    *,
    model_name: str | None,
    model_overrides: dict[str, Any],
    tracking_uri: str,
    endpoint_url: str | None = None,
    origin: Origin | None = None,
) -> Any:
    """The `vit.ViTConfig` of the model `fetch_starting_weights` would load, read without its weights: a
    checkpoint's `config.json` (a few hundred bytes), or the architecture `model_name` and the overrides name
    (built on the meta device: no memory, no random draw)."""
    import torch

    origin = origin or starting_origin(init, tracking_uri, endpoint_url)
    if origin.kind in ("scratch", "foreign"):
        with torch.device("meta"):
            config = vit.create_model(_architecture(origin, model_name), **model_overrides).config
    else:
        with tempfile.TemporaryDirectory() as tmp:
            config = _load_files(*_checkpoint_files(origin, str(init), tmp, tracking_uri, endpoint_url,
                                                    ("config.json",)), read=vit.checkpoint_config)
    _check_vit(type(config).__name__.removesuffix("Config"), isinstance(config, vit.ViTConfig), origin.source)
    return config


def _check_vit(what: str, is_vit: bool, source: str) -> None:
    if not is_vit:
        raise ValueError(f"init {source}: holds a {what}, not a ViT")


__all__ = ["ARCH_FIELDS", "Origin", "StartingWeights", "built_at", "check_architecture", "fetch_starting_weights", "init_kind",
           "origin_identity", "starting_config", "starting_origin"]
