"""Dynamic quantization with Huffman coding (Øland and Raj, ICASSP 2015;
papers/oland-raj-dynamic-quantization.txt), Algorithms 1 and 2, per tensor.

1. w_min, w_max of the tensor;
2. H, the entropy of an M-bit preliminary quantization of a random F-fraction of the values;
3. N = ceil(H + c) bits;
4. Q = uniform N-bit quantization of every value; P its 2^N-bin histogram; a Huffman codebook
   from P; the package [codes, w_min, w_max, P, N];
5. decoding: w_min + (w_max - w_min)(i + 0.5) / 2^N, the centre of bin i.

Defaults F = 0.03, M = 4, c = 6 (the paper's Section 5.2 setting; 5.1 prefers c = 5).

Errata of the paper, fixed here:

* **Quantize mirrored.** The paper's Quantize is floor(2^N (w_max - w) / (w_max - w_min)), which
  counts bins down from w_max, while its decoder w_min + (w_max - w_min)(i + 0.5) / 2^N counts them
  up from w_min: decoding would mirror every value about the centre of the range. We use
  (w - w_min), which is what the decoder inverts.
* **Index 2^N.** At w = w_max (with the fix; w = w_min in the paper's form) the floor gives 2^N,
  outside the 2^N bins the histogram and the decoder have. We clamp to 2^N - 1.
* **N is not an integer.** N = H + c with a real H; the number of bits must be an integer, so we
  round up (never fewer bits than the rule asks for).
* **Entropy base.** The paper writes log without a base; H is compared with bit counts, so log2.
* **Sample size.** F|W| may be fractional or below 1 for small tensors: we draw max(1, ceil(F d))
  values, without replacement.
* **Package P.** The decoder must rebuild exactly the encoder's codebook from P. Floats risk
  rounding differences, so we ship the histogram counts h (P = h / d, d known to both sides), each
  in ceil(log2(d + 1)) bits.
* w_max = w_min (a constant tensor) makes the ratio 0/0: every value is bin 0, and decoding gives
  w_min exactly because the bin width is 0.

The paper compresses weights exchanged after an epoch; here the same algorithm compresses gradients
(or any tensor, including weights). It is deterministic apart from the entropy sample, hence biased,
and its quantization step is (w_max - w_min) / 2^N. The aggregator must decode each package, sum,
and run Algorithm 1 again on the average: decompress-aggregate-recompress.

Wire layout: N (8 bits), w_min and w_max (float32 each), 2^N counts, then the Huffman code words;
``Message.bits`` is exact (the Huffman stream is not padded except for the final byte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.codecs.base import CodecState, DARCodec, Message, RoundContext, check_input, require
from worker_lib.codecs.bits import FLOAT_BITS, float_bytes, width_for
from worker_lib.codecs.huffman import HuffmanCode, entropy_bits
from worker_lib.wire.bits import pack_bits, unpack_bits

MAX_BITS = 16  # 2^N histogram bins travel with every package


@dataclass(frozen=True)
class DynQuantConfig:
    """Knobs: sample fraction F in (0, 1], preliminary bits M >= 1, floor c >= 0 (M + c <= 16)."""

    fraction: float = 0.03
    prelim_bits: int = 4
    floor: float = 6.0

    def __post_init__(self) -> None:
        require(isinstance(self.fraction, int | float) and 0 < self.fraction <= 1,
                f"fraction F must be in (0, 1], got {self.fraction!r}")
        require(isinstance(self.prelim_bits, int) and not isinstance(self.prelim_bits, bool)
                and 1 <= self.prelim_bits <= MAX_BITS, f"M must be an integer in 1..{MAX_BITS}, "
                f"got {self.prelim_bits!r}")
        require(isinstance(self.floor, int | float) and math.isfinite(self.floor) and self.floor >= 0,
                f"floor c must be a finite number >= 0, got {self.floor!r}")
        require(self.prelim_bits + self.floor <= MAX_BITS,
                f"M + c must be at most {MAX_BITS} (N can reach it), got {self.prelim_bits + self.floor}")


def quantize(w: torch.Tensor, w_min: float, w_max: float, bits: int) -> torch.Tensor:
    """Bin index in [0, 2^bits - 1] of every value (the paper's Quantize with its errata fixed)."""
    if w_max <= w_min:
        return torch.zeros(w.shape, dtype=torch.int64, device=w.device)
    scale = (1 << bits) / (float(w_max) - float(w_min))
    q = torch.floor((w.to(torch.float64) - w_min) * scale).to(torch.int64)
    return q.clamp_(0, (1 << bits) - 1)


def dequantize(q: torch.Tensor, w_min: float, w_max: float, bits: int) -> torch.Tensor:
    """Algorithm 2, line 4: the centre of each bin (float32)."""
    step = (float(w_max) - float(w_min)) / (1 << bits)
    return (q.to(torch.float64) + 0.5).mul_(step).add_(w_min).to(torch.float32)


class DynamicQuantization(DARCodec):
    """Entropy-driven uniform quantization to bin centres, Huffman coded."""

    name = "dynquant"

    def __init__(self, config: DynQuantConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__(config or DynQuantConfig(), device=device, seed=seed)

    def estimate_entropy(self, flat: torch.Tensor, w_min: float, w_max: float) -> float:
        """H of the M-bit quantization of a random F-fraction sample (Estimate Entropy)."""
        d = flat.numel()
        k = max(1, math.ceil(self.config.fraction * d - 1e-9))
        if k >= d:
            sample = flat
        else:
            sample = flat[torch.randperm(d, generator=self._generator, device=self.device)[:k]]
        m = self.config.prelim_bits
        hist = torch.bincount(quantize(sample, w_min, w_max, m), minlength=1 << m)
        return entropy_bits(hist.cpu().numpy())

    def bits_for(self, entropy: float) -> int:
        """N = ceil(H + c), at least 1."""
        return max(1, math.ceil(entropy + self.config.floor - 1e-9))

    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        flat = check_input(x, ctx).to(self.device)
        d = flat.numel()
        w_min, w_max = float(flat.min()), float(flat.max())
        n_bits = self.bits_for(self.estimate_entropy(flat, w_min, w_max))
        q = quantize(flat, w_min, w_max, n_bits)
        counts = torch.bincount(q, minlength=1 << n_bits).cpu().numpy()
        code = HuffmanCode.from_counts(counts)
        stream, stream_bits = code.encode(q.cpu().numpy())
        cw = width_for(d)
        header = np.concatenate([np.array([n_bits], dtype=np.uint8), float_bytes(w_min, w_max)])
        table_bits = counts.size * cw
        # header (72 bits) | counts | code words, as one bit string
        front = np.unpackbits(np.concatenate([header, pack_bits(counts, cw)]))[: 72 + table_bits]
        payload = np.packbits(np.concatenate([front, np.unpackbits(stream)[:stream_bits]]))
        return Message(payload, 8 + 2 * FLOAT_BITS + table_bits + stream_bits)

    def decode_one(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        d = ctx.length
        if msg.bits < 72:
            raise ValueError("message too short for the dynamic-quantization header")
        n_bits = int(msg.payload[0])
        if not 1 <= n_bits <= MAX_BITS:
            raise ValueError(f"N = {n_bits} outside 1..{MAX_BITS}: corrupt data")
        w_min, w_max = (float(v) for v in msg.payload[1:9].view(">f4"))
        cw = width_for(d)
        table_bits = (1 << n_bits) * cw
        if msg.bits < 72 + table_bits:
            raise ValueError("message too short for its histogram")
        bits = np.unpackbits(msg.payload)[: msg.bits]
        counts = unpack_bits(np.packbits(bits[72: 72 + table_bits]), cw, 1 << n_bits).astype(np.int64)
        if int(counts.sum()) != d:
            raise ValueError(f"the histogram counts {int(counts.sum())} values, the tensor has {d}")
        stream = bits[72 + table_bits:]
        q = HuffmanCode.from_counts(counts).decode(np.packbits(stream), stream.size, d)
        return dequantize(torch.from_numpy(q).to(self.device), w_min, w_max, n_bits)
