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
from collections.abc import Callable, Iterable, Mapping
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
#: The answer of a request of each kind (DATA and PARTIAL rounds give RESULT, norms NORM_RESULT).
RESULT_TYPE = {PacketType.DATA: PacketType.RESULT, PacketType.NORM: PacketType.NORM_RESULT,
               PacketType.PARTIAL: PacketType.RESULT, PacketType.PARTIAL_NORM: PacketType.NORM_RESULT}


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

    def start(self, round_: int, kind: int, bitmap: int, count: int) -> None:
        """Begin a round: the FRESH/NEWER row's overwrite (the sums or norm follow)."""
        self.round, self.kind, self.complete = round_, kind, False
        self.bitmap, self.count = bitmap, count


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


def check_addressing(hdr: Header, cfg: JobConfig | None, shard: int, shards: int,
                     senders: int | None = None) -> str | None:
    """The checks that tie a packet to its job's registers, in docs/protocol.md's order: the name of the
    counter of the first one that fails (None: all pass). Shared by switch jobs, DAR jobs and the two
    tiers, whose counter enums name these reasons alike. ``senders``: how many distinct ``worker`` ids
    the packet's senders have (default: the job's workers; a spine's senders are the leaves)."""
    if cfg is None:
        return "UNKNOWN_JOB"
    if hdr.key != cfg.key:
        return "BAD_KEY"
    if hdr.table_id != cfg.table_id:
        return "BAD_TABLE"
    if hdr.worker >= (cfg.workers if senders is None else senders):
        return "BAD_WORKER"
    if hdr.slot >= cfg.slots:
        return "BAD_SLOT"
    if hdr.slot % shards != shard:
        return "WRONG_SHARD"
    return None


def norm_bits_ok(bits: int) -> bool:
    """A norm's bits may be maxed as unsigned integers: sign clear (-0.0 too), exponent not all ones
    (infinite, NaN)."""
    return not (bits >> 31 or (bits >> 23) & 0xFF == 0xFF)


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
        if not norm_bits_ok(int.from_bytes(payload[:4], "big")):
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
    indexed by ``Counter``. ``last_valid``: the header of the last packet that passed validation (None if
    the last one failed): whose address it teaches (docs/protocol.md, "Addresses").

    The two-tier roles (``aggregator.tiers``) reuse this table: they override the validation, what a
    packet adds and weighs, and what a completion does.
    """

    bank_type: type[Bank] = Bank

    def __init__(self, jobs: Iterable[JobConfig] = (), *, shard: int = 0, shards: int = 1) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
        self.shard, self.shards = shard, shards
        self.counters = [0] * len(Counter)
        self.last_valid: Header | None = None
        self.jobs: dict[int, Job] = {}
        for cfg in jobs:
            self.add_job(cfg)

    def add_job(self, cfg: JobConfig) -> None:
        """Configure a job with all its slots empty (replacing a job of the same id resets it)."""
        cfg.check_one_tier()
        self._install(cfg)

    def _install(self, cfg: JobConfig) -> None:
        """Configure the job this table runs (one tier's, a leaf's or a spine's) with all its slots empty."""
        if cfg.kind not in ("thc", "uncompressed"):
            raise JobConfigError(f"job {cfg.job}: kind {cfg.kind!r} is not a switch job")
        self.jobs[cfg.job] = Job(cfg, [Slot(banks=(self.bank_type(), self.bank_type())) for _ in range(cfg.slots)])

    def remove_job(self, job: int) -> None:
        """Forget a job; its packets are then dropped as ``unknown_job``."""
        self.jobs.pop(job, None)

    def handle(self, packet: bytes) -> list[Output]:
        """Apply the state table to one packet; return what it makes the aggregator send."""
        received = self._receive(packet, self._validate)
        if received is None:
            return []
        hdr, payload = received
        self.last_valid = hdr
        job = self.jobs[hdr.job]
        slot = job.slots[hdr.slot]
        bank = slot.banks[hdr.round % 2]
        value = self._contribution(job, hdr, payload)

        # FRESH or NEWER: the packet starts its round in bank r mod 2.
        if not slot.used or serial_newer(hdr.round, slot.round):
            slot.used, slot.round = True, hdr.round
            bank.start(hdr.round, hdr.type, 1 << hdr.worker, self._weight(job, hdr))
            self._add(bank, value, first=True)
            self._count(Counter.NEW_ROUND, Counter.ACCEPTED)
            self._count_elements(job, hdr)
            return self._completion(job, bank, hdr)
        # STALE: bank r mod 2 does not hold round r; the sender hears the slot's current round.
        if bank.round != hdr.round:
            self._count(Counter.STRAGGLER)
            return [(False, self._straggler(hdr, slot.round))]
        # ACTIVE or COMPLETE, but for the other kind of packet (NORM into a DATA round or the reverse).
        if bank.kind != hdr.type:
            return self._nothing_but(Counter.KIND_MISMATCH)
        # COMPLETE: a duplicate or a latecomer gets the retained result, by unicast.
        if bank.complete:
            self._count(Counter.RETAINED)
            return [(False, self._result(job, bank, hdr))]
        held = self._held(job, bank, hdr)  # states a tier adds between COMPLETE and ACTIVE
        if held is not None:
            return held
        # ACTIVE: a duplicate before completion adds nothing; a new contributor is added.
        if bank.bitmap >> hdr.worker & 1:
            return self._nothing_but(Counter.DUPLICATE)
        bank.bitmap |= 1 << hdr.worker
        bank.count += self._weight(job, hdr)
        self._add(bank, value, first=False)
        self._count(Counter.ACCEPTED)
        self._count_elements(job, hdr)
        return self._completion(job, bank, hdr)

    def _receive(self, packet: bytes, validate: Callable[[Header, int, bytes], Counter | None]
                 ) -> tuple[Header, bytes] | None:
        """The steps before a state table: count the packet, check its length, parse it and ``validate``
        it; (header, payload), or None when it is dropped (its counter counted)."""
        self.counters[Counter.RX] += 1
        self.last_valid = None
        if len(packet) < HEADER_BYTES:
            self._nothing_but(Counter.SHORT)
            return None
        hdr, payload = Header.parse(packet)
        failed = validate(hdr, len(packet), payload)
        if failed is not None:
            self._nothing_but(failed)
            return None
        return hdr, payload

    # -- what a tier overrides -----------------------------------------------------------------------
    def _validate(self, hdr: Header, length: int, payload: bytes) -> Counter | None:
        """The first validation check the packet fails (None: valid)."""
        return validate(hdr, length, payload, self.jobs, self.shard, self.shards)

    def _contribution(self, job: Job, hdr: Header, payload: bytes) -> np.ndarray | int:
        """What a valid packet adds (sums or norm bits)."""
        return contribution(job.cfg, hdr, payload)

    def _weight(self, job: Job, hdr: Header) -> int:
        """Workers a valid packet counts for: one (a spine counts the leaf's workers)."""
        return 1

    def _held(self, job: Job, bank: Bank, hdr: Header) -> list[Output] | None:
        """A packet for a bank that is neither ACTIVE nor COMPLETE in a tier's own states (None: ACTIVE)."""
        return None

    def _contributors(self, bank: Bank) -> int:
        """The ``contributors`` field of a bank's result: the workers summed."""
        return bank.count

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

    def _result(self, job: Job, bank: Bank, hdr: Header) -> bytes:
        """RESULT (the sums at the job's result width) or NORM_RESULT (the max norm bits) of a bank, in the
        header of the packet that caused it."""
        cfg = job.cfg
        typ = RESULT_TYPE[bank.kind]
        if typ == PacketType.NORM_RESULT:
            elems, width, payload = 1, 32, bank.norm.to_bytes(4, "big")
        else:
            elems, width, payload = cfg.elems, cfg.result_bits, encode_sums(bank.sums, cfg.result_bits)
        return hdr.replace(type=typ, contributors=self._contributors(bank), round=bank.round, elems=elems,
                           width=width, flags=0, bitmap=bank.bitmap).pack(payload)

    @staticmethod
    def _straggler(hdr: Header, current: int) -> bytes:
        """A STRAGGLER notice for ``hdr``'s packet: the header alone, ``round`` = the slot's current round."""
        return hdr.replace(type=PacketType.STRAGGLER, contributors=0, round=current, elems=0, width=0, flags=0,
                           bitmap=0).pack()

    # -- counting ------------------------------------------------------------------------------------
    def _count(self, *counters: Counter) -> None:
        for c in counters:
            self.counters[c] += 1

    def _nothing_but(self, counter: Counter) -> list[Output]:
        """Count the outcome; the packet changes nothing and nothing is sent."""
        self.counters[counter] += 1
        return []

    def _count_elements(self, job: Job, hdr: Header) -> None:
        if RESULT_TYPE[hdr.type] == PacketType.RESULT:
            self.counters[Counter.ELEMENTS] += job.cfg.elems
