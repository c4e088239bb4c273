"""Loss that comes and goes within one DDP run, and the step times of its lossless and lossy phases compared.

The cost of 1 % loss on a DDP step is a few milliseconds, while separate runs of the same configuration
on a shared machine differ by tens (the machine's load moves from minute to minute). Comparing runs
therefore cannot show whether loss costs more than the time its resent datagrams need on the link
(issue 15's criterion). Alternating the loss every second or so *within* one run, and comparing each
lossy phase with the lossless phase just before it, cancels that drift: both phases run on the same
machine in the same second.

``LossPhases`` switches a ``Topology``'s loss on a timer (``Topology.set_loss``) and records when;
``compare_phases`` assigns each timed step (from ``examples/train_ddp.py``'s ``step_marks``) to the phase
it ran in wholly (steps that overlap a switch are left out) and compares the phases pair by pair.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import binom

from topologies.netem import NetemError, Topology

#: Confidence of the interval given for the median difference.
LEVEL = 0.9


@dataclass(frozen=True)
class Switch:
    """One change of the links' loss to ``percent``, starting a lossy phase or a lossless one (``lossy``; a
    lossy phase at 0 % is the control run's); ``before`` and ``after`` bracket the change (perf_counter
    seconds); ``cpu``: the aggregator's CPU seconds so far, read just before (nan where not measured);
    ``answers_resent``: the answers the aggregator had sent again so far from retained results (its
    ``retained`` counter, read just before; nan where not read)."""

    before: float
    after: float
    percent: float
    lossy: bool
    cpu: float = math.nan
    answers_resent: float = math.nan


class LossPhases:
    """Alternate every worker's loss between 0 and ``percent`` every ``period`` seconds, starting lossless,
    while a run is going on (a background thread; use as a context manager). ``cpu`` and ``answers_resent``,
    if given, read the aggregator's CPU seconds and its answers sent again so far, at every switch. With
    ``percent`` 0 nothing changes but the phases' labels: a control, whose "extra" shows the method's own
    bias and spread."""

    def __init__(self, net: Topology, percent: float, period: float, cpu: Callable[[], float] | None = None,
                 answers_resent: Callable[[], float] | None = None) -> None:
        self.net, self.percent, self.period, self.cpu = net, percent, period, cpu
        self.answers_resent = answers_resent
        self.switches: list[Switch] = []
        self._stop = threading.Event()
        self._error: Exception | None = None  #: why the switching stopped, raised at the end of the run
        self._thread = threading.Thread(target=self._run, name="loss-phases", daemon=True)

    def _set(self, lossy: bool) -> None:
        cpu = self.cpu() if self.cpu else math.nan
        answers = self.answers_resent() if self.answers_resent else math.nan
        percent = self.percent if lossy else 0.0
        before = time.perf_counter()
        self.net.set_loss({node: percent for node in self.net.cfg.loss_percent})
        self.switches.append(Switch(before, time.perf_counter(), percent, lossy, cpu, answers))

    def _run(self) -> None:
        lossy = False
        try:
            while not self._stop.wait(self.period):
                lossy = not lossy
                self._set(lossy)
        except Exception as exc:  # NetemError, or OSError from nft or tc: raised at the end of the run
            self._error = exc

    def __enter__(self) -> LossPhases:
        self._set(False)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._set(False)
        finally:
            if self._error is not None:  # the phases stopped switching part-way: the run's labels are wrong
                raise NetemError(f"the loss phases stopped switching: {self._error}") from self._error


#: The running counters of a step mark compared between phases, by their names in
#: ``examples/train_ddp.py``'s ``step_marks`` (the first two, rank 0's resends and every rank's, also give
#: ``resent_per_step`` and ``resent_all_per_step``). A counter that a run's marks lack (runs recorded before it
#: was added) reads nan.
COUNTERS = ("retransmissions", "retransmissions_all", "tail_s", "slot_bound_s", "window_bound_s", "encode_s",
            "network_s", "decode_s", "hook_cpu_s", "hook_wait_s", "cpu_s", "tail_probes")


def steps_by_phase(marks: list[dict[str, float]], switches: list[Switch],
                   warmup: int) -> list[list[tuple[float, ...]]]:
    """Per phase (the time from one switch's end to the next one's start), one tuple per timed step that ran
    wholly inside it: the step's seconds, then how much each of ``COUNTERS`` grew during the step.
    ``marks``: per step, warm-up steps first, its ``start`` and ``end`` and the counters so far, by name."""
    phases: list[list[tuple[float, ...]]] = [[] for _ in switches]
    for i in range(warmup, len(marks)):
        start, end = marks[i]["start"], marks[i]["end"]
        now = [marks[i].get(k, math.nan) for k in COUNTERS]  # nan: a counter the run did not record
        before = [marks[i - 1].get(k, math.nan) for k in COUNTERS] if i else [0] * len(now)
        for j, sw in enumerate(switches):
            nxt = switches[j + 1].before if j + 1 < len(switches) else float("inf")
            if sw.after <= start and end <= nxt:
                phases[j].append((end - start, *(a - b for a, b in zip(now, before, strict=True))))
                break
    return phases


@dataclass(frozen=True)
class PhaseComparison:
    """Lossy phases against the lossless phase before each (seconds; ``pairs`` of phases compared)."""

    pairs: int
    lossless_steps: int
    lossy_steps: int
    lossless_s: float  #: median step of all lossless phases' steps
    lossy_s: float  #: median step of all lossy phases' steps
    extra_s: float  #: median over the pairs of (lossy phase's median step - lossless phase's median step)
    low_s: float  #: the 90 % interval of the pairs' median difference (``median_interval``)
    high_s: float
    #: datagrams rank 0 resent per lossy step more than per lossless step (means): what loss added
    resent_per_step: float
    #: datagrams all ranks resent per lossy step more than per lossless step (means). Each crosses the
    #: aggregator's link, which carries every worker's uses and so is the busiest: their bytes are the wire
    #: time that loss must cost. (A lossless step resends too, now and then: a peer or the aggregator
    #: descheduled past a timer; that costs the lossless step as well.)
    resent_all_per_step: float
    #: mean tail probes per lossy step (rank 0): each is a loss at an exchange's end found by silence alone
    probes_per_step: float = 0.0
    #: answers the aggregator sent again from retained results per lossy step more than per lossless step (its
    #: rate over the lossy phases less its rate over the lossless ones, times the median lossy step); nan where
    #: the switches did not read it. Each answers a worker's resend of a complete use (its answer was lost, or a
    #: peer's resend completed the use first) and crosses the aggregator's link outbound, while the resent
    #: requests cross it inbound. A lossless step has some too: the second copies of an exchange's last uses
    #: that the last worker to send them sends (worker_lib/pacing.py, "Tail duplicates").
    answers_resent_per_step: float = math.nan
    #: per counter of ``COUNTERS`` but the first two, the median over the pairs of how much more it grew per step
    #: in the lossy phase than in the lossless one (where the extra goes); "aggregator_cpu_s" too where the
    #: switches read it (the difference of its CPU per second of the two phases, times the lossy step)
    grown: dict[str, float] = field(default_factory=dict)

    def resent_s(self, size: float, rate_mbit: float, all_ranks: bool = True) -> float:
        """Seconds the datagrams all ranks resent in a lossy step need on the aggregator's link (``size``
        bytes each); with ``all_ranks`` False, rank 0's alone."""
        resent = self.resent_all_per_step if all_ranks else self.resent_per_step
        return resent * size * 8 / (rate_mbit * 1e6)

    def answers_resent_s(self, answer_size: float, rate_mbit: float) -> float:
        """Seconds the answers the aggregator sent again in a lossy step need on its link (``answer_size``
        bytes each); nan where not read."""
        return self.answers_resent_per_step * answer_size * 8 / (rate_mbit * 1e6)

    def yardstick_s(self, size: float, rate_mbit: float, answer_size: float = math.nan) -> float:
        """The time loss may cost a step: what the bytes resent in it need on the aggregator's link, each
        direction apart since the link carries both at once: the workers' resent requests inbound, the answers
        sent again outbound, the longer of the two (the requests alone where the answers were not read)."""
        answers = self.answers_resent_s(answer_size, rate_mbit)
        requests = self.resent_s(size, rate_mbit)
        return requests if math.isnan(answers) else max(requests, answers)

    def verdict(self, size: float, rate_mbit: float, answer_size: float = math.nan) -> str:
        """"met" when even the interval's top is within ``yardstick_s``, "missed" when its bottom is above it,
        "undecided" otherwise."""
        limit = self.yardstick_s(size, rate_mbit, answer_size)
        return "met" if self.high_s <= limit else "missed" if self.low_s > limit else "undecided"


def median_interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """A distribution-free interval for the median of the population ``values`` are drawn from: the
    order statistics (k, n + 1 - k) with the largest k whose binomial tails leave at least ``level``
    between them. (A bootstrap of the median is too narrow for a few dozen pairs: a control run of 10
    pairs gave an interval that left out 0.) (-inf, inf) when there are too few values for ``level``."""
    x = np.sort(np.asarray(values, float))
    n = x.size
    # k: how many j < n have P(Bin(n, 1/2) <= j) within the tail. scipy's CDF, not 2.0 ** n, which overflows a
    # float from 1,024 values on (a pool of about 33 runs of the DDP benchmark's phases)
    k = int(np.count_nonzero(binom.cdf(np.arange(n), n, 0.5) <= (1 - level) / 2))
    return (-math.inf, math.inf) if k == 0 else (float(x[k - 1]), float(x[n - k]))


def compare_phases(runs: list[tuple[list[dict[str, float]], list[Switch], int]]) -> PhaseComparison | None:
    """Compare each lossy phase with the lossless phase just before it, over every run (``(marks,
    switches, warmup)`` each). None when no pair of phases has timed steps on both sides."""
    diffs: list[list[float]] = []  # per pair: step, then each counter's growth (lossy - lossless medians)
    lossless: list[float] = []
    lossy: list[float] = []
    resent: list[tuple[float, float, float]] = []  # per lossy step: rank 0's resends, all ranks', rank 0's probes
    resent_lossless: list[tuple[float, float]] = []  # per lossless step: rank 0's resends, all ranks'
    probes = 1 + COUNTERS.index("tail_probes")
    for marks, switches, warmup in runs:
        phases = steps_by_phase(marks, switches, warmup)
        for j, phase in enumerate(phases):
            (lossy if switches[j].lossy else lossless).extend(step[0] for step in phase)
            if switches[j].lossy:
                resent.extend((*step[1:3], step[probes]) for step in phase)
                continue
            resent_lossless.extend(step[1:3] for step in phase)
            if j + 1 < len(phases) and switches[j + 1].lossy and phase and phases[j + 1]:
                pair = [statistics.median(b) - statistics.median(a)
                        for a, b in zip(zip(*phase, strict=True), zip(*phases[j + 1], strict=True), strict=True)]
                diffs.append([*pair, _cpu_rate(switches, j + 1) - _cpu_rate(switches, j)])
    if not diffs:
        return None
    d = np.asarray(diffs)
    low, high = median_interval(d[:, 0])
    med = np.median(d[:, :-1], axis=0)
    agg = d[:, -1][~np.isnan(d[:, -1])]
    grown = {name: float(v) for name, v in zip(COUNTERS[2:], med[3:], strict=True)}
    lossy_step = statistics.median(lossy)
    if agg.size:
        grown["aggregator_cpu_s"] = float(np.median(agg)) * lossy_step
    answers = (_pooled_rate(runs, "answers_resent", True) - _pooled_rate(runs, "answers_resent", False)) * lossy_step
    before = [statistics.fmean(r[k] for r in resent_lossless) if resent_lossless else 0.0 for k in (0, 1)]
    return PhaseComparison(pairs=len(d), lossless_steps=len(lossless), lossy_steps=len(lossy),
                           lossless_s=statistics.median(lossless), lossy_s=lossy_step,
                           extra_s=float(med[0]), low_s=low, high_s=high,
                           resent_per_step=statistics.fmean(r[0] for r in resent) - before[0],
                           resent_all_per_step=statistics.fmean(r[1] for r in resent) - before[1],
                           probes_per_step=statistics.fmean(r[2] for r in resent),
                           answers_resent_per_step=answers, grown=grown)


def _pooled_rate(runs: list[tuple[list[dict[str, float]], list[Switch], int]], reading: str, lossy: bool) -> float:
    """How fast the aggregator's ``reading`` grew, per second, over all the lossy (or lossless) phases of
    ``runs`` that have readings at both ends; nan where none has."""
    grown = [_growth(switches, j, reading) for _, switches, _ in runs
             for j in range(len(switches)) if switches[j].lossy == lossy]
    grown = [g for g in grown if not math.isnan(g[0])]
    return sum(g[0] for g in grown) / sum(g[1] for g in grown) if grown else math.nan


def _growth(switches: list[Switch], j: int, reading: str) -> tuple[float, float]:
    """How much the aggregator's ``reading`` ("cpu" or "answers_resent") grew during phase ``j``, and the
    phase's seconds (nan growth without the next switch or without readings)."""
    if j + 1 >= len(switches):
        return math.nan, math.nan
    return (getattr(switches[j + 1], reading) - getattr(switches[j], reading),
            switches[j + 1].before - switches[j].before)


def _cpu_rate(switches: list[Switch], j: int) -> float:
    """The aggregator's CPU seconds per second during phase ``j`` (nan without the next switch or readings)."""
    grew, seconds = _growth(switches, j, "cpu")
    return grew / seconds
