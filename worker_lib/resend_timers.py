"""When the open uses of an exchange are due to be resent, as one compiled pass over the window (numba).

``Transport._exchange`` asks this twice per turn of its loop: which uses to resend now, and how long it
may wait in ``select`` before the next one falls due. Each use's deadline is the earlier of two
(worker_lib/pacing.py explains both):

- its timer: from its send (the oldest open use always, and every use before the first round trip is
  measured) or from when the path was next heard after its send, plus its timeout, the pacer's base
  timeout doubled once per resend up to a cap (the oldest use's cap ignores the path's silence);
- RACK: a use sent before the latest use answered on its first send (or at the same time, and earlier in
  send order) is lost once it has been out for that use's round trip plus the reordering margin; so is a
  use not yet resent that was first sent before a resent use now answered (uses are first sent in index
  order: a later use completed while this one did not).

As numpy expressions over the window (a few hundred uses), each question took some 30 array operations,
about 29 us for a window of 400 uses, timed alone; a DDP step at 1 Gbit/s turns the loop 60-80 times, so
about 4 ms of a worker's CPU per step, on cores the encoder and the aggregator share. Compiled: 6 us.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
def due_uses(base: int, nxt: int, now: float, sent_at: np.ndarray, heard_since: np.ndarray, tries: np.ndarray,
             done: np.ndarray, from_heard: bool, rto_base: float, cap_oldest: int, cap_rest: int,
             max_timeout: float, rack_sent: float, rack_use: int, rack_rtt: float, rack_margin: float,
             rack_above: int, due: np.ndarray, by_rack: np.ndarray) -> tuple[int, int, float]:
    """The open uses of ``base..nxt-1`` (not ``done``; ``base`` the oldest) that are due at ``now``.

    Per use i: ``sent_at[i]`` its last send, ``heard_since[i]`` when the path was first heard after it
    (inf: not yet), ``tries[i]`` its resends so far. The timer runs from ``heard_since`` when
    ``from_heard`` (the oldest use from its send while nothing was heard), else from the send; the
    timeout is min(``max_timeout``, ``rto_base`` * 2^min(tries, cap)), cap ``cap_oldest`` for ``base``
    and ``cap_rest`` for the others. ``rack_use`` < 0: no RACK deadline; else uses sent before
    (``rack_sent``, ``rack_use``) are due at their send + ``rack_rtt`` + ``rack_margin``, and so are the
    uses below ``rack_above`` (the highest use answered after a resend; -1: none) not resent yet.

    Writes the due uses, ascending, to ``due``, and whether RACK made each due (not only its timer) to
    ``by_rack`` at the same place; returns (how many, how many of them RACK made due, the earliest deadline
    of any open use: inf when none is open).
    """
    n_due = 0
    n_early = 0
    next_at = math.inf
    for i in range(base, nxt):
        if done[i]:
            continue
        at = sent_at[i]
        start = at
        if from_heard:
            start = heard_since[i]
            if i == base and start == math.inf:  # the oldest probes a silent path
                start = at
        cap = cap_oldest if i == base else cap_rest
        doublings = tries[i] if tries[i] < cap else cap
        timer_at = start + min(max_timeout, rto_base * 2.0 ** doublings)
        rack_at = math.inf
        if rack_use >= 0 and (at < rack_sent or (at == rack_sent and i < rack_use) or
                              (tries[i] == 0 and i < rack_above)):
            rack_at = at + rack_rtt + rack_margin
        at_due = min(timer_at, rack_at)
        next_at = min(next_at, at_due)
        if at_due <= now:
            due[n_due] = i
            by_rack[n_due] = rack_at <= now
            n_due += 1
            if rack_at <= now:
                n_early += 1
    return n_due, n_early, next_at
