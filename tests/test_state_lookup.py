"""The aggregator's whole-byte table lookup gives the values of the unpacked indices, for every b
that divides 8 and for tables whose values need 8, 16 or 32 bits."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.engine import _byte_lut, _value_dtype
from worker_lib.wire import pack_bits


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("top", [3, 255, 256, 65535, 65536, 2**31 - 1])
def test_byte_lut_matches_unpacked_lookup(bits: int, top: int) -> None:
    rng = np.random.default_rng(bits * 7 + top)
    values = np.sort(rng.integers(0, top + 1, 1 << bits)).astype(np.int64)
    values[-1] = top
    idx = rng.integers(0, 1 << bits, (5, 64)).astype(np.uint8)
    packed = pack_bits(idx, bits)
    vdt = _value_dtype(values)
    assert vdt.itemsize == (1 if top < 256 else 2 if top < 65536 else 4)
    got = _byte_lut(values, bits)[packed.astype(np.intp)].view(vdt).reshape(idx.shape)
    assert np.array_equal(got.astype(np.int64), values[idx])


def test_byte_lut_is_none_when_b_does_not_divide_8() -> None:
    assert _byte_lut(np.arange(8), 3) is None
