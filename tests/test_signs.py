"""The RHT signs follow docs/rht-signs.md exactly, on every code path."""

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import spec_signs
from worker_lib.thc.signs import SignKey, rademacher, sign_words

DOC = Path(__file__).resolve().parent.parent / "docs" / "rht-signs.md"


@given(job=st.integers(0, 2**32 - 1), tensor=st.integers(0, 2**32 - 1), step=st.integers(0, 2**64 - 1))
@settings(max_examples=60, deadline=None)
def test_key_derivation_matches_spec(job, tensor, step):
    key = SignKey.derive(job, tensor, step)
    assert (key.k0, key.k1) == spec_signs.key_words(job, tensor, step)


@pytest.mark.parametrize("d", [1, 31, 32, 33, 100, 1000, 4097])
def test_signs_match_spec(d):
    got = rademacher(SignKey.derive(7, 3, 2**40 + 5), d)
    assert got.tolist() == spec_signs.signs(7, 3, 2**40 + 5, d)


def test_float32_and_generic_paths_agree():
    key = SignKey.derive(1, 2, 3)
    fast = rademacher(key, 10_000)  # numpy uint32 hash and byte table (CPU float32)
    generic = rademacher(key, 10_000, dtype=torch.float64)  # torch shifts, as on a GPU
    assert torch.equal(fast.double(), generic)
    out = torch.empty(10_000)
    assert rademacher(key, 10_000, out=out) is out and torch.equal(out, fast)


def test_words_match_spec_for_large_counters():
    key = SignKey.derive(99, 1, 1)
    words = sign_words(key, 5000)
    for c in (0, 1, 4095, 4999):
        assert int(words[c]) == spec_signs.word(key.k0, key.k1, c)


def test_signs_are_balanced_and_key_dependent():
    d = 1 << 16
    a = rademacher(SignKey.derive(1, 0, 0), d)
    b = rademacher(SignKey.derive(1, 0, 1), d)
    c = rademacher(SignKey.derive(1, 1, 0), d)
    # 5 standard deviations of a fair +-1 sum
    assert abs(float(a.sum())) < 5 * d**0.5
    for other in (b, c):
        assert abs(float((a * other).sum())) < 5 * d**0.5


def test_published_vectors():
    text = DOC.read_text()
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(0x[0-9A-F]{8})\s*\|\s*(0x[0-9A-F]{8})\s*\|"
                      r"\s*([+-]+)\s*\|", text, re.M)
    assert len(rows) >= 4, "docs/rht-signs.md lost its test vectors"
    for job, tensor, step, k0, k1, pattern in rows:
        job, tensor, step = int(job), int(tensor), int(step)
        assert spec_signs.key_words(job, tensor, step) == (int(k0, 16), int(k1, 16))
        expected = [1 if ch == "+" else -1 for ch in pattern]
        assert rademacher(SignKey.derive(job, tensor, step), len(pattern)).tolist() == expected


@pytest.mark.parametrize("bad", [dict(job=-1, tensor=0, step=0), dict(job=0, tensor=2**32, step=0),
                                 dict(job=0, tensor=0, step=2**64)])
def test_key_range_errors(bad):
    with pytest.raises(ValueError, match="must be an integer"):
        SignKey.derive(**bad)


def test_nonpositive_length():
    with pytest.raises(ValueError):
        rademacher(SignKey.derive(0, 0, 0), 0)
