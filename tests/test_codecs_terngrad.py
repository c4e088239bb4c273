"""TernGrad (papers/terngrad.txt): clipping, scalar sharing, unbiasedness, 2-bit levels, integer sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker_lib.codecs import CodecKind, Message, RoundContext, TernGrad, TernGradConfig


def structured_gradient() -> tuple[np.ndarray, list[float]]:
    """Many copies of a few values plus 20 outliers that clipping at 2.5 sigma must cut."""
    values = [0.2, -0.5, 1.0, -0.05]
    x = np.repeat(np.array(values, dtype=np.float32), 50_000)
    x = np.concatenate([x, np.full(20, 40.0, dtype=np.float32)])
    return x, values


def run_round(codec: TernGrad, xs: list[torch.Tensor]) -> tuple[torch.Tensor, RoundContext, list]:
    ctx = RoundContext(length=xs[0].numel(), workers=len(xs))
    ctx = RoundContext(length=ctx.length, workers=len(xs),
                       shared=codec.combine_prelim([codec.prelim(x) for x in xs]))
    msgs = [codec.encode(x, ctx) for x in xs]
    return codec.decode_result(codec.aggregate(msgs, ctx), ctx), ctx, msgs


def test_unbiased_with_respect_to_the_clipped_gradient() -> None:
    x, values = structured_gradient()
    bound = 2.5 * float(np.std(x.astype(np.float64)))  # population std about the mean (Eq. 21)
    assert bound < 40.0  # the outliers are clipped
    codec = TernGrad(seed=1)
    n = 2
    est, ctx, _ = run_round(codec, [torch.from_numpy(x)] * n)
    s = ctx.shared
    assert s == pytest.approx(bound, rel=1e-5)  # max |clipped| is the bound itself
    est = est.numpy().astype(np.float64)
    for i, v in enumerate(values):
        group = est[i * 50_000: (i + 1) * 50_000]
        var = (s * abs(v) - v * v) / n  # Bernoulli(|v|/s) scaled by s, averaged over n workers
        tol = 5 * math.sqrt(var / group.size)
        assert abs(group.mean() - v) < tol, (v, group.mean(), tol)
    # the clipped outliers are quantized with probability |f(g)|/s = 1: exactly s, not 40
    np.testing.assert_allclose(est[-20:], bound, rtol=1e-5)


def test_levels_are_ternary_times_shared_scalar() -> None:
    x = torch.randn(5000)
    codec = TernGrad(TernGradConfig(clip=None), seed=2)
    est, ctx, _ = run_round(codec, [x])
    s = ctx.shared
    assert s == pytest.approx(float(x.abs().max()))
    levels = np.unique(np.round(est.numpy() / s, 5))
    assert set(levels.tolist()) <= {-1.0, 0.0, 1.0}
    # the sign never flips
    assert bool(((est * x) >= 0).all())


def test_scalar_sharing_takes_the_maximum_and_refuses_a_smaller_scalar() -> None:
    codec = TernGrad(TernGradConfig(clip=None), seed=0)
    a, b = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([0.25, 2.0, -0.5])
    assert codec.combine_prelim([codec.prelim(a), codec.prelim(b)]) == 3.0
    with pytest.raises(ValueError, match="shared scalar"):
        codec.encode(a, RoundContext(length=3, shared=2.0))
    with pytest.raises(ValueError, match="shared"):
        codec.encode(a, RoundContext(length=3))


@pytest.mark.parametrize(("n", "width"), [(1, 2), (2, 3), (4, 4), (8, 5), (16, 6)])
def test_bits_on_the_wire(n: int, width: int) -> None:
    d = 1001
    codec = TernGrad(seed=3)
    xs = [torch.randn(d) for _ in range(n)]
    _, ctx, msgs = run_round(codec, xs)
    for m in msgs:
        assert m.bits == 2 * d and m.nbytes == math.ceil(2 * d / 8)
    down = codec.aggregate(msgs, ctx)
    assert down.bits == width * d  # 2n + 1 levels need ceil(log2(2n + 1)) bits
    assert down.nbytes == math.ceil(width * d / 8)
    assert codec.prelim_bits == 32 and codec.kind is CodecKind.HOMOMORPHIC


def test_integer_aggregation_is_the_sum_of_levels() -> None:
    d, n = 777, 5
    codec = TernGrad(seed=4)
    xs = [torch.randn(d) for _ in range(n)]
    est, ctx, msgs = run_round(codec, xs)
    singles = torch.stack([codec.decode_one(m, ctx) for m in msgs]).mean(dim=0)
    torch.testing.assert_close(est, singles, rtol=1e-5, atol=1e-6)
    sums = codec.aggregate_integers(msgs, ctx)
    assert sums.min() >= 0 and sums.max() <= 2 * n
    levels = [np.rint(codec.decode_one(m, ctx).double().numpy() / ctx.shared) for m in msgs]
    np.testing.assert_array_equal(sums, sum(lv + 1 for lv in levels))


def test_zero_gradient() -> None:
    codec = TernGrad(seed=5)
    est, ctx, _ = run_round(codec, [torch.zeros(10)] * 3)
    assert ctx.shared == 0.0 and bool((est == 0).all())


@pytest.mark.parametrize("clip", [0, -1.0, float("nan"), float("inf"), "2"])
def test_bad_clip(clip: object) -> None:
    with pytest.raises(ValueError, match="clip"):
        TernGradConfig(clip=clip)  # type: ignore[arg-type]


def test_clipping_uses_population_standard_deviation() -> None:
    x = np.array([0.1, -0.2, 0.3, 0.0, -0.1, 0.2, -0.3, 5.0], dtype=np.float32)
    bound = 2.5 * float(np.std(x.astype(np.float64)))  # ddof = 0: 1.68..., the outlier 5.0 is cut
    assert bound < 5.0
    codec = TernGrad()
    assert codec.prelim(torch.from_numpy(x)) == pytest.approx(bound, rel=1e-6)
    clipped = codec.clipped(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(clipped, np.clip(x, -bound, bound), rtol=1e-6)


def test_invalid_two_bit_index_refused() -> None:
    codec = TernGrad()
    ctx = RoundContext(length=4, shared=1.0)
    bad = Message(np.array([0b11000000], dtype=np.uint8), 8)  # index 3 is not a level
    with pytest.raises(ValueError, match="outside the table"):
        codec.decode_one(bad, ctx)
    with pytest.raises(ValueError, match="outside the table"):
        codec.aggregate([bad], ctx)


def test_constant_tensor_is_not_clipped_to_zero() -> None:
    codec = TernGrad(seed=6)
    x = torch.full((1000,), -0.5)
    est, ctx, _ = run_round(codec, [x, x])
    assert ctx.shared == 0.5
    torch.testing.assert_close(est, x)  # |g| / s = 1: every level is exactly -1
