"""Widths chosen for the user: the index bits b and granularity g of a THC job from its worker count and
the width of the sums that aggregate it, so that the sums can never overflow.

Why: a switch adds n looked-up values of at most g into a sum of ``result_bits`` bits, so g * n must stay
below 2^result_bits, and a table of 2^b values from 0 to g needs g >= 2^b - 1. Picking g by hand for each
worker count is error-prone (8-bit sums allow g = 30 up to n = 8, g = 7 at n = 32). ``choose_widths``
takes, when asked, the largest b up to ``DEFAULT_AUTO_BITS`` that the sums leave room for, and the g the
sums allow (up to ``MAX_AUTO_GRANULARITY``, past which the table barely improves) whose optimal table
rounds best. Its cost is reported as the table's objective (the variance of stochastic rounding onto the
table, THC paper Section 5.3: what a bounded g costs in NMSE) beside that of the same b, or of b = 4 for
``bits=auto``, with ``MAX_AUTO_GRANULARITY``.

With a two-tier tree (leaf and spine aggregators), the sums of every tier hold n * g at most, where n
counts the workers below that tier; the narrowest tier's width over its workers is what binds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from worker_lib.thc.table import solve_table

#: Result width assumed when none is given: the switch programs' (p4gen) default sums, and the
#: smallest result packets.
DEFAULT_AUTO_RESULT_BITS = 8
#: b chosen by ``bits=auto`` where g allows it (4-bit indices, as in the THC paper).
DEFAULT_AUTO_BITS = 4
#: Largest g chosen: the table's objective at b = 4 is within 0.2 % of its limit there.
MAX_AUTO_GRANULARITY = 255


class WidthError(ValueError):
    """No (b, g) lets n workers' sums fit the result width; the message says what to change."""


@dataclass(frozen=True)
class WidthChoice:
    """The chosen widths and what they cost: ``objective`` is the chosen table's, ``best_objective`` that
    of the b asked for (4 for ``bits=auto``) with g = MAX_AUTO_GRANULARITY: sums wide enough not to bind."""

    bits: int
    granularity: int
    result_bits: int
    objective: float
    best_objective: float

    @property
    def cost(self) -> float:
        """Relative increase of the rounding variance over sums that do not bind (0.05: 5 % more)."""
        return self.objective / self.best_objective - 1

    def describe(self, workers: int) -> str:
        """One line for logs and CLIs."""
        return (f"auto widths for {workers} workers and {self.result_bits}-bit sums: b = {self.bits}, g = "
                f"{self.granularity} (g * n = {self.granularity * workers} < {1 << self.result_bits}); rounding "
                f"variance {self.objective:.6g}, {100 * self.cost:+.1f} % against {self.best_objective:.6g} with "
                f"sums that do not bind")


def choose_widths(workers: int, result_bits: int | None = None, bits: int | None = None,
                  p: float = 1 / 32) -> WidthChoice:
    """(b, g, result bits) for ``workers`` contributors whose sums have ``result_bits`` bits (default 8).

    ``bits`` None chooses b too (the largest up to 4 that g allows); a given b is kept or refused. Raises
    WidthError, saying what to change, where no choice fits."""
    if workers < 1:
        raise WidthError(f"workers must be at least 1, got {workers}")
    width = DEFAULT_AUTO_RESULT_BITS if result_bits is None else result_bits
    if width not in (8, 16, 32):
        raise WidthError(f"result_bits must be 8, 16 or 32, got {width}")
    top = min(((1 << width) - 1) // workers, MAX_AUTO_GRANULARITY)
    wider = "result_bits=16" if width == 8 else "result_bits=32" if width == 16 else "fewer workers"
    if top < 1:
        raise WidthError(f"{workers} workers overflow {width}-bit sums even with g = 1: use {wider}")
    most = (top + 1).bit_length() - 1  # the largest b with 2^b - 1 <= g
    wanted = DEFAULT_AUTO_BITS if bits is None else bits
    if bits is None:
        bits = min(DEFAULT_AUTO_BITS, most)
    elif (1 << bits) - 1 > top:
        raise WidthError(f"b = {bits} needs g >= {(1 << bits) - 1}, but {width}-bit sums over {workers} workers "
                         f"allow g <= {top}: use {wider}, bits={most} (or bits=auto), or fewer workers")
    objective, g = best_granularity(bits, top, p)
    reference, _ = best_granularity(wanted, MAX_AUTO_GRANULARITY, p)
    return WidthChoice(bits, g, width, objective, reference)


@functools.lru_cache(maxsize=64)
def best_granularity(bits: int, top: int, p: float) -> tuple[float, int]:
    """(objective, g) of the g in 2^b - 1 .. ``top`` whose optimal table rounds best. Why a search: the
    objective is not monotone in g (at b = 4, g = 28 rounds worse than g = 15)."""
    return min((solve_table(bits, g, p).objective, g) for g in range((1 << bits) - 1, top + 1))
