"""``thc-aggregator``: the batch engine served over UDP, built for packet rate.

``AggregatorServer`` binds one UDP port per shard and runs the shards (``aggregator.shard``: one
process each when there are several, counters in shared memory), handles signals (SIGINT/SIGTERM stop,
SIGHUP reloads the job file), the control port (``aggregator.control``) and what is shown of the
counters (``aggregator.metrics``: Prometheus, the statistics line).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import numpy as np

from aggregator.control import ControlChannel
from aggregator.engine import DEFAULT_STRIDE
from aggregator.metrics import StatsLine, start_metrics
from aggregator.shard import Shard, bind_shards, shard_process
from worker_lib.job import JobConfig, load_jobs
from worker_lib.wire.protocol import Counter, DarCounter

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """How ``thc-aggregator`` serves: address, shards, batching, outputs and observability."""

    host: str = "127.0.0.1"
    port: int = 9451
    shards: int = 1
    batch: int = 256
    stride: int = DEFAULT_STRIDE
    multicast: bool = False
    busy_poll: bool = False
    stats_interval: float = 0.0
    metrics_port: int | None = None
    config_path: Path | None = None
    jobs: list[JobConfig] = field(default_factory=list)
    pcap: Path | None = None
    poll_timeout: float = 0.05
    control_port: int | None = None  #: UDP port for text commands (add SPEC, remove ID, list, stats); 0: any

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= 64:
            raise ValueError(f"shards must be in 1..64, got {self.shards}")
        if not 1 <= self.batch <= 4096:
            raise ValueError(f"batch must be in 1..4096, got {self.batch}")
        if self.stats_interval < 0:
            raise ValueError("stats_interval must be >= 0")


class AggregatorServer:
    """``thc-aggregator``: shards, signals (SIGINT/SIGTERM stop, SIGHUP reloads the job file),
    statistics and Prometheus metrics."""

    def __init__(self, cfg: ServerConfig, *, out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.out = out
        self.jobs = self._load_jobs()
        self.socks = bind_shards(cfg.host, cfg.port, cfg.shards)
        self.port = self.socks[0].getsockname()[1]
        self.counters = np.zeros((cfg.shards, len(Counter)), np.int64)
        self.dar_counters = np.zeros((cfg.shards, len(DarCounter)), np.int64)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._metrics = None
        self.control = ControlChannel(cfg.host, cfg.control_port) if cfg.control_port is not None else None
        self.control_port = self.control.port if self.control is not None else None

    def _load_jobs(self) -> list[JobConfig]:
        jobs = {j.job: j for j in self.cfg.jobs}
        if self.cfg.config_path is not None:
            for j in load_jobs(self.cfg.config_path):
                jobs[j.job] = j
        if not jobs:
            jobs[1] = JobConfig()
        return list(jobs.values())

    def stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        self._reload.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._reload.set()
        else:
            self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _do_reload(self) -> list[JobConfig] | None:
        self._reload.clear()
        try:
            jobs = self._load_jobs()
        except ValueError as exc:
            log.error("reload refused, keeping the current jobs: %s", exc)
            self.out(f"reload refused: {exc}")
            return None
        self.jobs = jobs
        self.out(f"reloaded: jobs {sorted(j.job for j in jobs)}")
        return jobs

    def _poll_control(self) -> list[JobConfig] | None:
        """Answer waiting control commands; the new job list if one changed it (a later SIGHUP reload
        replaces the job set with the file's and --job's)."""
        if self.control is None:
            return None
        jobs = self.control.poll(self.jobs, self.totals)
        if jobs is None:
            return None
        self.jobs = jobs
        self.out(f"control: jobs {sorted(j.job for j in jobs)}")
        return jobs

    def totals(self) -> dict[str, int]:
        """Counter totals over the shards: the state machine's, then the DAR path's as ``dar_<name>``."""
        tot = self.counters.sum(axis=0)
        dar = self.dar_counters.sum(axis=0)
        out = {c.label: int(tot[c]) for c in Counter}
        out.update({f"dar_{c.label}": int(dar[c]) for c in DarCounter})
        return out

    def serve(self) -> None:
        """Run until stop() or SIGINT/SIGTERM."""
        cfg = self.cfg
        if cfg.metrics_port is not None:
            self._start_metrics()
        try:
            if cfg.shards == 1:
                self._serve_single()
            else:
                self._serve_sharded()
        finally:
            if self._metrics is not None:
                self._metrics.shutdown()
            for s in self.socks:
                s.close()
            if self.control is not None:
                self.control.close()

    def _serve_single(self) -> None:
        sh = Shard(self.cfg, self.socks[0], 0, self.jobs, self.counters[0], self.dar_counters[0])
        stats = StatsLine(self.cfg.stats_interval, self.counters, self.dar_counters, self.out)
        try:
            while not self._stop.is_set():
                sh.step(self.cfg.poll_timeout)
                jobs = self._do_reload() if self._reload.is_set() else None
                jobs = self._poll_control() or jobs
                if jobs is not None:
                    sh.set_jobs(jobs)
                stats.tick()
        finally:
            sh.close()

    def _serve_sharded(self) -> None:
        cfg = self.cfg
        ctx = mp.get_context("fork")
        shared = ctx.RawArray("q", cfg.shards * len(Counter))
        self.counters = np.frombuffer(shared, np.int64).reshape(cfg.shards, len(Counter))
        dar_shared = ctx.RawArray("q", cfg.shards * len(DarCounter))
        self.dar_counters = np.frombuffer(dar_shared, np.int64).reshape(cfg.shards, len(DarCounter))
        stop = ctx.Event()
        procs, conns = [], []
        for i, sock in enumerate(self.socks):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=shard_process, args=(cfg, sock, i, self.jobs, shared, dar_shared, child, stop),
                            name=f"thc-aggregator-shard{i}", daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        stats = StatsLine(cfg.stats_interval, self.counters, self.dar_counters, self.out)
        try:
            while not self._stop.wait(0.05):
                jobs = self._do_reload() if self._reload.is_set() else None
                jobs = self._poll_control() or jobs
                if jobs is not None:
                    for c in conns:
                        c.send(jobs)
                stats.tick()
                if not all(p.is_alive() for p in procs):
                    log.error("a shard process exited; stopping")
                    break
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=3)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=1)

    def _start_metrics(self) -> None:
        self._metrics = start_metrics(self.cfg.host, self.cfg.metrics_port, lambda: self.counters,
                                      lambda: self.dar_counters)
