"""Masked autoencoder pretraining: He et al. (2021), "Masked Autoencoders Are Scalable Vision Learners".

A random 75% of each image's patches is masked; the encoder, a plain `VisionTransformer`,
runs on the visible patches only (plus its class token); a narrower, shallower decoder
of the same `Block`s puts mask tokens in the gaps, adds its own fixed sin-cos positions
and predicts every patch's pixels; the loss is the MSE over the masked patches, of
per-patch normalised pixels by default.

`mae.encoder` is the ViT itself, so `mae.encoder.state_dict()` is an ordinary vit
checkpoint; the decoder's weights are `mae.decoder.state_dict()`, kept beside it.
Masks come from a `torch.Generator`: `masking_generator(seed, step, rank, micro)` gives each
micro-batch of each step on each rank its own, so a resumed run draws the same masks as an
uninterrupted one. `save_mae` writes the encoder as an ordinary vit checkpoint directory and
the decoder beside it (`mae_decoder.safetensors`, `mae.json`), so whatever loads a vit
checkpoint loads an MAE run's encoder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vit.config import ViTConfig
from vit.model import Block, VisionTransformer
from vit.patches import grid_size, patchify, unpatchify
from vit.pos_embed import check_grid, sincos_2d
from vit.weights import load_checkpoint, one_line, save_checkpoint

DECODER_FILE = "mae_decoder.safetensors"
MAE_CONFIG_FILE = "mae.json"


@dataclass
class Masking:
    """One batch's masks; `mask` and `ids_restore` are in the grid's row-major patch order."""

    ids_keep: torch.Tensor  # (B, keep): the visible patches, in the order the encoder sees them
    ids_restore: torch.Tensor  # (B, N): where each grid position sits in the shuffled order
    mask: torch.Tensor  # (B, N) float: 1 where a patch is masked, 0 where visible


@dataclass
class MAEOutput:
    """A forward pass: the loss, every patch's prediction `(B, N, P*P*C)`, and the masks used."""

    loss: torch.Tensor
    pred: torch.Tensor
    masking: Masking


def num_visible(num_patches: int, mask_ratio: float) -> int:
    """Patches left visible per image: round(N * (1 - mask_ratio)), which must leave some of each kind."""
    keep = round(num_patches * (1.0 - mask_ratio))
    if not 0 < keep < num_patches:
        raise ValueError(
            f"mask_ratio {mask_ratio} on {num_patches} patches keeps {keep}: it must leave at least one "
            "patch visible and one masked"
        )
    return keep


def masking_generator(seed: int, step: int, rank: int = 0, micro: int = 0) -> torch.Generator:
    """A CPU generator for the masks of one micro-batch: a function of the run's seed, the global step,
    the data-parallel rank and the micro-batch within the step alone."""
    # Hashed to 32 bits: the CPU generator (mt19937) ignores a seed's upper 32 bits.
    digest = hashlib.blake2b(f"mae-masks:{seed}:{step}:{rank}:{micro}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def random_masking(
    batch: int,
    num_patches: int,
    mask_ratio: float,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Masking:
    """Per-image random masks, by argsort of uniform noise (the paper's shuffle).

    With a generator the noise is drawn on the generator's device and then moved to `device`,
    so a CPU generator's seed gives the same masks on any device; without one it is drawn
    on `device` from the global RNG.
    """
    keep = num_visible(num_patches, mask_ratio)
    noise_device = generator.device if generator is not None else (device or "cpu")
    noise = torch.rand(batch, num_patches, generator=generator, device=noise_device).to(device or noise_device)
    ids_shuffle = noise.argsort(dim=1)
    ids_restore = ids_shuffle.argsort(dim=1)
    mask = torch.ones_like(noise)
    mask[:, :keep] = 0
    return Masking(ids_shuffle[:, :keep], ids_restore, mask.gather(1, ids_restore))


class MAEDecoder(nn.Module):
    """Mask tokens, fixed sin-cos positions and pre-LN blocks; predicts pixels for every patch."""

    def __init__(self, config: ViTConfig, encoder_dim: int, num_prefix_tokens: int) -> None:
        super().__init__()
        self.config = config
        dim = config.embed_dim
        self.num_prefix_tokens = num_prefix_tokens
        self.embed = nn.Linear(encoder_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", self._positions(config.grid), persistent=False)
        self.blocks = nn.ModuleList(Block(config, 0.0) for _ in range(config.depth))
        self.norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.pred = nn.Linear(dim, config.patch_dim)
        for m in self.modules():  # the paper's init: xavier-uniform Linears, N(0, 0.02) mask token
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.mask_token, std=0.02)

    def _positions(self, grid: tuple[int, int], like: torch.Tensor | None = None) -> torch.Tensor:
        """`(1, prefix + gh*gw, D)`: sin-cos rows for the patches, zero rows for the class token."""
        kw = {} if like is None else {"dtype": like.dtype, "device": like.device}
        table = sincos_2d(grid, self.config.embed_dim, **kw)
        return torch.cat([table.new_zeros(self.num_prefix_tokens, table.shape[1]), table]).unsqueeze(0)

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Encoder output `(B, prefix + keep, D_enc)` -> predicted patches `(B, N, P*P*C)` in grid order."""
        x = self.embed(latent)
        p = self.num_prefix_tokens
        b, n, d = x.shape[0], ids_restore.shape[1], x.shape[-1]
        masked = self.mask_token.to(x.dtype).expand(b, n - (x.shape[1] - p), -1)
        tokens = torch.cat([x[:, p:], masked], dim=1).gather(1, ids_restore.unsqueeze(-1).expand(-1, -1, d))
        pos = self.pos_embed if tuple(grid) == self.config.grid else self._positions(grid, self.pos_embed)
        x = torch.cat([x[:, :p], tokens], dim=1) + pos
        for block in self.blocks:
            x, _ = block(x)
        return self.pred(self.norm(x)[:, p:])


class MaskedAutoencoder(nn.Module):
    """MAE around a plain ViT encoder; build the encoder with `num_classes=0`, as its head goes unused.

    Inputs are images `(B, C, H, W)` or patch sequences `(B, N, P*P*C)` (the ingest's shards), float
    and normalised; the targets are those same pixels, per patch.
    """

    def __init__(
        self,
        encoder: VisionTransformer,
        decoder_dim: int = 512,
        decoder_depth: int = 8,
        decoder_heads: int = 16,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = True,
    ) -> None:
        super().__init__()
        c = encoder.config
        if c.hybrid is not None:
            raise ValueError("MAE needs a plain ViT encoder: a hybrid's ResNet stem would see the masked pixels")
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio!r}")
        if decoder_dim % 4:
            raise ValueError(f"decoder_dim must be divisible by 4 (sin-cos positions), got {decoder_dim}")
        decoder_config = ViTConfig(
            image_size=c.image_size, patch_size=c.patch_size, in_channels=c.in_channels, num_classes=0,
            embed_dim=decoder_dim, depth=decoder_depth, num_heads=decoder_heads, mlp_dim=4 * decoder_dim,
            pos_embed="sincos", layer_norm_eps=c.layer_norm_eps, attn_impl=c.attn_impl,
        )
        self.encoder = encoder
        self.decoder = MAEDecoder(decoder_config, c.embed_dim, encoder.num_prefix_tokens)
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        self.options = {"decoder_dim": decoder_dim, "decoder_depth": decoder_depth, "decoder_heads": decoder_heads,
                        "mask_ratio": mask_ratio, "norm_pix_loss": norm_pix_loss}

    def patches(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images or patch sequences as `(B, N, P*P*C)` patches and their grid; checks shapes first."""
        c = self.encoder.config
        if not torch.is_floating_point(x):
            raise ValueError(f"expected a float tensor (normalised pixels), got dtype {x.dtype}")
        if x.ndim == 4 and x.shape[1] == c.in_channels:
            return patchify(x, c.patch_size), grid_size(x.shape[2], x.shape[3], c.patch_size)
        if x.ndim == 3 and x.shape[2] == c.patch_dim:
            grid = c.grid if grid is None else check_grid("grid", grid)
            if grid[0] * grid[1] != x.shape[1]:
                raise ValueError(f"grid {grid[0]}x{grid[1]} needs {grid[0] * grid[1]} patches, got {x.shape[1]}")
            return x, grid
        raise ValueError(
            f"expected images (B, {c.in_channels}, H, W) or patch sequences (B, N, {c.patch_dim}), "
            f"got shape {tuple(x.shape)}"
        )

    def encode(self, patches: torch.Tensor, grid: tuple[int, int], masking: Masking) -> torch.Tensor:
        """The encoder on the visible patches only: `(B, prefix + keep, D)` after its final LayerNorm.

        Position embeddings are the encoder's own, for the full grid, gathered at the visible patches.
        """
        enc = self.encoder
        p = enc.num_prefix_tokens
        keep = masking.ids_keep.unsqueeze(-1)
        x = enc.patch_embed.proj(patches.gather(1, keep.expand(-1, -1, patches.shape[-1])))
        pos = enc.position_embeddings(grid)
        if pos is not None:
            x = x + pos[:, p:].expand(x.shape[0], -1, -1).gather(1, keep.expand(-1, -1, x.shape[-1]))
        if enc.cls_token is not None:
            cls = enc.cls_token if pos is None else enc.cls_token + pos[:, :p]
            x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = enc.pos_drop(x)
        for block in enc.blocks:
            x, _ = block(x)
        return enc.norm(x)

    def target(self, patches: torch.Tensor) -> torch.Tensor:
        """What the decoder predicts: the patches' pixels, normalised per patch when `norm_pix_loss`."""
        target = patches.float()
        if self.norm_pix_loss:
            mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1e-6).sqrt()
        return target

    def loss(self, patches: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the masked patches only."""
        per_patch = (pred.float() - self.target(patches)).pow(2).mean(-1)
        return (per_patch * mask).sum() / mask.sum()

    def forward(
        self, x: torch.Tensor, generator: torch.Generator | None = None, *, grid: tuple[int, int] | None = None
    ) -> MAEOutput:
        """Mask, encode, decode and score one batch; `generator` draws the masks (see `masking_generator`)."""
        patches, grid = self.patches(x, grid)
        masking = random_masking(
            patches.shape[0], patches.shape[1], self.mask_ratio, generator=generator, device=patches.device
        )
        pred = self.decoder(self.encode(patches, grid, masking), masking.ids_restore, grid)
        return MAEOutput(self.loss(patches, pred, masking.mask), pred, masking)

    @torch.no_grad()
    def reconstruct(
        self, images: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a picture: `(masked, reconstruction)` images `(B, C, H, W)` in the input's pixel space.

        Masked patches are zero in `masked`; in `reconstruction` they are the predictions (mapped back
        with each patch's own mean and variance when `norm_pix_loss`) and the visible patches are the input's.
        """
        out = self.forward(images, generator=generator)
        patches, grid = self.patches(images)
        pred = out.pred.float()
        if self.norm_pix_loss:
            pred = pred * (patches.var(-1, keepdim=True) + 1e-6).sqrt() + patches.mean(-1, keepdim=True)
        m = out.masking.mask.unsqueeze(-1).to(patches.dtype)
        c, p = self.encoder.config.in_channels, self.encoder.config.patch_size
        masked = unpatchify(patches * (1 - m), p, grid, c)
        return masked, unpatchify(patches * (1 - m) + pred.to(patches.dtype) * m, p, grid, c)


def save_mae(mae: MaskedAutoencoder, directory: str | Path) -> Path:
    """The encoder as a vit checkpoint in `directory`, the decoder and the MAE options beside it."""
    d = save_checkpoint(mae.encoder, directory)
    state = {k: v.detach().contiguous().cpu() for k, v in mae.decoder.state_dict().items()}
    save_file(state, d / DECODER_FILE)
    (d / MAE_CONFIG_FILE).write_text(json.dumps(mae.options, indent=2))
    return d


def load_mae_weights(mae: MaskedAutoencoder, directory: str | Path) -> None:
    """Load an MAE checkpoint written by `save_mae` into `mae` (strict: encoder and decoder)."""
    d = Path(directory)
    if not (d / DECODER_FILE).is_file():
        raise ValueError(f"{d} holds no MAE decoder ({DECODER_FILE}): it is not an MAE checkpoint")
    try:
        decoder = load_file(d / DECODER_FILE, device="cpu")
    except Exception as e:  # safetensors raises its own error type (a truncated or foreign file)
        raise ValueError(f"{d / DECODER_FILE} cannot be read as safetensors: {one_line(e)}") from None
    # torch's mismatch error spans many lines: one line naming the checkpoint instead.
    for part, state in ((mae.encoder, load_checkpoint(d).state_dict()), (mae.decoder, decoder)):
        try:
            part.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(f"MAE checkpoint {d} does not fit this model's {type(part).__name__}: "
                             f"{one_line(e)}") from None


def load_mae(directory: str | Path) -> MaskedAutoencoder:
    """The whole masked autoencoder of a checkpoint written by `save_mae`."""
    d = Path(directory)
    if not (d / MAE_CONFIG_FILE).is_file():
        raise ValueError(f"{d} holds no {MAE_CONFIG_FILE}: it is not an MAE checkpoint")
    try:
        options = json.loads((d / MAE_CONFIG_FILE).read_text())
        mae = MaskedAutoencoder(load_checkpoint(d), **options)
    except (TypeError, json.JSONDecodeError) as e:  # not JSON, not an object, or an unknown option
        raise ValueError(f"{d / MAE_CONFIG_FILE} does not hold MAE options: {e}") from None
    load_mae_weights(mae, d)
    return mae


__all__ = ["DECODER_FILE", "MAEDecoder", "MAEOutput", "MaskedAutoencoder", "Masking", "load_mae", "load_mae_weights",
           "masking_generator", "num_visible", "random_masking", "save_mae"]
