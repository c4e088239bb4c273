"""The reference state machine: the THC aggregator's logic, one packet at a time, as docs/protocol.md
writes it.

This module is the specification in code. It reads top to bottom like the document: the checks of
"Validation" in their order, then the rows of "State table" (FRESH or NEWER, ACTIVE, COMPLETE,
STALE), then the completion check. It favours plainness over speed; ``aggregator.engine`` is the
batch engine that ``thc-aggregator`` runs, and the differential tests (tests/test_fuzz.py) and the
shared scenario table (tests/scenarios.py) hold the engine, BMv2 and this module to the same bytes.

Only integers cross the aggregator: THC indices become the table's integers, uncompressed payloads are
int32 summed with two's-complement wrap, norms are maxed as raw IEEE-754 bits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.bits import unpack_bits
from worker_lib.wire.layout import HEADER_BYTES, VERSION, PacketType
from worker_lib.wire.protocol import Counter, Header, serial_newer
from worker_lib.wire.serializer import encode_sums

log = logging.getLogger(__name__)

#: (send to every worker of the job?, packet bytes): what one packet makes the aggregator send.
Output = tuple[bool, bytes]


@dataclass
class Bank:
    """One of a slot's two banks: the round it aggregates (None: empty) and what it holds so far."""

    round: int | None = None
    kind: int = 0  #: PacketType.DATA or PacketType.NORM
    bitmap: int = 0  #: bit w set when worker w contributed
    count: int = 0
    complete: bool = False
    sums: np.ndarray | None = None  #: DATA: K int32 sums
    norm: int = 0  #: NORM: the maximum of the norm bits


@dataclass
class Slot:
    """A slot: whether it was ever used, its current (newest) round, and its banks (round r uses r mod 2)."""

    used: bool = False
    round: int = 0
    banks: tuple[Bank, Bank] = field(default_factory=lambda: (Bank(), Bank()))


@dataclass
class Job:
    """A configured job and its slots."""

    cfg: JobConfig
    slots: list[Slot]


class _Configured(Protocol):
    cfg: JobConfig


def check_addressing(hdr: Header, cfg: JobConfig | None, shard: int, shards: int) -> str | None:
    """The checks that tie a packet to its job's registers, in docs/protocol.md's order: the name of the
    counter of the first one that fails (None: all pass). Shared by switch jobs and DAR jobs, whose
    counter enums name these reasons alike."""
    if cfg is None:
        return "UNKNOWN_JOB"
    if hdr.key != cfg.key:
        return "BAD_KEY"
    if hdr.table_id != cfg.table_id:
        return "BAD_TABLE"
    if hdr.worker >= cfg.workers:
        return "BAD_WORKER"
    if hdr.slot >= cfg.slots:
        return "BAD_SLOT"
    if hdr.slot % shards != shard:
        return "WRONG_SHARD"
    return None


def validate(hdr: Header, length: int, payload: bytes, jobs: Mapping[int, _Configured], shard: int,
             shards: int) -> Counter | None:
    """The first check of docs/protocol.md, "Validation", that a packet fails (None: it is valid).

    ``jobs`` maps job ids to anything with the job's ``cfg`` (the reference's ``Job``, the engine's
    ``JobState``: both use this one function for packets taken one at a time). ``payload`` needs only
    its first 4 bytes (a norm). The length check (``short``) comes before parsing: the caller's.
    """
    if hdr.version != VERSION:
        return Counter.BAD_VERSION
    if hdr.type not in (PacketType.DATA, PacketType.NORM):
        return Counter.BAD_TYPE
    job = jobs.get(hdr.job)
    cfg = job.cfg if job is not None else None
    failed = check_addressing(hdr, cfg, shard, shards)
    if failed is not None:
        return Counter[failed]
    if hdr.type == PacketType.NORM:
        if (hdr.elems, hdr.width, length) != (1, 32, HEADER_BYTES + 4):
            return Counter.BAD_FORMAT
        bits = int.from_bytes(payload[:4], "big")
        if bits >> 31 or (bits >> 23) & 0xFF == 0xFF:  # negative (-0.0 too), infinite or NaN
            return Counter.BAD_NORM
    elif (hdr.elems, hdr.width, length) != (cfg.elems, cfg.data_width, HEADER_BYTES + cfg.data_bytes):
        return Counter.BAD_FORMAT
    return None


def contribution(cfg: JobConfig, hdr: Header, payload: bytes) -> np.ndarray | int:
    """What a valid packet adds: a DATA packet's K integers (table values of its indices, or its int32
    values), or a NORM packet's norm bits."""
    if hdr.type == PacketType.NORM:
        return int.from_bytes(payload[:4], "big")
    if cfg.kind == "thc":
        return cfg.values()[unpack_bits(np.frombuffer(payload, np.uint8), cfg.bits, cfg.elems)]
    return np.frombuffer(payload, ">i4").astype(np.int32)


class ReferenceAggregator:
    """The state table for a set of jobs, one packet at a time (``handle``).

    ``shard``/``shards``: this instance serves the slots s with s mod shards == shard. ``counters`` is
    indexed by ``Counter``.
    """

    def __init__(self, jobs: Iterable[JobConfig] = (), *, shard: int = 0, shards: int = 1) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
        self.shard, self.shards = shard, shards
        self.counters = [0] * len(Counter)
        self.jobs: dict[int, Job] = {}
        for cfg in jobs:
            self.add_job(cfg)

    def add_job(self, cfg: JobConfig) -> None:
        """Configure a job with all its slots empty (replacing a job of the same id resets it)."""
        if cfg.kind not in ("thc", "uncompressed"):
            raise JobConfigError(f"job {cfg.job}: kind {cfg.kind!r} is not a switch job")
        self.jobs[cfg.job] = Job(cfg, [Slot() for _ in range(cfg.slots)])

    def remove_job(self, job: int) -> None:
        """Forget a job; its packets are then dropped as ``unknown_job``."""
        self.jobs.pop(job, None)

    def handle(self, packet: bytes) -> list[Output]:
        """Apply the state table to one packet; return what it makes the aggregator send."""
        self.counters[Counter.RX] += 1
        if len(packet) < HEADER_BYTES:
            return self._nothing_but(Counter.SHORT)
        hdr, payload = Header.parse(packet)
        failed = validate(hdr, len(packet), payload, self.jobs, self.shard, self.shards)
        if failed is not None:
            return self._nothing_but(failed)
        job = self.jobs[hdr.job]
        slot = job.slots[hdr.slot]
        bank = slot.banks[hdr.round % 2]
        value = contribution(job.cfg, hdr, payload)

        # FRESH or NEWER: the packet starts its round in bank r mod 2.
        if not slot.used or serial_newer(hdr.round, slot.round):
            slot.used, slot.round = True, hdr.round
            bank.round, bank.kind, bank.complete = hdr.round, hdr.type, False
            bank.bitmap, bank.count = 1 << hdr.worker, 1
            self._add(bank, value, first=True)
            self._count(Counter.NEW_ROUND, Counter.ACCEPTED)
            self._count_elements(job, hdr)
            return self._completion(job, bank, hdr)
        # STALE: bank r mod 2 does not hold round r; the sender hears the slot's current round.
        if bank.round != hdr.round:
            self._count(Counter.STRAGGLER)
            return [(False, hdr.replace(type=PacketType.STRAGGLER, contributors=0, round=slot.round, elems=0,
                                        width=0, flags=0, bitmap=0).pack())]
        # ACTIVE or COMPLETE, but for the other kind of packet (NORM into a DATA round or the reverse).
        if bank.kind != hdr.type:
            return self._nothing_but(Counter.KIND_MISMATCH)
        # COMPLETE: a duplicate or a latecomer gets the retained result, by unicast.
        if bank.complete:
            self._count(Counter.RETAINED)
            return [(False, self._result(job, bank, hdr))]
        # ACTIVE: a duplicate before completion adds nothing; a new contributor is added.
        if bank.bitmap >> hdr.worker & 1:
            return self._nothing_but(Counter.DUPLICATE)
        bank.bitmap |= 1 << hdr.worker
        bank.count += 1
        self._add(bank, value, first=False)
        self._count(Counter.ACCEPTED)
        self._count_elements(job, hdr)
        return self._completion(job, bank, hdr)

    # -- the rows' actions ---------------------------------------------------------------------------
    @staticmethod
    def _add(bank: Bank, value: np.ndarray | int, *, first: bool) -> None:
        """Overwrite (first contribution of a round) or add into the bank: int32 sums wrap, norms max."""
        if isinstance(value, int):
            bank.norm = value if first else max(bank.norm, value)
        elif first:
            bank.sums = value.astype(np.int32)
        else:
            bank.sums = (bank.sums + value.astype(np.int32)).astype(np.int32)

    def _completion(self, job: Job, bank: Bank, hdr: Header) -> list[Output]:
        """The completion check: at the threshold the bank is complete and its result goes to every worker."""
        if bank.count < job.cfg.threshold:
            return []
        bank.complete = True
        self._count(Counter.COMPLETED)
        return [(True, self._result(job, bank, hdr))]

    @staticmethod
    def _result(job: Job, bank: Bank, hdr: Header) -> bytes:
        """RESULT (the sums at the job's result width) or NORM_RESULT (the max norm bits) of a bank, in the
        header of the packet that caused it."""
        cfg = job.cfg
        if bank.kind == PacketType.NORM:
            typ, elems, width, payload = PacketType.NORM_RESULT, 1, 32, bank.norm.to_bytes(4, "big")
        else:
            typ, elems, width, payload = PacketType.RESULT, cfg.elems, cfg.result_bits, encode_sums(
                bank.sums, cfg.result_bits)
        return hdr.replace(type=typ, contributors=bank.count, round=bank.round, elems=elems, width=width, flags=0,
                           bitmap=bank.bitmap).pack(payload)

    # -- counting ------------------------------------------------------------------------------------
    def _count(self, *counters: Counter) -> None:
        for c in counters:
            self.counters[c] += 1

    def _nothing_but(self, counter: Counter) -> list[Output]:
        """Count the outcome; the packet changes nothing and nothing is sent."""
        self.counters[counter] += 1
        return []

    def _count_elements(self, job: Job, hdr: Header) -> None:
        if hdr.type == PacketType.DATA:
            self.counters[Counter.ELEMENTS] += job.cfg.elems
