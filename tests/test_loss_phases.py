"""benchmarks.loss_phases: steps assigned to the loss phase they ran in, and lossy phases compared with the
lossless phase before each (the figures are worked out by hand from the made-up steps below)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.loss_phases import (
    COUNTERS,
    LossPhases,
    PhaseComparison,
    Switch,
    compare_phases,
    median_interval,
    steps_by_phase,
)
from topologies.netem import NetemError


def _switches(*starts: float, cpu: tuple[float, ...] = (), answers: tuple[float, ...] = ()) -> list[Switch]:
    """Switches at ``starts`` (each taking 0.01 s), alternating 0 % and 1 %, lossless first; ``cpu`` and
    ``answers``: the aggregator's CPU seconds and answers sent again, read at each (none: not read)."""
    cpu = cpu or (math.nan,) * len(starts)
    answers = answers or (math.nan,) * len(starts)
    return [Switch(t, t + 0.01, 1.0 if i % 2 else 0.0, bool(i % 2), c, a)
            for i, (t, c, a) in enumerate(zip(starts, cpu, answers, strict=True))]


def _mark(start: float, end: float, resent: int, tail: float = 0.0, resent_all: int | None = None, probes: int = 0
          ) -> dict[str, float]:
    """A step mark as ``examples/train_ddp.py`` writes it: start, end, the running counters by name
    (rank 0's retransmissions, all ranks' (twice rank 0's unless given) tail_s and tail_probes given, the others held at
    0 here, one that is not compared too)."""
    return {"start": start, "end": end, "retransmissions": resent,
            "retransmissions_all": 2 * resent if resent_all is None else resent_all, "tail_s": tail,
            "slot_bound_s": 0.0, "window_bound_s": 0.0, "encode_s": 0.0, "network_s": 0.0, "decode_s": 0.0,
            "hook_cpu_s": 0.0, "hook_wait_s": 0.0, "cpu_s": 0.0, "tail_probes": probes, "not_compared": 99.0}


def test_a_counter_a_run_did_not_record_reads_nan() -> None:
    """Marks written before a counter existed (here hook_wait_s) still compare: that counter is nan, the
    others are read as before."""
    marks = [_mark(0.30, 0.60, 5, 0.5), _mark(1.20, 1.50, 19, 0.625)]
    for m in marks:
        del m["hook_wait_s"]
    phases = steps_by_phase(marks, _switches(0.0, 1.0), warmup=0)
    step = phases[1][0]
    assert math.isnan(step[1 + COUNTERS.index("hook_wait_s")])
    assert step[:4] == pytest.approx((0.30, 14, 28, 0.125))


def test_steps_are_assigned_to_the_phase_they_ran_in_wholly() -> None:
    """A step counts for a phase only if it started after the switch was done and ended before the next one
    began; warm-up steps never count; each step's counters are the growth of the running counts."""
    switches = _switches(0.0, 1.0, 2.0)
    marks = [_mark(0.02, 0.30, 5, 0.5),     # warm-up
             _mark(0.30, 0.60, 5, 0.5),     # phase 0, nothing resent, no tail
             _mark(0.60, 1.005, 6, 0.6),    # overlaps the switch at 1.0: left out
             _mark(1.005, 1.20, 9, 0.6),    # starts before the switch is done (1.01): left out
             _mark(1.20, 1.50, 19, 0.625),  # phase 1, 10 resent, 25 ms of tail
             _mark(1.50, 1.99, 31, 0.625),  # phase 1, 12 resent
             _mark(2.05, 2.30, 31, 0.625)]  # phase 2 (the last, open-ended)
    phases = steps_by_phase(marks, switches, warmup=1)
    rest = (0.0,) * (len(COUNTERS) - 3)
    assert phases == [[pytest.approx((0.30, 0, 0, 0.0, *rest))],
                      [pytest.approx((0.30, 10, 20, 0.025, *rest)), pytest.approx((0.49, 12, 24, 0.0, *rest))],
                      [pytest.approx((0.25, 0, 0, 0.0, *rest))]]


def test_each_lossy_phase_is_compared_with_the_lossless_one_before_it() -> None:
    """Run A drifts from 100 ms steps to 200 ms steps, its lossy phases 10 ms slower than the lossless one
    before each (of it 2 ms more tail); run B's lossy phase is 4 ms slower. Pooled medians mix the drift in;
    the pairs do not. The aggregator used 0.5 s of CPU per second in A's first phase, 0.6 in its second
    (its last phase has no end reading; run B no readings): 0.1 s/s more, times the lossy median step."""
    run_a = ([_mark(0.1, 0.2, 0), _mark(0.2, 0.3, 0),                 # phase 0 (lossless): 100 ms steps
              _mark(1.1, 1.21, 3, 0.002), _mark(1.3, 1.41, 6, 0.004),  # phase 1 (1 %): 110 ms, 3 resent each
              _mark(2.1, 2.3, 6, 0.004), _mark(2.3, 2.5, 6, 0.004),   # phase 2 (lossless): 200 ms
              _mark(3.1, 3.31, 7, 0.006, probes=1), _mark(3.4, 3.61, 8, 0.008, probes=3)],  # phase 3 (1 %): 210 ms,
             # 1 resent each, 1 and 2 tail probes
             _switches(0.0, 1.0, 2.0, 3.0, cpu=(0.0, 0.5, 1.1, 1.6)), 0)
    run_b = ([_mark(0.1, 0.25, 0), _mark(1.1, 1.254, 4, resent_all=5)], _switches(0.0, 1.0), 0)
    cmp = compare_phases([run_a, run_b])
    assert cmp is not None
    assert cmp.pairs == 3 and cmp.lossless_steps == 5 and cmp.lossy_steps == 5
    assert cmp.extra_s == pytest.approx(0.010)  # median of 10, 10 and 4 ms
    assert cmp.lossless_s == pytest.approx(0.150) and cmp.lossy_s == pytest.approx(0.154)
    assert (cmp.low_s, cmp.high_s) == (-math.inf, math.inf)  # 3 pairs are too few for a 90 % interval
    assert cmp.resent_per_step == pytest.approx((3 + 3 + 1 + 1 + 4) / 5)
    assert cmp.resent_all_per_step == pytest.approx((6 + 6 + 2 + 2 + 5) / 5)
    assert cmp.probes_per_step == pytest.approx((1 + 2) / 5)
    assert cmp.grown == pytest.approx({"tail_s": 0.002, **{k: 0.0 for k in COUNTERS[3:]},
                                       "aggregator_cpu_s": 0.1 * 0.154})


def test_resends_count_what_loss_added() -> None:
    """Rank 0 resends 1 datagram in each lossless step (a peer descheduled past a timer) and 5 in each lossy
    one, all ranks 3 and 11: loss added 4 and 8 per step, the resends the yardstick is made of."""
    marks = [_mark(0.1, 0.2, 1, resent_all=3), _mark(0.3, 0.4, 2, resent_all=6),
             _mark(1.1, 1.2, 7, resent_all=17), _mark(1.3, 1.4, 12, resent_all=28)]
    cmp = compare_phases([(marks, _switches(0.0, 1.0), 0)])
    assert cmp is not None and cmp.lossless_steps == 2 and cmp.lossy_steps == 2
    assert (cmp.resent_per_step, cmp.resent_all_per_step) == pytest.approx((4.0, 8.0))


def test_answers_sent_again_per_lossy_step() -> None:
    """The aggregator's answers sent again, read at each switch: run A's lossy phase 1 (1.0 .. 2.0 s) added 30,
    its lossy phase 3 (3.0 .. 5.0 s) 90: 40 a second; its lossless phases 0 and 2 added 5 and 55 in a second
    each, and run B's lossless phase 0 added 8 (its lossy phase has no end reading): 68 in 3 s. Loss added
    40 - 68 / 3 a second, times the median lossy step (120 ms): 2.08 per step. Without readings: nan."""
    steps = [_mark(0.1, 0.2, 0), _mark(1.1, 1.22, 3), _mark(2.1, 2.2, 3), _mark(3.1, 3.22, 4)]
    run_a = (steps, _switches(0.0, 1.0, 2.0, 3.0, 5.0, answers=(0.0, 5.0, 35.0, 90.0, 180.0)), 0)
    run_b = ([_mark(0.1, 0.2, 0), _mark(1.1, 1.22, 1)], _switches(0.0, 1.0, answers=(0.0, 8.0)), 0)
    cmp = compare_phases([run_a, run_b])
    assert cmp is not None and cmp.answers_resent_per_step == pytest.approx(2.08)
    cmp = compare_phases([(steps, _switches(0.0, 1.0, 2.0, 3.0, 5.0), 0)])
    assert cmp is not None and math.isnan(cmp.answers_resent_per_step)


def test_the_interval_of_the_median_is_made_of_order_statistics() -> None:
    """For 20 values, P(Bin(20, 1/2) <= 5) = 0.0207 and P(<= 6) = 0.0577: the 90 % interval runs from the
    6th to the 15th smallest; for 5 values P(<= 0) = 0.031 and P(<= 1) = 0.19: from the 1st to the 5th; for
    4 values P(0) = 0.0625 > 0.05: no interval. Order, not position, counts."""
    assert median_interval(np.arange(20.0, 0.0, -1.0)) == (6.0, 15.0)
    assert median_interval(np.array([5.0, 1.0, 3.0, 2.0, 4.0])) == (1.0, 5.0)
    assert median_interval(np.array([1.0, 2.0, 3.0, 4.0])) == (-math.inf, math.inf)


def test_the_interval_of_the_median_of_many_values() -> None:
    """Pools of a thousand pairs and more (33 runs of the DDP benchmark's phases) have their interval too; the
    order statistic checked against exact integer sums of the binomial coefficients (2 ** n is past a float's
    range from n = 1,024 on)."""
    for n in (1023, 1024, 2500):
        k = 0
        total = 0  # sum of C(n, j) for j < k
        while 20 * (total + math.comb(n, k)) <= 2 ** n:  # P(Bin(n, 1/2) <= k) <= 5 %
            total += math.comb(n, k)
            k += 1
        values = np.random.default_rng(n).permutation(n).astype(float)
        assert median_interval(values) == (float(k - 1), float(n - k))


def test_verdict_against_the_resent_bytes_time() -> None:
    """100 datagrams of 1,500 bytes resent by all ranks (40 of them by rank 0) need 1.2 ms at 1 Gbit/s on the
    aggregator's link: an interval wholly below is met, wholly above missed, across it undecided."""
    def cmp(low: float, high: float) -> PhaseComparison:
        return PhaseComparison(pairs=9, lossless_steps=9, lossy_steps=9, lossless_s=0.1, lossy_s=0.1,
                               extra_s=(low + high) / 2, low_s=low, high_s=high, resent_per_step=40,
                               resent_all_per_step=100)
    assert cmp(0, 0).resent_s(1500, 1000) == pytest.approx(0.0012)
    assert cmp(0, 0).resent_s(1500, 1000, all_ranks=False) == pytest.approx(0.00048)
    assert cmp(-0.002, 0.0011).verdict(1500, 1000) == "met"
    assert cmp(0.0013, 0.004).verdict(1500, 1000) == "missed"
    assert cmp(0.0005, 0.004).verdict(1500, 1000) == "undecided"


def test_the_longer_direction_of_the_resent_bytes_sets_the_verdict() -> None:
    """The resent requests cross the aggregator's link inbound (100 x 1,500 bytes: 1.2 ms at 1 Gbit/s), the
    answers sent again outbound (150 x 1,250 bytes: 1.5 ms); the link carries both at once, so the longer one
    is what loss may cost: an interval up to 1.4 ms is met, one from 1.45 ms undecided. With fewer answers
    sent again (50: 0.5 ms) the requests' 1.2 ms decide; without the readings too."""
    def cmp(low: float, high: float, answers: float) -> PhaseComparison:
        return PhaseComparison(pairs=9, lossless_steps=9, lossy_steps=9, lossless_s=0.1, lossy_s=0.1,
                               extra_s=(low + high) / 2, low_s=low, high_s=high, resent_per_step=40,
                               resent_all_per_step=100, answers_resent_per_step=answers)
    assert cmp(0, 0, 150).answers_resent_s(1250, 1000) == pytest.approx(0.0015)
    assert cmp(0, 0, 150).yardstick_s(1500, 1000, 1250) == pytest.approx(0.0015)
    assert cmp(0.0005, 0.0014, 150).verdict(1500, 1000, 1250) == "met"
    assert cmp(0.0005, 0.0014, 150).verdict(1500, 1000) == "undecided"  # the answers' size not known
    assert cmp(0.0005, 0.0014, 50).verdict(1500, 1000, 1250) == "undecided"
    assert cmp(0.00145, 0.004, 150).verdict(1500, 1000, 1250) == "undecided"
    assert cmp(0.0016, 0.004, 150).verdict(1500, 1000, 1250) == "missed"
    assert cmp(0.0005, 0.0014, math.nan).yardstick_s(1500, 1000, 1250) == pytest.approx(0.0012)


def test_no_pair_of_whole_phases_gives_none() -> None:
    """Phases too short for a whole step (every step overlaps a switch), or no lossy phase at all: None."""
    switches = _switches(0.0, 0.1, 0.2)
    assert compare_phases([([_mark(0.05, 0.15, 0), _mark(0.15, 0.25, 1)], switches, 0)]) is None
    assert compare_phases([([_mark(0.02, 0.05, 0)], _switches(0.0), 0)]) is None


class _FakeNet:
    """What LossPhases uses of a Topology: the configured loss and set_loss (which fails from call ``fail_at``)."""

    def __init__(self, fail_at: int = 10**9) -> None:
        self.cfg = SimpleNamespace(loss_percent={"w0": 0.0, "w1": 0.0})
        self.calls: list[dict[str, float]] = []
        self.fail_at = fail_at

    def set_loss(self, loss: dict[str, float]) -> None:
        if len(self.calls) >= self.fail_at:
            raise NetemError("nft: no such table")
        self.calls.append(dict(loss))


def test_phases_alternate_from_lossless_and_end_lossless() -> None:
    """Switches alternate lossless / lossy (every worker at once), each bracketed in time and read for the
    aggregator's CPU; the run ends with the loss off."""
    net = _FakeNet()
    with LossPhases(net, 2.0, 0.02, cpu=lambda: 1.5, answers_resent=lambda: 7.0) as phases:  # type: ignore[arg-type]
        time.sleep(0.15)
    sw = phases.switches
    assert len(sw) >= 4 and [s.lossy for s in sw[:4]] == [False, True, False, True]
    assert all(s.percent == (2.0 if s.lossy else 0.0) and s.before <= s.after and s.cpu == 1.5
               and s.answers_resent == 7.0 for s in sw)
    assert not sw[-1].lossy and net.calls[-1] == {"w0": 0.0, "w1": 0.0} and net.calls[1] == {"w0": 2.0, "w1": 2.0}


def test_phases_that_stop_switching_fail_the_run() -> None:
    """A switch that fails part-way (nft gone) is not swallowed: the run ends with a NetemError saying so,
    since its later steps would carry the wrong labels."""
    with pytest.raises(NetemError, match="stopped switching: nft: no such table"):
        with LossPhases(_FakeNet(fail_at=2), 1.0, 0.01):  # type: ignore[arg-type]
            time.sleep(0.1)
