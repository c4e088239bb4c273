"""The NMSE experiment of the THC paper's Appendix C.1.

One gradient drawn from LogNormal(0, 1) is copied to n workers; they share the RHT signs but quantize
with independent randomness; one THC round without error feedback; NMSE = ||estimate - x||^2 / ||x||^2,
averaged over trials. The simulations (sim/) plot from this same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.thc.codec import THCCodec, THCConfig
from worker_lib.thc.signs import SignKey


@dataclass(frozen=True)
class NMSESetting:
    """One point of the experiment."""

    bits: int = 4
    granularity: int = 38
    p: float = 1 / 32
    workers: int = 4
    dim: int = 1 << 20
    trials: int = 10
    seed: int = 0


def nmse_trials(setting: NMSESetting) -> np.ndarray:
    """The NMSE of each trial (float64 array of length setting.trials)."""
    if setting.workers < 1 or setting.dim < 1 or setting.trials < 1:
        raise ValueError("workers, dim and trials must be positive")
    config = THCConfig(bits=setting.bits, granularity=setting.granularity, p=setting.p,
                       error_feedback=False)
    codecs = [THCCodec(config, seed=setting.seed * 1000003 + i + 1) for i in range(setting.workers)]
    data = torch.Generator().manual_seed(setting.seed)
    out = np.empty(setting.trials)
    for t in range(setting.trials):
        x = torch.empty(setting.dim).log_normal_(0.0, 1.0, generator=data)
        key = SignKey.derive(job=setting.seed & 0xFFFFFFFF, tensor=0, step=t)
        norm = float(torch.linalg.vector_norm(x))
        indices = [c.encode(x, norm, key) for c in codecs]
        sums = codecs[0].aggregate([e.indices for e in indices])
        est = codecs[0].decode(sums, setting.workers, indices[0].scale, setting.dim, key)
        out[t] = float(torch.sum((est - x) ** 2) / torch.sum(x ** 2))
    return out


def mean_nmse(setting: NMSESetting) -> float:
    """Mean NMSE over the setting's trials."""
    return float(nmse_trials(setting).mean())
