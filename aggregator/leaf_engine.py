"""A leaf of two-tier jobs on the batch engine (docs/protocol.md, "Leaf state table").

``aggregator.tiers.LeafAggregator`` is the leaf's reference, one packet at a time; this is the same
table at the batch engine's speed. The local workers' packets go through ``aggregator.engine.Aggregator``
configured with each job's one-tier leaf job (``JobConfig.leaf``): a round complete there is complete
here. What the leaf adds is kept beside the engine's banks, per bank: LOCAL, FORWARDED (the partial
sent), DONE (the parent's result stored in the engine's bank) or UPSTREAM_STALE (with the spine's round),
with the round that state is about. The engine's answers are then rewritten as the leaf's table says: a
completion becomes the PARTIAL to the parent; a retained result of a FORWARDED bank the partial again,
of an UPSTREAM_STALE one a straggler notice with the spine's round; a DONE bank's retained result is
already the parent's.

The parent's packets (``from_parent``) are few, one per local round; each is applied where it arrived
with respect to the workers' packets of its slot: a batch is cut where a parent packet follows a worker
packet of the same slot, and otherwise the parent packet goes first (slots are independent). The result
equals the reference's packet by packet, up to the order of the answers of different slots
(tests/test_leaf_engine.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from aggregator.engine import DEFAULT_STRIDE, Aggregator
from aggregator.tiers import Dest, validate_parent
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.layout import HEADER_BYTES, PacketType
from worker_lib.wire.protocol import Counter, Header, TierCounter
from worker_lib.wire.serializer import batch_of, decode_sums, header_view, result_dtype

log = logging.getLogger(__name__)

UP_LOCAL, UP_FORWARDED, UP_DONE, UP_STALE = 0, 1, 2, 3  #: a leaf's state of a bank (beside the engine's)
_RESULT, _NORM_RESULT = int(PacketType.RESULT), int(PacketType.NORM_RESULT)
_PARTIAL = {_RESULT: int(PacketType.PARTIAL), _NORM_RESULT: int(PacketType.PARTIAL_NORM)}


@dataclass
class LeafOutputs:
    """Packets produced by one batch: row m of ``buf`` holds ``length[m]`` bytes for ``dest[m]`` (a
    ``Dest``: the sender of input row ``src[m]``, every worker of job ``job[m]``, or the parent)."""

    buf: np.ndarray
    length: np.ndarray
    src: np.ndarray
    dest: np.ndarray
    job: np.ndarray
    count: int = 0

    @classmethod
    def allocate(cls, rows: int, stride: int) -> LeafOutputs:
        return cls(np.zeros((rows, stride), np.uint8), np.zeros(rows, np.int64), np.zeros(rows, np.int64),
                   np.zeros(rows, np.int8), np.zeros(rows, np.int64))

    def packets(self) -> list[tuple[Dest, bytes]]:
        """(destination, bytes) of every output (tests and the one-packet API; not the hot path)."""
        return [(Dest(int(self.dest[m])), self.buf[m, :self.length[m]].tobytes()) for m in range(self.count)]


def _last_local_before(buf: np.ndarray, n: int, from_parent: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """For each parent row, the last worker row before it for the same job and slot (-1: none)."""
    h = header_view(buf[:n])
    key = h["job"].astype(np.int64) << 16 | h["slot"].astype(np.int64)
    local = np.flatnonzero(~np.asarray(from_parent[:n], bool))
    if local.size == 0:
        return np.full(parents.size, -1, np.int64)
    order = (key[local] * (n + 1) + local)
    order.sort()
    want = key[parents] * (n + 1) + parents
    at = np.searchsorted(order, want) - 1
    found = order[np.maximum(at, 0)]
    same = (at >= 0) & (found // (n + 1) == key[parents])
    return np.where(same, found % (n + 1), -1)


class LeafJob:
    """The leaf's state of one two-tier job's banks (2 S each), beside the engine's registers."""

    def __init__(self, tier: JobConfig, leaf: int) -> None:
        banks = 2 * tier.slots
        self.tier = tier
        self.state = np.zeros(banks, np.int8)
        self.round = np.full(banks, -1, np.int64)  #: the round ``state`` is about
        self.upstream = np.zeros(banks, np.int64)  #: UPSTREAM_STALE: the spine's round
        self.n = tier.leaves[leaf]
        self.width = tier.partial_bits(leaf)


class LeafEngine:
    """Leaf ``leaf`` of a set of two-tier jobs. ``counters`` (the engine's, indexed by ``Counter``) and
    ``tier_counters`` (indexed by ``TierCounter``) count as the reference does; ``last_good``,
    ``last_job`` and ``last_worker`` are the valid workers' rows of the last batch (their addresses are
    learned), ascending."""

    def __init__(self, leaf: int, jobs: Iterable[JobConfig] = (), *, max_batch: int = 256,
                 stride: int = DEFAULT_STRIDE, compiled: bool = False) -> None:
        self.leaf = leaf
        self.engine = Aggregator(max_batch=max_batch, stride=stride, compiled=compiled)
        self.tier_jobs: dict[int, LeafJob] = {}
        self.tier_counters = np.zeros(len(TierCounter), np.int64)
        self.out = LeafOutputs.allocate(max_batch, stride)
        self.last_good = self.last_job = self.last_worker = np.zeros(0, np.int64)
        self._good: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for cfg in jobs:
            self.add_job(cfg)

    @property
    def counters(self) -> np.ndarray:
        return self.engine.counters

    def add_job(self, cfg: JobConfig) -> None:
        """Configure a two-tier job (its whole ``JobConfig``): this leaf serves ``cfg.leaf(leaf)``."""
        if not cfg.tiered:
            raise JobConfigError(f"job {cfg.job}: not a two-tier job: configure leaves=N0:N1:...")
        if not 0 <= self.leaf < len(cfg.leaves):
            raise JobConfigError(f"job {cfg.job}: leaf {self.leaf} is not in 0..{len(cfg.leaves) - 1}")
        self.engine.add_job(cfg.leaf(self.leaf))
        self.tier_jobs[cfg.job] = LeafJob(cfg, self.leaf)

    def remove_job(self, job: int) -> None:
        self.engine.remove_job(job)
        self.tier_jobs.pop(job, None)

    def handle(self, packet: bytes, *, from_parent: bool = False) -> list[tuple[Dest, bytes]]:
        """One packet (the reference's API): the packets it causes."""
        return self.process(*batch_of([packet], self.engine.stride), np.array([from_parent])).packets()

    # -- a batch -----------------------------------------------------------------------------------
    def process(self, buf: np.ndarray, lengths: np.ndarray, from_parent: np.ndarray) -> LeafOutputs:
        """Apply the leaf's table to a batch: rows of ``buf`` are packets of ``lengths`` bytes, from the
        parent where ``from_parent``. Returns ``self.out`` (reused by the next call); never raises on
        packet contents."""
        n = len(lengths)
        self.out.count = 0
        self._good.clear()
        parents = np.flatnonzero(from_parent[:n])
        start = 0
        if parents.size:
            # A worker packet of this part of the batch for the parent packet's slot came first: apply that
            # part first. Otherwise the parent packet goes before the part's packets (of other slots), with
            # the other parent packets that do.
            last = _last_local_before(buf, n, from_parent, parents)
            group: list[int] = []
            for p, before in zip(parents.tolist(), last.tolist(), strict=True):
                if before >= start:
                    self._parents(buf, lengths, group)
                    self._workers(buf, lengths, from_parent, start, p)
                    group, start = [], p
                group.append(p)
            self._parents(buf, lengths, group)
        self._workers(buf, lengths, from_parent, start, n)
        if self._good:
            self.last_good, self.last_job, self.last_worker = (np.concatenate(x) for x in zip(*self._good,
                                                                                               strict=True))
            order = np.argsort(self.last_good, kind="stable")
            self.last_good, self.last_job, self.last_worker = (x[order] for x in (self.last_good, self.last_job,
                                                                                 self.last_worker))
        else:
            self.last_good = self.last_job = self.last_worker = np.zeros(0, np.int64)
        return self.out

    def _workers(self, buf: np.ndarray, lengths: np.ndarray, from_parent: np.ndarray, a: int, b: int) -> None:
        """Rows a..b-1 (the parent's among them already applied) through the engine, then its answers
        rewritten for the leaf."""
        if a >= b:
            return
        lens = np.array(lengths[a:b], np.int64)
        masked = np.flatnonzero(from_parent[a:b])
        lens[masked] = 0  # the engine drops them as short; their counts are taken back below
        eng = self.engine
        res = eng.process(buf[a:b], lens)
        if masked.size:
            eng.counters[Counter.RX] -= masked.size
            eng.counters[Counter.SHORT] -= masked.size
        good = eng.last_good
        if good.size:
            self._good.append((good + a, eng.last_job[good], eng.last_worker[good]))
        m = res.count
        if m == 0:
            return
        out = self.out
        c = out.count
        width = int(res.length[:m].max())
        out.buf[c:c + m, :width] = res.buf[:m, :width]
        out.length[c:c + m] = res.length[:m]
        out.src[c:c + m] = res.src[:m] + a
        out.job[c:c + m] = res.job[:m]
        out.dest[c:c + m] = np.where(res.fanout[:m], Dest.ALL, Dest.SENDER)
        out.count = c + m
        typ = out.buf[c:c + m, 1]
        results = np.flatnonzero((typ == _RESULT) | (typ == _NORM_RESULT))
        if results.size:
            self._leaf_answers(c + results)

    def _leaf_answers(self, rows: np.ndarray) -> None:
        """The engine's results (output ``rows``, in order) as the leaf answers them."""
        out = self.out
        hv = header_view(out.buf)
        jobs, slots, rounds = out.job[rows], hv["slot"][rows].astype(np.int64), hv["round"][rows].astype(np.int64)
        idx = 2 * slots + (rounds & 1)
        fan = out.dest[rows] == Dest.ALL
        if fan.all() and (jobs == jobs[0]).all() and np.unique(idx).size == idx.size:
            # The common case: completions only (of distinct banks), all of one job: forwarded at once.
            lj = self.tier_jobs[int(jobs[0])]
            lj.state[idx], lj.round[idx] = UP_FORWARDED, rounds
            self._as_partial(rows, lj)
            self.engine.counters[Counter.COMPLETED] -= rows.size
            self.tier_counters[TierCounter.FORWARDED] += rows.size
            return
        for k, m in enumerate(rows.tolist()):
            lj = self.tier_jobs[int(jobs[k])]
            i, r = int(idx[k]), int(rounds[k])
            if fan[k]:  # complete here: FORWARDED
                lj.state[i], lj.round[i] = UP_FORWARDED, r
                self._as_partial(np.array([m]), lj)
                self.engine.counters[Counter.COMPLETED] -= 1
                self.tier_counters[TierCounter.FORWARDED] += 1
                continue
            state = int(lj.state[i]) if lj.round[i] == r else UP_FORWARDED  # complete here is forwarded
            if state == UP_DONE:
                continue  # the engine's bank holds the parent's result: the retained result is its
            self.engine.counters[Counter.RETAINED] -= 1
            if state == UP_STALE:
                self.engine.counters[Counter.STRAGGLER] += 1
                for name, value in (("type", int(PacketType.STRAGGLER)), ("contributors", 0),
                                    ("round", int(lj.upstream[i])), ("elems", 0), ("width", 0), ("bitmap", 0)):
                    hv[name][m] = value
                out.length[m] = HEADER_BYTES
            else:
                self.tier_counters[TierCounter.FORWARDED_AGAIN] += 1
                self._as_partial(np.array([m]), lj)

    def _as_partial(self, rows: np.ndarray, lj: LeafJob) -> None:
        """Rewrite result rows of one job into the leaf's PARTIAL / PARTIAL_NORM to the parent: this leaf's
        index, its n_l workers, the sums at the leaf's width."""
        out = self.out
        hv = header_view(out.buf)
        typ = hv["type"][rows].astype(np.int64)
        hv["type"][rows] = np.where(typ == _RESULT, _PARTIAL[_RESULT], _PARTIAL[_NORM_RESULT])
        hv["worker"][rows] = self.leaf
        hv["contributors"][rows] = lj.n
        hv["bitmap"][rows] = (1 << lj.n) - 1
        out.dest[rows] = Dest.PARENT
        cfg = lj.tier
        data = rows[typ == _RESULT]
        if data.size and lj.width != cfg.result_bits:  # narrower partials: the sums re-encoded
            k = cfg.elems
            src = out.buf[data, HEADER_BYTES:HEADER_BYTES + cfg.result_bytes]
            sums = np.ascontiguousarray(src).view(result_dtype(cfg.result_bits)).reshape(data.size, k)
            out.buf[data, HEADER_BYTES:HEADER_BYTES + k * lj.width // 8] = (
                sums.astype(result_dtype(lj.width)).view(np.uint8).reshape(data.size, -1))
            hv["width"][data] = lj.width
            out.length[data] = HEADER_BYTES + k * lj.width // 8

    def _parents(self, buf: np.ndarray, lengths: np.ndarray, group: list[int]) -> None:
        """The parent's packets in rows ``group`` (in order), applied at once where they are the common
        case: valid RESULTs / NORM_RESULTs of one job, for distinct banks. Otherwise one by one."""
        if not group:
            return
        rows = np.array(group)
        lens = np.asarray(lengths)[rows].astype(np.int64)
        hv = header_view(buf)
        h = {f: hv[f][rows] for f in hv.dtype.names} if (lens >= HEADER_BYTES).all() else None  # fields alone
        lj = self.tier_jobs.get(int(h["job"][0])) if h is not None else None
        js = self.engine.jobs.get(int(h["job"][0])) if h is not None else None
        if h is None or lj is None or js is None or len(group) < 4:
            for p in group:
                self._parent(buf, int(lengths[p]), p)
            return
        cfg = js.cfg
        typ, slot, rnd = (h[f].astype(np.int64) for f in ("type", "slot", "round"))
        data = typ == _RESULT
        eng = self.engine
        ok = ((h["job"] == cfg.job) & (h["version"] == 1) & (data | (typ == _NORM_RESULT)) & (h["key"] == cfg.key)
              & (h["table_id"] == cfg.table_id) & (h["worker"] < len(lj.tier.leaves)) & (slot < cfg.slots)
              & (slot % eng.shards == eng.shard)
              & (h["elems"] == np.where(data, cfg.elems, 1)) & (h["width"] == np.where(data, cfg.result_bits, 32))
              & (lens == HEADER_BYTES + np.where(data, cfg.result_bytes, 4)))
        idx = 2 * slot + (rnd & 1)
        if not ok.all() or np.unique(idx).size != idx.size:
            for p in group:
                self._parent(buf, int(lengths[p]), p)
            return
        c = eng.counters
        c[Counter.RX] += rows.size
        kind = np.where(data, int(PacketType.DATA), int(PacketType.NORM))
        take = ((lj.state[idx] == UP_FORWARDED) & (lj.round[idx] == rnd) & (js.bank_round[idx] == rnd)
                & js.complete[idx] & (js.kind[idx] == kind))
        self.tier_counters[TierCounter.STALE_PARENT] += int((~take).sum())
        if not take.any():
            return
        rows, idx, slot, rnd, data = rows[take], idx[take], slot[take], rnd[take], data[take]
        lj.state[idx] = UP_DONE
        js.count[idx] = h["contributors"][take]
        js.bitmap[idx] = h["bitmap"][take]
        if data.any():
            k = cfg.elems
            raw = np.ascontiguousarray(buf[rows[data], HEADER_BYTES:HEADER_BYTES + cfg.result_bytes])
            sums = raw.view(result_dtype(cfg.result_bits)).reshape(-1, k)
            js.sums[slot[data], rnd[data] & 1] = (sums.astype(np.uint32).view(np.int32) if cfg.kind == "uncompressed"
                                                   else sums.astype(np.int32))
        if not data.all():
            raw = np.ascontiguousarray(buf[rows[~data], HEADER_BYTES:HEADER_BYTES + 4])
            js.norm[idx[~data]] = raw.view(">u4").reshape(-1).astype(np.int64)
        c[Counter.COMPLETED] += rows.size
        out = self.out
        m, width = out.count, int(lens.max())
        out.buf[m:m + rows.size, :width] = buf[rows, :width]
        out.length[m:m + rows.size] = lens[take]
        out.src[m:m + rows.size] = rows
        out.dest[m:m + rows.size] = Dest.ALL
        out.job[m:m + rows.size] = cfg.job
        out.count = m + rows.size

    def _parent(self, buf: np.ndarray, length: int, p: int) -> None:
        """The parent's packet in row ``p``: its answer stored (or its notice taken) by a FORWARDED bank."""
        c = self.engine.counters
        c[Counter.RX] += 1
        if length < HEADER_BYTES:
            c[Counter.SHORT] += 1
            return
        packet = buf[p, :length].tobytes()
        hdr, payload = Header.parse(packet)
        js = self.engine.jobs.get(hdr.job)
        lj = self.tier_jobs.get(hdr.job)
        failed = validate_parent(hdr, length, js.cfg if js else None, lj.tier if lj else None,
                                 self.engine.shard, self.engine.shards)
        if failed is not None:
            c[failed] += 1
            return
        assert js is not None and lj is not None
        notice = hdr.type == PacketType.STRAGGLER
        r = hdr.bitmap if notice else hdr.round  # a notice names the refused round in bitmap
        i = 2 * hdr.slot + (r & 1)
        kind = {PacketType.RESULT: PacketType.DATA, PacketType.NORM_RESULT: PacketType.NORM}.get(hdr.type)
        if (lj.state[i] != UP_FORWARDED or lj.round[i] != r or js.bank_round[i] != r or not js.complete[i]
                or (kind is not None and js.kind[i] != kind)):
            self.tier_counters[TierCounter.STALE_PARENT] += 1
            return
        if notice:
            lj.state[i], lj.upstream[i] = UP_STALE, hdr.round
            c[Counter.STRAGGLER] += 1
            packet = hdr.replace(bitmap=0).pack()
        else:
            lj.state[i] = UP_DONE
            if kind == PacketType.NORM:
                js.norm[i] = int.from_bytes(payload[:4], "big")
            else:
                js.sums[hdr.slot, r & 1] = decode_sums(payload, hdr.width, hdr.elems,
                                                       signed=js.cfg.kind == "uncompressed").astype(np.int32)
            js.count[i], js.bitmap[i] = hdr.contributors, hdr.bitmap
            c[Counter.COMPLETED] += 1
        out = self.out
        m = out.count
        out.buf[m, :len(packet)] = np.frombuffer(packet, np.uint8)
        out.length[m], out.src[m], out.dest[m], out.job[m] = len(packet), p, Dest.ALL, hdr.job
        out.count = m + 1
