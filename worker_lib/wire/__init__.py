"""THC wire format: the header layout (defined once), numpy batch (de)serializer, scapy layer,
pcap helpers and the generated Wireshark dissector. docs/protocol.md is the normative text."""

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
from worker_lib.wire.serializer import (
    bits_float,
    build_batch,
    build_packet,
    decode_sums,
    encode_int32,
    encode_sums,
    float_bits,
    header_view,
    make_header,
    pack_indices_np,
    packed_bytes,
    parse_packet,
    unpack_indices_np,
)

__all__ = [
    "FIELDS",
    "HEADER_BYTES",
    "HEADER_DTYPE",
    "MAX_WORKERS",
    "RESULT_WIDTHS",
    "ROUND_BITS",
    "THC_UDP_PORT",
    "VERSION",
    "Field",
    "PacketType",
    "bits_float",
    "build_batch",
    "build_packet",
    "decode_sums",
    "encode_int32",
    "encode_sums",
    "float_bits",
    "header_view",
    "make_header",
    "pack_indices_np",
    "packed_bytes",
    "parse_packet",
    "serial_newer",
    "unpack_indices_np",
]


def serial_newer(a: int, b: int) -> bool:
    """RFC 1982 serial-number comparison on ROUND_BITS bits: is round ``a`` newer than round ``b``?"""
    d = (a - b) & ((1 << ROUND_BITS) - 1)
    return 0 < d < (1 << (ROUND_BITS - 1))
