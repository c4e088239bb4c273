"""TopK sparsification (Stich et al. 2018; the THC paper's baseline "TopK 10%").

Each worker keeps the k percent of coordinates of largest magnitude and sends them as (index,
value) pairs: a 32-bit unsigned index and a float32 value each, with no header (the count follows
from k and d, which both sides know). With ``error_feedback`` the unsent residual is carried to
the next round in the worker's CodecState (Stich et al.'s memory); it is off by default, as in the
THC paper's comparison.

TopK is not homomorphic: the supports of different workers differ, so the aggregator decodes every
message into a dense vector, adds, and sparsifies the average again for the downlink (the
parameter-server cost the THC paper measures in its Figure 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.codecs.base import CodecState, DARCodec, Message, RoundContext, check_input, require

INDEX_BITS = 32
VALUE_BITS = 32


@dataclass(frozen=True)
class TopKConfig:
    """Knobs: the percentage of coordinates kept (0 < percent <= 100) and error feedback."""

    percent: float = 10.0
    error_feedback: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.percent, int | float) and math.isfinite(self.percent)
                and 0 < self.percent <= 100, f"percent must be in (0, 100], got {self.percent!r}")

    def kept(self, d: int) -> int:
        """Coordinates kept out of d: ceil(percent * d / 100), at least 1."""
        return max(1, min(d, math.ceil(self.percent * d / 100 - 1e-9)))


class TopK(DARCodec):
    """Keep the largest k% magnitudes; (uint32 index, float32 value) pairs on the wire."""

    name = "topk"

    def __init__(self, config: TopKConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__(config or TopKConfig(), device=device, seed=seed)

    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        flat = check_input(x, ctx).to(self.device)
        if ctx.length >= 1 << INDEX_BITS:
            raise ValueError("TopK indices are 32-bit: at most 2^32 coordinates")
        use_ef = state is not None and self.config.error_feedback
        if use_ef:
            flat = state.add_to(flat)
        k = self.config.kept(ctx.length)
        idx = torch.topk(flat.abs(), k, sorted=False).indices
        idx, _ = torch.sort(idx)
        values = flat[idx]
        if use_ef:
            residual = flat.clone()
            residual[idx] = 0
            state.error = residual
        payload = np.concatenate([idx.cpu().numpy().astype(">u4").view(np.uint8),
                                  values.cpu().numpy().astype(">f4").view(np.uint8)])
        return Message(payload, k * (INDEX_BITS + VALUE_BITS))

    def decode_one(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        k = self.config.kept(ctx.length)
        if msg.bits != k * (INDEX_BITS + VALUE_BITS):
            raise ValueError(f"expected {k * (INDEX_BITS + VALUE_BITS)} bits for k = {k}, got {msg.bits}")
        idx = msg.payload[: 4 * k].view(">u4").astype(np.int64)
        values = msg.payload[4 * k:].view(">f4").astype(np.float32)
        if idx.size and int(idx.max()) >= ctx.length:
            raise ValueError("an index is outside the tensor")
        out = torch.zeros(ctx.length, dtype=torch.float32, device=self.device)
        out[torch.from_numpy(idx).to(self.device)] = torch.from_numpy(values).to(self.device)
        return out
