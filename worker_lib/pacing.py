"""When a worker resends and how many uses it keeps in flight: the retransmission timeout and the
congestion window of one transport, apart from its sockets so that they can be read and tested alone.

Random loss must cost little and congestion must still slow a worker down, so the two are told apart:

- Timeout: ``RTO_FACTOR`` times the round trip of a use, never below ``min_timeout`` nor above
  ``max_timeout``. Until the first use is answered without retransmission (Karn's rule) it is
  ``timeout``, doubled by expiries at most once per timeout (as TCP's first timeout): behind a path
  slower than ``timeout`` no use would otherwise ever be answered on its first send, and no sample
  would ever come. (Doubled by every expiry, a window of uses waiting for a late worker pushed it to
  its ceiling at once.) The norm stage does not count (``Transport._exchange(paced=False)``): its
  answers wait for the last worker to reach the barrier, and under 10 % loss its expiries alone had
  doubled the first data window's timeout to 0.8 s. (With one
  sample, 3 x the sample is also RFC 6298's first timeout, R + 4 R/2.) The round trip is the lower
  quartile of the last ``SAMPLES`` clean uses, not RFC 6298's mean and deviation: a use also waits for
  the other workers, and while one of them recovers from a loss every other worker's clean sample grows
  by that worker's timeout. A mean feeds those waits back into every worker's timeout, which feeds them
  back into the others' samples: under 10 % loss the timeouts of 4 workers grew to seconds that way. A
  quartile ignores the waits as long as most uses are on time. It does not when every use waited: after a
  peer's stall the whole window is answered at once, each use a stall late, and one worker's timeout went to
  its 2 s ceiling while the others waited for its oldest use (one loopback run in 25 at 10 % loss took 3.5 s,
  the median 0.3 s). So the transport does not sample a use that was in flight across a silence of the path
  longer than a timeout (``Transport._exchange``); the uses sent after the path speaks again teach it the
  path, should the path itself have slowed down. The backoff is per use, not per
  transport: a use resent ``k`` times waits rto * 2^min(k, ``max_backoff``) with ``max_backoff`` 1 by
  default. One lost packet therefore delays only its own use, and a run of random losses cannot pile
  the timeout up to its ceiling. A use stuck in backoff holds its slot, and S uses later the window
  (``Transport._exchange``) cannot go on: on a 1 Gbit/s link with 10 % loss each way among 4
  workers, 3 doublings made the run 11x slower than lossless, 1 doubling 4.4x (both measured with a
  window that slid from the oldest open use). A path that answers nothing at all for ``SILENT_RTOS`` timeouts and
  at least ``SILENT_S`` (the aggregator is down or restarting) is a different thing: then one more
  doubling is allowed per doubling of the silence, up to ``DEAD_BACKOFF``, so that a window of
  retransmissions does not hammer it, and back to ``max_backoff`` at the next answer; except for the
  oldest open use (``backoff_cap``). A trace of a loopback run at 10 % loss (13.8x its lossless time)
  showed why: the workers wait for each other too, so one worker's silence is another's stall; the
  worker furthest behind, backed off for silence, resent its oldest use (complete at the aggregator,
  its answer lost) once a second while the other three waited for it, 0.7 to 4 s at a time.
- Window: starts at ``initial_window`` uses, grows by one use per answer (slow start) up to
  ``ssthresh``, then by one use per window of answers, up to ``max_window``; but not while the worker's
  own uses queue: queue = window * (1 - base / recent), with base the least clean round trip seen and
  recent the median of the last ``RECENT`` (TCP Vegas's estimate); above ``QUEUE_HIGH`` uses, when the
  queue also holds recent - base > max(``QUEUE_DELAY``, base) seconds, the window stays and slow start
  ends. A window larger than the path (or the aggregator's CPU) drains only lengthens the round trip,
  hence every timeout. The delay floor is there because these round trips are those of user-space
  processes on shared cores, whose scheduling alone moves them by a millisecond or more: with the
  count of uses alone, a base of 0.3 ms and a recent 1.5 ms read as 80 % of the window queued, and the
  window of a DDP step at 1 Gbit/s stayed near its first 16 uses, the limit of most of the step's
  network phase (``TransportStats.window_bound_s``). Losses cut the window (halve it, not below 2, at most
  once per round trip) only in a *burst*: a run of max(``BURST_RUN``, window / 2) uses, consecutive in
  send order, that all expired on their first send (``burst_run``). A queue that overflows drops a run
  of consecutive packets; random loss drops scattered ones. Even at 10 % each way among 4 workers,
  where 41 % of the uses expire (any of 4 requests or the answer lost), a run of 10 starts about once
  in 12,000 uses (0.59 x 0.41^10), so random loss leaves the window open. Expiries are not losses
  alone, though: a use also waits for the other workers, and while one of them is stuck every use
  sent meanwhile expires, in a row; half a window keeps most of those from reading as a burst. (The
  first rule counted, per round trip of time, the share of expired uses; behind one stalled use the
  window sends nothing new, no answer comes, and the share of a handful of expiries read 100 %: on a
  1 Gbit/s link with 10 % loss the window was cut 60 times, to 2..8 uses.)

Loss seen from later answers (RACK, RFC 8985): the aggregator completes a job's uses in the order the
workers send them, so when a use is answered on its first send, every open use sent before it is
missing a packet (a worker's request or this worker's answer). Such a use is resent once it has been out
for the answered use's round trip plus ``reorder_margin`` (a quarter of the least round trip, RACK's
reordering window), not after a whole timeout; resent, it is sent after that answered use and waits
for a later one (or its timeout) before it can be resent that way again. A loss in the middle of a
window then costs about one round trip, not ``RTO_FACTOR`` of them; only the last uses of an exchange,
with nothing sent after them, still wait for their timeout. The other workers see the same later
answers and resend their own copies as early; the aggregator answers a resent request of a complete
use from its retained result. Reordering is rare on one path, and a spurious resend costs a datagram.

Probing: the timer of a use starts when the path is next heard from after its send (a datagram for any
use of the exchange), not at the send; only the oldest open use, while nothing is heard, is timed
from its send, and probes the path alone. Until the path speaks nothing shows
that this use, rather than the path or a peer, is late: in a DDP step the worker that finishes
encoding first waits for the others, and each of its timeouts resent its whole window (timed from
the send, the first answer after the wait would also make the whole window due at once, its answers
already on their way), as would the next oldest, timed from its send, once the oldest is answered.
One probe per timeout is what TCP does too: it resends only its first segment when its timer expires
(``test_a_late_peer_costs_one_probe_per_timeout``). And as TCP restarts its timer at every ACK, the
timer of a use not yet resent starts again whenever a use sent no later than it is answered: the queue
ahead of it moves, so it is not late (a use sent later and answered first shows it lost: RACK). Timed
from the first answer after its send alone, the last uses of a window sent in one burst into a slow
link's queue expired while the queue drained, their round trips up to a window's serialisation longer
than those of the early uses that set the timeout, and each resend queued as well: on a 100 Mbit/s
link a lossless DDP step resent 250 to 700 of its 1,600 uses, and the aggregator answered each again
from its retained result on the link that was the bottleneck
(``test_a_window_queued_behind_a_slow_link_is_not_resent``).
Not before the first round trip is measured, though: then the first timeout is a guess, and the
expiry of a whole first window that overflowed a queue is what cuts the window before slow start
overflows it again and again (``test_congestion_window_backs_off_a_full_queue``).
The same probing takes over mid-exchange when the path stalls after it spoke: when more than
``BURST_RUN`` timers run out together while nothing has been heard for half a timeout and uses are still
waiting to be sent, a peer or the aggregator was not scheduled (cores shared with training); lost uses
show in later answers (RACK) instead. The open uses then count as unheard since their sends, and the
oldest probes alone (``Transport._exchange``; ``test_a_peer_that_stalls_mid_exchange_costs_one_probe_per_timeout``).
In DDP runs at 1 Gbit/s such a stall had resent a whole window of up to 512 uses in a third of the runs.
At the end of an exchange, with nothing left to send, the same holds once the tail probe has gone out:
the answers to the probe show the uses sent before it that were lost (RACK on the order of first sends),
and a peer that is late leaves the probe unanswered as well
(``test_a_peer_that_stalls_at_the_end_of_an_exchange_costs_one_probe_per_timeout``; at 10 Gbit/s a DDP
step whose peer was late at the end resent its whole last window, 250-360 uses, once in 30 to 70 steps per rank).

Tail probes (RACK-TLP's probe, RFC 8985, on silence): RACK needs a later answer, so a loss among the
last uses of an exchange used to wait for its timeout, and under load that timeout is long: the round
trip of a use queued behind a window of answers on a 1 Gbit/s link, times ``RTO_FACTOR``. In DDP steps at
1 Gbit/s with 1 % loss each way a quarter of the lossy steps waited 30-60 ms at their tail. Once every use
of an exchange is sent, answers arrive back to back until the queue drains; when none has come for
``probe_gap`` (twice the least round trip, at least ``PROBE_MIN_S``), the last ``PROBE_USES`` open uses
that the path spoke after are resent, and those sent at most a probe gap after it last spoke: answers
read in one batch (a worker descheduled while they came, or a coalesced receive) can all come before an
exchange's last sends, and a lost last use then waited for its timeout
(``test_a_lost_last_use_sent_after_the_last_answers_is_probed``). An answer to the probe then shows any
earlier loss to RACK. A use is probed once per time the path speaks; uses that nothing was heard after
or shortly before (a peer that has not sent yet, see "Probing") are left to the timers, so a late peer
still costs one probe per timeout. Reliable mode only: zero-fill's workers keep to one fixed timeout.

Tail copies: a use resent by RACK in the middle of an exchange is shown lost again by RACK, from the
answers to the new uses sent after it. Once the last new use is out, nothing is sent after a resend,
and a resend lost again waited for the tail probe's silence (twice the least round trip, at least 2
ms) and the probe's round trip. So a use that RACK finds lost with nothing sent after it gets a second
copy a least round trip (plus RACK's reordering margin) after the first, unless the first was answered
by then: found after the last new use, or in the pass that sends it (a pass's run sends its new uses
first, its resends last). Copied only when found after the last new use, as first built, the resends of
that last pass were 44 % of the tail probes of DDP steps at 1 Gbit/s with 5 % loss each way; copied
too, the probes per lossy step fell from 1.33 to 0.74 (docs/measurements.md, twenty-fifth session).
That covers two losses the probe used to wait for: the first copy lost, and a first copy that
reached the aggregator before a peer's resend completed the use (both workers see the same later
answers and resend at once) whose answer was then lost; the aggregator answers the second copy from
its retained result. Sent back to back, as first built (twenty-third session), both copies reached the
aggregator before the peer's resend in the second case, and whenever the first copy got through, the
second was answered again for nothing on the aggregator's busiest link. In DDP steps at 1 Gbit/s with 1 %
loss each way, four runs alternated with back-to-back copies: the lossy step's extra +1.08 ms (0.57 ..
1.84) instead of +2.32 (1.51 .. 3.06), 25 % fewer copies, 0.12 tail probes per lossy step instead of
0.17 (docs/measurements.md, twenty-fourth session). Only RACK's resends are
copied: a tail probe or a timer's resend is not (a peer late at the end must cost one probe per
timeout, see "Probing"), and neither is a resend in the middle of an exchange.

Tail duplicates: a loss among an exchange's last uses costs a recovery that nothing hides. Once every use is
sent, the answers queued on the aggregator's link drain; a use whose request was lost is found (RACK) when the
next use's answer arrives, and its resend is answered at the back of what is left of that queue. Found within
the last round trip of the drain, the resend's answer comes after the last one, a round trip plus RACK's
margin later, and the whole step waits for it. With 1 % loss each way and two workers, about 120 datagrams of
an exchange's last round trip at 1 Gbit/s, such a loss lengthened most lossy exchanges by about a millisecond
(docs/measurements.md, twenty-first and twenty-fourth sessions). So the pass that sends an exchange's last new
uses also sends a second copy of each of its last ``TAIL_DUPLICATES`` open uses
(``TransportConfig.tail_duplicates``), in the same run, after the first copies; of at most a quarter of the
exchange's uses (at least one): a short exchange is all tail, and copies of all of it would double its
traffic. Where a request was lost, its copy completes the use. Where it was not, the aggregator drops the copy
as a duplicate while the use waits for another worker's request, and answers it again from its retained result
when this worker's first copy completed the use (the last worker to send): that answer also recovers a lost
completion answer. The copies are not retransmissions (a lossless exchange sends them too) and start no timer.
Their price, in DDP steps at 1 Gbit/s: the last worker's copies answered again, about 30 answers of 1,500
bytes per exchange, and the sends. In nine runs of DDP steps with 1 % loss each way, alternated with the code
before: the lossless step unchanged (131.8 against 132.5 ms), the lossy one 1.2 ms shorter, its tail's growth
+0.3 ms instead of +1.3 (docs/measurements.md, twenty-seventh session). A use resent in the same pass gets no
duplicate besides.

A transport under ``zero-fill`` builds its ``Pacer`` with both adaptations off: its workers must stay in
step (a chunk one worker gave up must not complete for another), so the timeout stays ``timeout`` and
the window ``max_window``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

import numpy as np

#: Clean round trips kept.
SAMPLES = 32
#: The timeout is this many round trips (the lower quartile of the samples).
RTO_FACTOR = 3.0
#: Queued uses of this worker above which the window stops growing (with at least ``QUEUE_DELAY``).
QUEUE_HIGH = 6.0
#: Seconds of queueing delay (recent - least round trip) a queue must add, at least, to stop the window.
QUEUE_DELAY = 0.002
#: Samples whose median is the recent round trip the queue is measured with.
RECENT = 8
#: Timeouts without any answer after which the path is taken as dead and timeouts back off further,
#: and never before ``SILENT_S`` seconds (a loss tail, where few uses are left, is quiet for a while).
SILENT_RTOS = 8
SILENT_S = 0.25
#: Doublings of a use's timeout at most while the path is silent.
DEAD_BACKOFF = 6
#: Consecutive uses (in send order) lost on their first send that make a burst (congestion, not random loss).
BURST_RUN = 10
#: Open uses a tail probe resends at most, the last sent; and the least silence before it, seconds.
PROBE_USES = 8
PROBE_MIN_S = 0.002
#: The last uses of a data exchange sent twice, the copies with its last new uses ("Tail duplicates";
#: ``TransportConfig.tail_duplicates``): about one least round trip of answers on the aggregator's link in DDP
#: steps at 1 Gbit/s.
TAIL_DUPLICATES = 32


def extend_loss_runs(runs: np.ndarray, fresh: np.ndarray, need: int = BURST_RUN) -> bool:
    """Record that uses ``fresh`` (ascending indices in send order) expired on their first send:
    ``runs[i]`` becomes the length of the run of such uses ending at i. True when a run reaches
    ``BURST_RUN`` now (each run counts once)."""
    burst = False
    for i in fresh.tolist():
        runs[i] = runs[i - 1] + 1 if i > 0 and runs[i - 1] else 1
        burst |= runs[i] == need
    return burst


class Pacer:
    """The retransmission timeout of a use (``rto``) and the number of uses in flight (``window``)."""

    def __init__(self, *, timeout: float, max_timeout: float, max_window: int, initial_window: int,
                 min_timeout: float | None = None, max_backoff: int = 1, adaptive_timeout: bool = True,
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
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._rtt: float | None = None
        self._rtt_stale = False  #: samples came since ``_rtt`` was computed
        self.base_rtt = math.inf  #: the least clean round trip seen (no queue)
        self.cwnd = float(min(max_window, max(1, initial_window)))  #: congestion window (uses)
        self.ssthresh = float(max_window)
        self.cuts = 0  #: window cuts so far (bursts seen)
        self._last_cut = -math.inf
        self._startup_backoff = 0  #: doublings of the first timeout before the first sample
        self._last_startup_bump = -math.inf

    @property
    def rtt(self) -> float | None:
        """The round trip of a use: the lower quartile of the samples (None before the first). Computed
        when asked, not per sample: a worker answers thousands of uses between two of its timeouts."""
        if self._rtt_stale:
            n = len(self._samples)
            # statistics, not numpy: on 32 floats numpy's call costs 20x more. "inclusive" interpolates
            # linearly between order statistics, as numpy's default quantile does.
            self._rtt = self._samples[0] if n == 1 else statistics.quantiles(self._samples, n=4, method="inclusive")[0]
            self._rtt_stale = False
        return self._rtt

    def base_rto(self) -> float:
        """The timeout of a use sent for the first time, in seconds."""
        if not self.adaptive_timeout:
            return self.timeout
        if self.rtt is None:
            return min(self.max_timeout, self.timeout * 2.0 ** self._startup_backoff)
        return min(self.max_timeout, max(self.min_timeout, RTO_FACTOR * self.rtt))

    def backoff_cap(self, silent: float = 0.0) -> int:
        """Doublings a resent use's timeout may have when nothing has been answered for ``silent`` seconds:
        ``max_backoff``, one more per doubling of a silence past the dead threshold (see the module's text).
        The oldest open use of a window gets ``backoff_cap()`` whatever the silence
        (``worker_lib.resend_timers``): it is the use every later one waits behind, and often one that
        the aggregator completed long ago and answers at once (its answer was lost); the other workers
        wait for this worker to move its window on. Backing it off as well made the workers of a 10 %
        loss run wait for each other's silence, seconds at a time. One datagram per timeout does not
        hammer an aggregator that is down."""
        cap = self.max_backoff if self.adaptive_timeout else 0
        dead = max(SILENT_RTOS * self.base_rto(), SILENT_S)
        if self.adaptive_timeout and silent >= dead:  # one more doubling per doubling of the silence
            cap = min(DEAD_BACKOFF, cap + 1 + int(math.log2(silent / dead)))
        return cap

    def rto(self, tries: int | np.ndarray = 0, silent: float = 0.0) -> float | np.ndarray:
        """The timeout of a use already resent ``tries`` times (an int, or an array of counts), when
        nothing has been answered for ``silent`` seconds. The transport computes the same per window, in
        ``worker_lib.resend_timers.due_uses`` (tests/test_resend_timers.py holds the two together)."""
        out = np.minimum(self.max_timeout, self.base_rto() * np.exp2(np.minimum(tries, self.backoff_cap(silent))))
        return float(out) if np.isscalar(tries) else out

    def reorder_margin(self) -> float:
        """How much later than an answered use sent after it an open use may still be answered before it
        is taken as lost (RACK's reordering window): a quarter of the least clean round trip seen."""
        return self.base_rtt / 4 if math.isfinite(self.base_rtt) else self.base_rto()

    def probe_gap(self) -> float:
        """How long the answers of an exchange whose uses are all sent may stop before its tail is probed
        ("Tail probes" above): twice the least clean round trip, at least ``PROBE_MIN_S``, at most the
        timeout."""
        least = 2 * self.base_rtt if math.isfinite(self.base_rtt) else self.base_rto()
        return min(self.base_rto(), max(PROBE_MIN_S, least))

    def burst_run(self) -> int:
        """Consecutive first-send losses that make a burst now: ``BURST_RUN``, or half the window if more
        (a stalled peer leaves a few windows' worth of uses unanswered in a row; an overflow, most of one)."""
        return max(BURST_RUN, self.window() // 2)

    def window(self) -> int:
        """Uses that may be in flight now."""
        if not self.congestion_control:
            return self.max_window
        return max(1, min(self.max_window, int(self.cwnd)))

    def sample(self, rtt: float) -> None:
        """Fold in the round trip of a use answered without retransmission."""
        self.sample_many((rtt,))

    def sample_many(self, rtts: Iterable[float] | np.ndarray) -> None:
        """Fold in the round trips of uses answered without retransmission, in the order answered."""
        rtts = rtts.tolist() if isinstance(rtts, np.ndarray) else [float(r) for r in rtts]
        if not rtts:
            return
        self._samples.extend(rtts)
        self._recent.extend(rtts)
        self.base_rtt = min(self.base_rtt, min(rtts))
        self._rtt_stale = True

    def answered(self, now: float, count: int = 1) -> None:
        """``count`` uses were answered at ``now`` (one received batch): grow the window by each, unless a
        queue shows (see the module's text; the queue is judged once per batch)."""
        if not self.congestion_control:
            return
        recent = self._recent_rtt()
        if recent is not None and self._queued(recent) > QUEUE_HIGH and \
                recent - self.base_rtt > max(QUEUE_DELAY, self.base_rtt):
            self.ssthresh = min(self.ssthresh, self.cwnd)  # a queue shows: slow start ends, growth pauses
            return
        c = self.cwnd
        if count <= 0 or c >= self.max_window:
            return
        if c < self.ssthresh:  # slow start: one use per answer, until ssthresh
            ss = min(count, math.ceil(self.ssthresh - c))
            c, count = c + ss, count - ss
        if count == 1:  # congestion avoidance: 1/c per answer
            c += 1.0 / c
        elif count:
            # n answers at once: c^2 grows by 2 + 1/c_k^2 per answer, and the sum of the 1/c_k^2 over the batch
            # is ln(b/a)/2 + (1/a - 1/b)/2 (Euler-Maclaurin; a = c^2, b = c^2 + 2n), within 2e-4 of a use of
            # the per-answer loop for c >= 2 (tests/test_pacing.py). The loop took a lossy exchange, whose
            # window stays below its ceiling, 4,500 iterations.
            a, b = c * c, c * c + 2.0 * count
            c = math.sqrt(b + 0.5 * math.log(b / a) + 0.5 * (1.0 / a - 1.0 / b))
        self.cwnd = min(float(self.max_window), c)

    def queue(self) -> float | None:
        """Uses of this worker waiting in a queue on the path, estimated from the round trips (None
        before ``RECENT`` samples)."""
        recent = self._recent_rtt()
        return None if recent is None else self._queued(recent)

    def _recent_rtt(self) -> float | None:
        """The median of the last ``RECENT`` clean round trips (None before that many)."""
        return statistics.median(self._recent) if len(self._recent) == RECENT else None

    def _queued(self, recent: float) -> float:
        """Vegas's estimate of the uses queued when the recent round trip is ``recent``."""
        return self.cwnd * (1.0 - self.base_rtt / recent) if recent > 0 else 0.0

    def expired(self, now: float, count: int = 1, burst: bool = False) -> None:
        """``count`` uses timed out at ``now`` (seconds, monotonic): before the first sample, double the
        first timeout, at most once per timeout (as TCP backs off once per expiry of its timer, not per
        segment: a window of uses expiring one after another doubled it to its ceiling at once); halve
        the window when they completed a burst (``extend_loss_runs``), at most once per round trip."""
        if count <= 0:
            return
        if self.rtt is None and self.adaptive_timeout and self.base_rto() < self.max_timeout and \
                now - self._last_startup_bump >= self.base_rto():
            self._startup_backoff += 1
            self._last_startup_bump = now
        if not self.congestion_control or not burst:
            return
        # Expiries come one timeout after their sends, so the losses of a burst spread over a timeout.
        if now - self._last_cut >= self.base_rto():
            self.cwnd = max(2.0, self.cwnd / 2)
            self.ssthresh = self.cwnd
            self.cuts += 1
            self._last_cut = now
