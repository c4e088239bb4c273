"""The optimal lookup table T_{b,g,p} of non-uniform THC (THC paper, Section 5.3 and Appendix B).

Problem: choose 2^b values T[0] < ... < T[2^b - 1] from the grid {0, ..., g} (grid point i stands for
a = -t_p + 2 t_p i / g, with t_p = Phi^-1(1 - p/2)) and quantization probabilities P(a, z) that are
unbiased, minimising the expected variance of quantizing A ~ N(0, 1) over [-t_p, t_p], weighted by
the standard normal density (not renormalised to the truncation).

Facts used by the exact solver (no symmetry assumption):
* For a fixed set of values, the unbiased quantizer of least variance rounds a to one of the two
  adjacent values (stochastic rounding); its variance at a in [l, u] is (a - l)(u - a).
* Unbiasedness at a = -t_p and a = t_p forces T[0] = 0 and T[2^b - 1] = g.
* Adding a value never increases the variance, so all 2^b values are distinct and the objective is a
  sum of independent per-segment costs c(l, u) = int_l^u (a - l)(u - a) phi(a) da.
So the optimum is a shortest path from grid point 0 to grid point g using exactly 2^b - 1 segments,
which dynamic programming solves exactly in O(2^b * g^2) time.

About the paper: Appendix B prunes the search for odd g with the constraint
T(z) = T(z + 2^(b-1)) - (g + 1)/2. The text motivates it by the mirror symmetry of the normal density
(T(z) in the table iff g - T(z) is), but the formula as printed is a translation of the lower half
onto the upper half, not a reflection: for b = 3, g = 9, p = 1/32 it excludes the optimum
(0, 2, 3, 4, 5, 6, 7, 9), objective 0.05924, and the best table it admits, (0, 2, 3, 4, 5, 7, 8, 9),
scores 0.08162. Even the reflection is not safe to impose: for b = 2, g = 7 the two optimal tables
(0, 3, 5, 7) and (0, 2, 4, 7) are mirror images of each other (objective 0.35716) and the best
mirror-symmetric table (0, 3, 4, 7) scores 0.42138. So this solver assumes no symmetry; the tests
compare it with brute-force enumeration of all monotone tables.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import zlib
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri

from worker_lib.values import is_integer

MAX_GRANULARITY = 4096  # the dynamic programme holds a (g + 1)^2 matrix of float64 costs


def parse_fraction(text: str) -> float:
    """A probability written as a decimal ("0.03125") or a fraction ("1/32"); ValueError otherwise."""
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"not a number or a fraction like 1/32: {text!r}") from None


def truncation_threshold(p: float) -> float:
    """t_p = Phi^-1(1 - p/2): a standard normal leaves [-t_p, t_p] with probability p."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p!r}")
    t_p = float(ndtri(1.0 - p / 2.0))
    if t_p == math.inf:  # the table's grid would be all inf and nan, refused later under another name
        raise ValueError(f"p = {p!r} is too small: 1 - p/2 rounds to 1 in a double, so t_p is infinite")
    return t_p


def validate_parameters(bits: int, granularity: int) -> None:
    """Raise ValueError unless 1 <= bits <= 8 and 2^bits - 1 <= granularity <= MAX_GRANULARITY."""
    if not is_integer(bits) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    if not is_integer(granularity):
        raise ValueError(f"granularity must be an integer, got {granularity!r}")
    if granularity < (1 << bits) - 1:
        raise ValueError(f"granularity must be >= 2^bits - 1 = {(1 << bits) - 1} for {bits} bits, "
                         f"got {granularity}")
    if granularity > MAX_GRANULARITY:
        raise ValueError(f"granularity above {MAX_GRANULARITY} is not supported, got {granularity}")


def _segment_cost(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """int_lo^hi (a - lo)(hi - a) phi(a) da = hi phi(lo) - lo phi(hi) - (1 + lo hi)(Phi(hi) - Phi(lo))."""
    pdf_lo = np.exp(-0.5 * lo * lo) / np.sqrt(2 * np.pi)
    pdf_hi = np.exp(-0.5 * hi * hi) / np.sqrt(2 * np.pi)
    # Phi(hi) - Phi(lo) from the tail that keeps precision
    mass = np.where(lo >= 0, ndtr(-lo) - ndtr(-hi), ndtr(hi) - ndtr(lo))
    return hi * pdf_lo - lo * pdf_hi - (1.0 + lo * hi) * mass


def grid_points(granularity: int, t_p: float) -> np.ndarray:
    """The a-domain position of every grid value 0..g."""
    return -t_p + 2.0 * t_p * np.arange(granularity + 1, dtype=np.float64) / granularity


def table_objective(values: np.ndarray | list[int], granularity: int, p: float) -> float:
    """The paper's objective for a given increasing table (first 0, last g)."""
    v = np.asarray(values, dtype=np.int64)
    if v[0] != 0 or v[-1] != granularity or np.any(np.diff(v) <= 0):
        raise ValueError("a table must increase strictly from 0 to the granularity")
    a = grid_points(granularity, truncation_threshold(p))[v]
    return float(np.sum(_segment_cost(a[:-1], a[1:])))


@dataclass(frozen=True)
class LookupTable:
    """A THC lookup table: index z (b bits) -> integer value T[z] in 0..g."""

    bits: int
    granularity: int
    p: float | None
    values: tuple[int, ...]
    objective: float | None

    def __post_init__(self) -> None:
        validate_parameters(self.bits, self.granularity)
        v = self.values
        if len(v) != 1 << self.bits or v[0] != 0 or v[-1] != self.granularity or any(
                b <= a for a, b in itertools.pairwise(v)):
            raise ValueError("table must hold 2^bits strictly increasing values from 0 to g")

    @property
    def size(self) -> int:
        return 1 << self.bits

    def as_array(self) -> np.ndarray:
        """Table values as int32 (the aggregator's lookup)."""
        return np.asarray(self.values, dtype=np.int32)

    def table_id(self) -> int:
        """A 16-bit identifier of (bits, granularity, values), carried in packets to refuse mismatches."""
        blob = json.dumps([self.bits, self.granularity, list(self.values)]).encode()
        return zlib.crc32(blob) & 0xFFFF

    def to_json(self) -> dict:
        return {"bits": self.bits, "granularity": self.granularity, "p": self.p,
                "table": list(self.values), "objective": self.objective}


def uniform_table(bits: int) -> LookupTable:
    """The identity table of uniform THC (Algorithm 1): g = 2^b - 1, T[z] = z."""
    validate_parameters(bits, (1 << bits) - 1)
    g = (1 << bits) - 1
    return LookupTable(bits=bits, granularity=g, p=None, values=tuple(range(g + 1)), objective=None)


@functools.lru_cache(maxsize=64)
def solve_table(bits: int, granularity: int, p: float) -> LookupTable:
    """The exact optimum T_{b,g,p} (ties broken towards smaller values) and its objective."""
    validate_parameters(bits, granularity)
    t_p = truncation_threshold(p)
    g, segments = int(granularity), (1 << bits) - 1
    a = grid_points(g, t_p)
    # Dynamic programme over segments: best[j] is the least cost of reaching grid value j with k
    # segments; a segment ends at j and starts at some i < j. cost[j, i] holds the segment i -> j so that
    # each row's argmin runs over contiguous memory, and rows are taken in blocks that need only the
    # columns i < j (a lower triangle): the same sums and the same first-minimum ties as the plain
    # (g+1)^2 table, about 6x faster for g = 4000 (seconds, not half a minute).
    cost = _segment_cost(a[None, :], a[:, None])
    cost[np.triu_indices(g + 1)] = np.inf  # a segment must move right
    best = np.full(g + 1, np.inf)
    best[0] = 0.0
    parent = np.zeros((segments, g + 1), dtype=np.int32)
    block = 64
    for k in range(segments):
        nxt = np.full(g + 1, np.inf)
        for r in range(1, g + 1, block):
            end = min(r + block, g + 1)
            total = cost[r:end, :end - 1] + best[None, :end - 1]
            parent[k, r:end] = np.argmin(total, axis=1)
            nxt[r:end] = total[np.arange(end - r), parent[k, r:end]]
        best = nxt
    values = [g]
    for k in range(segments - 1, -1, -1):
        values.append(int(parent[k, values[-1]]))
    values.reverse()
    return LookupTable(bits=bits, granularity=g, p=float(p), values=tuple(values),
                       objective=float(best[g]))
