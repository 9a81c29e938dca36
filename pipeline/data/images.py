"""Seeded synthetic images for the CNN models: regression targets for `unet`, classes for `resnet`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelaunch.pipeline.graph.init import name_seed


@dataclass
class SyntheticImages:
    """Random images; the target is a fixed function of the image, so the loss can fall.

    `task=regression`: target = a channel-mixed, mirrored copy of the image (same shape as the
    output of an image-to-image model). `task=classification`: the class is read off the image's
    mean intensity, bucketed into `num_classes`.
    """

    channels: int
    image_size: int
    task: str = "regression"
    num_classes: int = 10
    out_channels: int | None = None
    seed: int = 0
    kind: str = "images"

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(f"images:step{step}", batch_size)

    def val_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: drawn like the training batches, from another stream."""
        return self._draw(f"images:val{index}", batch_size)

    def _draw(self, stream: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(name_seed(self.seed, stream))
        x = torch.randn(batch_size, self.channels, self.image_size, self.image_size, generator=gen)
        if self.task == "classification":
            score = x.mean(dim=(1, 2, 3)) * (self.image_size * self.channels**0.5)
            y = torch.bucketize(score, torch.linspace(-2.0, 2.0, self.num_classes - 1))
            return x, y
        out_c = self.out_channels or self.channels
        mixed = x.flip(-1).roll(1, dims=1)[:, :out_c] * 0.5
        return x, mixed
