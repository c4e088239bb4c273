"""The batch engine: the state table of docs/protocol.md applied to whole batches of packets.

``thc-aggregator`` serves this engine; ``aggregator/state.py`` is the readable reference it must
equal (tests/test_fuzz.py holds it to the reference byte for byte, counter for counter and register
for register; tests/scenarios.py runs through both). Per configured job it keeps S slots x 2 banks x
K elements, preallocated: round r of a slot aggregates in bank r mod 2 while the other bank retains
round r-1's result (SwitchML's shadow copies). A batch of packets is validated with numpy in one
pass and grouped by slot; slots are independent, so every slot whose packets in the batch are the
common case (one round, distinct new contributors, no completion before the last of them) is applied
at once, vectorized across slots; the rest walk the state table packet by packet in arrival order
(docs/aggregator.md).

Only integers cross the aggregator: THC indices become integer table values, uncompressed payloads
are int32 summed with two's-complement wrap (the worker's fixed-point scale prevents overflow),
norms are maxed as raw IEEE-754 bits (valid for non-negative finite floats only).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from aggregator.prefault import populate_in_background
from aggregator.state import validate
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.bits import unpack_bits
from worker_lib.wire.layout import HEADER_BYTES, MAX_MTU, VERSION, PacketType
from worker_lib.wire.protocol import Counter, Header, serial_newer
from worker_lib.wire.serializer import batch_of, header_view

log = logging.getLogger(__name__)

#: Largest packet (bytes of UDP payload) a batch row holds by default: any datagram of a job's largest MTU
#: (a jumbo frame), so that jobs with K up to 9152 8-bit results can be served.
DEFAULT_STRIDE = MAX_MTU


# Plain-int views of the enums for the hot path (an IntEnum member lookup costs a metaclass call).
_CI = SimpleNamespace(**{c.name: int(c) for c in Counter})
_PT = SimpleNamespace(**{t.name: int(t) for t in PacketType})

_EMPTY = -1  # bank_round of a bank that holds nothing


def _value_dtype(values: np.ndarray) -> np.dtype:
    """The narrowest unsigned type holding every table value (0..g): a narrower lookup is a faster one."""
    top = int(values.max())
    return np.dtype(np.uint8 if top < 1 << 8 else np.uint16 if top < 1 << 16 else np.int32)


def _byte_lut(values: np.ndarray, bits: int, dtype: np.dtype | None = None) -> np.ndarray | None:
    """Table lookup of a whole payload byte at once: byte -> the 8/b table values it packs.

    Returned as a (256,) array with one item of 8/b values (of ``dtype``, ``_value_dtype`` by default) per
    byte, so that one gather over the packed payload yields the values in order (then viewed as that type).
    None when b does not divide 8 (then the indices are unpacked first).
    """
    if 8 % bits:
        return None
    per = 8 // bits
    mask = (1 << bits) - 1
    vdt = _value_dtype(values) if dtype is None else np.dtype(dtype)
    byte = np.arange(256)
    lut = np.stack([values[(byte >> (8 - bits * (k + 1))) & mask] for k in range(per)], axis=1).astype(vdt)
    size = per * vdt.itemsize
    item = np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype((np.void, size))
    return np.ascontiguousarray(lut).view(item).reshape(256)


def _group_sums(vals: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Sums of the runs of rows of ``vals`` that begin at ``start`` (int32, wrapping like the loop's adds).

    A batch is mostly slots with one packet from each of the n workers, cut at its two ends: the
    longest block of consecutive runs of the largest size is summed with one reshape, the others
    (few) with one vectorized add per row rank. (np.add.reduceat along axis 0 is much slower.)
    """
    size = np.diff(np.append(start, len(vals)))
    z = int(size.max())
    full = size == z
    i0 = int(full.argmax())
    i1 = i0 + (int(full[i0:].argmin()) if not full[i0:].all() else size.size - i0)
    if i0 == 0 and i1 == size.size:
        return vals.reshape(size.size, z, -1).sum(axis=1, dtype=np.int32)
    out = np.empty((size.size, vals.shape[1]), np.int32)
    out[i0:i1] = vals[start[i0]:start[i0] + (i1 - i0) * z].reshape(i1 - i0, z, -1).sum(axis=1, dtype=np.int32)
    rest = np.concatenate((np.arange(i0), np.arange(i1, size.size)))
    part = vals[start[rest]].astype(np.int32)
    for k in range(1, int(size[rest].max())):
        sel = np.flatnonzero(size[rest] > k)
        part[sel] += vals[start[rest[sel]] + k]
    out[rest] = part
    return out


def bank_dtype(cfg: JobConfig) -> np.dtype:
    """The narrowest register that gives a job's results exactly: a THC job's result carries its sums'
    low ``result_bits`` bits (8 or 16; the job's check keeps its largest sum below 2^result_bits), and
    unsigned adds modulo 2^8 or 2^16 give those bits, as int32 adds do; uncompressed jobs sum int32.

    Why: a job's banks are slots x 2 x K registers, touched once per use and cycled through the whole
    slot pool, so they stream through the cache. The DDP benchmark's job (2,048 slots, K = 1,440) held
    23.6 MB of int32 banks, more than the L2 and most of the L3; as bytes, 5.9 MB, and the compiled state
    table handled 1.5-1.8x the packets/s (``python -m benchmarks.engine --workers 2 --slots 2048 --elems
    1440``, which runs both)."""
    if cfg.kind == "thc" and cfg.result_bits in (8, 16):
        return np.dtype(np.uint8 if cfg.result_bits == 8 else np.uint16)
    return np.dtype(np.int32)


#: every type ``bank_dtype`` gives (the compiled engine loads its loops for each before serving)
BANK_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


def pair_dtype(bank: np.dtype) -> np.dtype:
    """The word of two registers of type ``bank``: unsigned, twice as wide (aggregator.compiled's 4-bit loop
    adds a byte's two values into two registers at once as such a word)."""
    return np.dtype(f"u{2 * np.dtype(bank).itemsize}")


class JobState:
    """Registers of one job, all allocated when the job is configured. ``narrow``: banks of
    ``bank_dtype`` (the compiled engine's); otherwise int32, as the reference's and the numpy paths'."""

    def __init__(self, cfg: JobConfig, *, narrow: bool = False) -> None:
        self.cfg = cfg
        s, k = cfg.slots, cfg.elems
        self.values = cfg.values() if cfg.kind == "thc" else None
        self.byte_lut = _byte_lut(self.values, cfg.bits) if self.values is not None else None
        self.value_dtype = _value_dtype(self.values) if self.values is not None else np.dtype(np.int32)
        self.sums = np.zeros((s, 2, k), bank_dtype(cfg) if narrow else np.int32)
        #: the table in the banks' type (the compiled path adds its entries into the banks)
        self.bank_values = (self.values if self.values is not None else np.zeros(1)).astype(self.sums.dtype)
        #: the banks as words of two registers, and the values of a byte's two 4-bit indices as one such word
        #: (``_byte_lut`` in the banks' type; aggregator.compiled's 4-bit loop; empty for other jobs)
        self.sum_pairs = self.sums.view(pair_dtype(self.sums.dtype))
        self.pair_values = (_byte_lut(self.values, 4, self.sums.dtype) if self.values is not None and cfg.bits == 4
                            else np.zeros(0, self.sum_pairs.dtype))
        self.prefault = populate_in_background(self.sums)  #: maps the banks' pages (aggregator/prefault.py)
        self.norm = np.zeros(2 * s, np.int64)
        self.used = np.zeros(s, bool)
        self.cur_round = np.zeros(s, np.int64)
        self.bank_round = np.full(2 * s, _EMPTY, np.int64)
        self.bitmap = np.zeros(2 * s, np.int64)
        self.count = np.zeros(2 * s, np.int64)
        self.complete = np.zeros(2 * s, bool)
        self.kind = np.zeros(2 * s, np.int64)
        self.result_dtype = np.dtype({8: ">u1", 16: ">u2", 32: ">u4"}[cfg.result_bits])


@dataclass
class Outputs:
    """Packets produced by one batch, in a preallocated buffer.

    Row m of ``buf`` holds ``length[m]`` bytes; ``fanout[m]`` says whether it goes to every worker of
    job ``job[m]`` (a completion) or back to the sender of input row ``src[m]`` only.
    """

    buf: np.ndarray
    length: np.ndarray
    src: np.ndarray
    fanout: np.ndarray
    job: np.ndarray
    count: int = 0

    @classmethod
    def allocate(cls, rows: int, stride: int) -> Outputs:
        return cls(np.zeros((rows, stride), np.uint8), np.zeros(rows, np.int64), np.zeros(rows, np.int64),
                   np.zeros(rows, bool), np.zeros(rows, np.int64))

    def packets(self) -> list[tuple[bool, bytes]]:
        """(fanout, bytes) of every output (for tests and the reference API; not the hot path)."""
        return [(bool(self.fanout[m]), self.buf[m, : self.length[m]].tobytes()) for m in range(self.count)]


class Aggregator:
    """The state machine for a set of jobs; one instance per shard.

    ``shard``/``shards``: this instance owns the slots s with s mod shards == shard (others are
    dropped and counted). ``max_batch`` bounds the rows of one ``process`` call. A job's packets of a
    batch are applied slot group by slot group when there are at least ``group_min`` of them; fewer
    walk the state table one by one, which costs less than the grouping's fixed overhead. Batches of
    fewer than ``scalar_below`` packets are also validated one by one, in plain Python: for a few
    packets, numpy's fixed cost per call would be most of the work. ``compiled``: the checks and the state
    table in compiled loops (aggregator.compiled), with banks of ``bank_dtype`` unless ``narrow_banks`` is
    False (int32, as the numpy paths'; for comparing the two).
    """

    def __init__(self, jobs: Iterable[JobConfig] = (), *, shard: int = 0, shards: int = 1,
                 max_batch: int = 256, stride: int = DEFAULT_STRIDE, group_min: int = 16,
                 scalar_below: int = 32, compiled: bool = False, narrow_banks: bool = True) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
        self.shard, self.shards, self.max_batch, self.stride = shard, shards, max_batch, stride
        self.group_min, self.scalar_below = group_min, scalar_below
        self.compiled = compiled
        self.narrow_banks = compiled and narrow_banks  #: the compiled engine's banks of ``bank_dtype``
        self.counters = np.zeros(len(Counter), np.int64)
        self.jobs: dict[int, JobState] = {}
        # Per-job-id parameters of the validation (fixed size: job ids are 16 bits), one row each: known
        # (0/1), key, table id, workers, slots, K, DATA width, DATA payload bytes (the compiled check reads
        # the whole array; the numpy one its rows through the names below).
        self._params = np.zeros((8, 1 << 16), np.int64)
        (self._known, self._key, self._table, self._n, self._slots, self._elems, self._dwidth,
         self._dbytes) = self._params
        self.out = Outputs.allocate(max_batch, stride)
        if compiled:
            from aggregator.compiled import apply_rows, validate_rows, warm_up

            self._apply_rows, self._validate_rows = apply_rows, validate_rows
            # The header fields of a batch's rows and its valid rows, written by validate_rows.
            self._fields = {k: np.zeros(max_batch, np.int64)
                            for k in ("typ", "job", "worker", "slot", "rnd", "norm_bits", "good")}
            warm_up(self.out.buf, self.out.length, self.out.src, self.out.fanout, self.out.job, self.counters)
        self._out_headers = header_view(self.out.buf)
        # Header fields of this batch's outputs, written in one vectorized pass at the end.
        self._pending: list[tuple[int, int, int, int, int, int, int]] = []
        # Results of this batch whose sums are still to be copied: (job, bank index) -> output rows.
        self._payloads: dict[tuple[int, int], list[int]] = {}
        # Rows of the last batch that passed validation, with their job and worker ids (the server
        # learns worker addresses from them).
        self.last_good = np.zeros(0, np.int64)
        self.last_job = np.zeros(0, np.int64)
        self.last_worker = np.zeros(0, np.int64)
        for cfg in jobs:
            self.add_job(cfg)

    # -- configuration ---------------------------------------------------------------------------
    def add_job(self, cfg: JobConfig) -> None:
        """Configure a job (replacing one with the same id resets its registers)."""
        if cfg.kind not in ("thc", "uncompressed"):
            raise JobConfigError(f"job {cfg.job}: kind {cfg.kind!r} is not a switch job; decompress-aggregate-"
                                 "recompress jobs are served by aggregator.dar")
        cfg.check_one_tier()
        if HEADER_BYTES + max(cfg.data_bytes, cfg.result_bytes) > self.stride:
            raise JobConfigError(f"job {cfg.job}: packets of {HEADER_BYTES + cfg.data_bytes} bytes exceed "
                                 f"the aggregator's buffer stride {self.stride}")
        j = cfg.job
        self.jobs[j] = JobState(cfg, narrow=self.narrow_banks)
        self._known[j] = 1
        self._key[j] = cfg.key
        self._table[j] = cfg.table_id
        self._n[j] = cfg.workers
        self._slots[j] = cfg.slots
        self._elems[j] = cfg.elems
        self._dwidth[j] = cfg.data_width
        self._dbytes[j] = cfg.data_bytes
        log.info("job %d configured: %s", j, cfg)

    def remove_job(self, job: int) -> None:
        """Forget a job and free its registers; its packets are then dropped as unknown."""
        if self.jobs.pop(job, None) is not None:
            self._known[job] = 0
            log.info("job %d removed", job)

    # -- reference API ---------------------------------------------------------------------------
    def handle(self, packet: bytes) -> list[tuple[bool, bytes]]:
        """Process one packet; return the packets it causes as (fanout, bytes)."""
        return self.process(*batch_of([packet], self.stride)).packets()

    # -- the hot path ----------------------------------------------------------------------------
    def process(self, buf: np.ndarray, lengths: np.ndarray) -> Outputs:
        """Apply the state table to a batch: rows of ``buf`` are packets of ``lengths`` bytes.

        Returns ``self.out`` (reused by the next call). Never raises on packet contents.
        """
        n = len(lengths)
        if n > self.max_batch:
            raise ValueError(f"batch of {n} rows exceeds max_batch {self.max_batch}")
        out = self.out
        out.count = 0
        if n == 0:
            return out
        c = self.counters
        c[_CI.RX] += n
        if n < self.scalar_below and not self.compiled:
            return self._process_scalar(buf, lengths, n)
        if self.compiled:
            return self._process_compiled(buf, lengths, n)
        lens = np.asarray(lengths, np.int64)
        h = header_view(buf[:n])
        ver = h["version"].astype(np.int64)
        typ = h["type"].astype(np.int64)
        job = h["job"].astype(np.int64)
        worker = h["worker"].astype(np.int64)
        slot = h["slot"].astype(np.int64)
        elems = h["elems"].astype(np.int64)
        width = h["width"].astype(np.int64)
        is_norm = typ == _PT.NORM
        known = self._known[job] != 0
        key_ok = h["key"].astype(np.int64) == self._key[job]
        table_ok = h["table_id"].astype(np.int64) == self._table[job]
        format_ok = ((elems == np.where(is_norm, 1, self._elems[job]))
                     & (width == np.where(is_norm, 32, self._dwidth[job]))
                     & (lens == HEADER_BYTES + np.where(is_norm, 4, self._dbytes[job])))
        norm_bits = np.zeros(n, np.int64)
        norm_ok = True
        if is_norm.any():
            nb = buf[:n, HEADER_BYTES:HEADER_BYTES + 4].astype(np.int64)
            norm_bits = (nb[:, 0] << 24) | (nb[:, 1] << 16) | (nb[:, 2] << 8) | nb[:, 3]
            norm_ok = ~is_norm | ((norm_bits >> 31 == 0) & (((norm_bits >> 23) & 0xFF) != 0xFF))
        ok = ((lens >= HEADER_BYTES) & (ver == VERSION) & (is_norm | (typ == _PT.DATA)) & known
              & key_ok & table_ok & (worker < self._n[job]) & (slot < self._slots[job]) & format_ok & norm_ok)
        if self.shards > 1:
            ok &= slot % self.shards == self.shard
        if ok.all():
            good = np.arange(n)
        else:
            # Count each dropped packet under the first check it fails, in the order of docs/protocol.md.
            reason = np.zeros(n, np.int64)
            for cond, code in ((lens < HEADER_BYTES, _CI.SHORT), (ver != VERSION, _CI.BAD_VERSION),
                               ((typ != _PT.DATA) & ~is_norm, _CI.BAD_TYPE),
                               (~known, _CI.UNKNOWN_JOB), (~key_ok, _CI.BAD_KEY),
                               (~table_ok, _CI.BAD_TABLE), (worker >= self._n[job], _CI.BAD_WORKER),
                               (slot >= self._slots[job], _CI.BAD_SLOT),
                               (slot % self.shards != self.shard, _CI.WRONG_SHARD),
                               (~format_ok, _CI.BAD_FORMAT), (~np.asarray(norm_ok) & is_norm, _CI.BAD_NORM)):
                reason[(reason == 0) & cond] = code
            np.add.at(c, reason[reason != 0], 1)
            good = np.flatnonzero(reason == 0)
        self.last_good, self.last_job, self.last_worker = good, job, worker
        if good.size == 0:
            return out
        rnd = h["round"].astype(np.int64)
        values: dict[int, np.ndarray] = {}
        row_pos = np.full(n, -1, np.int64)
        slow: list[np.ndarray] = []
        good_jobs = job[good]
        for j in (good_jobs[:1] if (good_jobs == good_jobs[0]).all() else np.unique(good_jobs)).tolist():
            js = self.jobs[j]
            rows = good if len(self.jobs) == 1 else good[good_jobs == j]
            rows = rows[np.argsort(slot[rows], kind="stable")]  # grouped by slot, arrival order within
            data = rows[~is_norm[rows]]
            if data.size:
                values[j] = self._lookup(js, buf, data)
                row_pos[data] = np.arange(data.size)
            rest = self._fast_path(js, buf, rows, typ, worker, slot, rnd, norm_bits, row_pos, values.get(j)) \
                if rows.size >= self.group_min else rows
            if rest.size:
                slow.append(rest)
        if slow:
            rows = np.sort(np.concatenate(slow))
            self._apply(buf, rows.tolist(), typ.tolist(), job.tolist(), worker.tolist(), slot.tolist(),
                        rnd.tolist(), norm_bits.tolist(), row_pos.tolist(), values)
            self._flush_payloads()
            self._finish_headers(buf)
        return out

    def _process_scalar(self, buf: np.ndarray, lengths: np.ndarray, n: int) -> Outputs:
        """``process`` for a few packets: the reference's ``validate``, one packet at a time."""
        c = self.counters
        typ, job, worker, slot, rnd = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
        norm_bits, row_pos = [0] * n, [-1] * n
        good: list[int] = []
        data_rows: dict[int, list[int]] = {}
        for i in range(n):
            length = int(lengths[i])
            if length < HEADER_BYTES:
                c[_CI.SHORT] += 1
                continue
            hdr = Header.unpack_from(buf[i])
            t, j, w, s, r = hdr.type, hdr.job, hdr.worker, hdr.slot, hdr.round
            typ[i], job[i], worker[i], slot[i], rnd[i] = t, j, w, s, r
            is_norm = t == _PT.NORM
            norm = buf[i, HEADER_BYTES:HEADER_BYTES + 4].tobytes() if is_norm else b""
            failed = validate(hdr, length, norm, self.jobs, self.shard, self.shards)
            code = 0 if failed is None else int(failed)
            if is_norm and not code:
                norm_bits[i] = int.from_bytes(norm, "big")
            if code:
                c[code] += 1
                continue
            good.append(i)
            if not is_norm:
                data_rows.setdefault(j, []).append(i)
        self.last_good, self.last_job, self.last_worker = np.array(good, np.int64), np.array(job), np.array(worker)
        values: dict[int, np.ndarray] = {}
        for j, rows in data_rows.items():
            values[j] = self._lookup(self.jobs[j], buf, np.array(rows))
            for k, i in enumerate(rows):
                row_pos[i] = k
        if good:
            self._apply(buf, good, typ, job, worker, slot, rnd, norm_bits, row_pos, values)
            self._flush_payloads()
            self._finish_headers(buf)
        return self.out

    def _process_compiled(self, buf: np.ndarray, lengths: np.ndarray, n: int) -> Outputs:
        """``process`` compiled (aggregator.compiled): the checks in one loop, then the state table in one
        loop per job of the valid rows."""
        out, f = self.out, self._fields
        lens = lengths if lengths.dtype == np.int64 else np.asarray(lengths, np.int64)
        count, one_job = self._validate_rows(buf, lens, n, self._params, self.shard, self.shards, f["typ"], f["job"],
                                             f["worker"], f["slot"], f["rnd"], f["norm_bits"], f["good"],
                                             self.counters)
        good = f["good"][:count]
        job = f["job"][:n]
        self.last_good, self.last_job, self.last_worker = good, job, f["worker"][:n]
        if count == 0:
            return out
        for j in ([int(job[good[0]])] if one_job else np.unique(job[good]).tolist()):
            js, cfg = self.jobs[j], self.jobs[j].cfg
            rows = good if one_job else good[job[good] == j]
            out.count = self._apply_rows(
                rows, f["typ"], f["worker"], f["slot"], f["rnd"], f["norm_bits"], buf, j, cfg.kind == "thc",
                cfg.bits, cfg.elems, cfg.threshold, cfg.result_bits, js.bank_values, js.pair_values, js.used,
                js.cur_round, js.bank_round, js.bitmap, js.count, js.complete, js.kind, js.norm, js.sums, js.sum_pairs,
                out.buf, out.length, out.src, out.fanout, out.job, out.count, self.counters)
        return out

    @staticmethod
    def _lookup(js: JobState, buf: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The integer values of the DATA rows ``rows`` of one job, (rows, K) of ``js.value_dtype``: one gather."""
        cfg = js.cfg
        pay = buf[rows, HEADER_BYTES:HEADER_BYTES + cfg.data_bytes]
        if js.byte_lut is not None:
            return js.byte_lut[pay.astype(np.intp)].view(js.value_dtype).reshape(rows.size, cfg.elems)
        if cfg.kind == "thc":
            return js.values[unpack_bits(pay, cfg.bits, cfg.elems)]
        return np.ascontiguousarray(pay).view(">i4").astype(np.int32)

    def _fast_path(self, js: JobState, buf: np.ndarray, rows: np.ndarray, typ: np.ndarray, worker: np.ndarray,
                   slot: np.ndarray, rnd: np.ndarray, norm_bits: np.ndarray, row_pos: np.ndarray,
                   vals: np.ndarray | None) -> np.ndarray:
        """Apply the state table at once to every slot of one job whose packets in this batch are the
        common case; return the rows left for the packet-by-packet loop, in any order.

        ``rows`` are the job's valid rows grouped by slot (arrival order within a slot). A slot's group
        is taken here when its packets share one round and one kind, come from distinct workers, and
        either start a newer round or join an open bank they are not yet in, without passing the
        threshold before the group's last packet. Then the packet-by-packet result is the group's
        total, applied at once: the bank is overwritten (newer round) or added to, the bitmap gets the
        OR of the workers' bits, and a completion is answered for the group's last packet. Slots
        are independent, so taking some out of arrival order changes nothing but the order of the
        outputs. Everything else (duplicates, retained results, stragglers, mixed rounds) goes to the
        loop, which follows the state table row by row.
        """
        m = rows.size
        s, r, t = slot[rows], rnd[rows], typ[rows]
        start = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
        size = np.diff(np.append(start, m))
        gs, gr, gt = s[start], r[start], t[start]
        bits = np.left_shift(1, worker[rows])
        orb = np.bitwise_or.reduceat(bits, start)
        ok = ((np.minimum.reduceat(r, start) == np.maximum.reduceat(r, start))
              & (np.minimum.reduceat(t, start) == np.maximum.reduceat(t, start))
              & (np.add.reduceat(bits, start) == orb))
        idx = 2 * gs + (gr & 1)
        new = ~js.used[gs] | serial_newer(gr, js.cur_round[gs])
        before = np.where(new, 0, js.count[idx])
        ok &= (new | ((js.bank_round[idx] == gr) & (js.kind[idx] == gt) & ~js.complete[idx]
                      & ((js.bitmap[idx] & orb) == 0)))
        ok &= before + size <= js.cfg.threshold
        if not ok.any():
            return rows
        rest = rows[~np.repeat(ok, size)]
        last = rows[start + size - 1][ok]  # the packet that completes the group, if it completes
        gs, gr, gt, idx, new, orb, size = gs[ok], gr[ok], gt[ok], idx[ok], new[ok], orb[ok], size[ok]
        count = before[ok] + size
        done = count >= js.cfg.threshold
        bitmap = np.where(new, orb, js.bitmap[idx] | orb)
        js.used[gs] = True
        js.cur_round[gs] = np.where(new, gr, js.cur_round[gs])
        js.bank_round[idx] = gr
        js.kind[idx] = gt
        js.bitmap[idx] = bitmap
        js.count[idx] = count
        js.complete[idx] = done
        is_data = gt == _PT.DATA
        if is_data.any():
            # Sums over each slot's DATA rows (``vals`` follows ``rows`` restricted to DATA rows, so a
            # slot's DATA rows are contiguous in it), then the accepted groups' sums written over or
            # added to their banks; int32 wraps exactly as the loop's adds do.
            dslot = s[row_pos[rows] >= 0]
            dstart = np.flatnonzero(np.concatenate(([True], dslot[1:] != dslot[:-1])))
            gsum = _group_sums(vals, dstart)
            first = row_pos[rows[start[ok][is_data]]]
            if first.size != dstart.size:
                gsum = gsum[np.searchsorted(dstart, first)]
            sd, bd, nd = gs[is_data], gr[is_data] & 1, new[is_data]
            if nd.all():
                js.sums[sd, bd] = gsum
            else:
                js.sums[sd[nd], bd[nd]] = gsum[nd]
                js.sums[sd[~nd], bd[~nd]] += gsum[~nd]  # (slot, bank) pairs are distinct: no lost adds
        if not is_data.all():
            gmax = np.maximum.reduceat(norm_bits[rows], start)[ok][~is_data]
            inorm, nn = idx[~is_data], new[~is_data]
            js.norm[inorm] = np.where(nn, gmax, np.maximum(js.norm[inorm], gmax))
        c = self.counters
        c[_CI.ACCEPTED] += int(size.sum())
        c[_CI.NEW_ROUND] += int(new.sum())
        c[_CI.ELEMENTS] += int(size[is_data].sum()) * js.cfg.elems
        if done.any():
            c[_CI.COMPLETED] += int(done.sum())
            self._emit_completions(js, buf, last[done], gs[done], gr[done], idx[done], is_data[done],
                                   count[done], bitmap[done])
        return rest

    def _apply(self, buf: np.ndarray, rows: list[int], typ: list[int], job: list[int], worker: list[int],
               slot: list[int], rnd: list[int], norm_bits: list[int], row_pos: list[int],
               values: dict[int, np.ndarray]) -> None:
        """The state table, packet by packet, in arrival order (the hot loop: locals only)."""
        accepted = new_round = completed = retained = duplicate = straggler = mismatch = elements = 0
        jobs = self.jobs
        norm_t = _PT.NORM
        emit_result = self._emit_result
        for i in rows:
            js = jobs[job[i]]
            s, r, w, t = slot[i], rnd[i], worker[i], typ[i]
            b = r & 1
            idx = 2 * s + b
            if not js.used[s] or serial_newer(r, js.cur_round[s]):
                # First packet of a newer round: overwrite its bank, clear bitmap and count.
                if self._payloads and (job[i], idx) in self._payloads:
                    self._flush_payload(job[i], idx)
                js.used[s] = True
                js.cur_round[s] = r
                js.bank_round[idx] = r
                js.kind[idx] = t
                js.bitmap[idx] = 1 << w
                js.count[idx] = 1
                js.complete[idx] = False
                if t == norm_t:
                    js.norm[idx] = norm_bits[i]
                else:
                    js.sums[s, b] = values[job[i]][row_pos[i]]
                    elements += js.cfg.elems
                new_round += 1
                accepted += 1
            elif js.bank_round[idx] == r:
                if js.kind[idx] != t:
                    mismatch += 1
                    continue
                if js.complete[idx]:
                    retained += 1
                    emit_result(js, s, b, i, fanout=False)
                    continue
                bit = 1 << w
                if js.bitmap[idx] & bit:
                    duplicate += 1
                    continue
                js.bitmap[idx] |= bit
                js.count[idx] += 1
                if t == norm_t:
                    js.norm[idx] = max(js.norm[idx], norm_bits[i])
                else:
                    bank = js.sums[s, b]
                    np.add(bank, values[job[i]][row_pos[i]], out=bank)
                    elements += js.cfg.elems
                accepted += 1
            else:
                straggler += 1
                self._emit_straggler(js, s, i)
                continue
            if js.count[idx] >= js.cfg.threshold:
                js.complete[idx] = True
                completed += 1
                emit_result(js, s, b, i, fanout=True)
        c = self.counters
        c[_CI.ACCEPTED] += accepted
        c[_CI.NEW_ROUND] += new_round
        c[_CI.COMPLETED] += completed
        c[_CI.RETAINED] += retained
        c[_CI.DUPLICATE] += duplicate
        c[_CI.STRAGGLER] += straggler
        c[_CI.KIND_MISMATCH] += mismatch
        c[_CI.ELEMENTS] += elements

    # -- output construction ---------------------------------------------------------------------
    def _emit_completions(self, js: JobState, buf: np.ndarray, src: np.ndarray, gs: np.ndarray, gr: np.ndarray,
                          idx: np.ndarray, is_data: np.ndarray, count: np.ndarray, bitmap: np.ndarray) -> None:
        """Write the results of slots completed by the fast path, headers and payloads, vectorized."""
        out = self.out
        m0 = out.count
        ms = np.arange(m0, m0 + src.size)
        out.count = m0 + src.size
        out.src[ms] = src
        out.fanout[ms] = True
        out.job[ms] = js.cfg.job
        out.buf[ms, :HEADER_BYTES] = buf[src, :HEADER_BYTES]
        cfg = js.cfg
        hv = self._out_headers
        hv["type"][ms] = np.where(is_data, _PT.RESULT, _PT.NORM_RESULT)
        hv["contributors"][ms] = count
        hv["round"][ms] = gr
        hv["elems"][ms] = np.where(is_data, cfg.elems, 1)
        hv["width"][ms] = np.where(is_data, cfg.result_bits, 32)
        hv["bitmap"][ms] = bitmap
        hv["flags"][ms] = 0
        out.length[ms] = HEADER_BYTES + np.where(is_data, cfg.result_bytes, 4)
        if is_data.any():
            md = ms[is_data] if not is_data.all() else ms
            vals = js.sums[gs[is_data], gr[is_data] & 1].astype(js.result_dtype)
            out.buf[md, HEADER_BYTES:HEADER_BYTES + cfg.result_bytes] = vals.view(np.uint8).reshape(md.size, -1)
        if not is_data.all():
            norms = js.norm[idx[~is_data]].astype(">u4")
            out.buf[ms[~is_data], HEADER_BYTES:HEADER_BYTES + 4] = norms.view(np.uint8).reshape(-1, 4)

    def _emit(self, src: int, fanout: bool, job: int) -> int:
        out = self.out
        m = out.count
        out.count = m + 1
        out.src[m] = src
        out.fanout[m] = fanout
        out.job[m] = job
        return m

    def _emit_result(self, js: JobState, s: int, b: int, src: int, *, fanout: bool) -> None:
        out = self.out
        m = out.count
        out.count = m + 1
        out.src[m] = src
        out.fanout[m] = fanout
        out.job[m] = js.cfg.job
        idx = 2 * s + b
        if js.kind[idx] == _PT.NORM:
            out.buf[m, HEADER_BYTES:HEADER_BYTES + 4] = np.frombuffer(int(js.norm[idx]).to_bytes(4, "big"), np.uint8)
            plen, elems, width, typ = 4, 1, 32, _PT.NORM_RESULT
        else:
            # The sums are copied after the loop, in one vectorized pass per job (a bank cannot change
            # after completion except by a newer round's overwrite, which flushes first).
            plen = js.cfg.result_bytes
            key = (js.cfg.job, idx)
            lst = self._payloads.get(key)
            if lst is None:
                self._payloads[key] = [m]
            else:
                lst.append(m)
            elems, width, typ = js.cfg.elems, js.cfg.result_bits, _PT.RESULT
        out.length[m] = HEADER_BYTES + plen
        self._pending.append((m, typ, js.count[idx], js.bank_round[idx], elems, width, js.bitmap[idx]))

    def _flush_payload(self, job: int, idx: int) -> None:
        """Write the sums of bank ``idx`` of ``job`` into the results that wait for them (now)."""
        ms = self._payloads.pop((job, idx), None)
        if ms:
            js = self.jobs[job]
            plen = js.cfg.result_bytes
            self.out.buf[ms, HEADER_BYTES:HEADER_BYTES + plen] = (
                js.sums[idx >> 1, idx & 1].astype(js.result_dtype).view(np.uint8))

    def _flush_payloads(self) -> None:
        """Write all waiting result payloads: one gather and cast per job."""
        if not self._payloads:
            return
        by_job: dict[int, tuple[list[int], list[int]]] = {}
        for (job, idx), ms in self._payloads.items():
            rows, banks = by_job.setdefault(job, ([], []))
            rows.extend(ms)
            banks.extend([idx] * len(ms))
        self._payloads.clear()
        for job, (rows, banks) in by_job.items():
            js = self.jobs[job]
            plen = js.cfg.result_bytes
            bk = np.asarray(banks)
            vals = js.sums[bk >> 1, bk & 1].astype(js.result_dtype)
            self.out.buf[rows, HEADER_BYTES:HEADER_BYTES + plen] = vals.view(np.uint8).reshape(len(rows), plen)

    def _emit_straggler(self, js: JobState, s: int, src: int) -> None:
        m = self._emit(src, False, js.cfg.job)
        self.out.length[m] = HEADER_BYTES
        self._pending.append((m, _PT.STRAGGLER, 0, js.cur_round[s], 0, 0, 0))

    def _finish_headers(self, buf: np.ndarray) -> None:
        """Write the headers of this batch's outputs: the request's header with result fields patched."""
        out = self.out
        pend = self._pending
        if not pend:
            return
        m = np.array([p[0] for p in pend])
        out.buf[m, :HEADER_BYTES] = buf[out.src[m], :HEADER_BYTES]
        hv = header_view(out.buf)
        cols = np.array([p[1:] for p in pend], np.int64)
        for k, name in enumerate(("type", "contributors", "round", "elems", "width", "bitmap")):
            hv[name][m] = cols[:, k]
        hv["flags"][m] = 0
        pend.clear()
