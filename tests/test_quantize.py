"""Stochastic quantization onto table values, index packing, and the aggregator's sum."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_lib.thc.quantize import (
    TableQuantizer,
    UniformSource,
    Workspace,
    from_grid,
    lookup_sum,
    pack_indices,
    packed_size,
    to_grid,
    unpack_indices,
)
from worker_lib.thc.table import solve_table, uniform_table


def reference_pack(z, bits):
    """Pack by writing each index as a b-character bit string, MSB first, then cutting bytes."""
    z = list(z) + [0] * (-len(z) % 8)
    stream = "".join(format(v, f"0{bits}b") for v in z)
    return bytes(int(stream[i:i + 8], 2) for i in range(0, len(stream), 8))


@given(bits=st.integers(1, 8), data=st.data())
@settings(max_examples=80, deadline=None)
def test_pack_matches_bitstring_reference_and_round_trips(bits, data):
    n = data.draw(st.integers(1, 200))
    z = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n))
    t = torch.tensor(z, dtype=torch.uint8)
    for compiled in (True, False):  # the CPU's compiled passes and the torch kernels of every device
        packed = pack_indices(t, bits, compiled=compiled)
        assert packed.numel() == packed_size(n, bits)
        assert bytes(packed.numpy()) == reference_pack(z, bits)
        assert unpack_indices(packed, bits, n, compiled=compiled).tolist() == z


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_with_buffers(bits):
    n = 1024
    z = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    for compiled in (True, False):
        out = torch.empty(packed_size(n, bits), dtype=torch.uint8)
        assert pack_indices(z, bits, out=out, compiled=compiled) is out
        assert bytes(out.numpy()) == reference_pack(z.tolist(), bits)
        back = torch.empty(n, dtype=torch.uint8)
        assert unpack_indices(out, bits, n, out=back, compiled=compiled) is back
        assert torch.equal(back, z)


def test_pack_errors():
    with pytest.raises(ValueError):
        pack_indices(torch.zeros(8, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_indices(torch.zeros(3, dtype=torch.uint8), 4, 8)
    with pytest.raises(TypeError):
        unpack_indices(torch.zeros(8, dtype=torch.int32), 4, 8)


@pytest.mark.parametrize("table", [solve_table(4, 30, 1 / 32), solve_table(2, 36, 1 / 32), uniform_table(3),
                                   solve_table(3, 20, 0.01)], ids=["b4g30", "b2g36", "uniform3", "b3g20"])
def test_quantization_brackets_and_is_unbiased(table):
    g = table.granularity
    values = np.asarray(table.values)
    y = torch.linspace(0, g, 501)
    q = TableQuantizer(table)
    src = UniformSource(seed=5)
    trials = 4000
    acc = np.zeros(y.numel())
    for _ in range(trials):
        idx = q.quantize(y, src.fill(torch.empty(y.numel()))).numpy()
        picked = values[idx]
        lo = values[np.searchsorted(values, y.numpy(), side="right") - 1]
        hi = values[np.minimum(np.searchsorted(values, y.numpy(), side="left"), len(values) - 1)]
        assert np.all((picked == lo) | (picked == hi))  # only the two adjacent table values
        acc += picked
    mean = acc / trials
    yv = y.double().numpy()
    lo = values[np.clip(np.searchsorted(values, yv, side="right") - 1, 0, len(values) - 2)]
    hi = values[np.clip(np.searchsorted(values, yv, side="right"), 1, len(values) - 1)]
    sd = np.sqrt(np.maximum((yv - lo) * (hi - yv), 0) / trials)
    assert np.all(np.abs(mean - yv) <= 5 * sd + 1e-4)  # 5 sigma, plus float32 rounding of y


def test_quantize_with_workspace_reuses_buffers():
    table = solve_table(4, 30, 1 / 32)
    ws = Workspace(256, "cpu", 4)
    y = torch.rand(256) * 30
    idx = TableQuantizer(table).quantize(y, UniformSource(seed=1).fill(torch.empty(256)), ws)
    assert idx.data_ptr() == ws.indices.data_ptr()


def test_lookup_sum_against_loop():
    table = solve_table(4, 30, 1 / 32)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 16, size=(5, 100))
    expected = [sum(table.values[idx[w, c]] for w in range(5)) for c in range(100)]
    assert lookup_sum(table.as_array(), idx).tolist() == expected
    with pytest.raises(ValueError, match="outside the table"):
        lookup_sum(table.as_array(), np.full((1, 3), 16))


def splitmix_uniforms(key: int, n: int) -> np.ndarray:
    """SplitMix64's finaliser over a Weyl sequence (Steele, Lea and Flood), written here with Python
    integers, two 24-bit float32 fractions per output: in each block of 1024 positions, output m of the
    block (m < 512) gives its top 24 bits to position m and its bits 16..39 to position m + 512."""
    mask = (1 << 64) - 1
    out = np.empty(n, np.float32)
    for i in range(n):
        block, r = divmod(i, 1024)
        step = block * 512 + r % 512 + 1
        z = (key + step * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        bits = z >> 40 if r < 512 else (z >> 16) & 0xFFFFFF
        out[i] = bits / float(1 << 24)
    return out


@pytest.mark.parametrize("bits, g", [(4, 30), (2, 3), (8, 255)])
def test_compiled_cpu_pass_is_the_torch_quantizer(bits: int, g: int) -> None:
    """The CPU's one-pass quantization (worker_lib.thc.fused) gives the torch path's indices when fed the
    same uniforms (SplitMix64, recomputed here independently), table and identity table alike, out-of-
    range coordinates clamped."""
    from worker_lib.thc import fused

    table = solve_table(bits, g, 1 / 32)
    q = TableQuantizer(table)
    # 4 whole blocks and a partial one of 903 (beyond half a block): both of the pass's ways to draw
    x = torch.randn(4999, generator=torch.Generator().manual_seed(bits)) * 2  # beyond +-M as well
    m, key = 3.0, 0x1234_5678_9ABC_DEF0
    u = splitmix_uniforms(key, x.numel())
    assert np.array_equal(fused.uniforms(np.uint64(key), x.numel()), u)
    out = np.empty(x.numel(), np.uint8)
    scale = g / (2 * m)
    fused.quantize_into(x.numpy(), np.float32(scale), np.float32(m * scale), g, q.slope, q.offset, table.size - 1,
                        np.uint64(key), out)
    want = q.quantize(to_grid(x, -m, m, g), torch.from_numpy(u.copy())).numpy()
    assert np.array_equal(out, want)


def test_compiled_uniforms_are_uniform_and_uncorrelated() -> None:
    """The pass's uniforms, two per hash output: each half of a block is uniform over [0, 1) (chi-square
    over 64 bins, below the 0.999 quantile) and the two uniforms of one output, like neighbours, are
    uncorrelated (|r| under 4 standard errors)."""
    from scipy import stats

    from worker_lib.thc import fused

    u = fused.uniforms(np.uint64(0xDEAD_BEEF_0123_4567), 1 << 20).astype(np.float64)
    blocks = u.reshape(-1, 1024)
    first, second = blocks[:, :512].ravel(), blocks[:, 512:].ravel()
    limit = stats.chi2.ppf(0.999, 63)
    for half in (first, second):
        counts = np.bincount((half * 64).astype(int), minlength=64)
        expected = half.size / 64
        assert ((counts - expected) ** 2 / expected).sum() < limit
        assert half.min() >= 0 and half.max() < 1
    bound = 4 / np.sqrt(first.size)
    assert abs(np.corrcoef(first, second)[0, 1]) < bound
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < bound


def test_compiled_cpu_pass_is_unbiased() -> None:
    """E[T[index]] = y: over 2^20 coordinates the mean rounding error is within 4 standard errors of 0,
    for coordinates spread over every cell of the table."""
    from worker_lib.thc import fused

    table = solve_table(4, 30, 1 / 32)
    q = TableQuantizer(table)
    y = np.linspace(0, 30, 1 << 20, dtype=np.float32)
    out = np.empty(y.size, np.uint8)
    fused.quantize_into(y, np.float32(1.0), np.float32(0.0), 30, q.slope, q.offset, 15, np.uint64(99), out)
    err = np.asarray(table.values, np.float64)[out] - y
    gaps = np.diff(np.asarray(table.values, np.float64))
    assert np.all(np.abs(err) <= gaps.max())  # always one of the two neighbouring table values
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(err.size)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_compiled_estimate_is_from_grid_and_checks_the_range(dtype: torch.dtype) -> None:
    """The CPU's one-pass estimate gives from_grid's float32 values exactly, and refuses sums outside
    [0, g * count] (one sum one past the top, or negative, anywhere in the vector)."""
    from worker_lib.thc import fused

    g, count, m = 30, 3, 1.7
    sums = torch.randint(0, g * count + 1, (5003,), dtype=dtype, generator=torch.Generator().manual_seed(1))
    out = torch.empty(sums.numel())
    step = np.float32((2 * m) / (g * count))
    assert fused.estimate_into(sums.numpy(), g * count, step, np.float32(-m), out.numpy())
    assert torch.equal(out, from_grid(sums, count, -m, m, g))
    for bad in (g * count + 1, -1):
        wrong = sums.clone()
        wrong[4000] = bad
        assert not fused.estimate_into(wrong.numpy(), g * count, step, np.float32(-m), out.numpy())


#: (bits, granularity) of tables the compiled lookups read from two packed words (16 values up to 255:
#: ``fused._table_words``) and of tables they read from memory (32 values; 16 values beyond 255)
LOOKUP_TABLES = [(4, 30), (4, 255), (5, 60), (4, 400)]


@pytest.mark.parametrize(("bits", "g"), LOOKUP_TABLES)
def test_compiled_own_values_are_the_table_lookup_on_the_grid(bits: int, g: int) -> None:
    """A worker's own values X_i come from one compiled pass on the CPU; they equal from_grid of the
    torch table lookup exactly, for indices covering the whole table."""
    from worker_lib.thc import THCCodec, THCConfig
    from worker_lib.thc.codec import Encoded

    codec = THCCodec(THCConfig(bits=bits, granularity=g))
    size = 1 << bits
    indices = torch.randint(0, size, (4101,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert set(indices.tolist()) == set(range(size))
    enc = Encoded(indices, 1.37, 4101, bits)
    got = codec.own_values(enc, out=torch.empty(4101))
    looked_up = torch.index_select(codec.quantizer.values, 0, indices.to(torch.int32))
    assert torch.equal(got, from_grid(looked_up, 1, -1.37, 1.37, g))
    assert torch.equal(codec.own_values(enc), got)  # without a destination: the torch path


@pytest.mark.parametrize(("bits", "g"), LOOKUP_TABLES)
def test_compiled_residual_pass_leaves_what_the_indices_fail_to_carry(bits: int, g: int) -> None:
    """``quantize_residual_into`` writes the indices ``quantize_into`` writes (same key) and leaves x - X_i
    in x: torch's from_grid of the table lookup subtracted in float32, bit for bit (whole blocks and a
    partial one), for tables read from packed words and from memory."""
    from worker_lib.thc import fused

    table = solve_table(bits, g, 1 / 32)
    q = TableQuantizer(table)
    x = torch.randn(4999, generator=torch.Generator().manual_seed(11)) * 2  # beyond +-M as well
    m, key = 3.0, np.uint64(0x0F1E_2D3C_4B5A_6978)
    scale = g / (2 * m)
    args = (np.float32(scale), np.float32(m * scale), g, q.slope, q.offset, table.size - 1, key)
    want_idx = np.empty(x.numel(), np.uint8)
    fused.quantize_into(x.numpy(), *args, want_idx)
    assert np.unique(want_idx).size == table.size  # every value of the table is looked up
    looked_up = torch.index_select(q.values, 0, torch.from_numpy(want_idx).to(torch.int32))
    want = x - from_grid(looked_up, 1, -m, m, g)
    own = (q.values.numpy(), np.float32(2 * m / g), np.float32(-m))
    got, idx = x.clone(), np.empty(x.numel(), np.uint8)
    fused.quantize_residual_into(got.numpy(), *args, idx, *own, got.numpy())  # in place
    assert np.array_equal(idx, want_idx)
    assert torch.equal(got, want)
    assert float(got.abs().max()) > 0  # 4-bit indices do leave something behind
    # into a separate destination: x is left as it was (a fixed rotation quantizes it again if asked)
    src, res, idx2 = x.clone(), torch.full_like(x, 7.0), np.empty(x.numel(), np.uint8)
    fused.quantize_residual_into(src.numpy(), *args, idx2, *own, res.numpy())
    assert np.array_equal(idx2, want_idx) and torch.equal(res, want) and torch.equal(src, x)


def test_quantizing_in_pieces_gives_the_bits_of_one_pass() -> None:
    """A vector quantized piece by piece (``first``: where each piece starts, a multiple of BLOCK; the last
    piece partial) gets the indices and residuals of one pass over it, each piece taking the uniforms of its
    own positions; a piece that starts off a block boundary is refused."""
    from worker_lib.thc import fused

    table = solve_table(4, 30, 1 / 32)
    q = TableQuantizer(table)
    n = 5 * fused.BLOCK + 333
    x = (torch.randn(n, generator=torch.Generator().manual_seed(5)) * 2).numpy()
    m, g, key = 3.0, 30, np.uint64(0x1234_5678_9ABC_DEF0)
    args = (np.float32(g / (2 * m)), np.float32(m * g / (2 * m)), g, q.slope, q.offset, table.size - 1, key)
    own = (q.values.numpy(), np.float32(2 * m / g), np.float32(-m))
    want_idx, want_res = np.empty(n, np.uint8), np.empty(n, np.float32)
    fused.quantize_residual_into(x, *args, want_idx, *own, want_res)
    idx, res, idx2 = np.full(n, 99, np.uint8), np.full(n, np.nan, np.float32), np.full(n, 99, np.uint8)
    bounds = [0, fused.BLOCK, 3 * fused.BLOCK, 5 * fused.BLOCK, n]
    for a, b in itertools.pairwise(bounds):
        fused.quantize_residual_into(x[a:b], *args, idx[a:b], *own, res[a:b], a)
        fused.quantize_into(x[a:b], *args, idx2[a:b], a)
    assert np.array_equal(idx, want_idx) and np.array_equal(idx2, want_idx)
    assert np.array_equal(res, want_res)
    # the positions matter: the same piece quantized as if it started the vector draws other uniforms
    alone = np.empty(n - fused.BLOCK, np.uint8)
    fused.quantize_into(x[fused.BLOCK:], *args, alone)
    assert not np.array_equal(alone, want_idx[fused.BLOCK:])
    with pytest.raises(ValueError, match="multiple of BLOCK"):
        fused.quantize_into(x[5:], *args, idx[5:], 5)


def test_add_squares_adds_and_returns_the_squares() -> None:
    """``add_squares_into``: x += e elementwise (float32) and the float64 sum of the new squares, over
    whole words of 32 and a tail."""
    from worker_lib.thc import fused

    gen = torch.Generator().manual_seed(5)
    for n in (1, 31, 32, 1000):
        x, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        want = x + e
        got = x.clone()
        ss = fused.add_squares_into(got.numpy(), e.numpy())
        assert torch.equal(got, want)
        assert ss == pytest.approx(float((want.double() ** 2).sum()), rel=1e-12)
