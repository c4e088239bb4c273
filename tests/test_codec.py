"""THC end to end in one process: homomorphism, unbiasedness, partial aggregation, error feedback."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_lib.thc import (
    SignKey,
    THCCodec,
    THCConfig,
    THCWorker,
    table_decode,
    table_encode,
    uniform_encode,
    uniform_table,
)
from worker_lib.thc.hadamard import RandomizedHadamard
from worker_lib.thc.quantize import UniformSource


def own_values_f64(worker: THCWorker, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """X_i by its definition, in float64 on the CPU: -M + T[index] * 2M / g (M = ``scale``)."""
    values = torch.tensor(worker.codec.table.values, dtype=torch.float64)[indices.cpu().long()]
    return -scale + values * 2 * scale / worker.config.granularity


def run_round(xs, config, key, seeds, codec_count=None):
    codecs = [THCCodec(config, seed=s) for s in seeds]
    norm = max(float(x.norm()) for x in xs)
    encs = [c.encode(x, norm, key) for c, x in zip(codecs, xs, strict=True)]
    return codecs, encs


@given(d=st.integers(1, 700), n=st.integers(1, 6), bits=st.integers(1, 6), extra=st.integers(0, 40),
       seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_homomorphism(d, n, bits, extra, seed):
    """(1/n) sum D(T(C(x_i))) == D((1/n) sum T(C(x_i))): decoding the sum equals averaging the decodes."""
    config = THCConfig(bits=bits, granularity=(1 << bits) - 1 + extra, p=1 / 32, error_feedback=False)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(d, generator=gen) * (i + 1) for i in range(n)]
    key = SignKey.derive(seed, 0, 0)
    codecs, encs = run_round(xs, config, key, range(seed, seed + n))
    c = codecs[0]
    together = c.decode(c.aggregate([e.indices for e in encs]), n, encs[0].scale, d, key)
    separately = [c.decode(c.aggregate([e.indices]), 1, e.scale, d, key) for e in encs]
    avg = torch.stack(separately).mean(0)
    assert torch.allclose(together, avg, atol=1e-5 * (1 + float(avg.abs().max())))


def test_unbiased_with_respect_to_the_clamped_rotation():
    d, trials = 300, 3000
    config = THCConfig(bits=2, granularity=7, p=0.2, error_feedback=False)  # clamps noticeably
    x = torch.randn(d, generator=torch.Generator().manual_seed(3)).double()
    key = SignKey.derive(5, 0, 0)
    codec = THCCodec(config, seed=11)
    norm = float(x.norm())
    rht = RandomizedHadamard(d, key, dtype=torch.float64)
    big_m = config.t_p * norm / math.sqrt(rht.padded)
    target = rht.inverse(rht.forward(x).clamp(-big_m, big_m))
    acc = torch.zeros(d, dtype=torch.float64)
    for _ in range(trials):
        enc = codec.encode(x.float(), norm, key)
        acc += codec.decode(codec.aggregate([enc.indices]), 1, enc.scale, d, key).double()
    # a rotated coordinate's rounding variance is at most w^2 / 4, w the widest table segment; each
    # output coordinate of the orthonormal inverse averages those independent variances
    values = codec.table.values
    widest = max(b - a for a, b in itertools.pairwise(values)) * 2 * big_m / config.granularity
    sigma = widest / 2 / math.sqrt(trials)
    assert float((acc / trials - target).abs().max()) < 6 * sigma
    assert float((target - x).norm()) > 0.01 * float(x.norm())  # the test does exercise clamping


def test_partial_aggregation_divides_by_the_count_that_arrived():
    d, key = 1000, SignKey.derive(1, 2, 3)
    config = THCConfig(error_feedback=False)
    xs = [torch.randn(d) for _ in range(4)]
    codecs, encs = run_round(xs, config, key, range(4))
    c = codecs[0]
    three = c.decode(c.aggregate([e.indices for e in encs[:3]]), 3, encs[0].scale, d, key)
    each = [c.decode(c.aggregate([e.indices]), 1, e.scale, d, key) for e in encs[:3]]
    assert torch.allclose(three, torch.stack(each).mean(0), atol=1e-5)


def test_error_feedback_telescopes():
    """With one worker, the sum of decoded updates plus the final error equals the sum of gradients."""
    d, steps = 2000, 6
    w = THCWorker(THCConfig(bits=2, granularity=3, p=0.05), job=9, worker=0, seed=4)
    gen = torch.Generator().manual_seed(0)
    total_grad = torch.zeros(d, dtype=torch.float64)
    total_est = torch.zeros(d, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(d, generator=gen)
        total_grad += g.double()
        norm = w.begin(g, tensor=0, step=step)
        enc = w.compress(0, norm)
        total_est += w.finish(0, w.codec.aggregate([enc.indices]), 1).double()
    err = w.error(0).double()
    assert torch.allclose(total_est + err, total_grad, atol=1e-3)
    assert float(err.norm()) > 0  # 2-bit quantization does leave an error to carry


def test_error_feedback_matches_its_definition():
    d = 500
    w = THCWorker(THCConfig(), job=1, seed=2)
    g = torch.randn(d)
    norm = w.begin(g, 0, 0)
    enc = w.compress(0, norm * 1.5)
    indices = enc.indices.clone()
    w.finish(0, w.codec.aggregate([indices]), 1)
    key = SignKey.derive(1, 0, 0)
    rht = RandomizedHadamard(d, key, dtype=torch.float64)
    values = torch.tensor(w.codec.table.values, dtype=torch.float64)[indices.long()]
    x_i = -enc.scale + values * 2 * enc.scale / w.config.granularity
    assert torch.allclose(w.error(0).double(), g.double() - rht.inverse(x_i), atol=1e-5)
    # the next step starts from gradient + error
    g2 = torch.randn(d)
    assert math.isclose(w.begin(g2, 0, 1), float((g2 + w.error(0)).norm()), rel_tol=1e-5)


def test_residual_is_the_error_of_its_definition():
    """THCWorker.residual (for callers that keep error feedback themselves) is x - RHT^-1(X_i), computed
    independently in float64, and leaves the step's decoding intact."""
    d = 777
    w = THCWorker(THCConfig(error_feedback=False), job=2, seed=5)
    g = torch.randn(d)
    with pytest.raises(RuntimeError, match="compress"):
        w.begin(g, 0, 4)
        w.residual(0, g, out=torch.empty(d))
    enc = w.compress(0, w.begin(g, 0, 4))
    indices = enc.indices.clone()
    res = w.residual(0, g, out=torch.empty(d))
    rht = RandomizedHadamard(d, SignKey.derive(2, 0, 4), dtype=torch.float64)
    x_i = own_values_f64(w, indices, enc.scale)
    assert torch.allclose(res.double(), g.double() - rht.inverse(x_i), atol=1e-5)
    decoded = w.finish(0, w.codec.aggregate([indices]), 1)
    assert torch.allclose(decoded.double(), rht.inverse(x_i), atol=1e-5)


def test_residual_taken_twice_or_after_a_second_compress_is_still_its_definition():
    """``compress`` leaves the residual x_rot - X_i in the rotation's buffer for ``residual`` to rotate
    back, which consumes it. A second quantization of the step quantizes x_rot, not that residual: its
    indices are those of a worker that keeps no error (same seed, same uniforms). The error, taken from
    the buffer or (a second time) from the indices again, is x - RHT^-1(X_i) of the indices sent last
    (float64 definition), and the two ways agree to float32 rounding."""
    d = 1500
    g, e = torch.randn(d, generator=torch.Generator().manual_seed(76)), torch.full((d,), 0.01)
    config = THCConfig(error_feedback=False)
    keeper, plain = THCWorker(config, job=3, seed=6), THCWorker(config, job=3, seed=6)
    n = keeper.begin(g, 0, 2, error=e)
    assert plain.begin(g + e, 0, 2) == pytest.approx(n, rel=1e-6)
    assert torch.equal(keeper.compress(0, n).indices, plain.compress(0, n).indices)
    enc = keeper.compress(0, 2 * n)  # again, at another scale
    assert torch.equal(enc.indices, plain.compress(0, 2 * n).indices)
    indices = enc.indices.clone()
    first = keeper.residual(0, out=torch.empty(d))  # from the buffer
    second = keeper.residual(0, out=torch.empty(d))  # the buffer is consumed: from the indices
    rht = RandomizedHadamard(d, SignKey.derive(3, 0, 2), dtype=torch.float64)
    x_i = own_values_f64(keeper, indices, enc.scale)
    # float32 rounding of the 2048-point inverse transform: each of its 11 levels may round its first output
    # (the sum of all inputs over sqrt(D)) by 2^-24 of the inputs' magnitudes. A fixed 1e-5 failed there for 2 %
    # of random gradients (up to 1.4e-5, this seed's 1.2e-5; 0.71 of this bound at most in 300 draws).
    tol = 1e-6 + 11 * 2.0 ** -24 * float(x_i.abs().sum()) / math.sqrt(rht.padded)
    for res in (first, second):
        assert torch.allclose(res.double(), (g + e).double() - rht.inverse(x_i), atol=tol)
    assert torch.allclose(first, second, rtol=0, atol=1e-6)
    decoded = keeper.finish(0, keeper.codec.aggregate([indices]), 1)
    assert torch.allclose(decoded.double(), rht.inverse(x_i), atol=1e-5)


def test_a_step_whose_error_was_overwritten_cannot_be_quantized_again():
    """With a caller's error feedback ``begin`` does not keep x = gradient + error: a second quantization makes
    it from the caller's two tensors (the same indices as a worker given x itself). Once ``residual`` has
    written into the error passed to ``begin`` (as the DDP hook does), x is gone: quantizing again, or a
    residual that needs x, raises a clear error instead of using the new error; ``begin`` starts again."""
    d = 1500
    g = torch.randn(d, generator=torch.Generator().manual_seed(77))
    e = torch.full((d,), 0.01)
    config = THCConfig(error_feedback=False)
    keeper, plain = THCWorker(config, job=3, seed=6), THCWorker(config, job=3, seed=6)
    n = keeper.begin(g, 0, 2, error=e)
    plain.begin(g + e, 0, 2)
    assert torch.equal(keeper.compress(0, n).indices, plain.compress(0, n).indices)
    keeper.residual(0, out=e)  # the caller's error becomes the next step's
    assert not torch.equal(e, torch.full((d,), 0.01))
    with pytest.raises(RuntimeError, match=r"residual\(\) has overwritten the error feedback passed to begin"):
        keeper.compress(0, 2 * n)
    with pytest.raises(RuntimeError, match="call begin"):
        keeper.residual(0, out=torch.empty(d))
    n2 = keeper.begin(g, 0, 3, error=e)  # a new step from the new error works
    assert torch.equal(keeper.compress(0, n2).indices, plain.compress(0, plain.begin(g + e, 0, 3)).indices)
    keeper.residual(0, out=torch.empty(d))  # the buffer rotated back, the caller's tensors intact: x is made
    assert torch.equal(keeper.compress(0, 2 * n2).indices, plain.compress(0, 2 * n2).indices)


def steps_of_one_worker(w: THCWorker, d: int, steps: int, seed: int,
                        error: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` steps of tensor 0 through one worker alone (the sums are its own table values) with random
    gradients: the sum of the gradients and the sum of the decoded averages, in float64."""
    gen = torch.Generator().manual_seed(seed)
    total_grad = torch.zeros(d, dtype=torch.float64)
    total_est = torch.zeros(d, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(d, generator=gen)
        total_grad += g.double()
        enc = w.compress(0, w.begin(g, 0, step, error=error))
        total_est += w.finish(0, w.codec.aggregate([enc.indices]), 1).double()
    return total_grad, total_est


@pytest.mark.parametrize("d", [1024, 1000])
def test_fixed_rotation_keeps_its_error_rotated_and_telescopes(d: int) -> None:
    """``rotation="fixed"``: one key for every step, the error feedback kept rotated at the padded length,
    and the telescoping sum of error feedback holds in the original domain (sum of decoded updates plus the
    final error, rotated back, equals the sum of gradients), padding or not."""
    w = THCWorker(THCConfig(bits=2, granularity=3, p=0.05, rotation="fixed"), job=9, seed=4)
    assert w.key(0, 7) == w.key(0, 0) != w.key(1, 0)
    assert THCWorker(THCConfig(), job=9).key(0, 7) != THCWorker(THCConfig(), job=9).key(0, 0)
    total_grad, total_est = steps_of_one_worker(w, d, 6, seed=1)
    rotated = w.error(0)
    assert rotated.shape == (1024,)  # the padded length
    err = w.error_from_rotated(0, rotated, d).double()
    assert torch.allclose(total_est + err, total_grad, atol=1e-3)
    assert float(err.norm()) > 0.1 * math.sqrt(d)  # 2-bit quantization does leave an error to carry
    back = w.error_to_rotated(0, err.float())
    if d == 1024:  # nothing in the padding: rotating back and forth is the identity up to rounding
        assert torch.allclose(back, rotated, atol=1e-5)


def test_fixed_rotation_is_the_same_error_feedback_as_a_constant_key() -> None:
    """Error feedback kept rotated (fixed rotation) is the paper's x - RHT^-1(X_i) under a key that never
    changes: a per-step worker called with step 0 every time uses that key and keeps its error unrotated.
    Same seed, same uniforms: the two decode the same averages, step after step, to float32 rounding."""
    d = 2048  # a power of two: no padding, whose residual only the fixed rotation carries
    fixed = THCWorker(THCConfig(rotation="fixed"), job=5, seed=3)
    plain = THCWorker(THCConfig(), job=5, seed=3)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        g = torch.randn(d, generator=gen)
        n_fixed, n_plain = fixed.begin(g, 0, step), plain.begin(g, 0, 0)
        assert n_fixed == pytest.approx(n_plain, rel=1e-5)
        a = fixed.compress(0, n_fixed).indices.clone()
        b = plain.compress(0, n_plain).indices.clone()
        assert int((a != b).sum()) <= 2  # a uniform within a rounding of its threshold, at most
        avg_fixed = fixed.finish(0, fixed.codec.aggregate([a]), 1)
        avg_plain = plain.finish(0, plain.codec.aggregate([b]), 1)
        assert torch.allclose(avg_fixed, avg_plain, atol=0.05 if (a != b).any() else 1e-5)
    assert torch.allclose(fixed.error_from_rotated(0, fixed.error(0), d), plain.error(0), atol=0.05)


def test_fixed_rotation_with_caller_kept_error() -> None:
    """With the fixed rotation a caller's error is rotated, of the padded length (a length-d one is refused,
    saying so); compress overwrites it with x_rot - X_i, computed independently here in float64, and leaves
    the rotated vector for another compress of the same step; residual() has nothing left to compute; a
    refused finish keeps a worker's own error."""
    d = 1000
    w = THCWorker(THCConfig(error_feedback=False, rotation="fixed"), job=2, seed=5)
    g = torch.randn(d, generator=torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="kept rotated, 1024 coordinates"):
        w.begin(g, 0, 0, error=torch.zeros(d))
    e = torch.full((1024,), 0.01)
    n = w.begin(g, 0, 3, error=e)
    rht = RandomizedHadamard(d, SignKey.derive(2, 0, 0), dtype=torch.float64)
    x_rot = rht.forward(g.double()) + 0.01
    assert n == pytest.approx(float(x_rot.norm()), rel=1e-6)
    enc = w.compress(0, n)
    first = e.clone()
    assert torch.allclose(e.double(), x_rot - own_values_f64(w, enc.indices, enc.scale), atol=1e-5)
    enc = w.compress(0, 2 * n)  # again: from x_rot, not from the residual
    assert torch.allclose(e.double(), x_rot - own_values_f64(w, enc.indices, enc.scale), atol=1e-5)
    assert not torch.equal(e, first)
    assert w.residual(0, out=e) is e
    with pytest.raises(ValueError, match="takes no x"):
        w.residual(0, g, out=e)
    copy = w.residual(0, out=torch.empty(1024))
    assert torch.equal(copy, e)

    own = THCWorker(THCConfig(rotation="fixed"), job=2, seed=5)
    enc = own.compress(0, own.begin(g, 0, 0))
    own.finish(0, own.codec.aggregate([enc.indices]), 1)
    before = own.error(0).clone()
    enc = own.compress(0, own.begin(g, 0, 1))
    with pytest.raises(ValueError, match="sums outside"):
        own.finish(0, own.codec.aggregate([enc.indices]) + 1000, 1)
    assert torch.equal(own.error(0), before)


def test_fixed_rotation_without_the_compiled_passes_telescopes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed rotation's generic path (torch operations: what a GPU runs, and the CPU for an error it
    cannot hand to the compiled passes, here a strided view): the caller's rotated error is added with
    torch, the quantization draws its uniforms with ``fill`` and writes the residual with torch, and the
    telescoping sum of error feedback holds as on the compiled path."""
    d = 1000
    w = THCWorker(THCConfig(error_feedback=False, rotation="fixed"), job=3, seed=6)
    fills = []
    real_fill = w.codec.uniforms.fill
    monkeypatch.setattr(w.codec.uniforms, "fill", lambda out: fills.append(out.numel()) or real_fill(out))
    storage = torch.zeros(2 * 1024)
    error = storage[::2]  # rotated, of the padded length, and not contiguous
    assert not error.is_contiguous()
    total_grad, total_est = steps_of_one_worker(w, d, 5, seed=3, error=error)
    assert fills == [1024] * 5  # every step quantized by the generic path
    err = w.error_from_rotated(0, error.contiguous(), d).double()
    assert float(err.norm()) > 0.01 * math.sqrt(d)  # an error was carried
    assert torch.allclose(total_est + err, total_grad, atol=1e-3)


def test_config_choices_are_checked() -> None:
    """An unknown backend or rotation is refused by name, with the choices (it used to pass as auto)."""
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'fht-cpu', got 'bogus'"):
        THCConfig(backend="bogus")
    with pytest.raises(ValueError, match="rotation must be one of 'per-step', 'fixed', got 'once'"):
        THCConfig(rotation="once")
    # the command lines' --rotation choices (kept free of torch) are the codec's, each accepted
    from typing import get_args

    from worker_lib.cli.args import ROTATIONS
    from worker_lib.thc.codec import Rotation

    assert ROTATIONS == get_args(Rotation)
    assert all(THCConfig(rotation=r).rotation == r for r in ROTATIONS)


def test_workers_share_signs_but_not_randomness():
    x = torch.randn(4096)
    a, b = THCWorker(THCConfig(), job=3, seed=1), THCWorker(THCConfig(), job=3, seed=2)
    na, nb = a.begin(x, 0, 7), b.begin(x, 0, 7)
    ia, ib = a.compress(0, na).indices.clone(), b.compress(0, nb).indices.clone()
    assert 0 < int((ia != ib).sum()) < ia.numel() // 2  # same rotation, different rounding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_round_trip(dtype):
    w = THCWorker(THCConfig(), job=1)
    g = torch.randn(3, 100).to(dtype)
    n = w.begin(g, 0, 0)
    enc = w.compress(0, n)
    out = w.finish(0, w.codec.aggregate([enc.indices]), 1)
    assert out.dtype == dtype and out.shape == g.shape
    assert float((out.double() - g.double()).norm() / g.double().norm()) < 0.5


def test_zero_gradient_decodes_to_zero():
    w = THCWorker(THCConfig(), job=1)
    n = w.begin(torch.zeros(10), 0, 0)
    enc = w.compress(0, n)
    assert torch.equal(w.finish(0, w.codec.aggregate([enc.indices]), 1), torch.zeros(10))


def test_clear_errors():
    w = THCWorker(THCConfig(), job=1)
    with pytest.raises(ValueError, match="empty"):
        w.begin(torch.zeros(0), 0, 0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        w.begin(torch.tensor([1.0, float("nan")]), 0, 0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        w.begin(torch.tensor([1.0, float("inf")]), 0, 0)
    with pytest.raises(TypeError, match="floating-point"):
        w.begin(torch.tensor([1, 2]), 0, 0)
    with pytest.raises(RuntimeError, match="begin"):
        w.compress(5, 1.0)
    n = w.begin(torch.ones(8), 0, 0)
    with pytest.raises(ValueError, match="finite and non-negative"):
        w.compress(0, -1.0)
    with pytest.raises(RuntimeError, match="compress"):
        w.finish(0, torch.zeros(8, dtype=torch.int64), 1)
    enc = w.compress(0, n)
    sums = w.codec.aggregate([enc.indices])
    with pytest.raises(ValueError, match="count must be positive"):
        w.finish(0, sums, 0)
    with pytest.raises(ValueError, match=r"outside \[0, g \* count\]"):
        w.finish(0, sums + 1000, 1)
    with pytest.raises(ValueError, match="expected 8 sums"):
        w.finish(0, sums[:4], 1)
    with pytest.raises(ValueError, match="must be positive"):
        w.finish(0, sums, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="lost mask"):
        w.finish(0, sums, 1, lost=torch.zeros(3, dtype=torch.bool))
    assert w.error(0) is None  # every refused finish left the error feedback as it was
    w.finish(0, sums, 1)
    assert w.error(0) is not None
    with pytest.raises(ValueError, match="granularity"):
        THCConfig(bits=4, granularity=10)
    with pytest.raises(ValueError, match="p must lie"):
        THCConfig(p=1.5)


def test_uniform_and_table_algorithms_are_homomorphic():
    """Algorithms 1 and 2: sum of table values of the indices decodes to the average estimate."""
    xs = [torch.randn(50) for _ in range(3)]
    low, high = min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)
    src = UniformSource(seed=0)
    table = uniform_table(4)
    idx = [uniform_encode(x, low, high, 4, src) for x in xs]
    sums = sum(torch.tensor(table.values)[i.long()] for i in idx)
    avg = table_decode(sums, 3, low, high, table)
    each = [table_decode(torch.tensor(table.values)[i.long()], 1, low, high, table) for i in idx]
    assert torch.allclose(avg, torch.stack(each).mean(0), atol=1e-5)
    # with uniform THC the table is the identity: the sum of indices is the sum of values
    assert torch.equal(sum(i.long() for i in idx), sums)
    table2 = THCConfig(bits=2, granularity=9).table()
    idx2 = table_encode(xs[0], low, high, table2, src)
    est = table_decode(torch.tensor(table2.values)[idx2.long()], 1, low, high, table2)
    assert float((est - xs[0]).abs().max()) <= (high - low) / 9 * 4 + 1e-5  # within the widest segment


def test_per_chunk_counts_and_zero_fill():
    """Chunks may complete with different counts; lost chunks are zero in the rotated domain."""
    d, key, n = 64, SignKey.derive(4, 0, 0), 3
    config = THCConfig(error_feedback=False)
    xs = [torch.randn(d) for _ in range(n)]
    codecs, encs = run_round(xs, config, key, range(n))
    c = codecs[0]
    first = c.aggregate([e.indices[:32] for e in encs])  # chunk 0: all three workers
    second = c.aggregate([e.indices[32:] for e in encs[:2]])  # chunk 1: two of them
    sums = torch.cat([first, second])
    counts = torch.tensor([3] * 32 + [2] * 32)
    est = c.rotated_estimate(sums, counts, encs[0].scale)
    whole3 = c.rotated_estimate(c.aggregate([e.indices for e in encs]), 3, encs[0].scale)
    whole2 = c.rotated_estimate(c.aggregate([e.indices for e in encs[:2]]), 2, encs[0].scale)
    assert torch.allclose(est[:32], whole3[:32], atol=1e-6) and torch.allclose(est[32:], whole2[32:], atol=1e-6)
    lost = torch.zeros(d, dtype=torch.bool)
    lost[32:] = True
    filled = c.rotated_estimate(sums, counts, encs[0].scale, lost=lost)
    assert torch.equal(filled[32:], torch.zeros(32)) and torch.allclose(filled[:32], whole3[:32], atol=1e-6)
    # the full decode is the inverse RHT of exactly that zero-filled rotated estimate
    rht = RandomizedHadamard(d, key)
    dec = c.decode(sums, counts, encs[0].scale, d, key, lost=lost)
    assert torch.allclose(dec, rht.inverse(filled.clone()), atol=1e-5)


def test_sums_as_uint8_decode_as_wide_ones():
    """The transport hands THC's 8-bit results over as uint8: every decoding path (one count, compiled or
    torch; per-coordinate counts; zero-fill) gives what int64 sums of the same values give, bit for bit,
    and a sum above g * count is refused."""
    d, key, n = 100, SignKey.derive(4, 0, 1), 3
    c = THCCodec(THCConfig(error_feedback=False), seed=0)
    g = c.table.granularity
    wide = torch.randint(0, g * n + 1, (128,), dtype=torch.int64, generator=torch.Generator().manual_seed(3))
    small = wide.to(torch.uint8)
    assert torch.equal(small.to(torch.int64), wide)  # the values fit: g * n = 90
    lost = torch.zeros(128, dtype=torch.bool)
    lost[:16] = True
    buf = torch.empty(128)
    for out in (None, buf):  # the torch pass, the compiled pass
        for mask in (None, lost):
            assert torch.equal(c.rotated_estimate(small, n, 0.5, out=None if out is None else out.clone(), lost=mask),
                               c.rotated_estimate(wide, n, 0.5, out=None if out is None else out.clone(), lost=mask))
    counts = torch.tensor([n] * 64 + [n - 1] * 64)
    fit_wide = torch.minimum(wide, g * counts)
    fit_small = fit_wide.to(torch.uint8)
    for mask in (None, lost):
        assert torch.equal(c.rotated_estimate(fit_small, counts, 0.5, lost=mask),
                           c.rotated_estimate(fit_wide, counts, 0.5, lost=mask))
    assert torch.equal(c.decode(small, n, 0.5, d, key), c.decode(wide, n, 0.5, d, key))
    over = small.clone()
    over[5] = g * n + 1
    for out in (None, buf):
        with pytest.raises(ValueError, match="outside"):
            c.rotated_estimate(over, n, 0.5, out=out)
    with pytest.raises(ValueError, match="outside"):
        c.rotated_estimate(over, counts.clamp(min=n), 0.5)


def _lossy_allreduce(errors, outs=None, residual_fails=False):
    """Three workers through the simulated network with loss on the way up (some chunks lost, others
    with two contributors): the per-coordinate decoding path."""
    import numpy as np

    from sim.network import LinkLoss, SimulatedNetwork
    from worker_lib.allreduce import thc_allreduce
    from worker_lib.job import JobConfig

    job = JobConfig(workers=3, elems=64, slots=64, threshold=2)
    net = SimulatedNetwork(job, LinkLoss(up=0.2), seed=4)
    workers = [THCWorker(THCConfig(error_feedback=False), job=1, worker=w, seed=w) for w in range(3)]
    if residual_fails:
        def fail(*args, **kwargs):
            raise RuntimeError("residual failed")
        workers[1].residual = fail
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(3000, generator=gen) for _ in range(3)]
    res = thc_allreduce(workers, net.step(np.zeros(3, bool)), [g.clone() for g in grads], errors=errors, outs=outs)
    return grads, res


def test_allreduce_decodes_into_outs_and_computes_the_error_beside_the_exchange():
    """With ``outs`` each average is decoded into the given tensor (the gradient itself may be one): bit
    for bit what a fresh tensor gets. The caller-kept error, computed on a helper thread while the
    indices travel, equals x - RHT^-1(X_i) computed after the exchange from the step's own indices; an
    exception there reaches the caller."""
    errors_a = [torch.full((3000,), 0.01) for _ in range(3)]
    grads, plain = _lossy_allreduce(errors_a)
    assert any(r.lost.any() for r in plain) and any((r.contributors == 2).any() for r in plain)
    errors_b = [torch.full((3000,), 0.01) for _ in range(3)]
    outs = [torch.empty(3000) for _ in range(3)]
    _, direct = _lossy_allreduce(errors_b, outs=outs)
    for p, d, o, ea, eb in zip(plain, direct, outs, errors_a, errors_b, strict=True):
        assert d.average.data_ptr() == o.data_ptr() and torch.equal(p.average, o)
        assert torch.equal(ea, eb)
    # the error from its definition, with the step's rotation and the indices each worker sent
    config = THCConfig()
    values = torch.tensor(THCCodec(config).table.values, dtype=torch.float64)
    for g, r, e in zip(grads, plain, errors_a, strict=True):
        rht = RandomizedHadamard(3000, SignKey.derive(1, 0, 0), dtype=torch.float64)
        scale = config.t_p * r.max_norm / math.sqrt(rht.padded)
        x_i = -scale + values[torch.from_numpy(r.indices).long()] * 2 * scale / config.granularity
        assert torch.allclose(e.double(), (g.double() + 0.01) - rht.inverse(x_i), atol=1e-5)
    with pytest.raises(RuntimeError, match="residual failed"):
        _lossy_allreduce([torch.zeros(3000) for _ in range(3)], residual_fails=True)


def test_a_bad_gradient_or_error_is_named_and_leaves_nothing_to_decode():
    """With caller-kept error feedback one norm is computed, of gradient + error; a failure still names
    which of the two is bad, and the failed step cannot be quantized into a residual or decoded."""
    w = THCWorker(THCConfig(error_feedback=False), job=1)
    good, err = torch.ones(8), torch.zeros(8)
    n = w.begin(good, 0, 0, error=err)
    assert n == pytest.approx(8 ** 0.5)
    w.compress(0, n)
    with pytest.raises(ValueError, match=r"^gradient holds NaN or infinite"):
        w.begin(torch.tensor([1.0, float("nan")] * 4), 0, 1, error=err)
    with pytest.raises(RuntimeError, match="compress"):
        w.residual(0, out=torch.empty(8))
    with pytest.raises(ValueError, match=r"^the gradient plus its error feedback holds NaN or infinite"):
        w.begin(good, 0, 1, error=torch.tensor([0.0, float("inf")] * 4))
    with pytest.raises(ValueError, match=r"^gradient's norm overflows"):
        w.begin(torch.full((8,), 3e38), 0, 1, error=err)


def test_misuse_is_refused_and_leaves_the_worker_usable() -> None:
    """Bad arguments get a ValueError naming them, raised before anything changes: a worker that was given
    one still decodes the step and keeps its error feedback (a wrong ``out`` used to fail in torch after the
    step's state was cleared; a bad gradient of a new length used to drop the tensor's error feedback)."""
    import numpy as np

    w = THCWorker(THCConfig(bits=4, granularity=30), job=1, worker=0, seed=0)
    g = torch.randn(100, generator=torch.Generator().manual_seed(1))
    norm = w.begin(g, 0, 0)
    sums = w.codec.aggregate([w.compress(0, norm).indices])
    for kw, says in (({"out": torch.empty(5)}, "out must be a torch tensor of 100 elements, got 5 elements"),
                     ({"out": np.empty(100, np.float32)}, "out must be a torch tensor of 100 elements, got ndarray"),
                     ({"count": 1.5}, "the contributor count must be an integer"),
                     ({"count": torch.full((128,), 1.7)}, "contributor counts must be integers")):
        args = {"count": 1, **kw}
        with pytest.raises(ValueError, match=says):
            w.finish(0, sums, args.pop("count"), **args)
    out = w.finish(0, sums.numpy(), 1)  # the transport's numpy sums are taken as they come
    assert out.shape == (100,) and torch.isfinite(out).all()
    error = w.error(0).clone()
    bad = torch.randn(50)
    bad[0] = math.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        w.begin(bad, 0, 1)
    assert torch.equal(w.error(0), error)
    with pytest.raises(ValueError, match="scale must be finite"):
        w.codec.decode(sums, 1, math.nan, 100, SignKey.derive(1, 0, 0))
    # what the aggregator would compute, from indices that could not have come from a worker
    for rows, says in (([np.array([-1, 2], np.int64)], "outside the table's 0..15"),
                       ([np.array([16, 2])], "outside the table's 0..15"),
                       ([np.array([0.5, 2.0])], "indices must be integers, got float64"),
                       ([np.zeros(3, np.uint8), np.zeros(4, np.uint8)], "one flat index vector per worker"),
                       ([], "one flat index vector per worker")):
        with pytest.raises(ValueError, match=says):
            w.codec.aggregate(rows)
    with pytest.raises(ValueError, match=r"step must be an integer in \[0, 2\^64\), got 1.5"):
        w.begin(g, 0, 1.5)
    with pytest.raises(ValueError, match="seed must be a non-negative integer or None, got -1"):
        THCWorker(THCConfig(), job=1, seed=-1)
