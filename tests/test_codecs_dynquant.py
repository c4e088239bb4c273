"""Dynamic quantization with Huffman coding (papers/oland-raj-dynamic-quantization.txt)."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_lib.codecs import DynamicQuantization, DynQuantConfig, Message, RoundContext
from worker_lib.codecs.dynquant import dequantize, quantize
from worker_lib.codecs.huffman import HuffmanCode, code_lengths


def optimal_cost(counts: list[int]) -> int:
    """Total Huffman code length, as the sum of merged weights (independent of the codec's code)."""
    heap = [c for c in counts if c > 0]
    if len(heap) == 1:
        return heap[0]
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        total += a + b
        heapq.heappush(heap, a + b)
    return total


def entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40).filter(lambda c: sum(c) > 0), st.randoms())
def test_huffman_round_trip_and_optimality(counts: list[int], rnd: object) -> None:
    symbols = np.repeat(np.arange(len(counts)), counts)
    np.random.default_rng(rnd.randint(0, 2**32 - 1)).shuffle(symbols)  # type: ignore[attr-defined]
    code = HuffmanCode.from_counts(np.array(counts))
    buf, nbits = code.encode(symbols)
    assert buf.size == math.ceil(nbits / 8)
    assert nbits == optimal_cost(counts)
    assert code.decode(buf, nbits, symbols.size).tolist() == symbols.tolist()
    lengths = code.lengths[code.lengths > 0]
    if lengths.size > 1:
        assert sum(2.0 ** -lengths) == 1.0  # a complete prefix code


def test_huffman_codes_are_prefix_free() -> None:
    code = HuffmanCode.from_counts(np.array([50, 20, 20, 5, 3, 1, 1, 0, 7]))
    words = [format(int(c), f"0{int(ln)}b") for c, ln in zip(code.codes, code.lengths, strict=True) if ln]
    for a in words:
        for b in words:
            assert a == b or not b.startswith(a)


def test_huffman_decode_refuses_truncated_streams() -> None:
    code = HuffmanCode.from_counts(np.array([5, 3, 1, 1]))
    buf, nbits = code.encode(np.array([3, 2, 1, 0, 0, 3, 1]))
    with pytest.raises(ValueError):
        code.decode(buf, nbits - 1, 7)


def test_single_symbol_and_skewed_lengths() -> None:
    assert code_lengths(np.array([0, 9, 0])).tolist() == [0, 1, 0]
    fib = [1, 1, 2, 3, 5, 8, 13, 21, 34, 55]  # the deepest possible Huffman tree
    assert sorted(code_lengths(np.array(fib)).tolist()) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]


def test_quantize_errata_fixed() -> None:
    w = torch.tensor([-1.0, -0.5, 0.0, 0.999, 1.0], dtype=torch.float32)
    q = quantize(w, -1.0, 1.0, 3)
    # (w - w_min), not the paper's (w_max - w): bins count up from w_min, as the decoder assumes
    assert q.tolist() == [0, 2, 4, 7, 7]  # and w_max clamps to 2^N - 1, not 2^N
    torch.testing.assert_close(dequantize(q, -1.0, 1.0, 3),
                               torch.tensor([-0.875, -0.375, 0.125, 0.875, 0.875]))


def test_bits_entropy_and_reconstruction_with_full_sample() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(20_000).astype(np.float32)
    cfg = DynQuantConfig(fraction=1.0, prelim_bits=4, floor=2.0)
    codec = DynamicQuantization(cfg, seed=0)
    ctx = RoundContext(length=x.size)
    msg = codec.encode(torch.from_numpy(x), ctx)
    # independent computation of N = ceil(H + c) from the whole tensor (F = 1)
    lo, hi = float(x.min()), float(x.max())
    prelim = np.clip(np.floor(16 * (x.astype(np.float64) - lo) / (hi - lo)), 0, 15).astype(int)
    n_bits = math.ceil(entropy(np.bincount(prelim, minlength=16)) + 2.0)
    assert int(msg.payload[0]) == n_bits
    got = codec.decode_one(msg, ctx).numpy()
    step = (hi - lo) / 2 ** n_bits
    assert np.abs(got.astype(np.float64) - x).max() <= step / 2 * (1 + 1e-4)
    # exact accounting: 8 + 32 + 32 header bits, 2^N counts of ceil(log2(d + 1)) bits, code words
    q = np.clip(np.floor(2 ** n_bits * (x.astype(np.float64) - lo) / (hi - lo)), 0, 2 ** n_bits - 1)
    counts = np.bincount(q.astype(int), minlength=2 ** n_bits)
    table = 2 ** n_bits * math.ceil(math.log2(x.size + 1))
    assert msg.bits == 72 + table + optimal_cost(counts.tolist())
    assert msg.nbytes == math.ceil(msg.bits / 8)
    code_bits = msg.bits - 72 - table
    assert x.size * entropy(counts) <= code_bits < x.size * (entropy(counts) + 1)


def test_paper_defaults_and_sample_size() -> None:
    cfg = DynQuantConfig()
    assert (cfg.fraction, cfg.prelim_bits, cfg.floor) == (0.03, 4, 6.0)
    codec = DynamicQuantization(seed=1)
    x = torch.randn(5000)
    ctx = RoundContext(length=5000)
    n_bits = int(codec.encode(x, ctx).payload[0])
    assert 7 <= n_bits <= 10  # H of a 4-bit quantization lies in (0, 4], so N = ceil(H + 6)


def test_constant_tensor_decodes_exactly() -> None:
    codec = DynamicQuantization(seed=0)
    ctx = RoundContext(length=100)
    got = codec.decode_one(codec.encode(torch.full((100,), -0.375), ctx), ctx)
    assert bool((got == -0.375).all())


def test_truncated_package_refused() -> None:
    codec = DynamicQuantization(seed=0)
    ctx = RoundContext(length=1000)
    msg = codec.encode(torch.randn(1000), ctx)
    bits = msg.bits - 8
    with pytest.raises(ValueError):
        codec.decode_one(Message(msg.payload[: math.ceil(bits / 8)].copy(), bits), ctx)
    with pytest.raises(ValueError):
        codec.decode_one(msg, RoundContext(length=999))


@pytest.mark.parametrize("kwargs", [dict(fraction=0.0), dict(fraction=1.5), dict(prelim_bits=0),
                                    dict(floor=-1.0), dict(prelim_bits=8, floor=9.0),
                                    dict(floor=float("nan"))])
def test_bad_knobs(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DynQuantConfig(**kwargs)
