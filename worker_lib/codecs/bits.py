"""Bit-exact wire helpers shared by the codecs: fixed-width bit packing and float32 header fields.

Every field is written most significant bit first and bytes are big-endian, the order in which a
P4 parser extracts consecutive ``bit<w>`` fields. A stream of ``count`` fields of ``width`` bits
occupies exactly ``count * width`` bits; the last byte is zero-padded, and the codecs report the
exact bit count (``Message.bits``) rather than the padded byte count.
"""

from __future__ import annotations

import math

import numpy as np

FLOAT_BITS = 32


def width_for(max_value: int) -> int:
    """Bits needed to write every integer in [0, max_value] (at least 1)."""
    if max_value < 0:
        raise ValueError(f"max_value must be non-negative, got {max_value}")
    return max(1, int(max_value).bit_length())


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers (< 2^width, width in 1..32) into a uint8 array, MSB first."""
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in 1..32, got {width}")
    v = np.asarray(values).reshape(-1)
    if v.size and (int(v.min()) < 0 or int(v.max()) >= (1 << width)):
        raise ValueError(f"values outside [0, 2^{width})")
    if width == 8:
        return v.astype(np.uint8)
    need = math.ceil(v.size * width / 8)
    if width < 8:  # eight fields make `width` whole bytes: assemble them in one 64-bit word
        groups = np.zeros(math.ceil(v.size / 8) * 8, dtype=np.uint64)
        groups[: v.size] = v
        groups = groups.reshape(-1, 8)
        word = np.zeros(groups.shape[0], dtype=np.uint64)
        for k in range(8):
            word |= groups[:, k] << np.uint64(width * (7 - k))
        shifts = np.arange(8 * (width - 1), -1, -8, dtype=np.uint64)
        return ((word[:, None] >> shifts) & np.uint64(0xFF)).astype(np.uint8).reshape(-1)[:need]
    words = v.astype(">u4").view(np.uint8).reshape(-1, 4)
    bits = np.unpackbits(words, axis=1)[:, 32 - width:]
    return np.packbits(bits.reshape(-1))


def unpack_bits(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of pack_bits: the first ``count`` fields of ``width`` bits (int64)."""
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in 1..32, got {width}")
    buf = np.asarray(buf, dtype=np.uint8).reshape(-1)
    need = math.ceil(count * width / 8)
    if buf.size < need:
        raise ValueError(f"{buf.size} bytes cannot hold {count} fields of {width} bits")
    if width == 8:
        return buf[:count].astype(np.int64)
    if width < 8:
        groups = math.ceil(count / 8)
        raw = np.zeros(groups * width, dtype=np.uint64)
        raw[:need] = buf[:need]
        raw = raw.reshape(groups, width)
        word = np.zeros(groups, dtype=np.uint64)
        for j in range(width):
            word |= raw[:, j] << np.uint64(8 * (width - 1 - j))
        shifts = np.arange(width * 7, -1, -width, dtype=np.uint64)
        fields = (word[:, None] >> shifts) & np.uint64((1 << width) - 1)
        return fields.reshape(-1)[:count].astype(np.int64)
    bits = np.unpackbits(buf[:need])[: count * width].reshape(count, width)
    full = np.zeros((count, 32), dtype=np.uint8)
    full[:, 32 - width:] = bits
    return np.packbits(full, axis=1).view(">u4").reshape(-1).astype(np.int64)


def float_bytes(*values: float) -> np.ndarray:
    """IEEE-754 float32 header fields, big-endian."""
    return np.asarray(values, dtype=">f4").view(np.uint8).copy()


def read_floats(buf: np.ndarray, count: int, offset: int = 0) -> list[float]:
    """Read ``count`` big-endian float32 fields starting at byte ``offset``."""
    raw = np.asarray(buf, dtype=np.uint8)[offset: offset + 4 * count]
    if raw.size != 4 * count:
        raise ValueError("message too short for its float32 header")
    return [float(v) for v in raw.view(">f4")]
