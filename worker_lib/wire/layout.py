"""The THC header, defined once.

Every other rendering of the header derives from ``FIELDS``: the typed ``protocol.Header``, the
big-endian numpy dtype of the batch (de)serializer, the scapy layer's ``fields_desc``, the Wireshark
Lua dissector, the P4 header of both programs (``python -m p4gen.headers``) and the field table of
docs/protocol.md (tests check that each generated or written copy matches). Every field is
fixed-width and byte-aligned: a switch parser extracts it in one go and a Tofino register can hold it.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

#: UDP port of the THC protocol (aggregator side); workers send to it, results come back from it.
THC_UDP_PORT = 9451
#: Protocol version carried in every packet.
VERSION = 1
#: Most workers per job: the contributor bitmap is one 32-bit word (one Tofino register).
MAX_WORKERS = 32
#: Width of the per-slot round counter, compared with serial-number arithmetic (RFC 1982).
ROUND_BITS = 16
#: Result widths an aggregator register may have.
RESULT_WIDTHS = (8, 16, 32)
#: Bytes of IPv4 + UDP in front of the THC header (the path MTU counts these, not Ethernet).
IP_UDP_OVERHEAD = 28
#: Largest MTU a job may use (a jumbo frame): the aggregators' receive rows are sized for its datagrams.
MAX_MTU = 9216
#: Bytes of the prefix of every DAR_DATA / DAR_RESULT payload: the message's total bit count and its
#: fragment count, two big-endian uint32 (so that reassembly needs no other state).
DAR_PREFIX_BYTES = 8


class PacketType(IntEnum):
    """Values of the ``type`` field."""

    DATA = 1  #: worker -> aggregator: one chunk (THC indices, or int32 for uncompressed jobs)
    RESULT = 2  #: aggregator -> worker: the chunk's sums, contributor count and bitmap
    NORM = 3  #: worker -> aggregator: the worker's norm (IEEE-754 float32 bits)
    NORM_RESULT = 4  #: aggregator -> worker: the max norm of the contributors
    STRAGGLER = 5  #: aggregator -> worker: the packet's round is stale; carries the slot's round
    #: worker -> software aggregator: one fragment of a decompress-aggregate-recompress codec message
    #: (docs/protocol.md, "Decompress-aggregate-recompress jobs"); a switch drops it as bad_type
    DAR_DATA = 6
    #: software aggregator -> worker: one fragment of the re-encoded average of a DAR round
    DAR_RESULT = 7
    #: leaf -> spine (two-tier jobs): a leaf's K partial sums, its contributor count and bitmap
    PARTIAL = 8
    #: leaf -> spine (two-tier jobs): the maximum of a leaf's workers' norm bits
    PARTIAL_NORM = 9


@dataclass(frozen=True)
class Field:
    """One header field: name, width in bits, and what it means."""

    name: str
    bits: int
    meaning: str

    @property
    def nbytes(self) -> int:
        return self.bits // 8


FIELDS: tuple[Field, ...] = (
    Field("version", 8, f"protocol version, {VERSION}; other values are dropped"),
    Field("type", 8, "packet type: 1 DATA, 2 RESULT, 3 NORM, 4 NORM_RESULT, 5 STRAGGLER, 6 DAR_DATA, "
                     "7 DAR_RESULT, 8 PARTIAL, 9 PARTIAL_NORM"),
    Field("job", 16, "job id; selects the job's configuration and registers"),
    Field("key", 32, "the job's shared secret; a packet with another key is dropped"),
    Field("table_id", 16, "id of the THC lookup table (\"Table id\" below); 0 for uncompressed and dar jobs"),
    Field("worker", 8, "sender's worker id, 0..n-1 (echoed in results); in a two-tier job, the local id at "
                       "its leaf, and a leaf's index in PARTIAL"),
    Field("contributors", 8, "results: number of workers summed (two-tier: of leaves); 0 in requests"),
    Field("slot", 16, "aggregator slot (agtr_idx), 0..S-1"),
    Field("round", 16, "the slot's use counter (serial-number arithmetic); in a straggler notice, the "
                       "slot's current round"),
    Field("tensor", 32, "tensor id, opaque to the aggregator (echoed)"),
    Field("chunk", 32, "chunk position in the tensor, opaque to the aggregator (echoed)"),
    Field("elems", 16, "element count K of the payload (the job's K for DATA and RESULT, 1 for norms)"),
    Field("width", 8, "bits per payload element: b for THC DATA, 32 for uncompressed DATA and norms, "
                      "the result width for RESULT, 0 for STRAGGLER"),
    Field("flags", 8, "reserved, 0"),
    Field("bitmap", 32, "results: bit w set if worker w contributed; 0 in requests; in a spine's STRAGGLER "
                        "to a leaf, the round of the partial it refuses"),
)

HEADER_BYTES = sum(f.bits for f in FIELDS) // 8
FIELD_NAMES = tuple(f.name for f in FIELDS)

_NUMPY_CODES = {8: ">u1", 16: ">u2", 32: ">u4"}


@functools.lru_cache(maxsize=64)
def header_dtype(itemsize: int | None = None) -> np.dtype:
    """The header as a big-endian numpy structured dtype.

    With ``itemsize`` larger than the header, the dtype spans a whole receive buffer row so that
    ``np.frombuffer(buf, header_dtype(stride))`` views the headers of a batch of packets in place.
    """
    names, formats, offsets = [], [], []
    off = 0
    for f in FIELDS:
        names.append(f.name)
        formats.append(_NUMPY_CODES[f.bits])
        offsets.append(off)
        off += f.nbytes
    size = HEADER_BYTES if itemsize is None else itemsize
    if size < HEADER_BYTES:
        raise ValueError(f"itemsize {size} is smaller than the {HEADER_BYTES}-byte header")
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size})


HEADER_DTYPE = header_dtype()
#: The header as a big-endian ``struct`` format, for code that handles one packet at a time.
HEADER_STRUCT = struct.Struct(">" + "".join({8: "B", 16: "H", 32: "I"}[f.bits] for f in FIELDS))


def field_offsets() -> dict[str, int]:
    """Byte offset of each field in the header."""
    out, off = {}, 0
    for f in FIELDS:
        out[f.name] = off
        off += f.nbytes
    return out


def _check_layout() -> None:
    for f in FIELDS:
        if f.bits not in _NUMPY_CODES:
            raise AssertionError(f"field {f.name}: width {f.bits} is not byte-aligned 8/16/32")


_check_layout()


def markdown_table() -> str:
    """The field table as it appears in docs/protocol.md (a test compares the two)."""
    rows = ["| offset | field | bits | meaning |", "|---:|---|---:|---|"]
    for name, off in field_offsets().items():
        f = next(x for x in FIELDS if x.name == name)
        rows.append(f"| {off} | `{f.name}` | {f.bits} | {f.meaning} |")
    return "\n".join(rows)
