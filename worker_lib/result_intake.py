"""A worker's intake of a received batch of RESULT datagrams as one compiled loop (numba).

``Transport._exchange`` matches every received datagram to the open use of its slot, checks it is that
use's answer and stores its sums. Written as numpy expressions over the batch, that took about 40 array
operations per batch whatever its size, plus a scatter of the sums that converts big-endian bytes
through numpy's casting machinery: about a third of a worker's CPU in a DDP step at 1 Gbit/s (where
a batch holds some 30 datagrams), on cores that the encoder and the aggregator need. ``take_results``
does the same in one pass over the rows, with the same verdicts and counts (tests/test_result_intake.py
holds it to the numpy path).

It covers the hot case only: DATA answers (RESULT) of a one-tier job. A batch with a straggler notice
in it, norm answers, two-tier results and codec messages keep the numpy path in the transport.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from worker_lib.wire.compiled_fields import get16, get32
from worker_lib.wire.layout import HEADER_BYTES, PacketType, field_offsets

_H = HEADER_BYTES
_STRAGGLER = int(PacketType.STRAGGLER)
_OFF = field_offsets()
_O_TYPE, _O_JOB, _O_KEY, _O_SLOT, _O_ROUND = _OFF["type"], _OFF["job"], _OFF["key"], _OFF["slot"], _OFF["round"]
_O_CONTRIB, _O_ELEMS, _O_WIDTH, _O_BITMAP = _OFF["contributors"], _OFF["elems"], _OFF["width"], _OFF["bitmap"]


@njit(cache=True)
def has_notice(rows: np.ndarray, lens: np.ndarray) -> bool:
    """Whether any datagram of the batch is a straggler notice (whose handling stays in Python)."""
    for i in range(rows.shape[0]):
        if lens[i] >= _H and rows[i, _O_TYPE] == _STRAGGLER:
            return True
    return False


@njit(cache=True)
def take_results(rows: np.ndarray, lens: np.ndarray, job: int, key: int, use_of_slot: np.ndarray,
                 done: np.ndarray, rounds: np.ndarray, want_type: int, elems: int, width: int, signed: bool,
                 sums: np.ndarray, contrib: np.ndarray, bitmap: np.ndarray,
                 finished: np.ndarray) -> tuple[int, int, int]:
    """Take the answers among ``rows`` (one datagram each, ``lens`` their lengths), in arrival order.

    A datagram of this job and key whose slot holds an open use (``use_of_slot``, not ``done``) and whose
    round is that use's is *pending* (the path spoke for the use: a late copy of an earlier use of the
    slot says nothing of this one); it is that use's answer if its type is ``want_type``, its element
    count ``elems``, its width ``width`` and its length the header plus ``elems`` values of that width.
    An answer's values go to ``sums[use]`` (big-endian; 32-bit values as int32 when ``signed``), its
    contributor count and bitmap to ``contrib`` and ``bitmap``; the use is marked done, its slot freed,
    and it is appended to ``finished``. Every other datagram, a second answer of one use included, is
    unexpected. Returns (answers, pending datagrams, unexpected datagrams).
    """
    nslots = use_of_slot.shape[0]
    size = _H + elems * (width // 8)
    taken = pending = unexpected = 0
    for i in range(rows.shape[0]):
        length = lens[i]
        if length < _H:
            unexpected += 1
            continue
        row = rows[i]
        s = get16(row, _O_SLOT)
        if get16(row, _O_JOB) != job or get32(row, _O_KEY) != key or s >= nslots:
            unexpected += 1
            continue
        u = use_of_slot[s]
        if u < 0 or done[u] or get16(row, _O_ROUND) != rounds[u]:
            unexpected += 1
            continue
        pending += 1
        if (row[_O_TYPE] != want_type or get16(row, _O_ELEMS) != elems
                or row[_O_WIDTH] != width or length != size):
            unexpected += 1
            continue
        out = sums[u]
        if width == 8:
            for j in range(elems):
                out[j] = row[_H + j]
        elif width == 16:
            for j in range(elems):
                out[j] = get16(row, _H + 2 * j)
        else:
            for j in range(elems):
                v = get32(row, _H + 4 * j)
                out[j] = v - (1 << 32) if signed and v >= (1 << 31) else v
        contrib[u] = row[_O_CONTRIB]
        bitmap[u] = get32(row, _O_BITMAP)
        done[u] = True
        use_of_slot[s] = -1
        finished[taken] = u
        taken += 1
    return taken, pending, unexpected


#: Coordinates of each chunk that ``foreign_chunk`` checks (all of a chunk would cost a DDP step of 2^22
#: coordinates 3-4 ms; an answer of another run fails the check at a few coordinates in ten).
OWN_SHARE_PROBE = 64


@njit(cache=True)
def foreign_chunk(sums: np.ndarray, contrib: np.ndarray, bitmap: np.ndarray, lost: np.ndarray, indices: np.ndarray,
                  values: np.ndarray, worker: int, probe: int) -> int:
    """The first chunk whose sums cannot hold this worker's own contribution, or -1.

    A THC result that counts worker ``worker`` (its bit in ``bitmap``) sums its table value T[index] and
    ``contrib - 1`` others of at most T's largest value, so each coordinate's sum s obeys
    T[own] <= s <= T[own] + (contrib - 1) * max T. The first ``probe`` coordinates of every such chunk
    (``sums`` is (chunks, K); ``indices`` this worker's, shorter than chunks x K by the padding, whose index
    0 has value 0) are checked. A result of another run of the job, retained by the aggregator, fails it."""
    chunks, k = sums.shape
    top = values.max()
    for c in range(chunks):
        if lost[c] or not (bitmap[c] >> worker) & 1:
            continue
        extra = (contrib[c] - 1) * top
        for j in range(min(probe, k)):
            i = c * k + j
            own = values[indices[i]] if i < indices.size else 0
            s = np.int64(sums[c, j])
            if s < own or s - own > extra:
                return c
    return -1
