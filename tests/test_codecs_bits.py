"""Wire helpers of worker_lib.codecs: fixed-width packing and float32 header fields."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_lib.codecs.bits import float_bytes, read_floats, width_for
from worker_lib.thc.quantize import pack_indices
from worker_lib.wire.bits import pack_bits, pack_padded_rows, unpack_bits


def reference_pack(values: list[int], width: int) -> bytes:
    """Pure-Python MSB-first bit string, for comparison."""
    bits = "".join(format(v, f"0{width}b") for v in values)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i: i + 8], 2) for i in range(0, len(bits), 8))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 32).flatmap(
    lambda w: st.tuples(st.just(w), st.lists(st.integers(0, (1 << w) - 1), max_size=40))))
def test_pack_matches_bit_string_and_round_trips(case: tuple[int, list[int]]) -> None:
    width, values = case
    packed = pack_bits(np.array(values, dtype=np.int64), width)
    assert packed.tobytes() == reference_pack(values, width)
    assert packed.size == math.ceil(len(values) * width / 8)
    assert unpack_bits(packed, width, len(values)).tolist() == values


@pytest.mark.parametrize("width", [1, 2, 4])
def test_packets_of_whole_bytes_pack_row_by_row(width: int) -> None:
    """A (packets, K) array of 1-, 2- or 4-bit fields with K a multiple of 8 (the compiled pass over the
    flat array) packs each row as the bit string of that row alone."""
    rng = np.random.default_rng(width)
    rows = rng.integers(0, 1 << width, (5, 48), dtype=np.uint8)
    packed = pack_bits(rows, width)
    assert packed.shape == (5, 48 * width // 8)
    for row, got in zip(rows, packed, strict=True):
        assert got.tobytes() == reference_pack(row.tolist(), width)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([1, 3, 8, 12, 24, 1440]), st.integers(1, 5),
       st.data())
def test_padded_rows_pack_each_row_as_its_own_bit_string(width: int, count: int, rows: int, data) -> None:
    """``pack_padded_rows`` (the transport's packets of indices) gives every row the bit string of its own
    fields, the fields past the input zero, whether the rows are whole bytes (the straight pass) or not."""
    size = data.draw(st.integers(0, rows * count))
    rng = np.random.default_rng(size * 7 + width)
    fields = rng.integers(0, 1 << width, size, dtype=np.uint8)
    packed = pack_padded_rows(fields, width, rows, count)
    full = np.zeros(rows * count, np.int64)
    full[:size] = fields
    assert packed.shape == (rows, math.ceil(count * width / 8))
    for r in range(rows):
        assert packed[r].tobytes() == reference_pack(full[r * count:(r + 1) * count].tolist(), width)


def test_padded_rows_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="outside"):
        pack_padded_rows(np.array([1, 16], np.uint8), 4, 1, 8)
    with pytest.raises(ValueError, match="outside"):  # not wrapped to 0 by a cast to uint8
        pack_padded_rows(np.array([1, 256]), 4, 1, 8)
    with pytest.raises(ValueError, match="do not fit"):
        pack_padded_rows(np.zeros(9, np.uint8), 4, 1, 8)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8])
def test_pack_agrees_with_thc_index_packing(bits: int) -> None:
    z = torch.randint(0, 1 << bits, (64,), dtype=torch.uint8)
    assert pack_bits(z.numpy(), bits).tobytes() == pack_indices(z, bits).numpy().tobytes()


def test_width_for() -> None:
    assert [width_for(v) for v in (0, 1, 2, 3, 4, 60, 240, 255, 256)] == [1, 1, 2, 2, 3, 6, 8, 8, 9]


def test_pack_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        pack_bits(np.array([4]), 2)
    with pytest.raises(ValueError, match="width"):
        pack_bits(np.array([1]), 33)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(np.zeros(1, dtype=np.uint8), 3, 3)


def test_float_header_is_big_endian_ieee() -> None:
    assert float_bytes(1.0, -2.0).tobytes() == bytes([0x3F, 0x80, 0, 0, 0xC0, 0, 0, 0])
    assert read_floats(float_bytes(0.5, 3.25), 2) == [0.5, 3.25]
