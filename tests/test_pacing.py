"""The transport's pacing (worker_lib/pacing.py): the quartile timeout with its per-use backoff and the
window that only a burst of losses or a growing queue holds back, checked against values worked out by
hand from the rules in the module's text."""

from __future__ import annotations

import numpy as np
import pytest

from worker_lib.pacing import Pacer, extend_loss_runs
from worker_lib.resend_timers import due_uses


def pacer(**kw: object) -> Pacer:
    args = {"timeout": 0.01, "max_timeout": 5.0, "max_window": 64, "initial_window": 16} | kw
    return Pacer(**args)  # type: ignore[arg-type]


def test_rto_is_three_lower_quartile_round_trips_with_a_per_use_backoff() -> None:
    """``timeout`` before any clean sample, doubled by each expiry (to the ceiling); from the first
    sample on, 3 x the lower quartile of the samples (numpy's linear quantile: of 1, 2, 3, 4 ms it is
    1.75 ms), within [min_timeout, max_timeout]; a use resent k times waits 2^min(k, max_backoff)
    times that (max_backoff 1 by default, 3 here)."""
    p = pacer(min_timeout=0.001, max_backoff=3)
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
    default = pacer(min_timeout=0.001)
    default.sample(0.001)
    assert (default.rto(1), default.rto(5)) == (pytest.approx(0.006), pytest.approx(0.006))


def test_a_silent_path_backs_off_further() -> None:
    """Timeout 3 ms, max_backoff 1. While answers come (silent < max(8 timeouts, 0.25 s)) a resent use
    waits 6 ms at most; silent 0.25 s: one more doubling (12 ms); 0.5 s: two more (24 ms); 1 s: three;
    never past DEAD_BACKOFF = 6 doublings (192 ms) nor max_timeout."""
    p = pacer(min_timeout=0.001)
    p.sample(0.001)
    assert p.rto(5, silent=0.2) == pytest.approx(0.006)
    assert p.rto(5, silent=0.25) == pytest.approx(0.012)
    assert p.rto(5, silent=0.5) == pytest.approx(0.024)
    assert p.rto(5, silent=1.0) == pytest.approx(0.048)
    assert p.rto(9, silent=100.0) == pytest.approx(0.192)
    assert p.rto(1, silent=100.0) == pytest.approx(0.006)  # a use resent once has had one doubling only
    assert p.rto(0, silent=100.0) == pytest.approx(0.003)
    assert pacer(max_timeout=0.1, min_timeout=0.001).rto(9, silent=100.0) <= 0.1
    slow = pacer(min_timeout=0.001)
    slow.sample(0.05)  # timeout 0.15 s: silent means 8 timeouts, 1.2 s
    assert slow.rto(5, silent=1.0) == pytest.approx(0.3) and slow.rto(5, silent=1.25) == pytest.approx(0.6)


def test_the_oldest_use_of_a_window_is_never_backed_off_for_silence() -> None:
    """The others wait for this worker to move its window on: its oldest open use keeps rto * 2 (one
    doubling), the rest get the silent path's backoff (6 and 192 ms with a 3 ms timeout, as above)."""
    p = pacer(min_timeout=0.001)
    p.sample(0.001)
    assert (p.backoff_cap(), p.backoff_cap(0.1), p.backoff_cap(100.0)) == (1, 1, 6)
    sent_at, heard, tries, done = np.zeros(3), np.full(3, np.inf), np.array([9, 9, 0]), np.zeros(3, bool)

    def due(now: float) -> tuple[list[int], float]:
        out = np.empty(3, np.int64)
        n, _, next_at = due_uses(0, 3, now, sent_at, heard, tries, done, False, p.base_rto(), p.backoff_cap(),
                                 p.backoff_cap(100.0), p.max_timeout, -np.inf, -1, 0.0, 0.0, -1, out,
                                 np.empty(3, bool))
        return out[:n].tolist(), next_at

    assert due(0.0059) == ([2], pytest.approx(0.003))  # the oldest: 6 ms; the second: 192 ms; the third: 3 ms
    assert due(0.0061)[0] == [0, 2] and due(0.1915)[0] == [0, 2] and due(0.1925)[0] == [0, 1, 2]


def test_the_first_timeout_doubles_once_per_timeout_not_once_per_expiry() -> None:
    """Before any sample a window of uses expiring one after another doubles the first timeout once
    (10 -> 20 ms); the next doubling needs another full timeout (20 ms) to pass."""
    p = pacer()
    for now in (0.0, 0.001, 0.002, 0.009):
        p.expired(now, 3)
    assert p.rto() == pytest.approx(0.02)
    p.expired(0.015, 3)  # 15 ms after the doubling, within the doubled 20 ms timeout
    assert p.rto() == pytest.approx(0.02)
    p.expired(0.020, 3)
    assert p.rto() == pytest.approx(0.04)


def test_waits_for_other_workers_do_not_inflate_the_timeout() -> None:
    """A quarter of the clean samples waited 0.5 s for another worker's recovery: the lower quartile of
    the last 32 is still the 2 ms of the others (RFC 6298's mean + 4 deviations would be about 0.6 s)."""
    p = pacer(min_timeout=0.001)
    for i in range(32):
        p.sample(0.5 if i % 4 == 3 else 0.002)
    assert p.rto() == pytest.approx(0.006)


def test_window_grows_and_only_a_burst_of_losses_cuts_it() -> None:
    """Slow start adds one use per answer. Expiries that are not a burst leave the window; a burst
    halves it, at most once per round trip (here the 10 ms floor of the timeout), not below 2. At
    ssthresh each answer adds 1/cwnd; never above max_window."""
    p = pacer(max_window=40, initial_window=16)
    p.sample(0.002)  # a round trip is known: the timeout, and the round trip of the cuts, is min_timeout
    assert p.window() == 16 and p.rto() == 0.01
    for _ in range(20):
        p.answered(0.0)
    assert p.window() == 36
    p.expired(0.001, 3)
    p.expired(0.002, 30)
    assert p.window() == 36 and p.cuts == 0
    p.expired(1.0, 6, burst=True)
    assert (p.window(), p.ssthresh, p.cuts) == (18, 18.0, 1)
    p.expired(1.005, 6, burst=True)  # within the round trip of the last cut
    assert p.window() == 18
    p.expired(1.02, 6, burst=True)
    assert p.window() == 9
    for _ in range(9):  # at ssthresh: each answer adds 1/cwnd (9 -> 9.111 -> 9.221 -> ... -> 9.955)
        p.answered(2.0)
    assert p.window() == 9 and p.cwnd == pytest.approx(9.955, abs=1e-3)
    for now in (3.0, 4.0, 5.0, 6.0):
        p.expired(now, 8, burst=True)
    assert p.window() == 2
    for _ in range(10_000):
        p.answered(7.0)
    assert p.window() == 40


@pytest.mark.parametrize(("start", "ssthresh", "count"), [(16.0, 40.0, 1), (16.0, 20.0, 30), (9.0, 9.0, 9),
                                                        (37.5, 10.0, 200), (3.0, 3.0, 5000), (20.25, 20.0, 64),
                                                        (2.0, 2.0, 1), (2.0, 2.0, 3), (500.0, 100.0, 40)])
def test_a_batch_of_answers_grows_the_window_as_many_single_answers(start: float, ssthresh: float,
                                                                     count: int) -> None:
    """``answered(now, count)`` takes a received batch at once; the window it leaves is the one that
    ``count`` answers one by one leave (slow start adds 1 each up to ssthresh, then 1/cwnd each; capped),
    within a thousandth of a use, and its whole part (the window in uses) is the same."""
    batch, single = pacer(max_window=512), pacer(max_window=512)
    for p in (batch, single):
        p.cwnd, p.ssthresh = start, ssthresh
    batch.answered(0.0, count)
    for _ in range(count):
        single.answered(0.0)
    expected = start  # the per-answer rule, written out here
    for _ in range(count):
        expected = min(512.0, expected + (1.0 if expected < ssthresh else 1.0 / expected))
    assert single.cwnd == pytest.approx(expected, abs=1e-9)
    assert batch.cwnd == pytest.approx(expected, abs=1e-3) and batch.window() == single.window()


def test_a_burst_is_a_run_of_consecutive_first_send_losses() -> None:
    """Uses 0..9 lost on their first send, in two timeouts' worth of expiries: the 10th makes the run a
    burst, once; the same ten losses scattered (every other use) are not; a larger ``need`` waits for a
    longer run."""
    runs = np.zeros(40, np.int64)
    assert not extend_loss_runs(runs, np.arange(0, 6))
    assert extend_loss_runs(runs, np.arange(6, 12))
    assert runs[11] == 12 and not extend_loss_runs(runs, np.arange(12, 14))  # the same run counts once
    scattered = np.zeros(40, np.int64)
    assert not extend_loss_runs(scattered, np.arange(0, 40, 2))
    assert scattered.max() == 1
    longer = np.zeros(40, np.int64)
    assert not extend_loss_runs(longer, np.arange(0, 12), need=16) and extend_loss_runs(longer, np.arange(12, 20),
                                                                                            need=16)


def test_random_loss_among_four_workers_rarely_makes_a_burst() -> None:
    """41 % of uses expiring independently (10 % loss each way, 4 workers): over 100,000 uses the runs
    that reach 10 number about 100,000 x 0.59 x 0.41^10 = 7.9; a queue overflow losing 20 of 32
    consecutive uses is caught at once."""
    rng = np.random.default_rng(1)
    lost = np.flatnonzero(rng.random(100_000) < 0.41)
    runs = np.zeros(100_000, np.int64)
    bursts = sum(extend_loss_runs(runs, chunk) for chunk in np.array_split(lost, 4000))
    assert bursts <= 20
    overflow = np.zeros(32, np.int64)
    assert extend_loss_runs(overflow, np.arange(12, 32))


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


def test_scheduling_jitter_is_not_a_queue() -> None:
    """Base round trip 0.3 ms, recent 1.5 ms: by the count of uses 16 * 0.8 = 12.8 are queued, but the
    added delay (1.2 ms) is below 2 ms: processes on shared cores, not a queue; the window keeps growing.
    At recent 3 ms (2.7 ms added) it stops."""
    p = pacer(max_window=64, initial_window=16)
    p.sample(0.0003)
    for _ in range(7):
        p.sample(0.0015)
    assert p.queue() == pytest.approx(12.8)
    p.answered(0.0)
    assert p.cwnd == 17.0
    for _ in range(8):
        p.sample(0.003)
    p.answered(0.0)
    assert (p.window(), p.ssthresh) == (17, 17.0)


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
