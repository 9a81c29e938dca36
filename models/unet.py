"""A small U-Net: an encoder-decoder whose long skips join each encoder level to its decoder level.

Why it is here: its skips jump over most of the network, so a pipeline split of it has values that
travel from the first stage to the last. It is the test bed for graph partitioning and stage building.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.models.spec import ModelSpec, require_positive_ints
from pipelaunch.pipeline.core.errors import ConfigError


class ConvBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and SiLU (GroupNorm: no batch statistics across micro-batches).

    The convolutions have no bias: the norm right after removes any per-channel shift, so a bias
    would only add a parameter whose true gradient is zero (and whose computed one is noise)."""

    def __init__(self, c_in: int, c_out: int, groups: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(min(groups, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(min(groups, c_out), c_out)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    """`levels` encoder blocks (each halving resolution after it), a bottleneck, `levels` decoder blocks."""

    def __init__(
        self, in_channels: int = 3, out_channels: int = 3, channels: int = 8, levels: int = 3
    ) -> None:
        super().__init__()
        if levels < 1:
            raise ValueError(f"model.levels must be >= 1, got {levels}")
        widths = [channels * 2**i for i in range(levels + 1)]
        self.levels = levels
        self.encoders = nn.ModuleList()
        c = in_channels
        for i in range(levels):
            self.encoders.append(ConvBlock(c, widths[i]))
            c = widths[i]
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = ConvBlock(widths[levels - 1], widths[levels])
        self.ups = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for i in reversed(range(levels)):
            self.ups.append(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2))
            self.decoders.append(ConvBlock(2 * widths[i], widths[i]))
        self.head = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for enc in self.encoders:
            x = enc(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.ups, self.decoders, reversed(skips), strict=True):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet(
    channels: int = 8,
    levels: int = 3,
    image_size: int = 32,
    in_channels: int = 3,
    out_channels: int = 3,
    name: str = "unet",
    task: str = "regression",
) -> ModelSpec:
    """Image-to-image regression (MSE). Leaf modules are the conv blocks, ups and head."""
    require_positive_ints(channels=channels, levels=levels, image_size=image_size, in_channels=in_channels,
                          out_channels=out_channels)
    if image_size % 2**levels:
        raise ConfigError("model.image_size", f"{image_size} must be divisible by 2**levels = {2**levels} (each level "
                                              "halves it)")

    def build() -> nn.Module:
        return UNet(in_channels, out_channels, channels, levels)

    leaves = [f"encoders.{i}" for i in range(levels)] + ["bottleneck"]
    leaves += [f"ups.{i}" for i in range(levels)] + [f"decoders.{i}" for i in range(levels)] + ["head"]
    return ModelSpec(
        name=name,
        build=build,
        loss_fn=nn.functional.mse_loss,
        input_shape=(in_channels, image_size, image_size),
        input_dtype=torch.float32,
        target_shape=(out_channels, image_size, image_size),
        target_dtype=torch.float32,
        leaf_modules=leaves,
        meta={"channels": channels, "levels": levels, "image_size": image_size, "task": task},
    )
