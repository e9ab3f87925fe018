"""The frozen ViT a feature-reading stage (few-shot evaluation, embeddings) runs on an ingest output.

Both stages take the same `init`/`model`/`model_overrides`/`resolution` fields
and need the same checks against the data they read, so they load it here.
"""

from __future__ import annotations

from typing import Any, Protocol

from pipelines.training.starting_weights import (Origin, StartingWeights, built_at, fetch_starting_weights,
                                                 starting_config, starting_origin)


class FrozenModelFields(Protocol):
    """The config fields that say which model to load and at which resolution it reads the data."""

    data: str
    init: str | None
    model: str | None
    model_overrides: dict[str, Any]
    resolution: int | None
    endpoint_url: str | None
    seed: int  # draws a from-scratch model's weights (init none)


def frozen_origin(config: FrozenModelFields, manifest: dict[str, Any], tracking_uri: str) -> tuple[Origin, int]:
    """What names the weights `config.init` names, and the resolution they read `config.data` at, known from
    metadata and the checkpoint's `config.json` alone: enough to find a finished run before any weights are
    downloaded. The same one-line ValueErrors as `load_frozen_model`."""
    origin = starting_origin(config.init, tracking_uri, config.endpoint_url)
    model_config = starting_config(config.init, model_name=config.model, model_overrides=_overrides(config, manifest),
                                   tracking_uri=tracking_uri, endpoint_url=config.endpoint_url, origin=origin)
    return origin, _resolution(config, manifest, model_config)


def load_frozen_model(config: FrozenModelFields, manifest: dict[str, Any], tracking_uri: str,
                      origin: Origin | None = None) -> tuple[StartingWeights, int]:
    """The weights `config.init` names (`fetch_starting_weights`' result; `origin`: `frozen_origin`'s, when
    known) and the resolution they read `config.data` at; a one-line ValueError when the model cannot read
    the data's patches. A from-scratch model (init none) is drawn from `config.seed`."""
    start = fetch_starting_weights(config.init, model_name=config.model, model_overrides=_overrides(config, manifest),
                                   tracking_uri=tracking_uri, endpoint_url=config.endpoint_url, seed=config.seed,
                                   origin=origin)
    return start, _resolution(config, manifest, start.model.config)


def _overrides(config: FrozenModelFields, manifest: dict[str, Any]) -> dict[str, Any]:
    return built_at(config.init, config.model_overrides, manifest["image_size"])


def _resolution(config: FrozenModelFields, manifest: dict[str, Any], model_config: Any) -> int:
    if model_config.pixel_patch_size != manifest["patch_size"] or model_config.patch_dim != manifest["patch_dim"]:
        # Both numbers: a model of other channels reads patches of the data's size but of another length.
        raise ValueError(f"model reads {model_config.pixel_patch_size}-pixel patches of length {model_config.patch_dim}, "
                         f"but {config.data} holds {manifest['patch_size']}-pixel patches of length {manifest['patch_dim']}")
    size = config.resolution or model_config.image_hw[0]
    if size % manifest["patch_size"]:
        raise ValueError(f"resolution {size} is not a multiple of the patch size {manifest['patch_size']}")
    return size


__all__ = ["FrozenModelFields", "frozen_origin", "load_frozen_model"]
