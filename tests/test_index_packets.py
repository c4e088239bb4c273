"""The transport's DATA packets of a tensor's indices: the compiled builder against the header and the bit
string each packet must carry (docs/protocol.md), and against the numpy composition it replaced."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_codecs_bits import reference_pack
from worker_lib.job import JobConfig
from worker_lib.transport import Transport, TransportConfig
from worker_lib.wire.bits import pack_padded_rows
from worker_lib.wire.index_packets import IndexPacker, index_packets, stamp_uses
from worker_lib.wire.layout import HEADER_BYTES, PacketType
from worker_lib.wire.protocol import Header
from worker_lib.wire.serializer import build_batch

HEADER = {"type": int(PacketType.DATA), "job": 7, "key": 0x54484321, "table_id": 0xBEEF, "worker": 3,
          "tensor": 0x01020304}


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([8, 16, 24, 1440]), st.integers(0, 4), st.data())
def test_each_row_is_its_header_and_its_chunk_bit_string(width: int, elems: int, whole: int, data) -> None:
    """Row r: the header fields given, chunk r, slot and round 0, then the bit string of indices r*K ..
    (r+1)*K - 1, zeros past the tensor's end; as many rows as chunks (one for an empty tensor)."""
    size = whole * elems + data.draw(st.integers(0, elems - 1))
    rng = np.random.default_rng(size * 11 + width)
    fields = rng.integers(0, 1 << width, size, dtype=np.uint8)
    pkts = index_packets({**HEADER, "elems": elems, "width": width}, fields, width, elems)
    rows = max(1, -(-size // elems))
    assert pkts.shape == (rows, HEADER_BYTES + elems * width // 8)
    full = np.zeros(rows * elems, np.int64)
    full[:size] = fields
    for r in range(rows):
        hdr, payload = Header.parse(pkts[r].tobytes())
        assert hdr == Header(**HEADER, elems=elems, width=width, chunk=r, slot=0, round=0)
        assert payload == reference_pack(full[r * elems:(r + 1) * elems].tolist(), width)


@pytest.mark.parametrize(("width", "elems"), [(4, 1440), (4, 12), (3, 8), (1, 12)])
def test_the_same_bytes_as_the_numpy_composition(width: int, elems: int) -> None:
    """Rows of whole bytes of 1, 2, 4 or 8-bit indices take the compiled pass, the others (3 bits; 1 bit in
    rows of 12) the composition: either way the bytes of build_batch of pack_padded_rows, slots and rounds
    stamped."""
    rng = np.random.default_rng(width * elems)
    fields = rng.integers(0, 1 << width, 5 * elems - 3, dtype=np.uint8)
    slots, rounds = np.arange(5) % 3, np.arange(5) // 3 + 65534
    pkts = index_packets({**HEADER, "elems": elems, "width": width}, fields, width, elems)
    stamp_uses(pkts, slots, rounds)
    want = build_batch({**HEADER, "elems": elems, "width": width, "slot": slots, "round": rounds & 0xFFFF,
                        "chunk": np.arange(5)}, pack_padded_rows(fields, width, 5, elems))
    assert np.array_equal(pkts, want)


@pytest.mark.parametrize("bad", [np.array([1, 16, 2], np.uint8), np.array([1, 2, 300]), np.array([-1, 2])])
def test_indices_out_of_range_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="outside"):
        index_packets({**HEADER, "elems": 8, "width": 4}, bad, 4, 8)


def test_a_refused_tensor_spends_no_use_of_the_pool() -> None:
    """An index out of range is refused before the uses are claimed: the next tensor takes use 0's slot and
    round, as the job's other workers expect (no aggregator needed: nothing is sent)."""
    job = JobConfig(job=1, workers=2, bits=4, slots=4)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        tr = Transport(TransportConfig(job, worker=0, aggregator=s.getsockname()))
        with tr, pytest.raises(ValueError, match="outside"):
            tr.exchange_indices(np.full(3 * job.elems, 16, np.uint8))
        assert tr.next_use == 0 and tr.slot_round == [0] * 4


def test_rows_packed_a_range_at_a_time_are_index_packets_rows() -> None:
    """``IndexPacker``: rows packed in ranges, in any order, are ``index_packets``' rows byte for byte (chunk
    numbers, the tensor's partial last chunk); an index of 2^b or more in a range raises index_packets'
    error for that range, and a range whose indices are in range packs whatever lies beyond it."""
    elems, width = 24, 4
    fields = np.random.default_rng(3).integers(0, 16, 10 * elems + 7, dtype=np.uint8)
    header = {**HEADER, "elems": elems, "width": width}
    packer = IndexPacker(header, width, elems, fields.size)
    assert packer.rows == 11
    for start, stop in [(4, 11), (0, 1), (1, 4), (2, 2)]:
        packer.pack(fields, start, stop)
    assert np.array_equal(packer.packets, index_packets(header, fields, width, elems))
    bad = fields.copy()
    bad[5 * elems + 1] = 16
    with pytest.raises(ValueError) as want:
        index_packets(header, bad, width, elems)
    with pytest.raises(ValueError) as got:
        packer.pack(bad, 5, 6)
    assert str(got.value) == str(want.value)
    packer.pack(bad, 0, 5)  # the bad index lies beyond these rows
    assert np.array_equal(packer.packets[:5], index_packets(header, fields, width, elems)[:5])
