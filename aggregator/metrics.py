"""What ``thc-aggregator`` shows of its counters: Prometheus metrics and a periodic statistics line.

The counters live in (shared) arrays of shape (shards, len(Counter)) and (shards, len(DarCounter));
each metric's help text is the counter's description in the protocol core.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from enum import IntEnum
from http.server import ThreadingHTTPServer

import numpy as np

from worker_lib.wire.protocol import DAR_DROP_COUNTERS, DROP_COUNTERS, Counter, DarCounter


def _families(prefix: str, snap: np.ndarray, counters: type[IntEnum], drops: tuple,
              dropped_help: str) -> Iterator[object]:
    """One family per counter (labelled by shard), and one ``<prefix>_dropped`` family by reason."""
    from prometheus_client.core import CounterMetricFamily

    for c in counters:
        if c in drops:
            continue
        fam = CounterMetricFamily(f"{prefix}_{c.label}", c.description, labels=["shard"])
        for s in range(snap.shape[0]):
            fam.add_metric([str(s)], float(snap[s, c]))
        yield fam
    fam = CounterMetricFamily(f"{prefix}_dropped", dropped_help, labels=["reason", "shard"])
    for c in drops:
        for s in range(snap.shape[0]):
            fam.add_metric([c.label, str(s)], float(snap[s, c]))
    yield fam


def start_metrics(host: str, port: int, counters: Callable[[], np.ndarray],
                  dar_counters: Callable[[], np.ndarray]) -> ThreadingHTTPServer:
    """Serve the counters in Prometheus' text format on http://HOST:PORT/metrics (a daemon thread)."""
    from prometheus_client import CollectorRegistry, start_http_server

    class _Collector:
        def collect(self) -> Iterator[object]:
            yield from _families("thc_aggregator", counters().copy(), Counter, DROP_COUNTERS,
                                 "packets dropped, by reason")
            yield from _families("thc_aggregator_dar", dar_counters().copy(), DarCounter, DAR_DROP_COUNTERS,
                                 "DAR fragments dropped, by reason")

    registry = CollectorRegistry()
    registry.register(_Collector())
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return httpd


class StatsLine:
    """Periodic one-line statistics (packets/s, elements/s, drops by reason, stragglers, completions;
    with DAR traffic, DAR rounds and their CPU time per round)."""

    def __init__(self, interval: float, counters: np.ndarray, dar_counters: np.ndarray,
                 out: Callable[[str], None]) -> None:
        self.interval, self.counters, self.dar_counters, self.out = interval, counters, dar_counters, out
        self.last_t = time.monotonic()
        self.last = counters.sum(axis=0).copy()
        self.dar_last = dar_counters.sum(axis=0).copy()

    def tick(self) -> None:
        if self.interval <= 0:
            return
        now = time.monotonic()
        if now - self.last_t < self.interval:
            return
        cur = self.counters.sum(axis=0)
        d = cur - self.last
        dt = now - self.last_t
        drops = {c.name.lower(): int(d[c]) for c in DROP_COUNTERS if d[c]}
        dcur = self.dar_counters.sum(axis=0)
        dd = dcur - self.dar_last
        dar = ""
        if dd[DarCounter.RX]:
            rounds = int(dd[DarCounter.COMPLETED])
            per = dd[DarCounter.CPU_NS] / rounds / 1e6 if rounds else 0.0
            ddrops = {c.name.lower(): int(dd[c]) for c in DAR_DROP_COUNTERS if dd[c]}
            dar = f"  dar rounds {rounds} cpu {per:.3f} ms/round dropped {ddrops or 0}"
        self.out(f"rx {d[Counter.RX] / dt:,.0f} pkt/s  elements {d[Counter.ELEMENTS] / dt:,.0f}/s  "
                 f"completed {int(d[Counter.COMPLETED])}  retained {int(d[Counter.RETAINED])}  "
                 f"stragglers {int(d[Counter.STRAGGLER])}  dropped {drops or 0}{dar}")
        self.last, self.last_t = cur.copy(), now
        self.dar_last = dcur.copy()
