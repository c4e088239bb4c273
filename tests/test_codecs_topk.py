"""TopK sparsification: exact selection, wire size, error feedback, re-sparsified downlink."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker_lib.codecs import CodecKind, CodecState, RoundContext, TopK, TopKConfig


def distinct_magnitudes(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.permutation(d) + 1).astype(np.float32) * rng.choice([-1.0, 1.0], d).astype(np.float32)


@pytest.mark.parametrize(("d", "percent", "k"), [(1000, 10.0, 100), (1001, 10.0, 101), (7, 50.0, 4),
                                                 (5, 1.0, 1), (64, 100.0, 64)])
def test_keeps_exactly_the_largest_magnitudes(d: int, percent: float, k: int) -> None:
    x = distinct_magnitudes(d, seed=d)
    codec = TopK(TopKConfig(percent=percent))
    ctx = RoundContext(length=d)
    msg = codec.encode(torch.from_numpy(x), ctx)
    assert msg.bits == 64 * k and msg.nbytes == 8 * k  # uint32 index + float32 value per kept entry
    expected = np.zeros_like(x)
    top = np.argsort(-np.abs(x))[:k]
    expected[top] = x[top]
    np.testing.assert_array_equal(codec.decode_one(msg, ctx).numpy(), expected)


def test_downlink_is_topk_of_the_average_of_the_decoded_uplinks() -> None:
    d, n = 500, 3
    codec = TopK()
    xs = [distinct_magnitudes(d, seed=s) for s in range(n)]
    ctx = RoundContext(length=d, workers=n)
    msgs = [codec.encode(torch.from_numpy(x), ctx) for x in xs]
    sparse = []
    for x in xs:  # independent oracle: numpy top-50 of each worker
        y = np.zeros(d, dtype=np.float64)
        top = np.argsort(-np.abs(x))[:50]
        y[top] = x[top]
        sparse.append(y)
    avg = np.mean(sparse, axis=0)
    expected = np.zeros(d)
    top = np.argsort(-np.abs(avg), kind="stable")[:50]
    expected[top] = avg[top]
    got = codec.decode_result(codec.aggregate(msgs, ctx), ctx).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert codec.kind is CodecKind.DAR


def test_error_feedback_telescopes() -> None:
    d = 300
    codec = TopK(TopKConfig(percent=5.0, error_feedback=True))
    state = CodecState()
    ctx = RoundContext(length=d)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(d).astype(np.float32) for _ in range(6)]
    sent = sum(codec.decode_one(codec.encode(torch.from_numpy(x), ctx, state), ctx).double() for x in inputs)
    np.testing.assert_allclose(sent.numpy() + state.error.double().numpy(), np.sum(inputs, axis=0), atol=1e-4)


def test_error_feedback_off_by_default_leaves_state_alone() -> None:
    state = CodecState()
    TopK().encode(torch.ones(10), RoundContext(length=10), state)
    assert state.error is None


@pytest.mark.parametrize("percent", [0, -5, 100.5, float("nan")])
def test_bad_percent(percent: float) -> None:
    with pytest.raises(ValueError, match="percent"):
        TopKConfig(percent=percent)


def test_kept_count_rounds_up() -> None:
    kept = [TopKConfig(percent=10).kept(d) for d in (1, 9, 10, 11, 1 << 20)]
    assert kept == [1, 1, 1, 2, math.ceil(0.1 * (1 << 20))]
