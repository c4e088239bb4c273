"""3LC (papers/3lc.txt): quantization, quartic and zero-run encodings, 280x on zeros, error accumulation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_lib.codecs import CodecState, Message, RoundContext, ThreeLC, ThreeLCConfig
from worker_lib.codecs.threelc import quartic_decode, quartic_encode, zero_run_decode, zero_run_encode


def test_quartic_worked_examples() -> None:
    # five values form one byte: a*81 + b*27 + c*9 + d*3 + e of the values plus one
    assert quartic_encode(np.array([-1, 0, 1, 1, 0])).tolist() == [0 * 81 + 1 * 27 + 2 * 9 + 2 * 3 + 1]
    assert quartic_encode(np.zeros(5, dtype=np.int8)).tolist() == [121]
    assert quartic_encode(np.ones(5, dtype=np.int8)).tolist() == [242]
    # ten values: five contiguous partitions of two; byte j takes element j of each partition
    v = np.array([1, -1, 0, 0, -1, 1, 1, 1, 0, -1])
    assert quartic_encode(v).tolist() == [2 * 81 + 1 * 27 + 0 * 9 + 2 * 3 + 1,
                                          0 * 81 + 1 * 27 + 2 * 9 + 2 * 3 + 0]
    # padding (to a multiple of 5) is the zero level
    assert quartic_encode(np.array([1])).tolist() == [2 * 81 + 27 + 9 + 3 + 1]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([-1, 0, 1]), min_size=0, max_size=60))
def test_quartic_round_trip(values: list[int]) -> None:
    codes = quartic_encode(np.array(values, dtype=np.int8))
    assert codes.size == -(-len(values) // 5) and (codes.size == 0 or codes.max() <= 242)
    assert quartic_decode(codes, len(values)).tolist() == values


@pytest.mark.parametrize(("k", "expected"), [
    (1, [121]), (2, [243]), (3, [244]), (14, [255]), (15, [255, 121]), (16, [255, 243]),
    (28, [255, 255]), (29, [255, 255, 121]), (30, [255, 255, 243])])
def test_zero_run_worked_examples(k: int, expected: list[int]) -> None:
    assert zero_run_encode(np.full(k, 121, dtype=np.uint8)).tolist() == expected
    assert zero_run_encode(np.array([7] + [121] * k + [242], dtype=np.uint8)).tolist() == [7, *expected, 242]


@settings(max_examples=120, deadline=None)
@given(st.lists(st.one_of(st.just(121), st.integers(0, 242)), max_size=200))
def test_zero_run_round_trip(codes: list[int]) -> None:
    b = np.array(codes, dtype=np.uint8)
    out = zero_run_encode(b)
    assert zero_run_decode(out).tolist() == codes
    assert out.size <= b.size
    # greedy: no two adjacent zero groups remain
    s = out.tolist()
    assert not any(a == 121 and c == 121 for a, c in itertools.pairwise(s))


def test_all_zero_tensor_reaches_280x() -> None:
    d = 70 * 10_000
    codec = ThreeLC()
    msg = codec.encode(torch.zeros(d), RoundContext(length=d))
    payload_bytes = msg.nbytes - 4  # the float32 M aside
    assert payload_bytes == 10_000
    assert 32 * d / (8 * payload_bytes) == 280.0
    assert 32 * d / msg.bits >= 279
    assert bool((codec.decode_one(msg, RoundContext(length=d)) == 0).all())


def test_quantization_worked_example() -> None:
    t = torch.tensor([1.0, 0.4, -0.6, 0.2, -1.0, 0.55])
    ctx = RoundContext(length=6)
    got = ThreeLC().decode_one(ThreeLC().encode(t, ctx), ctx)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, -1.0, 0.0, -1.0, 1.0]))
    # s = 1.5: M = 1.5 and only |T| > M / 2 = 0.75 survive, dequantized to +-1.5
    codec = ThreeLC(ThreeLCConfig(sparsity=1.5))
    got = codec.decode_one(codec.encode(t, ctx), ctx)
    torch.testing.assert_close(got, torch.tensor([1.5, 0.0, 0.0, 0.0, -1.5, 0.0]))


@pytest.mark.parametrize("s", [1.0, 1.5, 1.9])
def test_decoded_is_m_times_round_and_error_bounded(s: float) -> None:
    x = np.random.default_rng(1).standard_normal(12_345).astype(np.float32)
    big_m = float(np.abs(x).max()) * s
    expected = big_m * np.round(x.astype(np.float64) / big_m)  # numpy rounds half to even too
    codec = ThreeLC(ThreeLCConfig(sparsity=s))
    ctx = RoundContext(length=x.size)
    msg = codec.encode(torch.from_numpy(x), ctx)
    got = codec.decode_one(msg, ctx).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.abs(got - x).max() <= big_m / 2 * (1 + 1e-6)
    assert msg.bits == 8 * msg.nbytes


def test_error_accumulation_telescopes() -> None:
    d = 1000
    codec = ThreeLC()
    state = CodecState()
    ctx = RoundContext(length=d)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(d).astype(np.float32) for _ in range(8)]
    sent = sum(codec.decode_one(codec.encode(torch.from_numpy(x), ctx, state), ctx).double() for x in inputs)
    np.testing.assert_allclose(sent.numpy() + state.error.double().numpy(), np.sum(inputs, axis=0), atol=1e-4)


def test_without_zero_run_encoding_the_size_is_fixed() -> None:
    d = 1003
    codec = ThreeLC(ThreeLCConfig(zero_run=False))
    msg = codec.encode(torch.zeros(d), RoundContext(length=d))
    assert msg.bits == 32 + 8 * (-(-d // 5))  # 1.6 bits per value plus M


@pytest.mark.parametrize("s", [0.99, 2.0, 2.5, float("nan")])
def test_bad_sparsity(s: float) -> None:
    with pytest.raises(ValueError, match="sparsity"):
        ThreeLCConfig(sparsity=s)


def test_corrupt_stream_is_refused() -> None:
    codec = ThreeLC()
    ctx = RoundContext(length=100)
    msg = codec.encode(torch.randn(100), ctx)
    with pytest.raises(ValueError):
        codec.decode_one(Message(msg.payload[:-1].copy(), msg.bits - 8), ctx)


def test_server_error_accumulation_on_the_downlink() -> None:
    """The pull direction keeps its own buffer: what workers receive plus its residual is the average."""
    d, n = 400, 3
    codec = ThreeLC()
    rng = np.random.default_rng(4)
    worker_states = [CodecState() for _ in range(n)]
    server = CodecState()
    ctx = RoundContext(length=d, workers=n)
    received = np.zeros(d)
    pushed = np.zeros(d)
    for _ in range(5):
        xs = [torch.from_numpy(rng.standard_normal(d).astype(np.float32)) for _ in range(n)]
        ups = [codec.encode(x, ctx, s) for x, s in zip(xs, worker_states, strict=True)]
        pushed += np.mean([codec.decode_one(m, ctx).double().numpy() for m in ups], axis=0)
        received += codec.decode_result(codec.aggregate(ups, ctx, server), ctx).double().numpy()
    np.testing.assert_allclose(received + server.error.double().numpy(), pushed, atol=1e-4)
