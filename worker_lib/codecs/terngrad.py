"""TernGrad (Wen et al., NIPS 2017; papers/terngrad.txt), a homomorphic codec with scalar sharing.

Per tensor (the paper's *layer-wise ternarizing*) each worker

1. clips its gradient at c * sigma, sigma the standard deviation of the tensor's values (Eq. 21,
   c = 2.5 in all of the paper's experiments);
2. publishes s_i = max |clipped| and receives the shared scalar s = max_i s_i (Eq. 4, *scalar
   sharing*; the paper counts 2N floats for it, one up and one down per worker);
3. sends the levels sign(g_k) * b_k with b_k ~ Bernoulli(|g_k| / s) (Eqs. 1 and 3) in 2 bits each.

Because all workers use the same s the sum of their levels is an integer in [-n, n], so the
aggregator only adds small integers (2N + 1 levels, Section 3): TernGrad is homomorphic. On the wire
a level l is the index l + 1 in {0, 1, 2} (the index 3 is unused), whose table value is the index
itself, so the sums lie in [0, 2n] and the average is s * (sum - n) / n.

Unbiasedness is with respect to the *clipped* gradient, which is what the tests check: clipping is a
deliberate bias (the paper: it changes the length of g by 1.0-1.5% and its direction by 2-3 degrees).

Ambiguity: the paper says "standard deviation of gradients in g" without saying whether the mean is
removed; we use the population standard deviation about the mean (torch.std with correction=0).
A tensor with sigma = 0 (constant, or one coordinate) is left unclipped rather than clipped to
zero. With ``clip=None`` no clipping is done (the paper's TernGrad-noclip row, and evidently what the THC
paper measured: its TernGrad NMSE of 15.7 on a log-normal vector is what unclipped TernGrad gives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.codecs.base import CodecState, HomomorphicCodec, Message, RoundContext, check_input, require
from worker_lib.wire.bits import pack_bits


@dataclass(frozen=True)
class TernGradConfig:
    """TernGrad's knobs: the clipping factor c (None disables clipping)."""

    clip: float | None = 2.5

    def __post_init__(self) -> None:
        if self.clip is not None:
            require(isinstance(self.clip, int | float) and math.isfinite(self.clip) and self.clip > 0,
                    f"clip must be a positive finite number or None, got {self.clip!r}")


class TernGrad(HomomorphicCodec):
    """Stochastic ternarization with a shared scalar; 2-bit levels; integer aggregation."""

    name = "terngrad"
    _TABLE = np.array([0, 1, 2], dtype=np.int64)  # index = level + 1; the 2-bit index 3 is invalid

    def __init__(self, config: TernGradConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__(config or TernGradConfig(), device=device, seed=seed)

    @property
    def table(self) -> np.ndarray:
        return self._TABLE

    @property
    def index_bits(self) -> int:
        return 2

    def transmitted(self, ctx: RoundContext) -> int:
        return ctx.length

    def clipped(self, x: torch.Tensor) -> torch.Tensor:
        """f(g) of Eq. 21: each value limited to [-c sigma, c sigma] (a new float32 tensor)."""
        flat = check_input(x).to(self.device)
        if self.config.clip is None:
            return flat.clone()
        sigma = float(torch.std(flat, correction=0))
        if sigma == 0.0:
            # A constant tensor (or a single coordinate) has sigma = 0, and Eq. 21 taken literally
            # would clip it to zero. Clipping exists to cut outliers and a constant tensor has none,
            # so we leave it unclipped.
            return flat.clone()
        bound = self.config.clip * sigma
        return flat.clamp(-bound, bound)

    def prelim(self, x: torch.Tensor, state: CodecState | None = None) -> float:
        """s_i = max |f(g_i)|, this worker's scalar before sharing."""
        return float(self.clipped(x).abs().max())

    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        g = self.clipped(check_input(x, ctx))
        s = self.shared(ctx)
        own = float(g.abs().max())
        if own > s * (1 + 1e-6):
            raise ValueError(f"the shared scalar {s} is below this worker's max |g| = {own}")
        if s == 0.0:
            levels = torch.zeros_like(g, dtype=torch.int64)
        else:
            b = self.rand(g.numel()) < (g.abs() / s)
            levels = torch.sign(g).to(torch.int64) * b
        idx = (levels + 1).cpu().numpy()
        return Message(pack_bits(idx, 2), 2 * idx.size)

    def from_sums(self, sums: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        n = ctx.workers
        return (sums.to(torch.float64) - n).mul_(self.shared(ctx) / n).to(torch.float32)
