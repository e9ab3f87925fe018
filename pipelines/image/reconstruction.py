"""What a masked autoencoder makes of held-out images: original | masked | reconstructed, logged to MLflow."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import vit
from pipelines.core import plots
from pipelines.image.attention_map import pixels
from pipelines.image.data import load_split

RECONSTRUCTION_FIGURE = "mae/reconstruction.png"
IMAGES = 4


def reconstruction_columns(mae: Any, patches: torch.Tensor, grid: tuple[int, int],
                           seed: int = 0) -> dict[str, np.ndarray]:
    """`{"original", "masked", "reconstructed"}` images `(B, H, W, C)` in [0, 1] for normalised patch sequences.

    The masks are drawn from `seed`, so the picture of a run is the same each time it is drawn.
    """
    mae.eval()
    p = mae.encoder.config.patch_size
    masked, reconstructed = mae.reconstruct(patches.float(), generator=vit.masking_generator(seed, 0))
    as_patches = {"original": patches.float(), "masked": vit.patchify(masked, p),
                  "reconstructed": vit.patchify(reconstructed, p)}
    return {name: pixels(x, p, grid) for name, x in as_patches.items()}


def log_reconstruction_picture(client: Any, run_id: str, mae: Any, data: str, manifest: dict[str, Any], *,
                               endpoint_url: str | None = None, count: int = IMAGES, seed: int = 0) -> str:
    """Log the picture for the first `count` held-out images of `data` (val, else test, else train);
    returns the split drawn from."""
    counts = manifest.get("counts", {})
    split = next((s for s in ("val", "test") if int(counts.get(s, 0)) > 0), "train")
    patches, _ = load_split(data, split, limit=count, endpoint_url=endpoint_url)
    grid = vit.grid_size(manifest["image_size"], manifest["image_size"], manifest["patch_size"])
    figure = plots.reconstruction_figure(
        reconstruction_columns(mae, patches, grid, seed),
        f"MAE on {split} images: {mae.mask_ratio:.0%} of the patches masked (blanked), then reconstructed",
    )
    client.log_figure(run_id, figure, RECONSTRUCTION_FIGURE)
    figure.clf()
    return split
