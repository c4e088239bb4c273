"""The checks and the state table as compiled loops (numba): the batch engine's hot path without
per-packet Python.

``validate_rows`` applies docs/protocol.md's checks to a batch in their order and counts each dropped
packet under the first it fails. ``apply_rows`` walks one job's valid packets of a batch in arrival
order exactly as the rows of docs/protocol.md's state table say (FRESH or NEWER, ACTIVE, COMPLETE,
STALE, then the completion check), looks the payload up (b-bit indices through the job's table, or
big-endian int32), adds into the job's registers, and writes every answer (header patched from the
request, payload at the result width) straight into the output buffer.
``aggregator.engine.Aggregator`` calls both when ``compiled=True``; tests/test_fuzz.py holds them to
the reference state machine byte for byte, like the engine's numpy paths.

Why numba and not a C extension: the loop is 80 lines of arithmetic on numpy arrays that the engine
already owns (no copies, no marshalling), it compiles on the user's machine with nothing but a wheel
(no compiler, no build step in ``pip install``), and it is cached on disk after the first run.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from aggregator.engine import BANK_DTYPES, pair_dtype
from worker_lib.wire.compiled_fields import get16, get32, put16, put32
from worker_lib.wire.layout import HEADER_BYTES, VERSION, PacketType, field_offsets
from worker_lib.wire.protocol import Counter

# Plain ints: numba folds module-level integers into the compiled code as constants.
_DATA, _NORM = int(PacketType.DATA), int(PacketType.NORM)
_RESULT, _NORM_RESULT, _STRAGGLER = int(PacketType.RESULT), int(PacketType.NORM_RESULT), int(PacketType.STRAGGLER)
_ACCEPTED, _NEW_ROUND, _COMPLETED = int(Counter.ACCEPTED), int(Counter.NEW_ROUND), int(Counter.COMPLETED)
_RETAINED, _DUPLICATE, _STRAGGLER_C = int(Counter.RETAINED), int(Counter.DUPLICATE), int(Counter.STRAGGLER)
_MISMATCH, _ELEMENTS = int(Counter.KIND_MISMATCH), int(Counter.ELEMENTS)
_H = HEADER_BYTES
_VERSION = VERSION
_OFF = field_offsets()
_O_VER, _O_TYPE, _O_JOB, _O_KEY, _O_TABLE = _OFF["version"], _OFF["type"], _OFF["job"], _OFF["key"], _OFF["table_id"]
_O_WORKER, _O_SLOT, _O_ROUND, _O_ELEMS, _O_WIDTH = _OFF["worker"], _OFF["slot"], _OFF["round"], _OFF["elems"], \
    _OFF["width"]
_SHORT, _BAD_VERSION, _BAD_TYPE = int(Counter.SHORT), int(Counter.BAD_VERSION), int(Counter.BAD_TYPE)
_UNKNOWN_JOB, _BAD_KEY, _BAD_TABLE = int(Counter.UNKNOWN_JOB), int(Counter.BAD_KEY), int(Counter.BAD_TABLE)
_BAD_WORKER, _BAD_SLOT, _WRONG_SHARD = int(Counter.BAD_WORKER), int(Counter.BAD_SLOT), int(Counter.WRONG_SHARD)
_BAD_FORMAT, _BAD_NORM = int(Counter.BAD_FORMAT), int(Counter.BAD_NORM)


@njit(cache=True)
def validate_rows(buf: np.ndarray, lens: np.ndarray, n: int, params: np.ndarray, shard: int, shards: int,
                  typ: np.ndarray, job: np.ndarray, worker: np.ndarray, slot: np.ndarray, rnd: np.ndarray,
                  norm_bits: np.ndarray, good: np.ndarray, counters: np.ndarray) -> tuple[int, bool]:
    """The checks of docs/protocol.md for rows 0..n-1 of ``buf``, in its order: each dropped row is counted
    under the first check it fails. Writes the header fields the state table needs into ``typ`` ..
    ``norm_bits`` (job and worker for every row: the server learns addresses from the valid ones) and the
    valid rows into ``good``. ``params[:, j]`` is job j's known flag, key, table id, workers, slots, K,
    DATA width and DATA payload bytes. Returns the count of valid rows and whether they are all of one
    job. (The same checks as numpy expressions cost about 25 us per batch whatever its size: most of a
    small batch's time.)"""
    g = 0
    one_job = True
    for i in range(n):
        job[i] = 0
        worker[i] = 0
        length = lens[i]
        if length < _H:
            counters[_SHORT] += 1
            continue
        row = buf[i]
        t = np.int64(row[_O_TYPE])
        j = get16(row, _O_JOB)
        w = np.int64(row[_O_WORKER])
        s = get16(row, _O_SLOT)
        job[i], worker[i] = j, w
        is_norm = t == _NORM
        if row[_O_VER] != _VERSION:
            code = _BAD_VERSION
        elif t != _DATA and not is_norm:
            code = _BAD_TYPE
        elif params[0, j] == 0:
            code = _UNKNOWN_JOB
        elif get32(row, _O_KEY) != params[1, j]:
            code = _BAD_KEY
        elif get16(row, _O_TABLE) != params[2, j]:
            code = _BAD_TABLE
        elif w >= params[3, j]:
            code = _BAD_WORKER
        elif s >= params[4, j]:
            code = _BAD_SLOT
        elif s % shards != shard:
            code = _WRONG_SHARD
        elif (get16(row, _O_ELEMS) != (1 if is_norm else params[5, j])
              or np.int64(row[_O_WIDTH]) != (32 if is_norm else params[6, j])
              or length != _H + (4 if is_norm else params[7, j])):
            code = _BAD_FORMAT
        else:
            code = 0
            if is_norm:
                bits = get32(row, _H)
                if bits >> 31 != 0 or ((bits >> 23) & 0xFF) == 0xFF:
                    code = _BAD_NORM
                norm_bits[i] = bits
            else:
                norm_bits[i] = 0
        if code:
            counters[code] += 1
            continue
        typ[i], slot[i], rnd[i] = t, s, get16(row, _O_ROUND)
        if g and j != job[good[0]]:
            one_job = False
        good[g] = i
        g += 1
    return g, one_job


@njit(cache=True)
def _add_payload(buf: np.ndarray, i: int, thc: bool, bits: int, elems: int, values: np.ndarray, pairs: np.ndarray,
                 bank: np.ndarray, pair_bank: np.ndarray, overwrite: bool) -> None:
    """Write (``overwrite``) or add the integers of DATA packet ``i`` into ``bank``: the table values of
    its b-bit indices (MSB first), or its big-endian int32s. The bank's type (``aggregator.engine.bank_dtype``)
    is the register's: adds wrap at its width, like the switch's. A bank that starts over is written, not
    cleared first: at two workers every other packet starts a bank, and clearing it (libc's memset) took
    about 7 % of the aggregator's CPU in a loopback exchange of 2^22 indices.

    4-bit indices (the common case) go a byte at a time: ``pairs[byte]`` holds the table values of both
    its indices as the two registers of one word twice as wide, added into ``pair_bank`` (the same bank
    seen as such words). No carry crosses from one register into the other: a register never exceeds the
    job's largest sum, which its check keeps below 2^result_bits (``JobConfig``). One lookup, load, add and
    store per two elements: 5.1e9 elements/s on one core against 2.4-3.2e9 for two lookups per byte (K =
    8192, ``python -m benchmarks.engine``; docs/aggregator.md). Other widths look each index up."""
    if not thc:
        for e in range(elems):
            at = _H + 4 * e
            value = (np.int64(buf[i, at]) << 24) | (np.int64(buf[i, at + 1]) << 16) \
                | (np.int64(buf[i, at + 2]) << 8) | np.int64(buf[i, at + 3])
            bank[e] = value + (0 if overwrite else bank[e])
        return
    if bits == 4:
        p = buf[i, _H:_H + elems // 2]
        if overwrite:
            for k in range(p.size):
                pair_bank[k] = pairs[p[k]]
        else:
            for k in range(p.size):
                pair_bank[k] += pairs[p[k]]
    elif bits == 8:
        p = buf[i, _H:_H + elems]
        for k in range(p.size):
            bank[k] = values[p[k]] + (0 if overwrite else bank[k])
    elif bits == 2:
        p = buf[i, _H:_H + elems // 4]
        for k in range(p.size):
            v = p[k]
            bank[4 * k] = values[v >> 6] + (0 if overwrite else bank[4 * k])
            bank[4 * k + 1] = values[(v >> 4) & 3] + (0 if overwrite else bank[4 * k + 1])
            bank[4 * k + 2] = values[(v >> 2) & 3] + (0 if overwrite else bank[4 * k + 2])
            bank[4 * k + 3] = values[v & 3] + (0 if overwrite else bank[4 * k + 3])
    else:  # any b: a 16-bit window over the byte that holds the index and the next
        mask = (1 << bits) - 1
        for e in range(elems):
            pos = e * bits
            byte = _H + (pos >> 3)
            window = (np.int64(buf[i, byte]) << 8) | (np.int64(buf[i, byte + 1]) if (pos & 7) + bits > 8 else 0)
            bank[e] = values[(window >> (16 - bits - (pos & 7))) & mask] + (0 if overwrite else bank[e])


@njit(cache=True)
def _emit(buf: np.ndarray, i: int, out_buf: np.ndarray, out_len: np.ndarray, out_src: np.ndarray,
          out_fanout: np.ndarray, out_job: np.ndarray, m: int, job: int, fanout: bool, typ: int, contributors: int,
          rnd: int, elems: int, width: int, bitmap: int, plen: int) -> None:
    """Output row ``m``: the request's header with the result fields patched (payload written by the caller)."""
    row = out_buf[m]
    for k in range(_H):
        row[k] = buf[i, k]
    row[1] = typ
    row[11] = contributors
    put16(row, 14, rnd)
    put16(row, 24, elems)
    row[26] = width
    row[27] = 0
    put32(row, 28, bitmap)
    out_len[m] = _H + plen
    out_src[m] = i
    out_fanout[m] = fanout
    out_job[m] = job


@njit(cache=True)
def _emit_result(buf: np.ndarray, i: int, s: int, b: int, out_buf: np.ndarray, out_len: np.ndarray,
                 out_src: np.ndarray, out_fanout: np.ndarray, out_job: np.ndarray, m: int, job: int, fanout: bool,
                 elems: int, width: int, bank_round: np.ndarray, kind: np.ndarray, bitmap: np.ndarray,
                 count: np.ndarray, norm: np.ndarray, sums: np.ndarray) -> None:
    idx = 2 * s + b
    row = out_buf[m]
    if kind[idx] == _NORM:
        _emit(buf, i, out_buf, out_len, out_src, out_fanout, out_job, m, job, fanout, _NORM_RESULT, count[idx],
              bank_round[idx], 1, 32, bitmap[idx], 4)
        put32(row, _H, norm[idx])
        return
    _emit(buf, i, out_buf, out_len, out_src, out_fanout, out_job, m, job, fanout, _RESULT, count[idx],
          bank_round[idx], elems, width, bitmap[idx], elems * width // 8)
    bank = sums[s, b]
    if width == 8:
        for e in range(elems):
            row[_H + e] = bank[e] & 0xFF
    elif width == 16:
        for e in range(elems):
            put16(row, _H + 2 * e, bank[e] & 0xFFFF)
    else:
        for e in range(elems):
            put32(row, _H + 4 * e, np.int64(bank[e]) & 0xFFFFFFFF)


@njit(cache=True)
def apply_rows(rows: np.ndarray, typ: np.ndarray, worker: np.ndarray, slot: np.ndarray, rnd: np.ndarray,
               norm_bits: np.ndarray, buf: np.ndarray, job: int, thc: bool, bits: int, elems: int, threshold: int,
               result_bits: int, values: np.ndarray, pairs: np.ndarray, used: np.ndarray, cur_round: np.ndarray,
               bank_round: np.ndarray, bitmap: np.ndarray, count: np.ndarray, complete: np.ndarray,
               kind: np.ndarray, norm: np.ndarray, sums: np.ndarray, sum_pairs: np.ndarray, out_buf: np.ndarray,
               out_len: np.ndarray,
               out_src: np.ndarray, out_fanout: np.ndarray, out_job: np.ndarray, m: int,
               counters: np.ndarray) -> int:
    """The state table for ``rows`` (one job's valid packets, in arrival order); returns the output count."""
    for k in range(rows.size):
        i = rows[k]
        s, r, w, t = slot[i], rnd[i], worker[i], typ[i]
        b = r & 1
        idx = 2 * s + b
        d = (r - cur_round[s]) & 0xFFFF
        if not used[s] or (d != 0 and d < 0x8000):  # FRESH or NEWER: the bank starts over
            used[s] = True
            cur_round[s] = r
            bank_round[idx] = r
            kind[idx] = t
            bitmap[idx] = 1 << w
            count[idx] = 1
            complete[idx] = False
            if t == _NORM:
                norm[idx] = norm_bits[i]
            else:
                _add_payload(buf, i, thc, bits, elems, values, pairs, sums[s, b], sum_pairs[s, b], True)
                counters[_ELEMENTS] += elems
            counters[_NEW_ROUND] += 1
            counters[_ACCEPTED] += 1
        elif bank_round[idx] == r:
            if kind[idx] != t:
                counters[_MISMATCH] += 1
                continue
            if complete[idx]:  # COMPLETE: the retained result, to the sender only
                counters[_RETAINED] += 1
                _emit_result(buf, i, s, b, out_buf, out_len, out_src, out_fanout, out_job, m, job, False, elems,
                             result_bits, bank_round, kind, bitmap, count, norm, sums)
                m += 1
                continue
            bit = np.int64(1) << w
            if bitmap[idx] & bit:
                counters[_DUPLICATE] += 1
                continue
            bitmap[idx] |= bit
            count[idx] += 1
            if t == _NORM:
                norm[idx] = max(norm[idx], norm_bits[i])
            else:
                _add_payload(buf, i, thc, bits, elems, values, pairs, sums[s, b], sum_pairs[s, b], False)
                counters[_ELEMENTS] += elems
            counters[_ACCEPTED] += 1
        else:  # STALE: a straggler notice with the slot's current round
            counters[_STRAGGLER_C] += 1
            _emit(buf, i, out_buf, out_len, out_src, out_fanout, out_job, m, job, False, _STRAGGLER, 0,
                  cur_round[s], 0, 0, 0, 0)
            m += 1
            continue
        if count[idx] >= threshold:
            complete[idx] = True
            counters[_COMPLETED] += 1
            _emit_result(buf, i, s, b, out_buf, out_len, out_src, out_fanout, out_job, m, job, True, elems,
                         result_bits, bank_round, kind, bitmap, count, norm, sums)
            m += 1
    return m


def warm_up(out_buf: np.ndarray, out_len: np.ndarray, out_src: np.ndarray, out_fanout: np.ndarray,
            out_job: np.ndarray, counters: np.ndarray) -> None:
    """Compile (or load from numba's cache) ``validate_rows`` and ``apply_rows`` for the engine's array
    types now, at configuration, so that the first batch does not wait for the compiler (seconds the
    first time)."""
    i64, none = np.zeros(1, np.int64), np.zeros(0, np.int64)
    validate_rows(np.zeros((1, _H), np.uint8), i64.copy(), 0, np.zeros((8, 1), np.int64), 0, 1, i64, i64, i64,
                  i64, i64, i64, i64.copy(), counters)
    for bank in BANK_DTYPES:
        pair = pair_dtype(bank)
        apply_rows(none, i64, i64, i64, i64, i64, np.zeros((1, _H), np.uint8), 0, True, 4, 8, 1, 8,
                   np.zeros(16, bank), np.zeros(256, pair), np.zeros(1, bool), i64.copy(), i64.copy(), i64.copy(),
                   i64.copy(), np.zeros(2, bool), i64.copy(), i64.copy(), np.zeros((1, 2, 8), bank),
                   np.zeros((1, 2, 4), pair), out_buf, out_len, out_src, out_fanout, out_job, 0, counters)
