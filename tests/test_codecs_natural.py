"""Natural compression (papers/intml-natural-compression.txt): the 2.5 example, unbiasedness, wire bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker_lib.codecs import Message, NaturalCompression, NaturalConfig, RoundContext


def round_trip(codec: NaturalCompression, x: torch.Tensor) -> torch.Tensor:
    ctx = RoundContext(length=x.numel())
    msg = codec.encode(x, ctx)
    assert msg.bits == 8 * x.numel() and msg.nbytes == x.numel()
    return codec.decode_one(msg, ctx)


def test_paper_example_2_5() -> None:
    n = 200_000
    got = round_trip(NaturalCompression(seed=7), torch.full((n,), 2.5)).numpy()
    assert set(np.unique(got).tolist()) == {2.0, 4.0}
    frac_two = float((got == 2.0).mean())
    assert abs(frac_two - 0.75) < 5 * math.sqrt(0.75 * 0.25 / n)


def test_unbiased_including_negative_and_tiny_values() -> None:
    values = [2.5, -0.3, 1e-3, -7.0, 1.0, 3e-16, -5e-17, 1000.0]  # 3e-16, 5e-17 are below 2^-50
    per = 40_000
    x = torch.tensor(np.repeat(np.array(values, dtype=np.float32), per))
    got = round_trip(NaturalCompression(seed=11), x).double().numpy().reshape(len(values), per)
    xv = x.double().numpy().reshape(len(values), per)[:, 0]
    for v, row in zip(xv, got, strict=True):
        t = abs(v)
        if t < 2.0 ** -50:
            lo, hi = 0.0, 2.0 ** -50
        else:
            lo = 2.0 ** math.floor(math.log2(t))
            hi = 2 * lo
        var = (t - lo) * (hi - t)
        tol = 5 * math.sqrt(var / per) + 1e-12 * t
        assert abs(row.mean() - v) <= tol, (v, row.mean(), tol)
        assert set(np.abs(row).tolist()) <= {lo, hi}


def test_wire_bytes() -> None:
    codec = NaturalCompression(NaturalConfig(rounding="nearest"))
    x = torch.tensor([2.0, -4.0, 0.0, 1.0, 2.0 ** -50, 2.0 ** 10, -0.5])
    msg = codec.encode(x, RoundContext(length=7))
    # bit 7 sign, bit 6 zero flag, bits 5..0 exponent + 50
    assert msg.payload.tolist() == [51, 0x80 | 52, 0x40, 50, 0, 60, 0x80 | 49]
    torch.testing.assert_close(codec.decode_one(msg, RoundContext(length=7)), x)


def test_deterministic_variant_rounds_to_nearest_power() -> None:
    codec = NaturalCompression(NaturalConfig(rounding="nearest"))
    x = torch.tensor([2.5, 2.9, 3.0, 3.5, -1.4, -1.6, 0.7, 1e-30])
    got = round_trip(codec, x)
    torch.testing.assert_close(got, torch.tensor([2.0, 2.0, 4.0, 4.0, -1.0, -2.0, 0.5, 0.0]))
    assert torch.equal(got, round_trip(codec, x))


def test_exponents_clipped_to_the_format() -> None:
    got = round_trip(NaturalCompression(seed=1), torch.tensor([5000.0, -3000.0]))
    torch.testing.assert_close(got, torch.tensor([1024.0, -1024.0]))


def test_corrupt_exponent_refused() -> None:
    codec = NaturalCompression()
    with pytest.raises(ValueError, match="exponent"):
        codec.decode_one(Message(np.array([61], dtype=np.uint8), 8), RoundContext(length=1))
    with pytest.raises(ValueError, match="bits"):
        codec.decode_one(Message(np.array([1, 2], dtype=np.uint8), 16), RoundContext(length=3))


def test_bad_rounding() -> None:
    with pytest.raises(ValueError, match="rounding"):
        NaturalConfig(rounding="up")  # type: ignore[arg-type]
