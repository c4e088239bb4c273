"""Small models that train to a meaningful accuracy in seconds to minutes on two CPU cores."""

from __future__ import annotations

import torch
from torch import nn


def make_model(image_shape: tuple[int, int, int], classes: int, seed: int, hidden: int | None = None) -> nn.Module:
    """An MLP for 8x8 images (``hidden`` units, 64 by default), a small CNN for larger ones (with a
    fully connected layer of ``hidden`` units before the classifier when given: it sets how many
    parameters, hence gradient bytes, a step exchanges); weights drawn from the seed."""
    if hidden is not None and hidden < 1:
        raise ValueError(f"hidden must be a positive width, got {hidden}")
    channels, height, width = image_shape
    with torch.random.fork_rng(devices=[]):  # seed the initialisation without touching global state
        torch.manual_seed(seed)
        if height <= 8:
            return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, hidden or 64), nn.ReLU(),
                                 nn.Linear(hidden or 64, classes))
        flat = 16 * (height // 4) * (width // 4)
        head: list[nn.Module] = [nn.Linear(flat, classes)] if hidden is None else \
            [nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, classes)]
        return nn.Sequential(
            nn.Conv2d(channels, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), *head,
        )
