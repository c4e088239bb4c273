"""The Walsh-Hadamard transform and the RHT against scipy's Hadamard matrix."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import hadamard

from worker_lib.thc.hadamard import RandomizedHadamard, fwht, have_fht_cpu, next_pow2
from worker_lib.thc.signs import SignKey, rademacher

needs_fht_cpu = pytest.mark.skipif(not have_fht_cpu(),
                                   reason="the fht-cpu package is not installed (x86-64 wheel only)")
BACKENDS = ["torch", pytest.param("fht-cpu", marks=needs_fht_cpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 1024])
def test_fwht_matches_scipy(backend, n):
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    expected = hadamard(n) @ x.numpy() / math.sqrt(n)
    np.testing.assert_allclose(fwht(x, backend=backend).numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fwht(x, backend=backend, normalize=False).numpy(), hadamard(n) @ x.numpy(),
                               rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fwht_rows_and_inplace(backend):
    x = torch.randn(3, 16, dtype=torch.float32)
    expected = torch.from_numpy((hadamard(16) @ x.double().numpy().T).T / 4).float()
    assert torch.allclose(fwht(x, backend=backend), expected, atol=1e-5)
    y = x.clone()
    assert fwht(y, backend=backend, inplace=True) is y
    assert torch.allclose(y, expected, atol=1e-5)


def test_backends_agree_in_float32():
    if not have_fht_cpu():
        pytest.skip("the fht-cpu package is not installed (x86-64 wheel only)")
    x = torch.randn(1 << 16)
    assert torch.allclose(fwht(x, backend="torch"), fwht(x, backend="fht-cpu"), atol=1e-5)


@given(d=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_rht_is_an_exact_orthonormal_rotation(d, seed):
    x = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed % 1000))
    rht = RandomizedHadamard(d, SignKey.derive(1, seed, 0), dtype=torch.float64)
    y = rht.forward(x)
    assert y.shape == (next_pow2(d),)
    assert math.isclose(float(y.norm()), float(x.norm()), rel_tol=1e-10)
    assert torch.allclose(rht.inverse(y), x, atol=1e-10)


def test_rht_equals_explicit_matrix_product():
    d, key = 11, SignKey.derive(3, 4, 5)
    x = torch.randn(d, dtype=torch.float64)
    padded = np.zeros(16)
    padded[:d] = x.numpy()
    signs = rademacher(key, 16, dtype=torch.float64).numpy()
    expected = hadamard(16) @ (signs * padded) / 4
    got = RandomizedHadamard(d, key, dtype=torch.float64).forward(x)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)


def test_rekey_changes_signs_in_place():
    """The float signs of the torch path are rebuilt into their own buffer at a new key."""
    rht = RandomizedHadamard(100, SignKey.derive(1, 1, 1))
    buf = rht.signs
    rht.rekey(SignKey.derive(1, 1, 2))
    assert rht.signs is buf
    assert torch.equal(buf, rademacher(SignKey.derive(1, 1, 2), 128))


def test_bad_inputs():
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(6))
    with pytest.raises(TypeError):
        fwht(torch.zeros(8, dtype=torch.int32))
    rht = RandomizedHadamard(5, SignKey.derive(0, 0, 0))
    with pytest.raises(ValueError, match="length 5"):
        rht.forward(torch.zeros(6))
    with pytest.raises(ValueError):
        next_pow2(0)


def exact_norm(x: torch.Tensor) -> float:
    """The norm of x from Python's exactly rounded float sum of the squares (math.fsum)."""
    return math.sqrt(math.fsum(v * v for v in x.double().tolist()))


@needs_fht_cpu
@pytest.mark.parametrize("d", [1, 5, 32, 33, 1000, 4099])
def test_compiled_rotation_is_the_torch_composition_bit_for_bit(d):
    """On the CPU in float32 the RHT's sign flips, padding, normalisation and subtraction run as compiled
    passes over the key's sign words; every output equals, bit for bit, the composition of torch
    operations with the materialised float signs (``rademacher``, itself checked against the spec) around
    the same fht-cpu transform: forward (normalised before the transform where D = 4^k, after it
    otherwise: both kinds of D are among the lengths), forward of a sum, inverse, inverse into a
    destination, and x - RHT^-1(y)."""
    key = SignKey.derive(7, d, 3)
    padded = next_pow2(d)
    signs = rademacher(key, padded)
    gen = torch.Generator().manual_seed(d)
    x, y = torch.randn(d, generator=gen), torch.randn(padded, generator=gen)
    minus = torch.randn(d, generator=gen)
    rht = RandomizedHadamard(d, key)

    want_fwd = torch.zeros(padded)
    torch.mul(x, signs[:d], out=want_fwd[:d])
    want_fwd = fwht(want_fwd, backend="fht-cpu", inplace=True)
    assert torch.equal(rht.forward(x), want_fwd)
    rotated, norm = rht.forward_norm(x)
    assert torch.equal(rotated, want_fwd) and norm == pytest.approx(exact_norm(x), rel=1e-12)

    # the gradient plus its error feedback, summed and rotated in one pass (into one of the addends too)
    a, b = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    total = torch.add(a, b)
    want_sum = torch.zeros(padded)
    torch.mul(total, signs[:d], out=want_sum[:d])
    want_sum = fwht(want_sum, backend="fht-cpu", inplace=True)
    x_out, rotated = torch.full((d,), 9.0), torch.full((padded,), 9.0)
    got, norm = rht.forward_sum(a, b, x_out, rotated)
    assert got is rotated and torch.equal(rotated, want_sum)
    assert torch.equal(x_out, total) and norm == pytest.approx(exact_norm(total), rel=1e-12)
    # the sum not kept (x None): the same rotation and norm, the addends untouched
    a0, b0, rotated = a.clone(), b.clone(), torch.full((padded,), 9.0)
    got, norm = rht.forward_sum(a, b, None, rotated)
    assert got is rotated and torch.equal(rotated, want_sum) and norm == pytest.approx(exact_norm(total), rel=1e-12)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    got, norm = RandomizedHadamard(d, key, backend="torch").forward_sum(a, b, None)
    assert torch.allclose(got, want_sum, atol=1e-5) and torch.equal(a, a0) and torch.equal(b, b0)
    assert torch.equal(rht.forward_sum(a, b, a)[0], want_sum) and torch.equal(a, total)
    first, second = total - b, b.clone()  # the torch path, into the second addend
    slow = RandomizedHadamard(d, key, backend="torch")
    got, norm = slow.forward_sum(first, second, second)
    assert torch.allclose(got, want_sum, atol=1e-5) and norm == pytest.approx(exact_norm(second), rel=1e-12)
    assert torch.equal(second, first + b)

    want_inv = fwht(y.clone(), backend="fht-cpu", inplace=True).mul_(signs)[:d]
    assert torch.equal(rht.inverse(y), want_inv)
    dest = torch.full((d,), 9.0)
    assert rht.inverse_into(y.clone(), dest) is dest and torch.equal(dest, want_inv)
    assert torch.equal(rht.inverse_into(y.clone(), dest, minus=minus), torch.sub(minus, want_inv))


@needs_fht_cpu
def test_rekey_switches_the_compiled_signs_too():
    """After ``rekey`` the compiled passes use the new key's signs (and ``signs`` shows them)."""
    d, old, new = 100, SignKey.derive(1, 1, 1), SignKey.derive(1, 1, 2)
    x = torch.randn(d)
    rht = RandomizedHadamard(d, old)
    rht.rekey(new)
    assert torch.equal(rht.forward(x), RandomizedHadamard(d, new).forward(x))
    assert torch.equal(rht.signs, rademacher(new, 128))
    assert not torch.equal(rht.forward(x), RandomizedHadamard(d, old).forward(x))


def test_inverse_into_refuses_wrong_shapes():
    rht = RandomizedHadamard(5, SignKey.derive(0, 0, 0))
    with pytest.raises(ValueError, match="length 8 into one of 5"):
        rht.inverse_into(torch.zeros(8), torch.zeros(6))
