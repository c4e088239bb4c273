"""Natural compression C_nat (Horváth et al., IntML; papers/intml-natural-compression.txt).

Each value t != 0 with 2^a <= |t| < 2^(a+1) becomes sign(t) 2^a with probability
(2^(a+1) - |t|) / 2^a and sign(t) 2^(a+1) otherwise, so E[C_nat(t)] = t (the paper's Figure 1:
2.5 -> 2 with probability 0.75, -> 4 with probability 0.25). The deterministic variant (the paper's
"C_nat deterministic", not defined further there) rounds to the nearer of the two powers, ties up.

Wire format, one byte per coordinate as in the IntML prototype (Section 3): bit 7 the sign (1 =
negative), bit 6 the zero flag (1 = the value is 0), bits 5..0 the exponent + 50, with exponents
clipped to [-50, 10] (stored 0..60).

What the paper leaves open and we decide (mathematically):

* Magnitudes below 2^-50 have no representable lower power of two. Instead of clipping them *up* to
  2^-50 (a bias of up to 2^-50 per coordinate, and a huge relative one) we round them stochastically
  between 0 and 2^-50, with P(2^-50) = |t| / 2^-50, which keeps the operator unbiased.
* Magnitudes whose rounding would exceed 2^10 are clipped to 2^10 (biased; the paper reports this
  never happened in its experiments). We count such coordinates and log them at WARNING level.

The aggregator decodes every byte to a float, adds, and applies C_nat to the average again (the
IntML aggregator does this stochastic rounding itself, which the paper identifies as its
bottleneck), so the codec is decompress-aggregate-recompress.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from worker_lib.codecs.base import CodecState, DARCodec, Message, RoundContext, check_input, require

log = logging.getLogger(__name__)

MIN_EXP = -50
MAX_EXP = 10


@dataclass(frozen=True)
class NaturalConfig:
    """Knobs: ``rounding`` is "stochastic" (C_nat, unbiased) or "nearest" (the deterministic variant)."""

    rounding: Literal["stochastic", "nearest"] = "stochastic"

    def __post_init__(self) -> None:
        require(self.rounding in ("stochastic", "nearest"),
                f"rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")


class NaturalCompression(DARCodec):
    """Randomized rounding to powers of two; 8 bits per coordinate."""

    name = "natural"

    def __init__(self, config: NaturalConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__(config or NaturalConfig(), device=device, seed=seed)

    def bytes_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The wire byte of every coordinate (uint8 tensor on the codec's device).

        Works on the float32 bit pattern: for a normal float, |t| = (1 + f) 2^a with f the mantissa
        fraction, so the probability of rounding up, (|t| - 2^a) / 2^a, is f itself.
        """
        raw = flat.contiguous().view(torch.int32)
        biased = (raw >> 23) & 0xFF  # IEEE exponent field; 0 for zero and subnormals (< 2^-126)
        frac = (raw & 0x7FFFFF).to(torch.float32) * (2.0 ** -23)
        a = biased - 127
        tiny = a < MIN_EXP
        if self.config.rounding == "stochastic":
            u = self.rand(flat.numel())
            up = u < frac
            # below 2^-50: 0 or 2^-50 with P(2^-50) = |t| 2^50, unbiased
            keep_tiny = u < flat.abs().mul(2.0 ** -MIN_EXP)
        else:
            up = frac >= 0.5
            keep_tiny = flat.abs() >= 2.0 ** (MIN_EXP - 1)
        r = a + up.to(torch.int32)
        over = int((r > MAX_EXP).sum())
        if over:
            log.warning("natural compression: %d coordinates above 2^%d clipped (biased)", over, MAX_EXP)
        r = torch.where(tiny, MIN_EXP, r).clamp_(MIN_EXP, MAX_EXP)
        zero = tiny & ~keep_tiny  # includes t == 0 (u < 0 never holds; 0 >= 2^-51 is false)
        stored = torch.where(zero, 0, r - MIN_EXP)
        sign = (raw < 0).to(torch.int32)
        return (sign << 7 | zero.to(torch.int32) << 6 | stored).to(torch.uint8)

    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        flat = check_input(x, ctx).to(self.device)
        out = self.bytes_of(flat).cpu().numpy()
        return Message(out, 8 * out.size)

    def decode_one(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        if msg.bits != 8 * ctx.length:
            raise ValueError(f"expected {8 * ctx.length} bits, got {msg.bits}")
        return decode_bytes(torch.from_numpy(np.ascontiguousarray(msg.payload)).to(self.device))


def decode_bytes(b: torch.Tensor) -> torch.Tensor:
    """float32 values of natural-compression bytes; ValueError on an exponent field above 60.

    The float32 bit pattern is assembled directly: sign bit, and exponent field (stored - 50) + 127.
    """
    v = b.to(torch.int32)
    stored = v & 0x3F
    zero = ((v >> 6) & 1).bool()
    if bool(((stored > MAX_EXP - MIN_EXP) & ~zero).any()):
        raise ValueError("exponent field outside [0, 60]: corrupt natural-compression data")
    raw = ((v >> 7) & 1) << 31 | (stored + (MIN_EXP + 127)) << 23
    return torch.where(zero, 0, raw).view(torch.float32)
