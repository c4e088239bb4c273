"""Fixed-width bit packing with numpy: THC's b-bit indices on the wire and the codecs' bit fields.

Every field is written most significant bit first (field 0 in the top bits of byte 0), the order in
which a P4 parser extracts consecutive ``bit<w>`` fields. ``count`` fields of ``width`` bits take
``ceil(count * width / 8)`` bytes; the last byte is zero-padded. Both functions work along the last
axis, so a 2-D array packs one row per packet. (``worker_lib.thc.pack_indices`` is the torch twin
for tensors on any device; tests hold the two byte-identical.)
"""

from __future__ import annotations

import numpy as np
from numba import njit


def packed_bytes(count: int, width: int) -> int:
    """Bytes of ``count`` fields of ``width`` bits."""
    return (count * width + 7) // 8


def check_width(width: int) -> None:
    """Refuse a field width outside 1..32 bits."""
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in 1..32, got {width}")


def check_fields(v: np.ndarray, width: int) -> None:
    """Refuse values outside [0, 2^width) (the minimum is read only for signed types)."""
    if v.size and ((v.dtype.kind != "u" and int(v.min()) < 0) or int(v.max()) >= (1 << width)):
        raise ValueError(f"values outside [0, 2^{width})")


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers below 2^width into uint8, MSB first, along the last axis."""
    check_width(width)
    v = np.asarray(values)
    check_fields(v, width)
    lead, count = v.shape[:-1], v.shape[-1] if v.ndim else 1
    v = v.reshape(*lead, count)
    need = packed_bytes(count, width)
    if width == 8:
        return v.astype(np.uint8)
    if width > 8:  # the low ``width`` bits of each big-endian 32-bit word, concatenated
        bits = np.unpackbits(v.astype(">u4").view(np.uint8).reshape(*lead, count, 4), axis=-1)[..., 32 - width:]
        return np.packbits(bits.reshape(*lead, count * width), axis=-1)
    pad = (-count) % 8
    z = np.ascontiguousarray(v, np.uint8)
    if 8 % width == 0 and not pad:  # whole bytes per row: one compiled pass over the flat array
        out = np.empty((*lead, need), np.uint8)
        pack_whole_into(z.reshape(-1), width, out.reshape(-1))
        return out
    if pad:
        z = np.concatenate([z, np.zeros((*lead, pad), np.uint8)], axis=-1)
    if 8 % width == 0:  # whole fields per byte: shift each field into place and OR them
        per = 8 // width
        out = z[..., 0::per] << (8 - width)
        for k in range(1, per):
            out |= z[..., k::per] << (8 - width * (k + 1))
        return out[..., :need]
    # Eight fields make ``width`` whole bytes: assemble them in one 64-bit word per group of eight.
    groups = z.reshape(*lead, -1, 8).astype(np.uint64)
    word = np.zeros(groups.shape[:-1], np.uint64)
    for k in range(8):
        word |= groups[..., k] << np.uint64(width * (7 - k))
    shifts = np.arange(8 * (width - 1), -1, -8, dtype=np.uint64)
    out = ((word[..., None] >> shifts) & np.uint64(0xFF)).astype(np.uint8)
    return out.reshape(*lead, -1)[..., :need]


# Packing with 1, 2 or 4 bits per field, each written out so that LLVM vectorises it: 0.24 ms for the
# 2^22 indices of a DDP bucket where the numpy slices took 10 ms (numpy strides over every other byte).
@njit(cache=True, nogil=True)
def _pack4(z: np.ndarray, out: np.ndarray) -> None:
    for j in range(out.size):
        out[j] = (z[2 * j] << 4) | z[2 * j + 1]


@njit(cache=True, nogil=True)
def _pack2(z: np.ndarray, out: np.ndarray) -> None:
    for j in range(out.size):
        out[j] = (z[4 * j] << 6) | (z[4 * j + 1] << 4) | (z[4 * j + 2] << 2) | z[4 * j + 3]


@njit(cache=True, nogil=True)
def _pack1(z: np.ndarray, out: np.ndarray) -> None:
    for j in range(out.size):
        b = 8 * j
        out[j] = ((z[b] << 7) | (z[b + 1] << 6) | (z[b + 2] << 5) | (z[b + 3] << 4) | (z[b + 4] << 3)
                  | (z[b + 5] << 2) | (z[b + 6] << 1) | z[b + 7])


_PACK_WHOLE = {1: _pack1, 2: _pack2, 4: _pack4}


# Their inverses, written out for the same reason: strided stores into every other byte (numpy's, torch's) took
# 1.9 ms for 2^20 indices of 4 bits in torch; these take 0.06 ms.
@njit(cache=True, nogil=True)
def _unpack4(b: np.ndarray, out: np.ndarray) -> None:
    for j in range(b.size):
        v = b[j]
        out[2 * j] = v >> 4
        out[2 * j + 1] = v & 15


@njit(cache=True, nogil=True)
def _unpack2(b: np.ndarray, out: np.ndarray) -> None:
    for j in range(b.size):
        v = b[j]
        out[4 * j] = v >> 6
        out[4 * j + 1] = (v >> 4) & 3
        out[4 * j + 2] = (v >> 2) & 3
        out[4 * j + 3] = v & 3


@njit(cache=True, nogil=True)
def _unpack1(b: np.ndarray, out: np.ndarray) -> None:
    for j in range(b.size):
        v = b[j]
        for k in range(8):
            out[8 * j + k] = (v >> (7 - k)) & 1


_UNPACK_WHOLE = {1: _unpack1, 2: _unpack2, 4: _unpack4}


def pack_whole_into(fields: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Pack flat uint8 ``fields`` of ``width`` = 1, 2 or 4 bits into ``out`` (``fields.size * width / 8``
    bytes; ``fields.size`` a multiple of 8 / width), MSB first, in one compiled pass. The fields must be
    below 2^width (not checked: for callers whose fields are indices they made)."""
    _PACK_WHOLE[width](fields, out)
    return out


def pack_padded_rows(fields: np.ndarray, width: int, rows: int, count: int) -> np.ndarray:
    """``pack_bits`` of flat ``fields`` zero-padded to ``rows`` x ``count``: (rows, packed_bytes(count, width))
    uint8. Where every row is whole bytes of 1-, 2- or 4-bit fields, the rows are one MSB-first stream, so
    the fields pack straight into the result and only the bytes past them are zeroed (a padded copy of the
    2^22 indices of a DDP bucket cost page faults and a pass over 4 MiB: 1.5 against 0.7-0.8 ms)."""
    check_width(width)
    f = np.asarray(fields).reshape(-1)
    if f.size > rows * count:
        raise ValueError(f"{f.size} fields do not fit {rows} rows of {count}")
    if f.dtype != np.uint8 or width not in _PACK_WHOLE or (count * width) % 8:
        padded = np.zeros(rows * count, np.int64 if f.dtype.kind == "i" else f.dtype)
        padded[: f.size] = f
        return pack_bits(padded.reshape(rows, count), width)
    check_fields(f, width)
    out = np.empty(rows * packed_bytes(count, width), np.uint8)
    per = 8 // width
    head = f.size - f.size % per
    done = head // per
    pack_whole_into(f[:head], width, out[:done])
    if head < f.size:  # the last fields share a byte with the padding
        out[done] = sum(int(v) << (8 - width * (k + 1)) for k, v in enumerate(f[head:]))
        done += 1
    out[done:] = 0
    return out.reshape(rows, -1)


def unpack_whole_into(buf: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_whole_into``: the ``buf.size * 8 / width`` fields of flat uint8 ``buf`` into
    ``out``."""
    _UNPACK_WHOLE[width](buf, out)
    return out


def unpack_bits(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of ``pack_bits``: the first ``count`` fields of each row (uint8 for widths up to 8,
    int64 above)."""
    check_width(width)
    b = np.asarray(buf, dtype=np.uint8)
    lead = b.shape[:-1]
    need = packed_bytes(count, width)
    if b.shape[-1] < need:
        raise ValueError(f"{b.shape[-1]} bytes cannot hold {count} fields of {width} bits")
    b = b[..., :need]
    if width == 8:
        return b.copy()
    if width > 8:
        bits = np.unpackbits(b, axis=-1)[..., : count * width].reshape(*lead, count, width)
        full = np.zeros((*lead, count, 32), np.uint8)
        full[..., 32 - width:] = bits
        return np.packbits(full, axis=-1).view(">u4").reshape(*lead, count).astype(np.int64)
    mask = (1 << width) - 1
    if 8 % width == 0:
        per = 8 // width
        out = np.empty((*lead, need * per), np.uint8)
        unpack_whole_into(np.ascontiguousarray(b).reshape(-1), width, out.reshape(-1))
        return out[..., :count]
    groups = -(-count // 8)
    raw = np.zeros((*lead, groups * width), np.uint64)
    raw[..., :need] = b
    raw = raw.reshape(*lead, groups, width)
    word = np.zeros((*lead, groups), np.uint64)
    for j in range(width):
        word |= raw[..., j] << np.uint64(8 * (width - 1 - j))
    shifts = np.arange(width * 7, -1, -width, dtype=np.uint64)
    fields = (word[..., None] >> shifts) & np.uint64(mask)
    return fields.astype(np.uint8).reshape(*lead, groups * 8)[..., :count]
