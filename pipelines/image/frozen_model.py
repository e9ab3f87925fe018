"""The frozen ViT a feature-reading stage (few-shot evaluation, embeddings) runs on an ingest output.

Both stages take the same `init`/`model`/`model_overrides`/`resolution` fields
and need the same checks against the data they read, so they load it here.
"""

from __future__ import annotations

from typing import Any, Protocol

from pipelines.training.starting_weights import StartingWeights, fetch_starting_weights, init_kind


class FrozenModelFields(Protocol):
    """The config fields that say which model to load and at which resolution it reads the data."""

    data: str
    init: str | None
    model: str | None
    model_overrides: dict[str, Any]
    resolution: int | None
    endpoint_url: str | None


def load_frozen_model(config: FrozenModelFields, manifest: dict[str, Any],
                      tracking_uri: str) -> tuple[StartingWeights, int]:
    """The weights `config.init` names (`fetch_starting_weights`' result) and the resolution they read
    `config.data` at; a one-line ValueError when the model cannot read the data's patches."""
    overrides = dict(config.model_overrides)
    if init_kind(config.init) in ("scratch", "foreign"):
        overrides.setdefault("image_size", manifest["image_size"])
    start = fetch_starting_weights(config.init, model_name=config.model, model_overrides=overrides,
                                   tracking_uri=tracking_uri, endpoint_url=config.endpoint_url)
    base = start.model
    if base.config.pixel_patch_size != manifest["patch_size"] or base.config.patch_dim != manifest["patch_dim"]:
        raise ValueError(f"model reads {base.config.pixel_patch_size}-pixel patches, but {config.data} holds "
                         f"{manifest['patch_size']}-pixel patches")
    size = config.resolution or base.config.image_hw[0]
    if size % manifest["patch_size"]:
        raise ValueError(f"resolution {size} is not a multiple of the patch size {manifest['patch_size']}")
    return start, size


__all__ = ["FrozenModelFields", "load_frozen_model"]
