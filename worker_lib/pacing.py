"""When a worker resends and how many uses it keeps in flight: the retransmission timeout and the
congestion window of one transport, apart from its sockets so that they can be read and tested alone.

- Timeout (RFC 6298): SRTT and RTTVAR from uses answered without retransmission (Karn's rule), gains
  1/8 and 1/4, RTO = SRTT + 4 RTTVAR, never below ``timeout`` nor above ``max_timeout``; every expiry
  doubles it (the backoff) until the next clean sample.
- Window (AIMD): starts at ``initial_window`` uses, grows by one use per answer up to ``ssthresh``
  (slow start), then by one use per window of answers, up to ``max_window``; an expiry halves it (not
  below 2), at most once per round trip.

A transport under ``zero-fill`` builds its ``Pacer`` with both adaptations off: its workers must stay in
step (a chunk one worker gave up must not complete for another), so the timeout stays ``timeout`` and
the window ``max_window``.
"""

from __future__ import annotations

import math


class Pacer:
    """The retransmission timeout (``rto``) and the number of uses that may be in flight (``window``)."""

    def __init__(self, *, timeout: float, max_timeout: float, max_window: int, initial_window: int,
                 adaptive_timeout: bool = True, congestion_control: bool = True) -> None:
        if not 0 < timeout <= max_timeout:
            raise ValueError(f"need 0 < timeout <= max_timeout, got {timeout} and {max_timeout}")
        if max_window < 1:
            raise ValueError(f"max_window must be at least 1, got {max_window}")
        self.timeout, self.max_timeout = timeout, max_timeout
        self.adaptive_timeout, self.congestion_control = adaptive_timeout, congestion_control
        self.max_window = max_window
        self.srtt: float | None = None  #: smoothed round trip of a use (seconds), None before a sample
        self.rttvar = 0.0
        self.backoff = 0  #: doublings of the timeout since the last clean sample
        self.cwnd = float(min(max_window, max(1, initial_window)))  #: congestion window (uses)
        self.ssthresh = float(max_window)
        self._last_cut = -math.inf

    def rto(self) -> float:
        """The current retransmission timeout of a use, in seconds."""
        if not self.adaptive_timeout:
            return self.timeout
        base = self.timeout if self.srtt is None else max(self.timeout, self.srtt + 4.0 * self.rttvar)
        return min(self.max_timeout, base * 2.0 ** self.backoff)

    def window(self) -> int:
        """Uses that may be in flight now."""
        if not self.congestion_control:
            return self.max_window
        return max(1, min(self.max_window, int(self.cwnd)))

    def sample(self, rtt: float) -> None:
        """Fold in the round trip of a use answered without retransmission; it ends the backoff."""
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.backoff = 0

    def answered(self) -> None:
        """A use was answered: grow the window (slow start below ``ssthresh``, then one use per window)."""
        if self.congestion_control:
            step = 1.0 if self.cwnd < self.ssthresh else 1.0 / self.cwnd
            self.cwnd = min(float(self.max_window), self.cwnd + step)

    def expired(self, now: float) -> None:
        """Uses timed out at time ``now`` (seconds, monotonic): back the timeout off, and halve the
        window unless it was cut less than a round trip ago."""
        if self.adaptive_timeout and self.rto() < self.max_timeout:
            self.backoff += 1
        if self.congestion_control and now - self._last_cut >= (self.srtt or self.timeout):
            self.ssthresh = max(2.0, self.cwnd / 2)
            self.cwnd = self.ssthresh
            self._last_cut = now
