"""THC's passes over memory on the CPU, compiled (numba): stochastic quantization (with, where the
caller keeps error feedback, the residual its indices leave), the decoder's estimate, a worker's own
values, and the rotation's sign flips around fht-cpu's transform.

The torch path (``quantize.to_grid`` then ``TableQuantizer.quantize`` with uniforms from
``UniformSource.fill``) makes four passes over a 2^20-coordinate vector and draws 2^20 float32 uniforms
from numpy's PCG64: 3.4 ms of a 6 ms encode on one core. Here one compiled pass (two loops per block)
maps each rotated coordinate onto the grid, finds its table cell, draws its uniform from a counter-based
hash of (key, position) and writes its index: the same arithmetic in the same
float32 order as the torch path, so that given the same uniforms both give the same indices
(``uniforms`` reproduces them, for the tests). With 24-bit uniforms (u = k / 2^24) the rounding
probabilities are exact to 6e-8.

Why a hash and not a generator: every coordinate's uniform is a pure function of (key, i), so the loop
carries no state and compiles to straight arithmetic; the key advances the stream from step to step
(``UniformSource.next_key``). The hash is SplitMix64's finaliser (Steele, Lea and Flood, 2014) over a
Weyl sequence, whose outputs pass BigCrush. Each 64-bit output gives two 24-bit uniforms, its top bits
to coordinate j of a block and its next 24 bits to coordinate j + BLOCK / 2 (``_uniform`` says which
hash serves which position): without a 64-bit vector multiply (AVX2 has none) the hash was half of the
pass, 1.15 of 2.3 ms for 2^20 coordinates.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_WEYL = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
_INV24 = np.float32(1.0 / (1 << 24))


#: Coordinates per block of ``quantize_into``'s loops (12 KiB of block buffers: they stay in L1).
BLOCK = 1024
_HALF = BLOCK // 2
_LOW24 = np.uint64(0xFFFFFF)
_S16 = np.uint64(16)


@njit(cache=True, inline="always")
def _mix(key: np.uint64, m: int) -> np.uint64:
    """SplitMix64's finaliser at step m + 1 of the Weyl sequence that starts at ``key``."""
    z = key + np.uint64(m + 1) * _WEYL
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def _high(z: np.uint64) -> np.float32:
    # through int32: LLVM has no vector conversion of uint64 to float on AVX2 and kept the loop scalar
    return np.float32(np.int32(z >> _S40)) * _INV24


@njit(cache=True, inline="always")
def _low(z: np.uint64) -> np.float32:
    return np.float32(np.int32((z >> _S16) & _LOW24)) * _INV24


@njit(cache=True, inline="always")
def _uniform(key: np.uint64, i: int) -> np.float32:
    """Position i's uniform in [0, 1). Position i = BLOCK * b + r takes hash m = (BLOCK / 2) * b + r mod
    (BLOCK / 2): its top 24 bits if r < BLOCK / 2, else its bits 16..39."""
    r = i % BLOCK
    z = _mix(key, (i // BLOCK) * _HALF + r % _HALF)
    return _high(z) if r < _HALF else _low(z)


@njit(cache=True, nogil=True)
def quantize_into(x: np.ndarray, scale: np.float32, shift: np.float32, granularity: int, slope: np.ndarray,
                  offset: np.ndarray, top: int, key: np.uint64, out: np.ndarray, first: int = 0) -> None:
    """out[i] = the table index of x[i]: y = clamp(x[i] * scale + shift, 0, g) on the grid, its cell
    c = min(floor(y), g - 1), then min(floor(y * slope[c] + offset[c] + u_i), top) (never negative:
    y * slope[c] + offset[c] >= c's segment index >= 0). min/max rather than branches.

    Three loops per block of ``BLOCK`` coordinates: the grid and the cells, then the uniforms (both
    vectorised by LLVM; in a whole block, one hash per two uniforms: 1.9 against 2.25 ms for 2^20
    coordinates here), then the table's slope and offset by cell and the rounding. In one loop the lookups by
    cell kept the whole pass scalar (LLVM does not emit gathers for this CPU): 15.2 against 11.7 ms for
    2^22 coordinates here, the same indices. The cells are unsigned and each block works on slices, so
    that no index needs numba's wrap-around of negative indices: with it, every lookup of the scalar
    second loop carried a sign test and a select of the base address (2.7 against 1.7 ms for 2^20).

    ``first``: the position of x[0] in the whole vector (a multiple of ``BLOCK``), whose uniforms x's
    coordinates take: a vector quantized in pieces (``x``, ``out`` slices from ``first`` on) gets the indices
    it gets in one call, so that a worker can send its first chunks while it quantizes the rest."""
    _quantize(x, scale, shift, granularity, slope, offset, top, key, out, False, _NO_VALUES, np.float32(0.0),
              np.float32(0.0), x, first)


@njit(cache=True, nogil=True)
def quantize_residual_into(x: np.ndarray, scale: np.float32, shift: np.float32, granularity: int,
                           slope: np.ndarray, offset: np.ndarray, top: int, key: np.uint64, out: np.ndarray,
                           values: np.ndarray, step: np.float32, low: np.float32, res: np.ndarray,
                           first: int = 0) -> None:
    """``quantize_into``, then res[i] = x[i] - (float32(values[out[i]]) * step + low), block by block: what
    the indices fail to carry in the rotated domain, x - X_i (``lookup_estimate_into``'s X_i, in its
    arithmetic, then one float32 subtraction); ``res`` is x itself or does not overlap it. The error feedback
    then needs at most the inverse rotation of the residual (none with a fixed rotation, whose error feedback
    stays rotated), not a pass that looks the indices up again and another that subtracts
    (``THCWorker.residual``); the block is still in L1 when its residual is written. ``first`` as
    ``quantize_into``'s."""
    _quantize(x, scale, shift, granularity, slope, offset, top, key, out, True, values, step, low, res, first)


_NO_VALUES = np.zeros(1, np.int32)

# A table of at most 16 values in 0..255 (every table of 4-bit indices on a grid up to 255) is looked up
# without a load per index: its values are the bytes of two 64-bit words, and index i picks word i // 8 and
# its byte i % 8 by a select and a shift, which LLVM vectorises where it keeps a lookup from memory scalar
# (it emits no gathers for this CPU). For the residual pass over 2^22 coordinates: 0.94 against 1.85 ms in
# the cache. Tables that do not fit keep the loads.
_BYTE = np.uint64(255)
_THREE, _SEVEN, _EIGHT = np.uint64(3), np.uint64(7), np.uint64(8)


@njit(cache=True, inline="always")
def _table_words(values: np.ndarray) -> tuple[bool, np.uint64, np.uint64]:
    """(whether ``values`` fits two words, the words): value k is byte k % 8 of word k // 8."""
    w0, w1 = np.uint64(0), np.uint64(0)
    if values.size > 16:
        return False, w0, w1
    for k in range(values.size):
        v = values[k]
        if v < 0 or v > 255:
            return False, w0, w1
        byte = np.uint64(v) << (np.uint64(k % 8) << _THREE)
        if k < 8:
            w0 |= byte
        else:
            w1 |= byte
    return True, w0, w1


@njit(cache=True, inline="always")
def _word_value(w0: np.uint64, w1: np.uint64, i: np.uint64) -> np.float32:
    """Value i of the table ``_table_words`` packed, as float32 (exactly float32 of the table's int32)."""
    w = w0 if i < _EIGHT else w1
    return np.float32(np.int32((w >> ((i & _SEVEN) << _THREE)) & _BYTE))


@njit(cache=True, inline="always")
def _quantize(x: np.ndarray, scale: np.float32, shift: np.float32, granularity: int, slope: np.ndarray,
              offset: np.ndarray, top: int, key: np.uint64, out: np.ndarray, residual: bool, values: np.ndarray,
              step: np.float32, low: np.float32, res: np.ndarray, first: int) -> None:
    """The two passes above: the blocks' indices, and with ``residual`` each block's x - X_i into res; x[0] is
    position ``first`` (a multiple of ``BLOCK``) of the vector, whose uniforms it takes."""
    if first % BLOCK:
        raise ValueError("a piece must start at a multiple of BLOCK")
    g = np.float32(granularity)
    zero = np.float32(0.0)
    last, cap = np.int32(granularity - 1), np.int32(top)
    ys = np.empty(BLOCK, np.float32)
    cells = np.empty(BLOCK, np.uint32)
    us = np.empty(BLOCK, np.float32)
    packed, w0, w1 = _table_words(values)
    in_place = res.ctypes.data == x.ctypes.data
    for s in range(0, x.size, BLOCK):
        m = min(BLOCK, x.size - s)
        xs, os, rs = x[s:s + m], out[s:s + m], res[s:s + m]
        for j in range(m):
            y = min(max(xs[j] * scale + shift, zero), g)
            ys[j] = y
            cells[j] = np.uint32(min(np.int32(y), last))
        if m == BLOCK:  # a whole block: one hash per two uniforms
            base = ((first + s) // BLOCK) * _HALF
            for j in range(_HALF):
                z = _mix(key, base + j)
                us[j] = _high(z)
                us[j + _HALF] = _low(z)
        else:
            for j in range(m):
                us[j] = _uniform(key, first + s + j)
        for j in range(m):
            c = cells[j]
            os[j] = min(np.int32(ys[j] * slope[c] + offset[c] + us[j]), cap)
        if residual:  # X_i into ys (free now), then x - X_i: loops that LLVM vectorises (``_table_words``)
            if packed:
                for j in range(m):
                    ys[j] = _word_value(w0, w1, np.uint64(os[j])) * step + low
            else:
                for j in range(m):
                    ys[j] = np.float32(values[os[j]]) * step + low
            if in_place:  # one array: LLVM's overlap check between two would keep the loop scalar
                for j in range(m):
                    xs[j] = xs[j] - ys[j]
            else:
                for j in range(m):
                    rs[j] = xs[j] - ys[j]


@njit(cache=True)
def uniforms(key: np.uint64, n: int) -> np.ndarray:
    """The uniforms ``quantize_into`` draws for positions 0..n-1 under ``key`` (float32)."""
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = _uniform(key, i)
    return out


@njit(cache=True, nogil=True)
def estimate_into(sums: np.ndarray, top: int, scale: np.float32, low: np.float32, out: np.ndarray) -> bool:
    """out[i] = float32(sums[i]) * scale + low (``quantize.from_grid``'s arithmetic, in its order) in one
    pass; False if a sum lies outside [0, top] (a wrong count or corrupt data: the caller raises; ``out``
    is then garbage). The range is checked through the pass's min and max, not a branch per sum, so that
    the loop vectorises."""
    lo, hi = sums[0], sums[0]
    for i in range(sums.size):
        v = sums[i]
        lo = min(lo, v)
        hi = max(hi, v)
        out[i] = np.float32(v) * scale + low
    return lo >= 0 and hi <= top



# The rotation's passes. The signs come as the 32-bit words of ``signs.sign_words_u32`` (bit i mod 32 of
# word i // 32 set: coordinate i is -1) and are applied as a multiplication by +1.0 or -1.0, exactly what
# the torch path's multiplication by its float signs computes; the inverse's normalisation by c = 1/sqrt(D)
# comes first, as in ``hadamard.fwht``. Materialising 2^22 float signs cost 8 ms per step; these words
# are 512 KiB. Each loop walks whole words with a constant inner count of 32, which LLVM vectorises
# (1.6 ms for 2^22 coordinates, as fast as a copy; a shift by i mod 32 per coordinate took 4.7 ms).
#
# _SQUARES: the forward passes also sum the squares of what they rotate, for the norm the worker publishes,
# so that the norm costs no pass of its own (torch's norm read the 16 MiB of a 2^22 bucket again: 1.5-1.7
# ms, while the sums add nothing measurable to a pass that waits for memory). Each of the 32 positions of a
# word keeps its own float64 partial sum, so the loop still vectorises without reassociating anything;
# float64 makes the norm exact to about 1e-15 (torch's float32 norm of 2^20 normal values was off by 1e-5).

@njit(cache=True, inline="always")
def _sign(word: np.int64, k: int) -> np.float32:
    return np.float32(1 - 2 * ((word >> k) & 1))


@njit(cache=True, nogil=True)
def signs_pad_into(x: np.ndarray, words: np.ndarray, c: np.float32, out: np.ndarray) -> float:
    """out[i] = (x[i] * s_i) * c for i < x.size and 0 beyond (the RHT's sign flip, zero padding and a
    power-of-two normalisation, ``hadamard.RandomizedHadamard.forward``, in one pass); returns the sum of
    x's squares (float64, ``_SQUARES``)."""
    n = x.size
    acc = np.zeros(32, np.float64)
    for j in range(n // 32):
        w, b = np.int64(words[j]), j * 32
        for k in range(32):
            v = x[b + k]
            out[b + k] = (v * _sign(w, k)) * c
            acc[k] += np.float64(v) * np.float64(v)
    ss = 0.0
    for i in range(n - n % 32, n):
        out[i] = (x[i] * _sign(np.int64(words[i >> 5]), i & 31)) * c
        ss += np.float64(x[i]) * np.float64(x[i])
    for i in range(n, out.size):
        out[i] = np.float32(0.0)
    return ss + acc.sum()


@njit(cache=True, nogil=True)
def sum_signs_pad_into(a: np.ndarray, b: np.ndarray, words: np.ndarray, c: np.float32, x: np.ndarray,
                       out: np.ndarray) -> float:
    """x[i] = a[i] + b[i] and out[i] = (x[i] * s_i) * c, 0 beyond x.size: the gradient plus its error
    feedback and its sign flip in one pass (``forward_sum``); x may be a or b. Returns the sum of x's
    squares (float64, ``_SQUARES``)."""
    return _sum_signs_pad(a, b, words, c, x, out, True)


@njit(cache=True, nogil=True)
def sum_signs_pad_only(a: np.ndarray, b: np.ndarray, words: np.ndarray, c: np.float32, out: np.ndarray) -> float:
    """``sum_signs_pad_into`` without writing the sum a + b: for a caller that does not keep it (the DDP hook's
    worker, whose quantization leaves the error feedback's residual and needs no x). One stream of 4 bytes
    per coordinate fewer: 1.7-1.9 against 2.3-2.4 ms for 4.19 M coordinates out of the cache."""
    return _sum_signs_pad(a, b, words, c, a, out, False)


@njit(cache=True, inline="always")
def _sum_signs_pad(a: np.ndarray, b: np.ndarray, words: np.ndarray, c: np.float32, x: np.ndarray,
                   out: np.ndarray, keep: bool) -> float:
    """The two passes above; x is written only with ``keep`` (a constant of each, folded away)."""
    n = a.size
    acc = np.zeros(32, np.float64)
    for j in range(n // 32):
        w, base = np.int64(words[j]), j * 32
        for k in range(32):
            v = a[base + k] + b[base + k]
            if keep:
                x[base + k] = v
            out[base + k] = (v * _sign(w, k)) * c
            acc[k] += np.float64(v) * np.float64(v)
    ss = 0.0
    for i in range(n - n % 32, n):
        v = a[i] + b[i]
        if keep:
            x[i] = v
        out[i] = (v * _sign(np.int64(words[i >> 5]), i & 31)) * c
        ss += np.float64(v) * np.float64(v)
    for i in range(n, out.size):
        out[i] = np.float32(0.0)
    return ss + acc.sum()


@njit(cache=True, nogil=True)
def add_squares_into(x: np.ndarray, e: np.ndarray) -> float:
    """x[i] += e[i] and the sum of the new x's squares (float64, ``_SQUARES``) in one pass: a rotated
    gradient plus error feedback kept in the rotated domain (``THCConfig.rotation = "fixed"``), and the
    norm of what will be quantized."""
    n = x.size
    acc = np.zeros(32, np.float64)
    for j in range(n // 32):
        b = j * 32
        for k in range(32):
            v = x[b + k] + e[b + k]
            x[b + k] = v
            acc[k] += np.float64(v) * np.float64(v)
    ss = 0.0
    for i in range(n - n % 32, n):
        v = x[i] + e[i]
        x[i] = v
        ss += np.float64(v) * np.float64(v)
    return ss + acc.sum()


@njit(cache=True, nogil=True)
def unscale_signs_into(raw: np.ndarray, words: np.ndarray, c: np.float32, out: np.ndarray) -> None:
    """out[i] = s_i * (raw[i] * c) for i < out.size: the inverse RHT's last two passes over the transformed
    ``raw``, written straight into the length-d destination (``out`` may be ``raw``'s head)."""
    n = out.size
    for j in range(n // 32):
        w, b = np.int64(words[j]), j * 32
        for k in range(32):
            out[b + k] = (raw[b + k] * c) * _sign(w, k)
    for i in range(n - n % 32, n):
        out[i] = (raw[i] * c) * _sign(np.int64(words[i >> 5]), i & 31)


@njit(cache=True, nogil=True)
def minus_unscale_signs_into(x: np.ndarray, raw: np.ndarray, words: np.ndarray, c: np.float32,
                             out: np.ndarray) -> None:
    """out[i] = x[i] - s_i * (raw[i] * c): the error feedback's x - RHT^-1(X_i) without the intermediate."""
    n = out.size
    for j in range(n // 32):
        w, b = np.int64(words[j]), j * 32
        for k in range(32):
            out[b + k] = x[b + k] - (raw[b + k] * c) * _sign(w, k)
    for i in range(n - n % 32, n):
        out[i] = x[i] - (raw[i] * c) * _sign(np.int64(words[i >> 5]), i & 31)


@njit(cache=True, nogil=True)
def lookup_estimate_into(indices: np.ndarray, values: np.ndarray, step: np.float32, low: np.float32,
                         out: np.ndarray) -> None:
    """out[i] = float32(values[indices[i]]) * step + low: a worker's own quantized values X_i on the grid
    (``quantize.from_grid`` of the table lookup, its arithmetic in its order) in one pass."""
    packed, w0, w1 = _table_words(values)
    if packed:
        for i in range(indices.size):
            out[i] = _word_value(w0, w1, np.uint64(indices[i])) * step + low
        return
    for i in range(indices.size):
        out[i] = np.float32(values[indices[i]]) * step + low
