"""THC wire format: the header layout (defined once), the protocol core (typed header, rounds, counters),
numpy batch (de)serializer, scapy layer, pcap helpers and the generated Wireshark dissector.
docs/protocol.md is the normative text."""

from worker_lib.wire.bits import pack_bits, packed_bytes, unpack_bits
from worker_lib.wire.layout import (
    FIELDS,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAX_WORKERS,
    RESULT_WIDTHS,
    ROUND_BITS,
    THC_UDP_PORT,
    VERSION,
    Field,
    PacketType,
)
from worker_lib.wire.protocol import (
    ROUND_MASK,
    Counter,
    DarCounter,
    Header,
    TierCounter,
    fragment_count,
    next_round,
    serial_newer,
)
from worker_lib.wire.serializer import (
    bits_float,
    build_batch,
    decode_sums,
    encode_int32,
    encode_sums,
    float_bits,
    header_view,
)

__all__ = [
    "FIELDS",
    "HEADER_BYTES",
    "HEADER_DTYPE",
    "MAX_WORKERS",
    "RESULT_WIDTHS",
    "ROUND_BITS",
    "ROUND_MASK",
    "THC_UDP_PORT",
    "VERSION",
    "Counter",
    "DarCounter",
    "Field",
    "Header",
    "PacketType",
    "TierCounter",
    "bits_float",
    "build_batch",
    "decode_sums",
    "encode_int32",
    "encode_sums",
    "float_bits",
    "fragment_count",
    "header_view",
    "next_round",
    "pack_bits",
    "packed_bytes",
    "serial_newer",
    "unpack_bits",
]

