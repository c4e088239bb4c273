"""The THC protocol core: the typed header, round arithmetic, fragment counts and the counters.

Everything a target of the protocol shares with every other one lives here once: the transport, the
reference state machine, the batch engine, the DAR path, the simulations, the P4 generators and both
control planes import it (docs/protocol.md is the normative text; ``layout.FIELDS`` defines the bytes).

- ``Header``: the 15 header fields by name, with one ``parse`` and one ``pack``. Batches of packets
  use the numpy view of the same layout (``serializer.header_view``).
- Rounds are ``ROUND_BITS``-bit serial numbers (RFC 1982): ``serial_newer`` is the one comparison,
  ``next_round`` the one increment, ``use_slot_round`` the
  slot and round of a use; both take Python ints or numpy arrays.
- ``fragment_count``: fragments of a DAR message.
- ``Counter``, ``DarCounter`` and ``TierCounter``: what an aggregator counts, each with its description (the metric's
  help text and the P4 programs' counter indices come from here).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields, replace
from enum import IntEnum
from typing import Any, Self

from worker_lib.wire.layout import FIELD_NAMES, HEADER_BYTES, HEADER_STRUCT, ROUND_BITS, VERSION

#: Mask of a round number.
ROUND_MASK = (1 << ROUND_BITS) - 1
#: Half the round space: a round at a serial distance below this is newer, at or above it older.
ROUND_HALF = 1 << (ROUND_BITS - 1)


def serial_newer(a: Any, b: Any) -> Any:
    """RFC 1982 on ROUND_BITS bits: is round ``a`` newer than round ``b``?

    Works element-wise on numpy integer arrays (returning a bool array) as well as on ints. Two rounds
    exactly half the space apart are neither newer nor older than each other (RFC 1982 leaves that
    case undefined); the state table treats such a packet as stale.
    """
    d = (a - b) & ROUND_MASK
    return (d > 0) & (d < ROUND_HALF)


def next_round(r: Any) -> Any:
    """The round after ``r`` (wrapping on ROUND_BITS bits); ints or numpy arrays."""
    return (r + 1) & ROUND_MASK


def use_slot_round(use: int, slots: int) -> tuple[int, int]:
    """The slot and round of a job's ``use``-th use of its slot pool: use u takes slot u mod S in the
    round after the slot's previous use (docs/protocol.md, "Jobs, slots and rounds")."""
    return use % slots, (use // slots) & ROUND_MASK


def fragment_count(nbytes: int, per: int) -> int:
    """Fragments of a DAR message of ``nbytes`` bytes at ``per`` bytes per fragment (at least 1)."""
    return max(1, -(-nbytes // per))


@dataclass(slots=True)
class Header:
    """One THC header with named fields (docs/protocol.md, "Header"); unset fields are 0.

    ``Header.parse(data)`` reads a packet's header and payload; ``hdr.pack(payload)`` writes the packet.
    """

    version: int = VERSION
    type: int = 0
    job: int = 0
    key: int = 0
    table_id: int = 0
    worker: int = 0
    contributors: int = 0
    slot: int = 0
    round: int = 0
    tensor: int = 0
    chunk: int = 0
    elems: int = 0
    width: int = 0
    flags: int = 0
    bitmap: int = 0

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview) -> tuple[Self, bytes]:
        """(header, payload) of one packet (a UDP payload). Raises ValueError when it is too short."""
        if len(data) < HEADER_BYTES:
            raise ValueError(f"packet of {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
        return cls.unpack_from(data), bytes(data[HEADER_BYTES:])

    @classmethod
    def unpack_from(cls, buffer: Any) -> Self:
        """The header at the start of ``buffer`` (anything with the buffer protocol, at least
        HEADER_BYTES long: a receive buffer, a numpy row), without copying a payload."""
        return cls(*HEADER_STRUCT.unpack_from(buffer))

    def pack(self, payload: bytes | bytearray | memoryview = b"") -> bytes:
        """The bytes of the packet: this header, then ``payload``. Raises struct.error on a field out of range."""
        return HEADER_STRUCT.pack(*astuple(self)) + bytes(payload)

    def replace(self, **changes: int) -> Header:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def as_dict(self) -> dict[str, int]:
        """The fields as a dict, in wire order."""
        return dict(zip(FIELD_NAMES, astuple(self), strict=True))


if tuple(f.name for f in fields(Header)) != FIELD_NAMES:  # pragma: no cover - a layout edit must update both
    raise AssertionError("Header's fields must be layout.FIELDS in order")


class _Described(IntEnum):
    """An IntEnum whose members carry a one-line description: ``NAME = value, "what it counts"``."""

    description: str

    def __new__(cls, value: int, description: str = "") -> Self:
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj.description = description
        return obj

    @property
    def label(self) -> str:
        """The metric label: the lower-case name."""
        return self.name.lower()


class Counter(_Described):
    """What the switch-job state table counts (``Aggregator.counters`` index, ``thc_stats`` index in P4).

    Members from ``SHORT`` on count packets dropped for the reason given, each under the first check it
    fails in the order of docs/protocol.md.
    """

    RX = 0, "packets received"
    ACCEPTED = 1, "contributions added to a bank"
    NEW_ROUND = 2, "banks (re)started by the first packet of a newer round"
    COMPLETED = 3, "slot rounds that reached the threshold"
    RETAINED = 4, "retained results sent again by unicast (duplicate or latecomer of a completed round)"
    DUPLICATE = 5, "duplicates before completion (dropped, added nothing)"
    STRAGGLER = 6, "straggler notices sent (stale round)"
    ELEMENTS = 7, "elements aggregated (K per accepted DATA packet)"
    SHORT = 8, "dropped: shorter than the header"
    BAD_VERSION = 9, "dropped: unknown version"
    BAD_TYPE = 10, "dropped: not DATA or NORM"
    UNKNOWN_JOB = 11, "dropped: job not configured"
    BAD_KEY = 12, "dropped: wrong key"
    BAD_TABLE = 13, "dropped: wrong table id"
    BAD_WORKER = 14, "dropped: worker id >= n"
    BAD_SLOT = 15, "dropped: slot >= S"
    WRONG_SHARD = 16, "dropped: slot belongs to another shard"
    BAD_FORMAT = 17, "dropped: elems, width or length do not match the job"
    BAD_NORM = 18, "dropped: norm negative, NaN or infinite"
    KIND_MISMATCH = 19, "dropped: NORM for a DATA round or the reverse"


class DarCounter(_Described):
    """What the decompress-aggregate-recompress path counts (``DarAggregator.counters`` index)."""

    RX = 0, "DAR_DATA fragments received"
    ACCEPTED = 1, "fragments stored into a reassembly buffer"
    NEW_ROUND = 2, "banks (re)started by the first fragment of a newer round"
    MESSAGES = 3, "worker messages completed (all their fragments arrived)"
    COMPLETED = 4, "slot rounds that reached the threshold and were aggregated"
    RETAINED = 5, "fragments of a completed round answered with retained result fragments"
    DUPLICATE = 6, "fragments already held (or of a message already complete): added nothing"
    STRAGGLER = 7, "straggler notices sent (stale round)"
    RESULT_FRAGMENTS = 8, "DAR_RESULT fragments built at completions"
    CPU_NS = 9, "aggregator CPU ns in decode + float sum + re-encode, over all completions"
    SHORT = 10, "dropped: shorter than header + prefix"
    BAD_VERSION = 11, "dropped: unknown version"
    UNKNOWN_JOB = 12, "dropped: no dar job with this id"
    BAD_KEY = 13, "dropped: wrong key"
    BAD_TABLE = 14, "dropped: table_id != 0"
    BAD_WORKER = 15, "dropped: worker id >= n"
    BAD_SLOT = 16, "dropped: slot >= S"
    WRONG_SHARD = 17, "dropped: slot of another shard"
    BAD_FORMAT = 18, "dropped: width != 8, or elems / length do not match the fragment"
    BAD_PREFIX = 19, "dropped: total bits over max_message, or fragment count not the one the bits need"
    BAD_FRAGMENT = 20, "dropped: fragment index >= fragment count"
    INCONSISTENT = 21, "dropped: totals differ from those of the message's earlier fragments"
    BAD_MESSAGE = 22, "complete messages the codec could not decode (discarded; the worker may resend)"
    RESULT_TOO_LARGE = 23, "rounds whose re-encoded result exceeded max_message (discarded, logged)"


class TierCounter(_Described):
    """What a two-tier aggregator counts besides ``Counter`` (docs/protocol.md, "Two tiers"): a leaf's
    exchanges with its parent."""

    FORWARDED = 0, "partials sent to the parent (a leaf's round complete locally)"
    FORWARDED_AGAIN = 1, "partials sent again (a worker's retransmission found the round forwarded)"
    STALE_PARENT = 2, "packets from the parent for no forwarded round (duplicates, other rounds): ignored"


#: The counters of dropped packets, in check order.
DROP_COUNTERS: tuple[Counter, ...] = tuple(c for c in Counter if c >= Counter.SHORT)
DAR_DROP_COUNTERS: tuple[DarCounter, ...] = tuple(c for c in DarCounter if c >= DarCounter.SHORT)
