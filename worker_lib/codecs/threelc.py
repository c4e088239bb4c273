"""3LC (Lim, Andersen and Kaminsky, SysML 2019; papers/3lc.txt).

Three stages per tensor (Section 3):

1. **3-value quantization with sparsity multiplication** (lossy): M = max|T| * s with 1 <= s < 2
   (Eq. 1), T_q = round(T / M) in {-1, 0, 1} (Eq. 2), dequantized as M * T_q (Eq. 3). An *error
   accumulation buffer* (CodecState) adds the previous residual before quantizing and keeps
   (T + e) - M T_q afterwards.
2. **Quartic encoding** (lossless): add 1, pad to a multiple of 5, split the array into five
   contiguous partitions p0..p4 and emit a = 81 p0 + 27 p1 + 9 p2 + 3 p3 + p4 (values 0..242).
3. **Zero-run encoding** (lossless): a run of k = 2..14 bytes of 121 (five zeros) becomes the byte
   243 + (k - 2); longer runs are cut greedily into runs of 14 (and a last single 121 stays 121).

Wire message: M as a big-endian float32, then the zero-run-encoded bytes (the decoder knows d, so
the stream needs no length field). A zero tensor costs one byte per 70 coordinates: the paper's
280x over float32, reached exactly when d is a multiple of 70 (the 4-byte M aside).

Decisions where the paper is silent or loose:

* Padding: the paper pads with 0 *after* adding 1, i.e. with the level -1. We pad with 1 (the level
  0) so that padding joins zero runs; padding is dropped on decoding either way.
* round() is round-half-to-even (TensorFlow's and torch's round), so |T| = M / 2 maps to 0.
* A zero tensor has M = 0 and T / M undefined; every level is then 0 (the only sensible output).

The aggregator (a parameter server in the paper) decompresses each push, sums, and compresses the
model delta with 3LC again for the pull, keeping its own error accumulation buffer; pass a
CodecState to ``aggregate`` for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.codecs.base import CodecState, DARCodec, Message, RoundContext, check_input, require
from worker_lib.codecs.bits import float_bytes, read_floats

ZERO_GROUP = 121  # quartic code of five zeros: 81 + 27 + 9 + 3 + 1
RUN_BASE = 243  # 243 + (k - 2) for a run of k = 2..14 zero groups
MAX_RUN = 14
_POW3 = np.array([81, 27, 9, 3, 1], dtype=np.uint8)


@dataclass(frozen=True)
class ThreeLCConfig:
    """Knobs: the sparsity multiplier s in [1, 2), zero-run encoding on/off, error accumulation."""

    sparsity: float = 1.0
    zero_run: bool = True
    error_feedback: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.sparsity, int | float) and 1.0 <= self.sparsity < 2.0,
                f"sparsity multiplier s must be in [1, 2), got {self.sparsity!r}")


def quartic_encode(levels: np.ndarray) -> np.ndarray:
    """Fold values in {-1, 0, 1} five to a byte (0..242); see the module docstring for padding."""
    v = np.asarray(levels).reshape(-1)
    if v.size and (int(v.min()) < -1 or int(v.max()) > 1):
        raise ValueError("quartic encoding takes values in {-1, 0, 1}")
    u = (v + 1).astype(np.uint8)
    groups = math.ceil(u.size / 5)
    padded = np.ones(5 * groups, dtype=np.uint8)
    padded[: u.size] = u
    parts = padded.reshape(5, groups)  # five contiguous partitions p0..p4
    return (parts * _POW3[:, None]).sum(axis=0, dtype=np.uint16).astype(np.uint8)


def quartic_decode(codes: np.ndarray, count: int) -> np.ndarray:
    """Inverse of quartic_encode: the first ``count`` values (int8 in {-1, 0, 1})."""
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if c.size != math.ceil(count / 5):
        raise ValueError(f"{c.size} quartic bytes do not hold {count} values")
    if c.size and int(c.max()) > 242:
        raise ValueError("quartic bytes must lie in 0..242")
    parts = (c[None, :] // _POW3[:, None]) % 3
    return parts.reshape(-1)[:count].astype(np.int8) - 1


def zero_run_encode(codes: np.ndarray) -> np.ndarray:
    """Replace runs of k = 2..14 bytes 121 by 243 + (k - 2), greedily (runs of 14 first)."""
    b = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if b.size and int(b.max()) > 242:
        raise ValueError("zero-run encoding takes quartic bytes (0..242)")
    if b.size == 0:
        return b.copy()
    is_zero = b == ZERO_GROUP
    edges = np.diff(np.concatenate([[0], is_zero.view(np.int8), [0]]))
    starts = np.flatnonzero(edges == 1)
    lengths = np.flatnonzero(edges == -1) - starts
    full, rest = lengths // MAX_RUN, lengths % MAX_RUN
    run_out = full + (rest > 0)
    # output bytes contributed by each input byte: 1 outside runs, run_out at a run's start, 0 inside
    count = (~is_zero).astype(np.int64)
    count[starts] = run_out
    offset = np.cumsum(count) - count
    out = np.empty(int(count.sum()), dtype=np.uint8)
    keep = ~is_zero
    out[offset[keep]] = b[keep]
    # runs: `full` bytes of 255, then the remainder (none, a single 121, or 243 + rest - 2)
    first = np.repeat(offset[starts], run_out)
    within = np.arange(first.size) - np.repeat(np.cumsum(run_out) - run_out, run_out)
    out[first + within] = RUN_BASE + MAX_RUN - 2
    last = np.where(rest == 1, ZERO_GROUP, RUN_BASE + rest - 2)
    tail = rest > 0
    out[(offset[starts] + run_out - 1)[tail]] = last[tail]
    return out


def zero_run_decode(stream: np.ndarray) -> np.ndarray:
    """Inverse of zero_run_encode."""
    s = np.asarray(stream, dtype=np.uint8).reshape(-1)
    is_run = s >= RUN_BASE
    reps = np.where(is_run, s.astype(np.int64) - RUN_BASE + 2, 1)
    return np.repeat(np.where(is_run, ZERO_GROUP, s).astype(np.uint8), reps)


class ThreeLC(DARCodec):
    """3-value quantization + quartic + zero-run encoding, with error accumulation."""

    name = "3lc"

    def __init__(self, config: ThreeLCConfig | None = None, *, device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        super().__init__(config or ThreeLCConfig(), device=device, seed=seed)

    def quantize(self, flat: torch.Tensor) -> tuple[float, torch.Tensor]:
        """(M, T_q) of Eqs. 1-2 for a flat float tensor."""
        big_m = float(flat.abs().max()) * self.config.sparsity
        if big_m == 0.0:
            return 0.0, torch.zeros_like(flat, dtype=torch.int8)
        return big_m, torch.round(flat / big_m).clamp_(-1, 1).to(torch.int8)

    def encode(self, x: torch.Tensor, ctx: RoundContext, state: CodecState | None = None) -> Message:
        flat = check_input(x, ctx).to(self.device)
        use_ef = state is not None and self.config.error_feedback
        if use_ef:
            flat = state.add_to(flat)
        big_m, q = self.quantize(flat)
        if use_ef:
            state.error = flat - big_m * q.to(torch.float32)
        codes = quartic_encode(q.cpu().numpy())
        if self.config.zero_run:
            codes = zero_run_encode(codes)
        payload = np.concatenate([float_bytes(big_m), codes])
        return Message(payload, 8 * payload.size)

    def decode_one(self, msg: Message, ctx: RoundContext) -> torch.Tensor:
        if msg.bits != 8 * msg.nbytes:
            raise ValueError("a 3LC message is a whole number of bytes")
        (big_m,) = read_floats(msg.payload, 1)
        codes = msg.payload[4:]
        if self.config.zero_run:
            codes = zero_run_decode(codes)
        levels = quartic_decode(codes, ctx.length)
        return torch.from_numpy(levels).to(self.device, torch.float32).mul_(big_m)
