"""worker_lib.resend_timers: the compiled deadlines of a window's open uses against the same rules written
here as numpy expressions (the transport's formulation before it was compiled), on random windows."""

from __future__ import annotations

import numpy as np
import pytest

from worker_lib.pacing import Pacer
from worker_lib.resend_timers import due_uses


def reference(base: int, nxt: int, now: float, sent_at: np.ndarray, heard: np.ndarray, tries: np.ndarray,
              done: np.ndarray, from_heard: bool, rto_base: float, cap_oldest: int, cap_rest: int,
              max_timeout: float, rack_sent: float, rack_use: int, rack_rtt: float,
              margin: float, rack_above: int) -> tuple[list[int], list[bool], int, float]:
    """Due uses, whether RACK made each due, RACK's share of them and the earliest deadline, by whole-window
    array expressions."""
    at = sent_at[base:nxt]
    start = at
    if from_heard and at.size:
        start = heard[base:nxt].copy()
        if start[0] == np.inf:
            start[0] = at[0]
    caps = np.full(at.size, cap_rest)
    caps[:1] = cap_oldest
    timer_at = start + np.minimum(max_timeout, rto_base * np.exp2(np.minimum(tries[base:nxt], caps)))
    rack_at = np.full(at.size, np.inf)
    if rack_use >= 0:
        use = np.arange(base, nxt)
        before = (at < rack_sent) | ((at == rack_sent) & (use < rack_use))
        before |= (tries[base:nxt] == 0) & (use < rack_above)  # first sent before a resent use now answered
        rack_at[before] = at[before] + rack_rtt + margin
    open_ = ~done[base:nxt]
    due_at = np.minimum(timer_at, rack_at)
    due = np.flatnonzero(open_ & (due_at <= now))
    return ((base + due).tolist(), (rack_at[due] <= now).tolist(), int(np.count_nonzero(rack_at[due] <= now)),
            float(due_at[open_].min()) if open_.any() else np.inf)


@pytest.mark.parametrize("seed", range(300))
def test_random_windows_agree_with_the_array_rules(seed: int) -> None:
    """Windows of 0-600 uses with sends, hearings, resends, answered uses, RACK marks and silences drawn
    at random (ties of send times included, as a GSO run's uses share one stamp): the same due uses in the
    same order, the same RACK count and the same earliest deadline, bit for bit."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 700))
    base = int(rng.integers(0, count))
    nxt = int(rng.integers(base, count + 1))
    sent_at = np.round(rng.uniform(0, 0.05, count), 3)  # rounded: many equal stamps
    heard = np.where(rng.random(count) < 0.4, np.inf, sent_at + rng.uniform(0, 0.01, count))
    tries = rng.integers(0, 4, count) * (rng.random(count) < 0.3)
    done = rng.random(count) < rng.uniform(0, 0.9)
    done[base] = bool(rng.random() < 0.1)  # the oldest is open in the transport; a done one must be skipped too
    rack_use = int(rng.integers(-1, count))
    args = (base, nxt, float(rng.uniform(0, 0.08)), sent_at, heard, tries, done, bool(rng.random() < 0.7),
            float(rng.uniform(0.001, 0.02)), int(rng.integers(0, 3)), int(rng.integers(0, 7)),
            float(rng.uniform(0.01, 0.2)), float(sent_at[rack_use]) if rack_use >= 0 else -np.inf, rack_use,
            float(rng.uniform(0, 0.01)), float(rng.uniform(0, 0.002)), int(rng.integers(-1, count + 1)))
    out, by_rack = np.empty(count, np.int64), np.empty(count, bool)
    n, n_early, next_at = due_uses(*args, out, by_rack)
    assert (out[:n].tolist(), by_rack[:n].tolist(), n_early, next_at) == reference(*args)


def test_a_window_with_nothing_open() -> None:
    """No open use: nothing due, and no deadline (inf)."""
    out, by_rack = np.empty(4, np.int64), np.empty(4, bool)
    done = np.ones(4, bool)
    assert due_uses(0, 4, 1.0, np.zeros(4), np.zeros(4), np.zeros(4, np.int64), done, True, 0.01, 1, 1, 1.0,
                    0.5, 3, 0.001, 0.0, -1, out, by_rack) == (0, 0, np.inf)
    assert due_uses(2, 2, 1.0, np.zeros(4), np.zeros(4), np.zeros(4, np.int64), ~done, True, 0.01, 1, 1, 1.0,
                    0.5, 3, 0.001, 0.0, 3, out, by_rack) == (0, 0, np.inf)


@pytest.mark.parametrize("silent", [0.0, 0.3, 5.0, 100.0])
def test_each_use_waits_the_pacers_timeout(silent: float) -> None:
    """The kernel's timer is Pacer.rto: a window of uses sent at 0 with 0..8 resends each falls due, use by
    use, at rto(tries, silent), the oldest at rto(tries) whatever the silence (pacing.py's two rules in one
    place: the cap and the oldest's exception)."""
    p = Pacer(timeout=0.05, max_timeout=0.2, max_window=64, initial_window=8, min_timeout=0.001)
    p.sample_many(np.full(8, 0.002))
    tries = np.arange(9, dtype=np.int64)
    out = np.empty(9, np.int64)
    for i in range(9):
        done = np.ones(9, bool)
        done[i] = False
        base = i if i == 0 else 0  # use 0 open and oldest; otherwise use 0 done, so i is not the oldest
        if i:
            done[0] = True
        _, _, next_at = due_uses(base, 9, 0.0, np.zeros(9), np.full(9, np.inf), tries, done, False, p.base_rto(),
                                 p.backoff_cap(), p.backoff_cap(silent), p.max_timeout, -np.inf, -1, 0.0, 0.0, -1, out,
                                 np.empty(9, bool))
        want = p.rto(int(tries[i])) if i == 0 else p.rto(int(tries[i]), silent=silent)
        assert next_at == want, (i, next_at, want)
