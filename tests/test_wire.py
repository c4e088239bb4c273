"""Wire format: one layout, rendered identically by scapy, numpy and docs/protocol.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP

from worker_lib.job import JobConfig
from worker_lib.thc import pack_indices, unpack_indices
from worker_lib.wire import (
    FIELDS,
    HEADER_BYTES,
    THC_UDP_PORT,
    Header,
    PacketType,
    bits_float,
    build_batch,
    decode_sums,
    encode_sums,
    float_bits,
    header_view,
    pack_bits,
    serial_newer,
    unpack_bits,
)
from worker_lib.wire.layout import field_offsets
from worker_lib.wire.scapy_layer import THC

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"

header_values = st.fixed_dictionaries({f.name: st.integers(0, (1 << f.bits) - 1) for f in FIELDS})


def test_doc_table_matches_layout() -> None:
    """docs/protocol.md lists exactly the layout's fields, offsets and widths, in order."""
    section = DOC.read_text().split("\n## Header\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    parsed = []
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            parsed.append((int(cells[0]), cells[1].strip("`"), int(cells[2]), cells[3]))
    offs = field_offsets()
    assert parsed == [(offs[f.name], f.name, f.bits, f.meaning) for f in FIELDS]


def test_layout_is_switch_friendly() -> None:
    """Every field is byte-aligned 8/16/32 bits and the header is a whole number of 32-bit words."""
    assert all(f.bits in (8, 16, 32) for f in FIELDS)
    assert HEADER_BYTES == sum(f.bits for f in FIELDS) // 8 and HEADER_BYTES % 4 == 0
    offs = field_offsets()
    for f in FIELDS:  # natural alignment: a field never straddles its own width
        assert offs[f.name] % (f.bits // 8) == 0


@settings(max_examples=60, deadline=None)
@given(header_values, st.binary(max_size=64))
def test_scapy_and_numpy_produce_same_bytes(fields: dict, payload: bytes) -> None:
    """The scapy layer and the numpy serializer build the same bytes, and both parse them back."""
    via_numpy = Header(**fields).pack(payload)
    via_scapy = bytes(THC(**fields) / payload) if payload else bytes(THC(**fields))
    assert via_numpy == via_scapy
    hdr, pay = Header.parse(via_scapy)
    assert hdr.as_dict() == fields and pay == payload
    back = THC(via_numpy)
    assert {f.name: back.getfieldval(f.name) for f in FIELDS} == fields
    assert bytes(back.payload) == payload


def test_big_endian_and_offsets() -> None:
    """Fields sit at their documented offsets, most significant byte first."""
    pkt = Header(job=0x0102, key=0x03040506, slot=0x0708, bitmap=0x090A0B0C).pack()
    offs = field_offsets()
    assert pkt[offs["job"]:offs["job"] + 2] == b"\x01\x02"
    assert pkt[offs["key"]:offs["key"] + 4] == b"\x03\x04\x05\x06"
    assert pkt[offs["slot"]:offs["slot"] + 2] == b"\x07\x08"
    assert pkt[offs["bitmap"]:offs["bitmap"] + 4] == b"\x09\x0a\x0b\x0c"


def test_scapy_bound_to_udp_port() -> None:
    """A UDP datagram to the THC port dissects as THC (ls/show work on it)."""
    wire = bytes(IP(dst="127.0.0.1") / UDP(sport=40000, dport=THC_UDP_PORT) / THC(type=PacketType.NORM, job=9))
    pkt = IP(wire)
    assert pkt.haslayer(THC) and pkt[THC].job == 9 and pkt[THC].type == PacketType.NORM
    assert "NORM" in pkt[THC].show(dump=True)


@pytest.mark.parametrize("bits", range(1, 9))
def test_numpy_packing_matches_thc_pack_indices(bits: int) -> None:
    """The numpy packer is byte-identical to worker_lib.thc.pack_indices (MSB first) and inverts."""
    rng = np.random.default_rng(bits)
    for count in (8, 24, 1000):
        idx = rng.integers(0, 1 << bits, count).astype(np.uint8)
        ours = pack_bits(idx, bits)
        theirs = pack_indices(torch.from_numpy(idx), bits).numpy()
        assert ours.tobytes() == theirs.tobytes()
        assert np.array_equal(unpack_bits(ours, bits, count), idx)
        assert np.array_equal(unpack_indices(torch.from_numpy(ours), bits, count).numpy(), idx)


def test_msb_first_explicit() -> None:
    """Index 0 sits in the top bits of byte 0 (hand-written bytes)."""
    assert pack_bits(np.array([1, 2, 3, 4, 5, 6, 7, 8]), 4).tobytes() == bytes([0x12, 0x34, 0x56, 0x78])
    assert pack_bits(np.array([1, 0, 1, 1, 0, 0, 0, 1]), 1).tobytes() == bytes([0b10110001])
    assert pack_bits(np.array([3, 0, 2, 1, 0, 0, 0, 0]), 2).tobytes() == bytes([0b11001001, 0])


def test_batch_serializer_rows_equal_single_packets() -> None:
    """build_batch rows equal build_packet bytes; header_view reads them back without copying."""
    rng = np.random.default_rng(1)
    payloads = rng.integers(0, 256, (5, 16), dtype=np.uint8)
    cols = {"type": np.full(5, 1), "job": np.arange(5), "slot": np.arange(5) * 3, "round": np.arange(5) + 65530,
            "key": np.full(5, 0xDEADBEEF), "elems": np.full(5, 32), "width": np.full(5, 4)}
    batch = build_batch(cols, payloads)
    for i in range(5):
        single = Header(**{k: int(v[i]) for k, v in cols.items()}).pack(payloads[i].tobytes())
        assert batch[i].tobytes() == single
    hv = header_view(batch)
    assert hv["round"].tolist() == [65530, 65531, 65532, 65533, 65534]
    assert np.shares_memory(hv, batch)


def test_sums_and_norm_round_trip() -> None:
    """Result payloads carry sums at 8/16/32 bits big-endian; a too-big sum is refused."""
    sums = np.array([0, 1, 255, 17])
    assert encode_sums(sums, 8) == bytes([0, 1, 255, 17])
    assert encode_sums(sums, 16) == bytes([0, 0, 0, 1, 0, 255, 0, 17])
    assert decode_sums(encode_sums(sums, 32), 32, 4).tolist() == sums.tolist()
    with pytest.raises(ValueError, match="does not fit"):
        encode_sums(np.array([256]), 8)
    assert decode_sums(encode_sums(np.array([-5, 7]), 32), 32, 2, signed=True).tolist() == [-5, 7]
    assert float_bits(1.0) == 0x3F800000 and bits_float(0x40100000) == 2.25


def test_serial_arithmetic() -> None:
    """RFC 1982 on 16 bits: wraparound is newer, half-way is neither."""
    assert serial_newer(1, 0) and serial_newer(0, 65535) and serial_newer(100, 65000)
    assert not serial_newer(0, 0) and not serial_newer(65535, 0) and not serial_newer(5, 6)
    assert not serial_newer(32768, 0) and not serial_newer(0, 32768)
    assert serial_newer(32767, 0)


def test_parse_short_packet_raises() -> None:
    with pytest.raises(ValueError, match="shorter than the 32-byte header"):
        Header.parse(b"\x01\x02")


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 31, 32])
def test_pack_bits_rows_are_packed_like_single_payloads(width: int) -> None:
    """A 2-D array packs (and unpacks) row by row exactly as each row alone, for every width."""
    rng = np.random.default_rng(width)
    for count in (8, 13, 40):
        rows = rng.integers(0, 1 << width, (5, count), dtype=np.int64)
        packed = pack_bits(rows, width)
        assert packed.shape == (5, -(-count * width // 8))
        for r in range(5):
            assert packed[r].tobytes() == pack_bits(rows[r], width).tobytes()
        assert np.array_equal(unpack_bits(packed, width, count), rows)


def _crc32_bitwise(data: bytes) -> int:
    """CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), bit by bit: independent of zlib."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_table_id_follows_the_documented_recipe() -> None:
    """docs/protocol.md, "Table id": the low 16 bits of CRC-32 of the text [b, g, [T0, ..., T(2^b-1)]]; its
    worked example, and the ids jobs really carry, from a CRC written here bit by bit."""
    assert _crc32_bitwise(b"[2, 3, [0, 1, 2, 3]]") & 0xFFFF == 0x095C
    assert JobConfig(workers=1, bits=2, granularity=3, table=(0, 1, 2, 3), elems=8).table_id == 0x095C
    for cfg in (JobConfig(workers=4), JobConfig(workers=2, bits=3, granularity=20, p=1 / 64, elems=16)):
        values = ", ".join(str(int(v)) for v in cfg.values())
        text = f"[{cfg.bits}, {cfg.granularity}, [{values}]]".encode()
        assert cfg.table_id == _crc32_bitwise(text) & 0xFFFF
    assert JobConfig(workers=2, kind="uncompressed", elems=8).table_id == 0
