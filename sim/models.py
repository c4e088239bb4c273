"""Small models that train to a meaningful accuracy in seconds to minutes on two CPU cores."""

from __future__ import annotations

import torch
from torch import nn


def make_model(image_shape: tuple[int, int, int], classes: int, seed: int) -> nn.Module:
    """An MLP for 8x8 images, a small CNN for larger ones; weights drawn from the seed."""
    channels, height, width = image_shape
    with torch.random.fork_rng(devices=[]):  # seed the initialisation without touching global state
        torch.manual_seed(seed)
        if height <= 8:
            return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, 64), nn.ReLU(),
                                 nn.Linear(64, classes))
        return nn.Sequential(
            nn.Conv2d(channels, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * (height // 4) * (width // 4), classes),
        )
