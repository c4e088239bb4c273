"""The transport's pacing (worker_lib/pacing.py): the quartile timeout with its per-use backoff and the
window that only a burst of losses or a growing queue holds back, checked against values worked out by
hand from the rules in the module's text."""

from __future__ import annotations

import numpy as np
import pytest

from worker_lib.pacing import Pacer


def pacer(**kw: object) -> Pacer:
    args = {"timeout": 0.01, "max_timeout": 5.0, "max_window": 64, "initial_window": 16} | kw
    return Pacer(**args)  # type: ignore[arg-type]


def test_rto_is_three_lower_quartile_round_trips_with_a_per_use_backoff() -> None:
    """``timeout`` before any clean sample, doubled by each expiry (to the ceiling); from the first
    sample on, 3 x the lower quartile of the samples (numpy's linear quantile: of 1, 2, 3, 4 ms it is
    1.75 ms), within [min_timeout, max_timeout]; a use resent k times waits 2^min(k, 3) times that."""
    p = pacer(min_timeout=0.001)
    assert p.rto() == 0.01
    p.expired(0.0, 1)
    p.expired(0.1, 5)
    assert p.rto() == pytest.approx(0.04) and p.rto(1) == pytest.approx(0.08)
    p.sample(0.001)
    assert p.rto() == pytest.approx(0.003)  # 3 R: RFC 6298's first timeout, R + 4 R/2
    for rtt in (0.002, 0.003, 0.004):
        p.sample(rtt)
    assert p.rtt == pytest.approx(0.00175)
    assert p.rto() == pytest.approx(0.00525)
    p.expired(1.0, 50)  # with samples, expiries back off only their own uses
    assert p.rto() == pytest.approx(0.00525)
    assert (p.rto(1), p.rto(3), p.rto(9)) == (pytest.approx(0.0105), pytest.approx(0.042), pytest.approx(0.042))
    assert np.allclose(p.rto(np.array([0, 1, 5])), [0.00525, 0.0105, 0.042])
    floor = pacer(timeout=0.2, min_timeout=0.05)
    ceiling = pacer(max_timeout=1.0)
    for _ in range(4):
        floor.sample(0.001)
        ceiling.sample(0.5)
    assert floor.rto() == 0.05
    assert ceiling.rto() == 1.0 and ceiling.rto(3) == 1.0
    for _ in range(20):
        ceiling.expired(0.0)
    assert pacer(max_timeout=1.0).rto() == 0.01


def test_waits_for_other_workers_do_not_inflate_the_timeout() -> None:
    """A quarter of the clean samples waited 0.5 s for another worker's recovery: the lower quartile of
    the last 32 is still the 2 ms of the others (RFC 6298's mean + 4 deviations would be about 0.6 s)."""
    p = pacer(min_timeout=0.001)
    for i in range(32):
        p.sample(0.5 if i % 4 == 3 else 0.002)
    assert p.rto() == pytest.approx(0.006)


def test_window_grows_and_only_a_burst_of_losses_cuts_it() -> None:
    """Slow start adds one use per answer. Within one round trip (here the 10 ms floor of the timeout),
    3 expiries, or 13 expiries among 33 ended uses, are scattered loss: no cut. 6 expiries out of 6 are a
    burst: the window halves, at most once per round trip, not below 2. At ssthresh each answer adds
    1/cwnd; never above max_window."""
    p = pacer(max_window=40, initial_window=16)
    p.sample(0.002)  # a round trip is known: the timeout, and the round trip of the cuts, is min_timeout
    assert p.window() == 16 and p.rto() == 0.01
    for _ in range(20):
        p.answered(0.0)
    assert p.window() == 36
    p.expired(0.001, 3)
    p.expired(0.002, 10)
    assert p.window() == 36 and p.cuts == 0
    p.expired(1.0, 6)
    assert (p.window(), p.ssthresh, p.cuts) == (18, 18.0, 1)
    p.expired(1.005, 6)  # within the round trip of the last cut
    assert p.window() == 18
    p.expired(1.02, 6)
    assert p.window() == 9
    for _ in range(9):  # at ssthresh: each answer adds 1/cwnd (9 -> 9.111 -> 9.221 -> ... -> 9.955)
        p.answered(2.0)
    assert p.window() == 9 and p.cwnd == pytest.approx(9.955, abs=1e-3)
    for now in (3.0, 4.0, 5.0, 6.0):
        p.expired(now, 8)
    assert p.window() == 2
    for _ in range(10_000):
        p.answered(7.0)
    assert p.window() == 40


def test_a_growing_queue_stops_the_window_growing() -> None:
    """Base round trip 1 ms, the last 8 samples' median 10 ms: 16 * (1 - 0.1) = 14.4 uses queued, above
    6: the window stays and slow start ends. Once the round trips are back near the base (1.1 ms: 1.45
    queued) it grows again, now by 1/cwnd per answer."""
    p = pacer(max_window=64, initial_window=16)
    p.sample(0.001)
    for _ in range(7):
        p.sample(0.01)
    assert p.queue() == pytest.approx(14.4)
    p.answered(0.0)
    assert (p.window(), p.ssthresh) == (16, 16.0)
    for _ in range(8):
        p.sample(0.0011)
    assert p.queue() == pytest.approx(16 * (1 - 1 / 1.1))
    p.answered(0.0)
    assert p.cwnd == pytest.approx(16 + 1 / 16)


def test_fixed_pacing_ignores_samples_and_expiries() -> None:
    """With both adaptations off (zero-fill), the timeout and the window never move."""
    p = pacer(adaptive_timeout=False, congestion_control=False, max_window=8)
    for _ in range(8):
        p.sample(0.3)
    p.expired(1.0, 50)
    p.answered(1.0)
    assert (p.rto(), p.rto(3), p.window()) == (0.01, 0.01, 8)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout"):
        pacer(timeout=0.5, max_timeout=0.1)
    with pytest.raises(ValueError, match="max_window"):
        pacer(max_window=0)
    with pytest.raises(ValueError, match="min_timeout"):
        pacer(min_timeout=0.02)
    with pytest.raises(ValueError, match="max_backoff"):
        pacer(max_backoff=17)
