"""``thc-aggregator``: the batch engine served over UDP, built for packet rate.

``AggregatorServer`` binds one UDP port per shard and runs the shards (``aggregator.shard``: one
process each when there are several, counters in shared memory), handles signals (SIGINT/SIGTERM stop,
SIGHUP reloads the job file), the control socket (``aggregator.control``) and what is shown of the
counters (``aggregator.metrics``: Prometheus, the statistics line).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import FrameType

import numpy as np

from aggregator.control import ControlChannel, ControlConfig, Install
from aggregator.dar import preload_codecs
from aggregator.engine import DEFAULT_STRIDE, Aggregator
from aggregator.metrics import StatsLine, start_metrics
from aggregator.shard import Shard, bind_shards, shard_process, warm_up_shard
from worker_lib.batch_io import warm_up_io
from worker_lib.job import JobConfig, load_jobs
from worker_lib.wire.protocol import Counter, DarCounter

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """How ``thc-aggregator`` serves: address, shards, batching, outputs and observability."""

    host: str = "127.0.0.1"
    port: int = 9451
    shards: int = 1
    #: this server is member ``member`` of ``members`` aggregators serving the same jobs (on other
    #: machines, each with ``shards`` shards): its shard i owns the slots s with
    #: s mod (members * shards) == member * shards + i, and the workers list all members in order
    member: int = 0
    members: int = 1
    batch: int = 256
    stride: int = DEFAULT_STRIDE
    multicast: bool = False
    busy_poll: bool = False
    #: read runs that arrive whole as one message (UDP_GRO) where the kernel has it: less CPU per
    #: datagram (docs/aggregator.md)
    gro: bool = True
    stats_interval: float = 0.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  #: the Prometheus endpoint's address: loopback unless asked
    config_path: Path | None = None
    jobs: list[JobConfig] = field(default_factory=list)
    pcap: Path | None = None
    poll_timeout: float = 0.05
    control: ControlConfig | None = None  #: the control socket (aggregator.control); None: no control
    engine: str = "compiled"  #: "compiled" (aggregator.compiled, numba) or "numpy" (the vectorised paths)

    def __post_init__(self) -> None:
        if self.engine not in ("compiled", "numpy"):
            raise ValueError(f"engine must be compiled or numpy, got {self.engine!r}")
        if not 1 <= self.shards <= 64:
            raise ValueError(f"shards must be in 1..64, got {self.shards}")
        if not 0 <= self.member < self.members <= 64:
            raise ValueError(f"member must be in 0..members-1 and members in 1..64, got {self.member}/{self.members}")
        if not 1 <= self.batch <= 4096:
            raise ValueError(f"batch must be in 1..4096, got {self.batch}")
        if self.stats_interval < 0:
            raise ValueError("stats_interval must be >= 0")

    def global_shard(self, shard: int) -> tuple[int, int]:
        """(index, count) of local shard ``shard`` among the shards of all members: the slot partition."""
        return self.member * self.shards + shard, self.members * self.shards


class _Loader:
    """``load()`` run in a thread: ``done`` once it returned, ``result`` the jobs or the error raised."""

    def __init__(self, load: Callable[[], list[JobConfig]]) -> None:
        self.result: list[JobConfig] | ValueError | OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), name="thc-reload", daemon=True)
        self._thread.start()

    def _run(self, load: Callable[[], list[JobConfig]]) -> None:
        try:
            self.result = load()
        except (ValueError, OSError) as exc:  # a bad or unreadable file: reported, the jobs kept
            self.result = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


class AggregatorServer:
    """``thc-aggregator``: shards, signals (SIGINT/SIGTERM stop, SIGHUP reloads the job file),
    statistics and Prometheus metrics."""

    def __init__(self, cfg: ServerConfig, *, out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.out = out
        self.jobs = self._load_jobs()
        if cfg.engine == "compiled":  # compile (or load from cache) now, before the port is announced: the
            Aggregator(max_batch=1, compiled=True)  # first time takes seconds; shards inherit it (fork)
        warm_up_shard()  # the same for the shard's per-batch passes and its socket's
        warm_up_io(gso=True, gro=cfg.gro)
        self.socks = bind_shards(cfg.host, cfg.port, cfg.shards)
        self.port = self.socks[0].getsockname()[1]
        self.counters = np.zeros((cfg.shards, len(Counter)), np.int64)
        self.dar_counters = np.zeros((cfg.shards, len(DarCounter)), np.int64)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._loader: _Loader | None = None
        self._metrics: ThreadingHTTPServer | None = None
        self.control: ControlChannel | None = None
        try:
            if cfg.pcap is not None and not os.access(cfg.pcap.parent, os.W_OK):
                raise OSError(f"cannot write the pcap file {cfg.pcap}: {cfg.pcap.parent} is not a writable "
                              "directory")
            self._metrics = self._start_metrics() if cfg.metrics_port is not None else None
            if cfg.control is not None:  # a dar job may be added at any time: load its codecs (torch) now,
                import worker_lib.codecs  # noqa: F401  # not while packets wait (seconds holding the GIL)

                self.control = ControlChannel(cfg.control, lambda: self.jobs, self.totals)
        except BaseException:  # nothing half-started is left behind: sockets, metrics thread
            self._release()
            raise

    def _release(self) -> None:
        """Close what ``__init__`` opened: the shard sockets, the metrics endpoint, the control socket."""
        if self._metrics is not None:
            self._metrics.shutdown()
        for s in self.socks:
            s.close()
        if self.control is not None:
            self.control.close()

    def _load_jobs(self) -> list[JobConfig]:
        """--job's jobs, replaced by the config file's where the ids are the same."""
        jobs = {j.job: j for j in self.cfg.jobs}
        if self.cfg.config_path is not None:
            for j in load_jobs(self.cfg.config_path):
                jobs[j.job] = j
        if not jobs:
            jobs[1] = JobConfig()
        for j in jobs.values():
            j.check_one_tier()
        return list(jobs.values())

    def _reload_jobs(self) -> list[JobConfig]:
        """_load_jobs, then the codecs its dar jobs need (in the reload thread, not the packet loop)."""
        jobs = self._load_jobs()
        preload_codecs(jobs)
        return jobs

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

    def _poll_reload(self) -> list[JobConfig] | None:
        """Start a requested reload in a thread (reading the file solves every job's table: seconds for a
        large granularity, which must not stall the packets); the new job list once it is ready."""
        if self._reload.is_set() and self._loader is None:
            self._reload.clear()
            self._loader = _Loader(self._reload_jobs)
        if self._loader is None or not self._loader.done:
            return None
        loaded, self._loader = self._loader, None
        if isinstance(loaded.result, (ValueError, OSError)):
            log.error("reload refused, keeping the current jobs: %s", loaded.result)
            self.out(f"reload refused: {loaded.result}")
            return None
        self.jobs = loaded.result
        self.out(f"reloaded: jobs {sorted(j.job for j in self.jobs)}")
        return self.jobs

    def _apply_job_changes(self, install: Install) -> None:
        """Install what a finished reload and the waiting control commands change, through the serving
        loop's ``install``. A reload keeps unchanged jobs' registers; a control ``add`` configures its job
        anew even where unchanged, and a command is answered only once its change is installed (a later
        SIGHUP reload replaces the job set with the file's and --job's)."""
        reloaded = self._poll_reload()
        if reloaded is not None:
            install(reloaded, frozenset())
        if self.control is None:
            return

        def from_control(jobs: list[JobConfig], fresh: frozenset[int]) -> None:
            self.jobs = jobs
            install(jobs, fresh)
            self.out(f"control: jobs {sorted(j.job for j in self.jobs)}")

        self.control.apply(self.jobs, from_control)

    def totals(self) -> dict[str, int]:
        """Counter totals over the shards: the state machine's, then the DAR path's as ``dar_<name>``."""
        tot = self.counters.sum(axis=0)
        dar = self.dar_counters.sum(axis=0)
        out = {c.label: int(tot[c]) for c in Counter}
        out.update({f"dar_{c.label}": int(dar[c]) for c in DarCounter})
        if self.control is not None:
            out.update(self.control.counts)
        return out

    def serve(self) -> None:
        """Run until stop() or SIGINT/SIGTERM."""
        try:
            if self.cfg.shards == 1:
                self._serve_single()
            else:
                self._serve_sharded()
        finally:
            self._release()

    def _serve_single(self) -> None:
        sh = Shard(self.cfg, self.socks[0], 0, self.jobs, self.counters[0], self.dar_counters[0])
        if self.control is not None:
            self.control.start()
        stats = StatsLine(self.cfg.stats_interval, self.counters, self.dar_counters, self.out)
        try:
            while not self._stop.is_set():
                sh.step(self.cfg.poll_timeout)
                self._apply_job_changes(sh.set_jobs)
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
        if self.control is not None:
            self.control.start()
        stats = StatsLine(cfg.stats_interval, self.counters, self.dar_counters, self.out)

        def install(jobs: list[JobConfig], fresh: frozenset[int]) -> None:
            """Every shard process installs the change and says so before a command that made it is
            answered (a shard that is gone or silent for 5 s is left to the liveness check below)."""
            try:
                for c in conns:
                    c.send((jobs, fresh))
                for c in conns:
                    if not c.poll(5.0):
                        log.error("a shard did not confirm the job change within 5 s")
                        continue
                    c.recv()
            except (EOFError, OSError) as exc:  # a shard process exited: its pipe is closed
                log.error("a shard could not take the job change: %s", exc)

        try:
            while not self._stop.wait(0.05):
                self._apply_job_changes(install)
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

    def _start_metrics(self) -> ThreadingHTTPServer:
        try:
            return start_metrics(self.cfg.metrics_host, self.cfg.metrics_port, lambda: self.counters,
                                 lambda: self.dar_counters)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on TCP {self.cfg.metrics_host}:{self.cfg.metrics_port}: "
                          f"{exc.strerror or exc}") from None
