"""Bit-exact helpers shared by the codecs: field widths and float32 header fields.

Fixed-width bit fields are packed by ``worker_lib.wire.bits`` (MSB first, the order in which a P4
parser extracts consecutive ``bit<w>`` fields); the codecs report the exact bit count of a message
(``Message.bits``) rather than its padded byte count.
"""

from __future__ import annotations

import numpy as np

FLOAT_BITS = 32


def width_for(max_value: int) -> int:
    """Bits needed to write every integer in [0, max_value] (at least 1)."""
    if max_value < 0:
        raise ValueError(f"max_value must be non-negative, got {max_value}")
    return max(1, int(max_value).bit_length())


def float_bytes(*values: float) -> np.ndarray:
    """IEEE-754 float32 header fields, big-endian."""
    return np.asarray(values, dtype=">f4").view(np.uint8).copy()


def read_floats(buf: np.ndarray, count: int, offset: int = 0) -> list[float]:
    """Read ``count`` big-endian float32 fields starting at byte ``offset``."""
    raw = np.asarray(buf, dtype=np.uint8)[offset: offset + 4 * count]
    if raw.size != 4 * count:
        raise ValueError("message too short for its float32 header")
    return [float(v) for v in raw.view(">f4")]
