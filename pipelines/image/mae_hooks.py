"""The worker side of an MAE pretrain (`objective: mae`): the masked autoencoder in the one worker loop.

The loop trains and checkpoints the whole `vit.mae.MaskedAutoencoder`; its
checkpoints hold the encoder as an ordinary vit checkpoint with the decoder
beside it (`vit.mae.save_mae`). Each micro-batch's masks come from
`masking_generator(seed, global step, rank, micro-batch)`, so a run resumed at
step k draws the masks an uninterrupted run draws. Labels are never read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vit.mae import MaskedAutoencoder, load_mae_weights, masking_generator, save_mae
from pipelines.training.hooks import LoopHooks
from pipelines.training.recipe import LoopSettings
from pipelines.training.worker import Rank0Log, Worker


@dataclass(frozen=True)
class MAEOptions:
    """The MAE fields of a pretrain config."""

    mask_ratio: float = 0.75
    decoder_dim: int = 512
    decoder_depth: int = 8
    decoder_heads: int = 16
    norm_pix_loss: bool = True

    def build(self, encoder: nn.Module) -> MaskedAutoencoder:
        """The masked autoencoder around `encoder` (a headless plain ViT)."""
        return MaskedAutoencoder(encoder, decoder_dim=self.decoder_dim, decoder_depth=self.decoder_depth,
                                 decoder_heads=self.decoder_heads, mask_ratio=self.mask_ratio,
                                 norm_pix_loss=self.norm_pix_loss)


class MAELoss(nn.Module):
    """What the step calls: the autoencoder's loss on `(patches, mask generator)`, a scalar."""

    def __init__(self, mae: MaskedAutoencoder) -> None:
        super().__init__()
        self.mae = mae

    def forward(self, patches: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.mae(patches, generator).loss


def _output_is_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return output


class MAEHooks(LoopHooks):
    """MAE pretraining in the worker loop; `batches` are the stage's own hooks, which stream (and augment) data."""

    keep_best = False  # no validation top-1 to rank checkpoints by: the final model is the one kept

    def __init__(self, options: MAEOptions, batches: LoopHooks) -> None:
        self.options, self.batches = options, batches
        self.start_step = 0

    def start_model(self, s: LoopSettings, worker: Worker) -> nn.Module:
        """The stage's encoder (headless) inside a fresh decoder."""
        return self.options.build(super().start_model(s, worker))

    def forward_model(self, model: nn.Module) -> nn.Module:
        """The autoencoder's loss as the forward pass."""
        return MAELoss(model)

    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The forward pass already returns the loss."""
        return _output_is_loss

    def save_weights(self, model: nn.Module, directory: Path) -> None:
        """The encoder as a vit checkpoint, the decoder beside it."""
        save_mae(model, directory)

    def load_weights(self, model: nn.Module, directory: Path) -> None:
        """Encoder and decoder from a checkpoint `save_weights` wrote."""
        load_mae_weights(model, directory)

    def on_start(self, log: Rank0Log, amp_dtype: torch.dtype | None, device: torch.device,
                 resumed_from: int | None) -> None:
        """Remember the step this execution starts at: the masks are numbered from it."""
        super().on_start(log, amp_dtype, device, resumed_from)
        self.start_step = resumed_from or 0

    def train_batches(self, s: LoopSettings, worker: Worker, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
        """The stage's batches, each with the generator of its masks (the loop takes `grad_accum_steps` a step)."""
        count = self.start_step * s.grad_accum_steps
        for epoch_now, index, batch in self.batches.train_batches(s, worker, epoch, skip):
            step, micro = divmod(count, s.grad_accum_steps)
            count += 1
            yield epoch_now, index, {**batch, "masks": masking_generator(s.seed, step, worker.rank, micro)}

    def inputs(self, batch: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        """`((patches, mask generator), no labels)`."""
        return (batch["patches"], batch["masks"]), torch.empty(0)
