"""A small ResNet-shaped CNN with BatchNorm on tiny synthetic images: a workload verify must fail.

BatchNorm in training mode normalizes with the statistics of the examples in the same forward, so
micro-batches of 2 images are normalized differently from the batch of 8: the accumulated gradient
is the gradient of a different function, and no loss scaling can repair that. The scan names each
BatchNorm layer (``bn1``, ``layer1.0.bn1``, ``layer1.0.bn2``) as the likely cause.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BasicBlock", "SmallResNet", "build_bn_cnn", "cnn_loss", "synthetic_images"]

IMAGE_SIZE = 8
CLASSES = 4


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, as in ResNet-18."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nn.Module):
    """A stem, one residual stage and a linear head: module paths as in torchvision's ResNet."""

    def __init__(self, width: int = 8, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width))
        self.fc = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(images)))
        x = self.layer1(x)
        return self.fc(x.mean(dim=(2, 3)))


def build_bn_cnn(seed: int = 0, *, width: int = 8, dtype: torch.dtype = torch.float32) -> SmallResNet:
    """The bundled CNN with weights fixed by ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallResNet(width)
    return model.to(dtype)


def synthetic_images(n: int, seed: int, *, classes: int = CLASSES) -> dict[str, torch.Tensor]:
    """``n`` noisy 3x8x8 images of ``classes`` fixed patterns, with their labels.

    The patterns are the same for every seed (so the task is learnable across draws); the labels
    and noise depend on ``seed``.
    """
    patterns = torch.randn(classes, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    noise = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {"images": patterns[labels] + 0.5 * noise, "labels": labels}


def cnn_loss(model: nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch's images (the count is its number of examples)."""
    return F.cross_entropy(model(micro_batch["images"]), micro_batch["labels"], reduction="sum")
