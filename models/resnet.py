"""A small residual CNN classifier (cross-entropy), for graph partitioning of short-skip models."""

from __future__ import annotations

import torch
from torch import nn

from pipelaunch.models.spec import ModelSpec, require_positive_ints


class ResidualBlock(nn.Module):
    """conv-norm-relu-conv-norm plus a shortcut (1x1 strided conv when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(min(4, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(min(4, c_out), c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, `len(widths)` groups of `depth` residual blocks (downsampling between groups), pooled head."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        widths: tuple[int, ...] = (16, 32, 64),
        depth: int = 2,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.GroupNorm(4, widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c = widths[0]
        for gi, w in enumerate(widths):
            for bi in range(depth):
                layers.append(ResidualBlock(c, w, stride=2 if gi > 0 and bi == 0 else 1))
                c = w
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet(
    widths: tuple[int, ...] = (16, 32, 64),
    depth: int = 2,
    num_classes: int = 10,
    image_size: int = 32,
    in_channels: int = 3,
    name: str = "resnet",
    task: str = "classification",
) -> ModelSpec:
    """Classifier spec; leaf modules are the stem, each residual block and the head."""
    widths = tuple(widths)
    require_positive_ints(depth=depth, num_classes=num_classes, image_size=image_size, in_channels=in_channels,
                          **{f"widths[{i}]": w for i, w in enumerate(widths)})

    def build() -> nn.Module:
        return ResNet(in_channels, num_classes, widths, depth)

    leaves = ["stem"] + [f"layers.{i}" for i in range(len(widths) * depth)] + ["fc"]
    return ModelSpec(
        name=name,
        build=build,
        loss_fn=nn.functional.cross_entropy,
        input_shape=(in_channels, image_size, image_size),
        input_dtype=torch.float32,
        target_shape=(),
        target_dtype=torch.long,
        leaf_modules=leaves,
        meta={"widths": list(widths), "depth": depth, "num_classes": num_classes, "task": task},
    )
