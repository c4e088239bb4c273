"""THC (papers/thc-tensor-homomorphic-compression.txt) behind the common codec interface.

A thin adapter over ``worker_lib.thc.THCCodec``: the preliminary value is the worker's L2 norm (plus
error feedback), combined by max; the uplink is the b-bit table indices of the D = next_pow2(d)
rotated coordinates; the aggregator adds table values (``aggregate_integers``) and the downlink carries the
sums, at ceil(log2(g * n + 1)) bits each; decoding divides by the contributor count and undoes the
rotation. The rotation signs come from (job, tensor, step) in the ``RoundContext``.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_lib.codecs.base import CodecState, HomomorphicCodec, Message, RoundContext, check_input
from worker_lib.thc.codec import THCCodec, THCConfig
from worker_lib.thc.hadamard import next_pow2
from worker_lib.thc.signs import SignKey
from worker_lib.wire.bits import pack_bits


class THC(HomomorphicCodec):
    """Non-uniform THC with the optimal table T_{b,g,p}; error feedback per CodecState if enabled."""

    name = "thc"

    def __init__(self, config: THCConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__(config or THCConfig(), device=device, seed=seed)
        self.inner = THCCodec(self.config, device=self.device, seed=seed)
        self._table = np.asarray(self.inner.table.values, dtype=np.int64)

    @property
    def table(self) -> np.ndarray:
        return self._table

    @property
    def index_bits(self) -> int:
        return self.config.bits

    def transmitted(self, ctx: RoundContext) -> int:
        return next_pow2(ctx.length)

    @staticmethod
    def key(ctx: RoundContext) -> SignKey:
        return SignKey.derive(ctx.job, ctx.tensor, ctx.step)

    def _with_error(self, x: torch.Tensor, state: CodecState | None) -> torch.Tensor:
        flat = check_input(x).to(self.device)
        if state is not None and self.config.error_feedback:
            flat = state.add_to(flat)
        return flat

    def prelim(self, x: torch.Tensor, state: CodecState | None = None) -> float:
        """||x + e||, the norm this worker publishes."""
        return float(torch.linalg.vector_norm(self._with_error(x, state)))

    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        check_input(x, ctx)
        flat = self._with_error(x, state)
        max_norm = self.shared(ctx)
        norm = float(torch.linalg.vector_norm(flat))
        if max_norm < norm * (1 - 1e-6):
            raise ValueError(f"max_norm {max_norm} is below this worker's norm {norm}")
        key = self.key(ctx)
        enc = self.inner.encode(flat, max_norm, key)
        idx = enc.indices.cpu().numpy().astype(np.int64)  # copied out of the codec's workspace
        if state is not None and self.config.error_feedback:
            own = torch.from_numpy(self._table[idx]).to(self.device)
            state.error = flat - self.inner.decode(own, 1, enc.scale, flat.numel(), key).reshape(-1)
        return Message(pack_bits(idx, self.index_bits), idx.size * self.index_bits)

    def from_sums(self, sums: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        scale = self.inner.scale(self.shared(ctx), self.transmitted(ctx))
        return self.inner.decode(sums, ctx.workers, scale, ctx.length, self.key(ctx)).reshape(-1)
