"""The transport's pacing (worker_lib/pacing.py): the RFC 6298 timeout and the AIMD window, checked
against values worked out by hand from the RFC and the AIMD rules."""

from __future__ import annotations

import pytest

from worker_lib.pacing import Pacer


def pacer(**kw: object) -> Pacer:
    args = {"timeout": 0.01, "max_timeout": 5.0, "max_window": 64, "initial_window": 16} | kw
    return Pacer(**args)  # type: ignore[arg-type]


def test_rto_follows_rfc6298() -> None:
    """The timeout starts at ``timeout``, then is SRTT + 4 RTTVAR (first sample: SRTT = R, RTTVAR = R/2;
    then gains 1/8 and 1/4), clamped to [timeout, max_timeout], doubled by each expiry until a clean
    sample."""
    p = pacer()
    assert p.rto() == 0.01
    p.sample(0.1)  # SRTT 0.1, RTTVAR 0.05
    assert p.rto() == pytest.approx(0.3)
    p.sample(0.3)  # RTTVAR = 0.75 * 0.05 + 0.25 * 0.2 = 0.0875; SRTT = 0.875 * 0.1 + 0.125 * 0.3 = 0.125
    assert (p.srtt, p.rttvar) == (pytest.approx(0.125), pytest.approx(0.0875))
    assert p.rto() == pytest.approx(0.475)
    p.expired(0.0)
    p.expired(0.0)
    assert p.rto() == pytest.approx(4 * 0.475)
    for _ in range(10):
        p.expired(0.0)
    assert p.rto() == 5.0 and p.backoff == 4  # 0.475 * 2^4 > 5: the backoff stops at the ceiling
    p.sample(0.125)  # RTTVAR = 0.75 * 0.0875 = 0.065625, SRTT unchanged; the backoff ends
    assert p.rto() == pytest.approx(0.125 + 4 * 0.065625)
    p.sample(50.0)
    assert p.rto() == 5.0
    tiny = pacer(timeout=0.2)
    tiny.sample(0.001)
    assert tiny.rto() == 0.2  # never below the floor


def test_window_is_aimd() -> None:
    """Slow start adds one use per answer up to ssthresh; an expiry halves the window once per round
    trip (not below 2); beyond ssthresh one use per window of answers; never above max_window."""
    p = pacer(max_window=40, initial_window=16)
    assert p.window() == 16
    for _ in range(20):
        p.answered()
    assert p.window() == 36
    p.sample(0.5)  # SRTT 0.5 s: at most one cut per half second
    p.expired(10.0)
    assert (p.window(), p.ssthresh) == (18, 18.0)
    p.expired(10.2)  # within the round trip of the last cut: no second cut
    assert p.window() == 18
    p.expired(10.6)
    assert p.window() == 9
    for _ in range(9):  # at ssthresh: each answer adds 1/cwnd (9 -> 9.111 -> 9.221 -> ... -> 9.955)
        p.answered()
    assert p.window() == 9 and p.cwnd == pytest.approx(9.955, abs=1e-3)
    for now in (20.0, 21.0, 22.0, 23.0, 24.0):
        p.expired(now)
    assert p.window() == 2
    for _ in range(10_000):
        p.answered()
    assert p.window() == 40


def test_fixed_pacing_ignores_samples_and_expiries() -> None:
    """With both adaptations off (zero-fill), the timeout and the window never move."""
    p = pacer(adaptive_timeout=False, congestion_control=False, max_window=8)
    p.sample(0.3)
    p.expired(1.0)
    p.answered()
    assert (p.rto(), p.window()) == (0.01, 8)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        pacer(timeout=0.5, max_timeout=0.1)
    with pytest.raises(ValueError, match="max_window"):
        pacer(max_window=0)
