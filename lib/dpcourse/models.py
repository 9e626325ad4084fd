"""The models of the course (PyTorch): a small CNN for quick CPU runs and ResNet-18 for 32×32.

``SmallCNN`` has no BatchNorm on purpose: with it, "DDP on N ranks == one process on the
global batch" holds exactly (BatchNorm's statistics are per rank, which lesson 04 shows with
SyncBatchNorm). ``resnet18_cifar`` is torchvision's ResNet-18 with the stem changed for 32×32
inputs (3×3 first convolution, stride 1, no max-pool) — the model the classic DDP examples use.
Used in lessons 01–04 and 06. ``flat_params`` / ``set_flat_params`` read and write a model's
weights as one flat vector (lessons 03, 07–09 compare runs with them; lesson 09's parameter
server sends them).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallCNN", "resnet18_cifar", "build_model", "count_parameters", "flat_params",
           "set_flat_params"]


class SmallCNN(nn.Module):
    """conv-relu-pool ×3, then a 2-layer classifier: 188,810 parameters at width 32.

    Shown in lesson 01, §"One step, taken apart"; lesson 03, §"Averaging gradients".
    """

    def __init__(self, num_classes: int = 10, width: int = 32, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),           # 16×16
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 8×8
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4×4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, 128), nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"SmallCNN expects images shaped (N, 3, H, W), got {tuple(x.shape)}")
        return self.classifier(self.features(x))


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with a 32×32-friendly stem (weights random, nothing downloaded)."""
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_model(name: str = "small_cnn", num_classes: int = 10, **kwargs) -> nn.Module:
    """A model by name: ``"small_cnn"`` or ``"resnet18"``."""
    if name == "small_cnn":
        return SmallCNN(num_classes, **kwargs)
    if name == "resnet18":
        return resnet18_cifar(num_classes)
    raise ValueError(f"unknown model {name!r}: choose 'small_cnn' or 'resnet18'")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flat_params(model: nn.Module) -> torch.Tensor:
    """All the weights as one new flat CPU vector, in ``model.parameters()`` order: what two runs
    are compared by, and what a parameter server stores and sends.

    Shown in lesson 03, §"Averaging gradients — and DDP, which does it for you"; lesson 09, §1.
    """
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def set_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` into the model's weights (the inverse of
    :func:`flat_params`); ``flat`` must hold exactly as many numbers as the model.

    Shown in lesson 09, §1.
    """
    total = sum(p.numel() for p in model.parameters())
    if flat.numel() != total:
        raise ValueError(f"flat has {flat.numel()} numbers, the model {total} weights")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
