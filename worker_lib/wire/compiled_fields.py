"""Big-endian header fields read and written inside compiled (numba) loops.

The aggregator's batch engine (``aggregator.compiled``) and the worker's intake of answers
(``worker_lib.result_intake``) parse rows of a receive buffer in place; these four helpers are the one
definition of how a 16- or 32-bit field sits in a row (network byte order, docs/protocol.md). They
inline into their callers, so a field costs a couple of loads.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def put16(row: np.ndarray, at: int, v: int) -> None:
    row[at] = (v >> 8) & 0xFF
    row[at + 1] = v & 0xFF


@njit(cache=True, inline="always")
def put32(row: np.ndarray, at: int, v: int) -> None:
    row[at] = (v >> 24) & 0xFF
    row[at + 1] = (v >> 16) & 0xFF
    row[at + 2] = (v >> 8) & 0xFF
    row[at + 3] = v & 0xFF


@njit(cache=True, inline="always")
def get16(row: np.ndarray, at: int) -> int:
    return (np.int64(row[at]) << 8) | np.int64(row[at + 1])


@njit(cache=True, inline="always")
def get32(row: np.ndarray, at: int) -> int:
    return (get16(row, at) << 16) | get16(row, at + 2)
