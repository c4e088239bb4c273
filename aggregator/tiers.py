"""The two-tier roles, leaf and spine, as reference state machines (docs/protocol.md, "Two tiers").

Both are the one-tier table of ``aggregator.state`` with what the document changes:

- ``SpineAggregator``: the leaves in the workers' place. It takes PARTIAL and PARTIAL_NORM, adds a
  leaf's partial sums without a table lookup, counts workers (a leaf's n_l) against the job's threshold
  and answers every leaf with RESULT / NORM_RESULT whose ``contributors`` and ``bitmap`` are leaves.
- ``LeafAggregator``: leaf l's one-tier job (``JobConfig.leaf``) for its local workers, but a round
  complete here is FORWARDED (its partial sent to the parent) until the spine's answer makes it
  COMPLETE (or its notice UPSTREAM_STALE); a retransmission that finds the round forwarded sends the
  partial again. Packets from the parent are handled with ``handle(packet, from_parent=True)``.

Outputs are ``(Dest, bytes)``: to the sender, to every worker (leaf) of the job, or to the parent.
``Dest.SENDER`` and ``Dest.ALL`` equal the one-tier ``Output``'s False and True.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from aggregator.state import RESULT_TYPE, Bank, Job, ReferenceAggregator, check_addressing, norm_bits_ok
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.layout import HEADER_BYTES, ROUND_BITS, VERSION, PacketType
from worker_lib.wire.protocol import Counter, Header, TierCounter
from worker_lib.wire.serializer import decode_sums, encode_sums


class Dest(IntEnum):
    """Where a tier's packet goes."""

    SENDER = 0  #: the packet's sender (unicast)
    ALL = 1  #: every worker of the job (a spine: every leaf)
    PARENT = 2  #: the leaf's parent (the spine)


TierOutput = tuple[Dest, bytes]

#: The partial a leaf sends for a round of each kind.
PARTIAL_TYPE = {PacketType.DATA: PacketType.PARTIAL, PacketType.NORM: PacketType.PARTIAL_NORM}


def _two_tier(cfg: JobConfig) -> JobConfig:
    if not cfg.tiered:
        raise JobConfigError(f"job {cfg.job}: not a two-tier job: configure leaves=N0:N1:...")
    return cfg


def validate_parent(hdr: Header, length: int, cfg: JobConfig | None, tier: JobConfig | None, shard: int = 0,
                    shards: int = 1) -> Counter | None:
    """The checks of a packet from a leaf's parent (docs/protocol.md, "Leaf state table"), in order: the
    counter of the first that fails (None: valid). ``cfg`` is the leaf's one-tier job, ``tier`` the
    two-tier job (the spine's answers carry a leaf's index)."""
    if hdr.version != VERSION:
        return Counter.BAD_VERSION
    if hdr.type not in (PacketType.RESULT, PacketType.NORM_RESULT, PacketType.STRAGGLER):
        return Counter.BAD_TYPE
    failed = check_addressing(hdr, cfg, shard, shards, len(tier.leaves) if tier else None)
    if failed is not None:
        return Counter[failed]
    expect = {PacketType.RESULT: (cfg.elems, cfg.result_bits, HEADER_BYTES + cfg.result_bytes),
              PacketType.NORM_RESULT: (1, 32, HEADER_BYTES + 4)}.get(hdr.type, (0, 0, HEADER_BYTES))
    if (hdr.elems, hdr.width, length) != expect:
        return Counter.BAD_FORMAT
    if hdr.type == PacketType.STRAGGLER and hdr.bitmap >> ROUND_BITS:
        return Counter.BAD_FORMAT  # a spine's notice names the refused partial's round in bitmap
    return None


class SpineAggregator(ReferenceAggregator):
    """The spine's state table for a set of two-tier jobs (configured with their whole ``JobConfig``)."""

    def add_job(self, cfg: JobConfig) -> None:
        """Configure a two-tier job with all its slots empty."""
        self._install(_two_tier(cfg))

    def _validate(self, hdr: Header, length: int, payload: bytes) -> Counter | None:
        if hdr.version != VERSION:
            return Counter.BAD_VERSION
        if hdr.type not in (PacketType.PARTIAL, PacketType.PARTIAL_NORM):
            return Counter.BAD_TYPE
        job = self.jobs.get(hdr.job)
        cfg = job.cfg if job is not None else None
        failed = check_addressing(hdr, cfg, self.shard, self.shards, len(cfg.leaves) if cfg else None)
        if failed is not None:
            return Counter[failed]
        n = cfg.leaves[hdr.worker]
        if (hdr.contributors, hdr.bitmap) != (n, (1 << n) - 1):
            return Counter.BAD_FORMAT
        if hdr.type == PacketType.PARTIAL_NORM:
            if (hdr.elems, hdr.width, length) != (1, 32, HEADER_BYTES + 4):
                return Counter.BAD_FORMAT
            if not norm_bits_ok(int.from_bytes(payload[:4], "big")):
                return Counter.BAD_NORM
            return None
        width = cfg.partial_bits(hdr.worker)
        if (hdr.elems, hdr.width, length) != (cfg.elems, width, HEADER_BYTES + cfg.elems * width // 8):
            return Counter.BAD_FORMAT
        return None

    def _contribution(self, job: Job, hdr: Header, payload: bytes) -> np.ndarray | int:
        if hdr.type == PacketType.PARTIAL_NORM:
            return int.from_bytes(payload[:4], "big")
        return decode_sums(payload, hdr.width, job.cfg.elems, signed=job.cfg.kind == "uncompressed").astype(np.int32)

    def _weight(self, job: Job, hdr: Header) -> int:
        return job.cfg.leaves[hdr.worker]

    def _contributors(self, bank: Bank) -> int:
        return bank.bitmap.bit_count()  # leaves: a two-tier job's workers may not fit the 8-bit field

    @staticmethod
    def _straggler(hdr: Header, current: int) -> bytes:
        """A STRAGGLER notice to a leaf: ``round`` = the slot's current round, ``bitmap`` = the round of the
        refused partial (so that the leaf finds its FORWARDED bank)."""
        return hdr.replace(type=PacketType.STRAGGLER, contributors=0, round=current, elems=0, width=0, flags=0,
                           bitmap=hdr.round).pack()


@dataclass
class LeafBank(Bank):
    """A leaf's bank: a one-tier bank and the states the parent adds."""

    forwarded: bool = False  #: FORWARDED: complete here, the partial sent, no answer yet
    partial: bytes = b""  #: the partial sent (sent again as it is)
    upstream_round: int | None = None  #: UPSTREAM_STALE: the round the spine's notice carried

    def start(self, round_: int, kind: int, bitmap: int, count: int) -> None:
        super().start(round_, kind, bitmap, count)
        self.forwarded, self.partial, self.upstream_round = False, b"", None


class LeafAggregator(ReferenceAggregator):
    """Leaf ``leaf`` of two-tier jobs: the one-tier table of each job's ``leaf(l)`` for local workers, a
    parent for completions. ``tier_counters`` is indexed by ``TierCounter``."""

    bank_type = LeafBank

    def __init__(self, leaf: int, jobs: Iterable[JobConfig] = (), *, shard: int = 0,
                 shards: int = 1) -> None:
        self.leaf = leaf
        self.tier_jobs: dict[int, JobConfig] = {}
        self.tier_counters = [0] * len(TierCounter)
        super().__init__(jobs, shard=shard, shards=shards)

    def add_job(self, cfg: JobConfig) -> None:
        """Configure a two-tier job (its whole ``JobConfig``): this leaf serves ``cfg.leaf(self.leaf)``."""
        cfg = _two_tier(cfg)
        if not 0 <= self.leaf < len(cfg.leaves):
            raise JobConfigError(f"job {cfg.job}: leaf {self.leaf} is not in 0..{len(cfg.leaves) - 1}")
        self.tier_jobs[cfg.job] = cfg
        self._install(cfg.leaf(self.leaf))

    def remove_job(self, job: int) -> None:
        super().remove_job(job)
        self.tier_jobs.pop(job, None)

    def handle(self, packet: bytes, *, from_parent: bool = False) -> list[TierOutput]:  # type: ignore[override]
        """Apply the leaf's table to one packet: from a local worker, or (``from_parent``) from the spine."""
        if not from_parent:
            return [(Dest(d), p) for d, p in super().handle(packet)]
        received = self._receive(packet, self._validate_parent)  # teaches no address: last_valid stays None
        if received is None:
            return []
        hdr, payload = received
        job = self.jobs[hdr.job]
        slot = job.slots[hdr.slot]
        if hdr.type == PacketType.STRAGGLER:
            # The spine refused the partial of round ``bitmap`` (its notice's own round is the spine's):
            # that round's bank, if still FORWARDED, becomes UPSTREAM_STALE; the workers hear the spine's
            # round in a one-tier notice (bitmap 0).
            bank = slot.banks[hdr.bitmap % 2]
            if not self._forwarded(bank) or bank.round != hdr.bitmap:
                self.tier_counters[TierCounter.STALE_PARENT] += 1
                return []
            bank.upstream_round = hdr.round
            self._count(Counter.STRAGGLER)
            return [(Dest.ALL, hdr.replace(bitmap=0).pack())]
        bank = slot.banks[hdr.round % 2]
        if not self._forwarded(bank) or bank.round != hdr.round or RESULT_TYPE[bank.kind] != hdr.type:
            self.tier_counters[TierCounter.STALE_PARENT] += 1
            return []
        if hdr.type == PacketType.NORM_RESULT:
            bank.norm = int.from_bytes(payload[:4], "big")
        else:
            bank.sums = decode_sums(payload, hdr.width, hdr.elems, signed=job.cfg.kind == "uncompressed"
                                    ).astype(np.int32)
        bank.count, bank.bitmap, bank.complete = hdr.contributors, hdr.bitmap, True
        self._count(Counter.COMPLETED)
        return [(Dest.ALL, packet)]

    @staticmethod
    def _forwarded(bank: Bank) -> bool:
        """FORWARDED: complete here, the partial sent, the spine has not answered."""
        assert isinstance(bank, LeafBank)
        return bank.forwarded and not bank.complete and bank.upstream_round is None

    def _validate_parent(self, hdr: Header, length: int, payload: bytes) -> Counter | None:
        job = self.jobs.get(hdr.job)
        return validate_parent(hdr, length, job.cfg if job else None, self.tier_jobs.get(hdr.job), self.shard,
                               self.shards)

    def _held(self, job: Job, bank: Bank, hdr: Header) -> list[TierOutput] | None:
        assert isinstance(bank, LeafBank)
        if bank.upstream_round is not None:  # UPSTREAM_STALE: the spine's round
            self._count(Counter.STRAGGLER)
            return [(Dest.SENDER, self._straggler(hdr, bank.upstream_round))]
        if bank.forwarded:  # the spine's answer is late or lost: the partial again
            self.tier_counters[TierCounter.FORWARDED_AGAIN] += 1
            return [(Dest.PARENT, bank.partial)]
        return None

    def _completion(self, job: Job, bank: Bank, hdr: Header) -> list[TierOutput]:
        """The local completion check: all n_l local workers make the bank FORWARDED and send its partial."""
        assert isinstance(bank, LeafBank)
        if bank.count < job.cfg.threshold:
            return []
        tier = self.tier_jobs[job.cfg.job]
        n = tier.leaves[self.leaf]
        typ = PARTIAL_TYPE[PacketType(bank.kind)]
        if typ == PacketType.PARTIAL_NORM:
            elems, width, payload = 1, 32, bank.norm.to_bytes(4, "big")
        else:
            elems, width = tier.elems, tier.partial_bits(self.leaf)
            payload = encode_sums(bank.sums, width)
        bank.partial = hdr.replace(type=typ, worker=self.leaf, contributors=n, elems=elems, width=width, flags=0,
                                   bitmap=(1 << n) - 1).pack(payload)
        bank.forwarded = True
        self.tier_counters[TierCounter.FORWARDED] += 1
        return [(Dest.PARENT, bank.partial)]
