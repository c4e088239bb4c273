"""Fast numpy (de)serialization of THC packets, one packet or whole batches at a time.

The header is a big-endian structured dtype (``layout.HEADER_DTYPE``); a batch of received packets
sits in a 2-D uint8 buffer (one row per packet), and ``header_view`` gives every header of the batch
without copying. Payload helpers carry sums at the job's result width, big-endian (b-bit indices are
packed by ``worker_lib.wire.bits``). Nothing
here needs torch: the transport's low-level calls and the aggregator use it directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from worker_lib.wire.layout import FIELD_NAMES, HEADER_BYTES, VERSION, header_dtype

_RESULT_DTYPES = {8: np.dtype(">u1"), 16: np.dtype(">u2"), 32: np.dtype(">u4")}


def result_dtype(width: int) -> np.dtype:
    """Big-endian unsigned dtype of a result element of ``width`` bits."""
    try:
        return _RESULT_DTYPES[width]
    except KeyError:
        raise ValueError(f"result width must be one of 8, 16, 32, got {width}") from None


def encode_sums(sums: np.ndarray, width: int) -> bytes:
    """Sums as a result payload: unsigned big-endian (uncompressed jobs' int32 sums: two's complement)."""
    s = np.asarray(sums)
    if width == 32:
        return s.astype(np.int64).astype(np.uint32).astype(">u4").tobytes()
    if s.size and (int(s.min()) < 0 or int(s.max()) >= (1 << width)):
        raise ValueError(f"a sum does not fit in {width} bits")
    return s.astype(result_dtype(width)).tobytes()


def decode_sums(payload: bytes | np.ndarray, width: int, count: int, *, signed: bool = False) -> np.ndarray:
    """Result payload -> int64 sums (``signed`` for the int32 sums of uncompressed jobs)."""
    dt = result_dtype(width)
    if isinstance(payload, bytes | bytearray | memoryview):
        arr = np.frombuffer(payload, dtype=dt, count=count)
    else:
        arr = np.ascontiguousarray(np.asarray(payload, np.uint8)[: count * dt.itemsize]).view(dt)
    if signed:
        if width != 32:
            raise ValueError("signed sums are int32")
        return arr.astype(np.uint32).view(np.int32).astype(np.int64)
    return arr.astype(np.int64)


def encode_int32(values: np.ndarray) -> bytes:
    """Uncompressed payload: int32 fixed-point values, big-endian."""
    return np.asarray(values, dtype=np.int64).astype(np.int32).astype(">i4").tobytes()


def float_bits(value: float) -> int:
    """IEEE-754 float32 bits of a norm (the aggregator maxes them as integers)."""
    return int(np.array([value], dtype=">f4").view(">u4")[0])


def bits_float(bits: int) -> float:
    """Inverse of ``float_bits``."""
    return float(np.array([bits], dtype=">u4").view(">f4")[0])


def build_batch(headers: np.ndarray | Mapping[str, np.ndarray], payloads: np.ndarray) -> np.ndarray:
    """Serialize a batch: B headers and a (B, L) uint8 payload array -> (B, HEADER_BYTES + L) uint8."""
    pay = np.asarray(payloads, dtype=np.uint8)
    if pay.ndim != 2:
        raise ValueError("payloads must be a 2-D uint8 array (one row per packet)")
    rows = pay.shape[0]
    out = np.zeros((rows, HEADER_BYTES + pay.shape[1]), np.uint8)
    view = header_view(out)
    if isinstance(headers, np.ndarray) and headers.dtype.names:
        for name in FIELD_NAMES:
            view[name] = headers[name]
    else:
        view["version"] = VERSION
        for name, value in headers.items():
            view[name] = value
    out[:, HEADER_BYTES:] = pay
    return out


def batch_of(packets: Sequence[bytes], stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Packets as a receive batch: a (B, ``stride``) uint8 buffer, one packet per row (cut at ``stride``,
    as a receive buffer would), and their lengths as sent."""
    buf = np.zeros((len(packets), stride), np.uint8)
    for i, p in enumerate(packets):
        data = np.frombuffer(p, np.uint8)[:stride]
        buf[i, :data.size] = data
    return buf, np.array([len(p) for p in packets], np.int64)


def header_view(buf: np.ndarray) -> np.ndarray:
    """Structured view of the headers of a 2-D uint8 batch buffer (one packet per row), no copy."""
    if buf.ndim != 2 or buf.dtype != np.uint8:
        raise ValueError("a batch buffer is a 2-D uint8 array")
    if not buf.flags.c_contiguous:
        raise ValueError("a batch buffer must be C-contiguous")
    return np.frombuffer(buf, dtype=header_dtype(buf.shape[1]), count=buf.shape[0]) if buf.size \
        else np.zeros(0, dtype=header_dtype(max(buf.shape[1], HEADER_BYTES)))


def split_batch(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(headers view, payload view) of a batch buffer."""
    return header_view(buf), buf[:, HEADER_BYTES:]
