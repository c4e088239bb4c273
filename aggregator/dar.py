"""Decompress-aggregate-recompress (DAR) jobs: the software aggregator's path for codecs that are not
homomorphic (TopK, natural compression, 3LC, dynamic quantization; docs/protocol.md, section
"Decompress-aggregate-recompress jobs").

A switch cannot do this (it drops DAR_DATA as ``bad_type``); it exists so that the aggregator cost of
those codecs can be measured against THC's table lookups and integer adds (the THC paper's Figure 2).

Per configured dar job everything is preallocated: for each slot and bank (round parity, as in the
main state table) and each worker, a reassembly buffer of ``max_message`` bytes with a received-
fragment map, and the retained result as ready-to-send packets. A worker's codec message for one use
travels as fragments (``chunk`` = fragment index, ``elems`` = its bytes); every fragment's payload
starts with the message's total bit count and fragment count, so reassembly needs no other state.
When the job's threshold of complete messages is reached, the messages (in worker-id order) go
through the codec's own aggregate path (``codec.aggregate``: ``decode_one`` each, float sum, divide
by the count, ``reencode``), whose CPU time is counted, and the result is fragmented and fanned out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from aggregator.engine import DEFAULT_STRIDE
from aggregator.state import check_addressing
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.layout import DAR_PREFIX_BYTES, HEADER_BYTES, VERSION, PacketType
from worker_lib.wire.protocol import DarCounter, Header, fragment_count, serial_newer
from worker_lib.wire.serializer import header_view

if TYPE_CHECKING:
    from worker_lib.codecs import Codec, Message, RoundContext

log = logging.getLogger(__name__)

#: Bytes in front of a fragment's message bytes: THC header + DAR prefix.
FRAGMENT_OVERHEAD = HEADER_BYTES + DAR_PREFIX_BYTES


_EMPTY = -1


def round_seed(seed: int, job: int, slot: int, rnd: int) -> int:
    """Seed of the codec that re-encodes round ``rnd`` of ``slot`` of ``job`` (docs/protocol.md).

    Stochastic re-encoders (natural compression, dynamic quantization's sample) draw from a codec
    seeded with this, so a round's result depends only on its messages and (seed, job, slot, round),
    not on the order in which rounds complete.
    """
    return int(np.random.SeedSequence([seed, job, slot, rnd]).generate_state(1, np.uint32)[0])


class DarJobState:
    """Preallocated registers and buffers of one dar job."""

    def __init__(self, cfg: JobConfig) -> None:
        if cfg.kind != "dar":
            raise JobConfigError(f"job {cfg.job} is kind {cfg.kind!r}, not dar")
        self.cfg = cfg
        s, n, per, frags = cfg.slots, cfg.workers, cfg.elems, cfg.max_fragments
        self.per, self.max_frags, self.max_bits = per, frags, 8 * cfg.max_message
        # Reassembly: message bytes of each (slot, bank, worker), and which fragments arrived.
        self.buf = np.zeros((s, 2, n, frags * per), np.uint8)
        self.got = np.zeros((s, 2, n, frags), bool)
        self.msg_bits = [[[0] * n for _ in range(2)] for _ in range(s)]
        self.msg_frags = [[[0] * n for _ in range(2)] for _ in range(s)]
        self.msg_have = [[[0] * n for _ in range(2)] for _ in range(s)]
        self.msg_started = [[[False] * n for _ in range(2)] for _ in range(s)]
        # Slot / bank registers, as in the main state table.
        self.used = [False] * s
        self.cur_round = [0] * s
        self.bank_round = [[_EMPTY, _EMPTY] for _ in range(s)]
        self.bitmap = [[0, 0] for _ in range(s)]
        self.count = [[0, 0] for _ in range(s)]
        self.complete = [[False, False] for _ in range(s)]
        # Retained results as ready packets: (slot, bank, fragment) rows of header + prefix + bytes.
        self.res = np.zeros((s, 2, frags, FRAGMENT_OVERHEAD + per), np.uint8)
        self.res_flat = self.res.reshape(s * 2 * frags, FRAGMENT_OVERHEAD + per)
        self.res_len = np.zeros((s, 2, frags), np.int64)
        self.res_frags = [[0, 0] for _ in range(s)]
        #: CPU ns of the last aggregate call of this job (the counters hold the totals)
        self.cpu_ns_last = 0



def preload_codecs(jobs: Iterable[JobConfig]) -> None:
    """Import the codecs (torch) when a job is a dar job: called off the packet loop, before the job is
    handed to it, so that its first packet does not wait seconds for the import."""
    if any(j.kind == "dar" for j in jobs):
        import worker_lib.codecs  # noqa: F401


@dataclass
class DarSend:
    """Datagrams to send: rows ``rows`` of ``buf`` (``lengths`` bytes each), either to every worker of
    job ``job`` (``fanout``) or to the sender of input row ``src``."""

    buf: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    fanout: bool
    job: int
    src: int
    bank: tuple[int, int, int] | None = None  #: (job, slot, bank) whose retained packets ``buf`` views


@dataclass
class DarOutputs:
    """What one batch produced: the sends, and the rows that passed validation (to learn addresses)."""

    sends: list[DarSend] = field(default_factory=list)
    good_rows: list[int] = field(default_factory=list)
    good_jobs: list[int] = field(default_factory=list)
    good_workers: list[int] = field(default_factory=list)

    def packets(self) -> list[tuple[bool, bytes]]:
        """(fanout, bytes) of every datagram (tests and the reference API; not the hot path)."""
        return [(s.fanout, s.buf[r, :ln].tobytes()) for s in self.sends
                for r, ln in zip(s.rows.tolist(), s.lengths.tolist(), strict=True)]


class DarAggregator:
    """The DAR state machine for a set of dar jobs (one instance per shard, like ``Aggregator``)."""

    def __init__(self, jobs: Iterable[JobConfig] = (), *, shard: int = 0, shards: int = 1,
                 stride: int = DEFAULT_STRIDE) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
        self.shard, self.shards, self.stride = shard, shards, stride
        self.counters = np.zeros(len(DarCounter), np.int64)
        self.jobs: dict[int, DarJobState] = {}
        for cfg in jobs:
            self.add_job(cfg)

    def add_job(self, cfg: JobConfig) -> None:
        """Configure a dar job (replacing one with the same id resets it); buffers allocated now."""
        if FRAGMENT_OVERHEAD + cfg.elems > self.stride:
            raise JobConfigError(f"job {cfg.job}: fragments of {FRAGMENT_OVERHEAD + cfg.elems} bytes exceed the "
                                 f"aggregator's buffer stride {self.stride}")
        self.jobs[cfg.job] = DarJobState(cfg)
        log.info("dar job %d configured: %s (%.1f MiB)", cfg.job, cfg, cfg.dar_memory / 2**20)

    def remove_job(self, job: int) -> None:
        """Forget a dar job; its packets are then dropped as unknown."""
        if self.jobs.pop(job, None) is not None:
            log.info("dar job %d removed", job)

    def handle(self, packet: bytes) -> list[tuple[bool, bytes]]:
        """Process one packet; return the packets it causes as (fanout, bytes)."""
        stride = max(len(packet), FRAGMENT_OVERHEAD)
        row = np.zeros((1, stride), np.uint8)
        row[0, : len(packet)] = np.frombuffer(packet, np.uint8)
        return self.process(row, np.array([len(packet)])).packets()

    def process(self, buf: np.ndarray, lengths: np.ndarray) -> DarOutputs:
        """Apply the DAR state table to a batch of DAR_DATA packets (rows of ``buf``). Never raises on
        packet contents: bad fragments are counted and dropped."""
        out = DarOutputs()
        n = len(lengths)
        if n == 0:
            return out
        c = self.counters
        c[DarCounter.RX] += n
        lens = np.asarray(lengths, np.int64).tolist()
        h = header_view(buf[:n])
        cols = {name: h[name].astype(np.int64).tolist()
                for name in ("job", "worker", "slot", "round", "chunk", "elems")}
        prefix = np.ascontiguousarray(buf[:n, HEADER_BYTES:FRAGMENT_OVERHEAD]).view(">u4").astype(np.int64)
        bits_l, frags_l = prefix[:, 0].tolist(), prefix[:, 1].tolist()
        for i in range(n):
            hdr = Header.unpack_from(buf[i])
            reason = self._validate(hdr, lens[i], bits_l[i], frags_l[i])
            if reason is not None:
                c[reason] += 1
                continue
            job, w = cols["job"][i], cols["worker"][i]
            out.good_rows.append(i)
            out.good_jobs.append(job)
            out.good_workers.append(w)
            self._apply(self.jobs[job], buf, i, cols, bits_l[i], frags_l[i], out)
        return out

    # -- validation --------------------------------------------------------------------------------
    def _validate(self, hdr: Header, length: int, bits: int, frags: int) -> DarCounter | None:
        """The first failing check of a fragment (docs/protocol.md, DAR validation), or None."""
        if length < FRAGMENT_OVERHEAD:
            return DarCounter.SHORT
        if hdr.version != VERSION:
            return DarCounter.BAD_VERSION
        js = self.jobs.get(hdr.job)
        failed = check_addressing(hdr, js.cfg if js is not None else None, self.shard, self.shards)
        if failed is not None:
            return DarCounter[failed]
        if hdr.width != 8 or length != FRAGMENT_OVERHEAD + hdr.elems:
            return DarCounter.BAD_FORMAT
        nbytes = -(-bits // 8)
        if bits > js.max_bits or frags != fragment_count(nbytes, js.per):
            return DarCounter.BAD_PREFIX
        if hdr.chunk >= frags:
            return DarCounter.BAD_FRAGMENT
        if hdr.elems != min(js.per, nbytes - hdr.chunk * js.per):
            return DarCounter.BAD_FORMAT
        return None

    # -- the state table ---------------------------------------------------------------------------
    def _apply(self, js: DarJobState, buf: np.ndarray, i: int, cols: dict[str, list[int]], bits: int,
               frags: int, out: DarOutputs) -> None:
        """The DAR state table (docs/protocol.md) for valid fragment i."""
        c = self.counters
        s, r, w, k = cols["slot"][i], cols["round"][i], cols["worker"][i], cols["chunk"][i]
        b = r & 1
        if not js.used[s] or serial_newer(r, js.cur_round[s]):
            # First fragment of a newer round: the bank starts over (nothing of the old round is added).
            js.used[s] = True
            js.cur_round[s] = r
            js.bank_round[s][b] = r
            js.bitmap[s][b] = 0
            js.count[s][b] = 0
            js.complete[s][b] = False
            js.res_frags[s][b] = 0
            started = js.msg_started[s][b]
            for x in range(len(started)):
                started[x] = False
            c[DarCounter.NEW_ROUND] += 1
        elif js.bank_round[s][b] != r:
            c[DarCounter.STRAGGLER] += 1
            out.sends.append(self._straggler(js, buf, i, s))
            return
        if js.complete[s][b]:
            # Retained result: fragment k of the request gets result fragments k, k + F_up, ...
            c[DarCounter.RETAINED] += 1
            fdown = js.res_frags[s][b]
            sel = np.arange(k, fdown, frags)
            if sel.size:
                base = (s * 2 + b) * js.max_frags
                out.sends.append(DarSend(js.res_flat, base + sel, js.res_len[s, b, sel], False, js.cfg.job, i,
                                         (js.cfg.job, s, b)))
            return
        if js.bitmap[s][b] >> w & 1:
            c[DarCounter.DUPLICATE] += 1
            return
        got = js.got[s, b, w]
        if not js.msg_started[s][b][w]:
            js.msg_started[s][b][w] = True
            js.msg_bits[s][b][w] = bits
            js.msg_frags[s][b][w] = frags
            js.msg_have[s][b][w] = 0
            got[:frags] = False
        elif js.msg_bits[s][b][w] != bits or js.msg_frags[s][b][w] != frags:
            c[DarCounter.INCONSISTENT] += 1
            return
        if got[k]:
            c[DarCounter.DUPLICATE] += 1
            return
        e = cols["elems"][i]
        js.buf[s, b, w, k * js.per: k * js.per + e] = buf[i, FRAGMENT_OVERHEAD:FRAGMENT_OVERHEAD + e]
        got[k] = True
        js.msg_have[s][b][w] += 1
        c[DarCounter.ACCEPTED] += 1
        if js.msg_have[s][b][w] < frags:
            return
        js.bitmap[s][b] |= 1 << w
        js.count[s][b] += 1
        c[DarCounter.MESSAGES] += 1
        if js.count[s][b] >= js.cfg.threshold:
            self._complete(js, buf, i, s, b, r, out)

    def _complete(self, js: DarJobState, buf: np.ndarray, i: int, s: int, b: int, r: int, out: DarOutputs) -> None:
        """Aggregate round r of slot s (bank b) through the codec and fan the result out."""
        from worker_lib.codecs import Message, RoundContext, make_codec

        c = self.counters
        cfg = js.cfg
        workers = [w for w in range(cfg.workers) if js.bitmap[s][b] >> w & 1]
        msgs = [Message(js.buf[s, b, w, : -(-js.msg_bits[s][b][w] // 8)], js.msg_bits[s][b][w]) for w in workers]
        ctx = RoundContext(length=cfg.length, workers=len(msgs), job=cfg.job)
        codec = make_codec(cfg.codec, seed=round_seed(cfg.dar_seed, cfg.job, s, r))
        t0 = time.process_time_ns()
        try:
            down = codec.aggregate(msgs, ctx)
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            self._discard_bad(js, s, b, workers, msgs, ctx, codec, exc)
            return
        finally:
            spent = time.process_time_ns() - t0
            c[DarCounter.CPU_NS] += spent
            js.cpu_ns_last = spent
        if down.nbytes > cfg.max_message:
            c[DarCounter.RESULT_TOO_LARGE] += 1
            log.error("dar job %d slot %d round %d: the re-encoded result has %d bytes, over max_message %d; "
                      "round discarded (configure a larger max_message)", cfg.job, s, r, down.nbytes,
                      cfg.max_message)
            self._reset_messages(js, s, b)
            return
        # The bank's retained packets are about to change: sends of this batch that still view them
        # get their own copy first.
        for snd in out.sends:
            if snd.bank == (cfg.job, s, b):
                snd.buf, snd.rows, snd.bank = snd.buf[snd.rows].copy(), np.arange(snd.rows.size), None
        fdown = fragment_count(down.nbytes, js.per)
        rows = js.res[s, b, :fdown]
        rows[:, :HEADER_BYTES] = buf[i, :HEADER_BYTES]
        hv = header_view(rows)
        hv["type"] = PacketType.DAR_RESULT
        hv["contributors"] = len(msgs)
        hv["round"] = r
        hv["chunk"] = np.arange(fdown)
        sizes = np.minimum(js.per, down.nbytes - np.arange(fdown) * js.per)
        hv["elems"] = sizes
        hv["width"] = 8
        hv["flags"] = 0
        hv["bitmap"] = js.bitmap[s][b]
        rows[:, HEADER_BYTES:FRAGMENT_OVERHEAD] = np.array([down.bits, fdown], ">u4").view(np.uint8)
        full = (fdown - 1) * js.per
        if full:
            rows[: fdown - 1, FRAGMENT_OVERHEAD:] = down.payload[:full].reshape(fdown - 1, js.per)
        last = down.nbytes - full
        rows[fdown - 1, FRAGMENT_OVERHEAD:FRAGMENT_OVERHEAD + last] = down.payload[full:]
        js.res_len[s, b, :fdown] = FRAGMENT_OVERHEAD + sizes
        js.res_frags[s][b] = fdown
        js.complete[s][b] = True
        c[DarCounter.COMPLETED] += 1
        c[DarCounter.RESULT_FRAGMENTS] += fdown
        base = (s * 2 + b) * js.max_frags
        out.sends.append(DarSend(js.res_flat, base + np.arange(fdown), js.res_len[s, b, :fdown].copy(), True,
                                 cfg.job, i, (cfg.job, s, b)))

    def _discard_bad(self, js: DarJobState, s: int, b: int, workers: list[int], msgs: list[Message],
                     ctx: RoundContext, codec: Codec, exc: Exception) -> None:
        """The codec refused a round: drop the messages it cannot decode (their workers may resend);
        if none fails on its own, drop them all. Counted, logged, never raised."""
        bad = []
        for w, m in zip(workers, msgs, strict=True):
            try:
                codec.decode_one(m, ctx)
            except (ValueError, TypeError, IndexError, RuntimeError):
                bad.append(w)
        bad = bad or workers
        log.warning("dar job %d slot %d: codec refused the messages of workers %s (%s); discarded",
                    js.cfg.job, s, bad, exc)
        self.counters[DarCounter.BAD_MESSAGE] += len(bad)
        for w in bad:
            js.bitmap[s][b] &= ~(1 << w)
            js.count[s][b] -= 1
            js.msg_started[s][b][w] = False

    def _reset_messages(self, js: DarJobState, s: int, b: int) -> None:
        """Forget every message of bank b of slot s (the round stays; workers' resends start over)."""
        js.bitmap[s][b] = 0
        js.count[s][b] = 0
        started = js.msg_started[s][b]
        for x in range(len(started)):
            started[x] = False

    def _straggler(self, js: DarJobState, buf: np.ndarray, i: int, s: int) -> DarSend:
        """A STRAGGLER notice for input row i: its header with the slot's current round."""
        row = buf[i: i + 1, :HEADER_BYTES].copy()
        hv = header_view(row)
        hv["type"] = PacketType.STRAGGLER
        hv["contributors"] = 0
        hv["round"] = js.cur_round[s]
        hv["elems"] = 0
        hv["width"] = 0
        hv["flags"] = 0
        hv["bitmap"] = 0
        return DarSend(row, np.zeros(1, np.int64), np.array([HEADER_BYTES]), False, js.cfg.job, i)
