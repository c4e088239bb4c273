"""When a worker resends and how many uses it keeps in flight: the retransmission timeout and the
congestion window of one transport, apart from its sockets so that they can be read and tested alone.

Random loss must cost little and congestion must still slow a worker down, so the two are told apart:

- Timeout: ``RTO_FACTOR`` times the round trip of a use, never below ``min_timeout`` nor above
  ``max_timeout``. Until the first use is answered without retransmission (Karn's rule) it is
  ``timeout``, doubled by every expiry (as TCP's first timeout): behind a path slower than ``timeout``
  no use would otherwise ever be answered on its first send, and no sample would ever come. (With one
  sample, 3 x the sample is also RFC 6298's first timeout, R + 4 R/2.) The round trip is the lower
  quartile of the last ``SAMPLES`` clean uses, not RFC 6298's mean and deviation: a use also waits for
  the other workers, and while one of them recovers from a loss every other worker's clean sample grows
  by that worker's timeout. A mean feeds those waits back into every worker's timeout, which feeds them
  back into the others' samples: under 10 % loss the timeouts of 4 workers grew to seconds that way. A
  quartile ignores the waits as long as most uses are on time. The backoff is per use, not per
  transport: a use resent ``k`` times waits rto * 2^min(k, ``max_backoff``). One lost packet therefore
  delays only its own use, and a run of random losses cannot pile the timeout up to its ceiling.
- Window: starts at ``initial_window`` uses, grows by one use per answer (slow start) up to
  ``ssthresh``, then by one use per window of answers, up to ``max_window``; but not while the worker's
  own uses queue: queue = window * (1 - base / recent), with base the least clean round trip seen and
  recent the median of the last ``RECENT`` (TCP Vegas's estimate); above ``QUEUE_HIGH`` uses the window
  stays and slow start ends. A window larger than the path (or the aggregator's CPU) drains only
  lengthens the round trip, hence every timeout. Losses cut the window (halve it, not below 2, at most
  once per round trip) only in a *burst*: within one round trip, at least ``BURST_LOSSES`` uses expired
  on their first send and they were at least ``BURST_SHARE`` of the uses that ended (answered or
  expired). A queue that overflows drops a run of consecutive packets, so nearly every use of that round
  trip expires; random loss, even 10 % each way among 4 workers, leaves most uses answered, so
  scattered losses never shrink the window.

A transport under ``zero-fill`` builds its ``Pacer`` with both adaptations off: its workers must stay in
step (a chunk one worker gave up must not complete for another), so the timeout stays ``timeout`` and
the window ``max_window``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

#: Clean round trips kept.
SAMPLES = 32
#: The timeout is this many round trips (the lower quartile of the samples).
RTO_FACTOR = 3.0
#: Queued uses of this worker above which the window stops growing.
QUEUE_HIGH = 6.0
#: Samples whose median is the recent round trip the queue is measured with.
RECENT = 8
#: Expired uses in one round trip before a cut is considered at all.
BURST_LOSSES = 4
#: The share of the round trip's ended uses that must have expired for a cut (a burst, not random loss).
BURST_SHARE = 0.75


class Pacer:
    """The retransmission timeout of a use (``rto``) and the number of uses in flight (``window``)."""

    def __init__(self, *, timeout: float, max_timeout: float, max_window: int, initial_window: int,
                 min_timeout: float | None = None, max_backoff: int = 3, adaptive_timeout: bool = True,
                 congestion_control: bool = True) -> None:
        min_timeout = timeout if min_timeout is None else min_timeout
        if not 0 < min_timeout <= timeout <= max_timeout:
            raise ValueError(f"need 0 < min_timeout <= timeout <= max_timeout, got {min_timeout}, {timeout} "
                             f"and {max_timeout}")
        if max_window < 1:
            raise ValueError(f"max_window must be at least 1, got {max_window}")
        if not 0 <= max_backoff <= 16:
            raise ValueError(f"max_backoff must be in 0..16, got {max_backoff}")
        self.timeout, self.min_timeout, self.max_timeout = timeout, min_timeout, max_timeout
        self.max_backoff = max_backoff
        self.adaptive_timeout, self.congestion_control = adaptive_timeout, congestion_control
        self.max_window = max_window
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self.rtt: float | None = None  #: round trip of a use (lower quartile of the samples), None before
        self.base_rtt = math.inf  #: the least clean round trip seen (no queue)
        self.cwnd = float(min(max_window, max(1, initial_window)))  #: congestion window (uses)
        self.ssthresh = float(max_window)
        self.cuts = 0  #: window cuts so far (bursts seen)
        self._last_cut = -math.inf
        self._epoch_start = -math.inf
        self._epoch_answered = 0
        self._epoch_expired = 0
        self._startup_backoff = 0  #: expiries before the first sample (each doubles the first timeout)

    def base_rto(self) -> float:
        """The timeout of a use sent for the first time, in seconds."""
        if not self.adaptive_timeout:
            return self.timeout
        if self.rtt is None:
            return min(self.max_timeout, self.timeout * 2.0 ** self._startup_backoff)
        return min(self.max_timeout, max(self.min_timeout, RTO_FACTOR * self.rtt))

    def rto(self, tries: int | np.ndarray = 0) -> float | np.ndarray:
        """The timeout of a use already resent ``tries`` times (an int, or an array of counts)."""
        doublings = np.minimum(tries, self.max_backoff if self.adaptive_timeout else 0)
        out = np.minimum(self.max_timeout, self.base_rto() * np.exp2(doublings))
        return float(out) if np.isscalar(tries) else out

    def window(self) -> int:
        """Uses that may be in flight now."""
        if not self.congestion_control:
            return self.max_window
        return max(1, min(self.max_window, int(self.cwnd)))

    def sample(self, rtt: float) -> None:
        """Fold in the round trip of a use answered without retransmission."""
        self._samples.append(rtt)
        self.base_rtt = min(self.base_rtt, rtt)
        # statistics, not numpy: this runs per answered use, and on 32 floats numpy's call costs 20x more.
        # "inclusive" interpolates linearly between order statistics, as numpy's default quantile does.
        n = len(self._samples)
        self.rtt = rtt if n == 1 else statistics.quantiles(self._samples, n=4, method="inclusive")[0]

    def answered(self, now: float) -> None:
        """A use was answered at ``now``: grow the window unless a queue shows (see the module's text)."""
        if not self.congestion_control:
            return
        self._roll_epoch(now)
        self._epoch_answered += 1
        queue = self.queue()
        if queue is not None and queue > QUEUE_HIGH:
            self.ssthresh = min(self.ssthresh, self.cwnd)  # a queue shows: slow start ends, growth pauses
            return
        step = 1.0 if self.cwnd < self.ssthresh else 1.0 / self.cwnd
        self.cwnd = min(float(self.max_window), self.cwnd + step)

    def queue(self) -> float | None:
        """Uses of this worker waiting in a queue on the path, estimated from the round trips (None
        before ``RECENT`` samples)."""
        if len(self._samples) < RECENT:
            return None
        recent = statistics.median(list(self._samples)[-RECENT:])
        return self.cwnd * (1.0 - self.base_rtt / recent) if recent > 0 else 0.0

    def expired(self, now: float, count: int = 1, first_sends: int | None = None) -> None:
        """``count`` uses timed out at ``now`` (seconds, monotonic), ``first_sends`` of them (default: all)
        on their first send: before the first sample, double the first timeout; halve the window if this
        round trip's first-send losses are a burst (see the module's text), at most once per round trip."""
        if count <= 0:
            return
        if self.rtt is None and self.adaptive_timeout and self.base_rto() < self.max_timeout:
            self._startup_backoff += 1
        if not self.congestion_control:
            return
        self._roll_epoch(now)
        self._epoch_expired += count if first_sends is None else first_sends
        ended = self._epoch_expired + self._epoch_answered
        burst = self._epoch_expired >= BURST_LOSSES and self._epoch_expired >= BURST_SHARE * ended
        if burst and now - self._last_cut >= self._round_trip():
            self.cwnd = max(2.0, self.cwnd / 2)
            self.ssthresh = self.cwnd
            self.cuts += 1
            self._last_cut = now
            self._epoch_start, self._epoch_answered, self._epoch_expired = now, 0, 0

    def _round_trip(self) -> float:
        # Expiries come one timeout after their sends, so the losses of a burst spread over a timeout.
        return self.base_rto()

    def _roll_epoch(self, now: float) -> None:
        if now - self._epoch_start >= self._round_trip():
            self._epoch_start, self._epoch_answered, self._epoch_expired = now, 0, 0
