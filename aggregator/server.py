"""The userspace aggregator: the reference state machine served over UDP, built for packet rate.

Each shard is one process with one socket (port ``base + shard``) owning the slots s with
s mod P == shard. A shard loops: wait (or busy-poll), recvmmsg a batch into a preallocated buffer,
``Aggregator.process`` the whole batch (numpy validation and table lookups over the batch), learn
the senders' addresses, then sendmmsg every result: unicast fan-out to the job's workers (addresses
learned from their packets) or one datagram to the job's multicast group, and unicast answers
(retained results, straggler notices) to their senders. Counters live in shared memory so that the
parent process prints statistics and exports them to Prometheus for all shards.

DAR_DATA packets (fragments of decompress-aggregate-recompress jobs, a software-only extension) are
routed by their type byte to ``aggregator.dar.DarAggregator``; everything else goes to the reference
state machine, which keeps dropping DAR types as ``bad_type`` exactly as a switch does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import numpy as np

from aggregator.dar import DarAggregator, DarOutputs
from aggregator.engine import DEFAULT_STRIDE, Aggregator
from aggregator.io import BatchSocket, sockaddr_in, sockaddr_to_tuple, udp_socket
from worker_lib.job import JobConfig, load_jobs, parse_job_spec
from worker_lib.wire.layout import PacketType
from worker_lib.wire.protocol import DAR_DROP_COUNTERS, DROP_COUNTERS, Counter, DarCounter

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


def bind_shards(host: str, port: int, shards: int, attempts: int = 50) -> list[socket.socket]:
    """Bind ``shards`` consecutive UDP ports from ``port`` (port 0: any free consecutive range)."""
    if port != 0:
        return [udp_socket(host, port + i) for i in range(shards)]
    for _ in range(attempts):
        first = udp_socket(host, 0)
        base = first.getsockname()[1]
        socks = [first]
        try:
            if base + shards > 65536:
                raise OSError("range")
            socks += [udp_socket(host, base + i) for i in range(1, shards)]
            return socks
        except OSError:
            for s in socks:
                s.close()  # retry from another ephemeral base
    raise OSError(f"could not bind {shards} consecutive UDP ports on {host}")


class _Addresses:
    """Learned worker addresses of one job (n sockaddr_in), preallocated at configuration."""

    def __init__(self, cfg: JobConfig) -> None:
        self.addr = np.zeros((cfg.workers, 16), np.uint8)
        self.known = np.zeros(cfg.workers, bool)
        self.group = None
        if cfg.multicast:
            host, _, port = cfg.multicast.rpartition(":")
            self.group = np.frombuffer(sockaddr_in(host, int(port)), np.uint8)[None, :]


class Shard:
    """One shard: a socket, a state machine, and the loop between them."""

    def __init__(self, cfg: ServerConfig, sock: socket.socket, shard: int, jobs: Sequence[JobConfig],
                 counters: np.ndarray | None = None, dar_counters: np.ndarray | None = None) -> None:
        self.cfg, self.shard = cfg, shard
        self.io = BatchSocket(sock, batch=cfg.batch, stride=cfg.stride)
        if cfg.multicast:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(cfg.host))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        self.agg = Aggregator(shard=shard, shards=cfg.shards, max_batch=cfg.batch, stride=cfg.stride)
        if counters is not None:
            self.agg.counters = counters
        self.dar = DarAggregator(shard=shard, shards=cfg.shards, stride=cfg.stride)
        if dar_counters is not None:
            self.dar.counters = dar_counters
        self.addrs: dict[int, _Addresses] = {}
        self.set_jobs(jobs)
        self.pcap = None
        if cfg.pcap is not None:
            from worker_lib.wire.pcap import PcapWriter

            path = cfg.pcap if cfg.shards == 1 else cfg.pcap.with_suffix(f".shard{shard}{cfg.pcap.suffix}")
            self.pcap = PcapWriter(path)
        self.local = sockaddr_to_tuple(sockaddr_in(*sock.getsockname()))

    def set_jobs(self, jobs: Sequence[JobConfig]) -> None:
        """Apply a job list: new or changed jobs are (re)configured, missing ones removed."""
        wanted = {j.job: j for j in jobs}
        for jid in list(self.agg.jobs):
            if jid not in wanted or wanted[jid].kind == "dar":
                self.agg.remove_job(jid)
                self.addrs.pop(jid, None)
        for jid in list(self.dar.jobs):
            if jid not in wanted or wanted[jid].kind != "dar":
                self.dar.remove_job(jid)
                self.addrs.pop(jid, None)
        for jid, cfg in wanted.items():
            table = self.dar if cfg.kind == "dar" else self.agg
            cur = table.jobs.get(jid)
            if cur is None or cur.cfg != cfg:
                table.add_job(cfg)
                self.addrs[jid] = _Addresses(cfg)

    def step(self, timeout: float) -> int:
        """One iteration: receive a batch (waiting up to ``timeout`` unless busy polling), process, send.

        Packet contents never raise (they are validated and counted); should a bug raise anyway, the
        batch is logged and skipped so that one bad batch cannot stop the aggregator.
        """
        try:
            return self._step(timeout)
        except Exception:
            log.exception("shard %d: batch skipped after an internal error", self.shard)
            return 0

    def _step(self, timeout: float) -> int:
        io = self.io
        if not self.cfg.busy_poll and not io.wait(timeout):
            return 0
        n = io.recv()
        if n == 0:
            return 0
        if self.pcap is not None:
            for i in range(n):
                self.pcap.write(sockaddr_to_tuple(io.rx_addr[i]), self.local, io.rx[i, : io.rx_len[i]].tobytes())
        is_dar = (io.rx[:n, 1] == PacketType.DAR_DATA) & (io.rx_len[:n] >= 2)
        if not is_dar.any():
            out = self.agg.process(io.rx[:n], io.rx_len[:n])
            good = self.agg.last_good
            self._learn(good, self.agg.last_job[good], self.agg.last_worker[good])
            if out.count:
                self._send(out, io.rx_addr)
            return n
        dar_rows = np.flatnonzero(is_dar)
        rest = np.flatnonzero(~is_dar)
        self.agg.counters[Counter.RX] += dar_rows.size  # rx counts every datagram; the rest add theirs
        if rest.size:  # a batch mixing kinds (rare): the state machine gets the others, compacted
            out = self.agg.process(np.ascontiguousarray(io.rx[rest]), io.rx_len[rest])
            good = self.agg.last_good
            self._learn(rest[good], self.agg.last_job[good], self.agg.last_worker[good])
            if out.count:
                self._send(out, io.rx_addr[rest])
        sub = io.rx[:n] if rest.size == 0 else np.ascontiguousarray(io.rx[dar_rows])
        dout = self.dar.process(sub, io.rx_len[dar_rows])
        if dout.good_rows:
            self._learn(dar_rows[dout.good_rows], np.asarray(dout.good_jobs), np.asarray(dout.good_workers))
        if dout.sends:
            self._send_dar(dout, io.rx_addr[dar_rows])
        return n

    def _learn(self, rows: np.ndarray, jobs: np.ndarray, workers: np.ndarray) -> None:
        """Remember the source address of worker ``workers[k]`` of job ``jobs[k]`` (rx row ``rows[k]``)."""
        if rows.size == 0:
            return
        for j in np.unique(jobs).tolist():
            sel = jobs == j
            tab = self.addrs.get(j)
            if tab is None:
                continue
            w = workers[sel]
            tab.addr[w] = self.io.rx_addr[rows[sel]]
            tab.known[w] = True

    def _destinations(self, job: int) -> np.ndarray | None:
        """Addresses a completion of ``job`` goes to: its multicast group, or its known workers."""
        tab = self.addrs.get(job)
        if tab is None:
            return None
        dests = tab.group if (self.cfg.multicast and tab.group is not None) else tab.addr[tab.known]
        return dests if len(dests) else None

    def _send_dar(self, out: DarOutputs, src_addr: np.ndarray) -> None:
        """Send the DAR path's datagrams (result fragments fanned out, unicast answers to senders)."""
        for snd in out.sends:
            if snd.fanout:
                dests = self._destinations(snd.job)
                if dests is None:
                    continue
                rows = np.repeat(snd.rows, len(dests))
                lengths = np.repeat(snd.lengths, len(dests))
                addrs = np.tile(dests, (snd.rows.size, 1))
            else:
                rows, lengths = snd.rows, snd.lengths
                addrs = np.repeat(src_addr[snd.src][None, :], snd.rows.size, axis=0)
            self.io.send(snd.buf, rows, lengths, addrs)
            if self.pcap is not None:
                for r, a, ln in zip(rows.tolist(), addrs, lengths.tolist(), strict=True):
                    self.pcap.write(self.local, sockaddr_to_tuple(a), snd.buf[r, :ln].tobytes())

    def _send(self, out: object, src_addr: np.ndarray) -> None:
        from aggregator.engine import Outputs

        assert isinstance(out, Outputs)
        m = out.count
        fan = out.fanout[:m]
        rows_l: list[np.ndarray] = []
        addr_l: list[np.ndarray] = []
        uni = np.flatnonzero(~fan)
        if uni.size:
            rows_l.append(uni)
            addr_l.append(src_addr[out.src[uni]])
        fo = np.flatnonzero(fan)
        if fo.size:
            jobs = out.job[fo]
            for j in np.unique(jobs).tolist():
                ms = fo[jobs == j]
                dests = self._destinations(j)
                if dests is None:
                    continue
                rows_l.append(np.repeat(ms, len(dests)))
                addr_l.append(np.tile(dests, (ms.size, 1)))
        if not rows_l:
            return
        rows = np.concatenate(rows_l)
        addrs = np.concatenate(addr_l)
        lengths = out.length[rows]
        self.io.send(out.buf, rows, lengths, addrs)
        if self.pcap is not None:
            for r, a, ln in zip(rows.tolist(), addrs, lengths.tolist(), strict=True):
                self.pcap.write(self.local, sockaddr_to_tuple(a), out.buf[r, :ln].tobytes())

    def close(self) -> None:
        if self.pcap is not None:
            self.pcap.close()
        self.io.sock.close()


def _shard_main(cfg: ServerConfig, sock: socket.socket, shard: int, jobs: list[JobConfig],
                shared: mp.Array, dar_shared: mp.Array, conn: multiprocessing.connection.Connection,
                stop: mp.Event) -> None:
    """Body of a shard process (shards > 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    counters = np.frombuffer(shared, np.int64).reshape(cfg.shards, len(Counter))[shard]
    dar_counters = np.frombuffer(dar_shared, np.int64).reshape(cfg.shards, len(DarCounter))[shard]
    sh = Shard(cfg, sock, shard, jobs, counters, dar_counters)
    try:
        while not stop.is_set():
            sh.step(cfg.poll_timeout)
            if conn.poll():
                sh.set_jobs(conn.recv())
    finally:
        sh.close()


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
        self.control: socket.socket | None = None
        self.control_port: int | None = None
        if cfg.control_port is not None:
            self.control = udp_socket(cfg.host, cfg.control_port, rcvbuf=1 << 16, sndbuf=1 << 16)
            self.control_port = self.control.getsockname()[1]

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
        """Answer waiting control commands; return the new job list if one changed it.

        Commands (one per datagram, text): ``add SPEC`` (a --job spec; replaces a job with the same
        id), ``remove ID``, ``list`` (JSON), ``stats`` (JSON counter totals). A SIGHUP reload later
        replaces the job set with the file's and --job's.
        """
        if self.control is None:
            return None
        changed = False
        jobs = {j.job: j for j in self.jobs}
        while True:
            try:
                data, peer = self.control.recvfrom(4096)
            except (BlockingIOError, InterruptedError):
                break
            text = data.decode("utf-8", "replace").strip()
            cmd, _, arg = text.partition(" ")
            try:
                if cmd == "add":
                    cfg = parse_job_spec(arg)
                    jobs[cfg.job] = cfg
                    changed = True
                    reply = f"ok: job {cfg.job} configured"
                elif cmd == "remove":
                    jid = int(arg, 0)
                    if jid not in jobs:
                        raise ValueError(f"no job {jid}")
                    del jobs[jid]
                    changed = True
                    reply = f"ok: job {jid} removed"
                elif cmd == "list":
                    reply = json.dumps([j.to_dict() for j in jobs.values()])
                elif cmd == "stats":
                    reply = json.dumps(self.totals())
                else:
                    reply = "error: unknown command; use: add SPEC | remove ID | list | stats"
            except ValueError as exc:
                reply = f"error: {exc}"
            with contextlib.suppress(OSError):
                self.control.sendto(reply.encode(), peer)
        if not changed:
            return None
        self.jobs = list(jobs.values())
        self.out(f"control: jobs {sorted(jobs)}")
        return self.jobs

    def totals(self) -> dict[str, int]:
        """Counter totals over the shards: the state machine's, then the DAR path's as ``dar_<name>``."""
        tot = self.counters.sum(axis=0)
        dar = self.dar_counters.sum(axis=0)
        out = {c.name.lower(): int(tot[c]) for c in Counter}
        out.update({f"dar_{c.name.lower()}": int(dar[c]) for c in DarCounter})
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
        stats = _Stats(self.cfg.stats_interval, self.counters, self.dar_counters, self.out)
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
            p = ctx.Process(target=_shard_main, args=(cfg, sock, i, self.jobs, shared, dar_shared, child, stop),
                            name=f"thc-aggregator-shard{i}", daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        stats = _Stats(cfg.stats_interval, self.counters, self.dar_counters, self.out)
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
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.core import CounterMetricFamily

        server = self

        def families(prefix: str, snap: np.ndarray, counters: type, drops: tuple, helps: dict,
                     dropped_help: str):  # type: ignore[no-untyped-def]
            """One family per counter and shard, and one ``<prefix>_dropped`` family by reason."""
            for c in counters:
                if c in drops:
                    continue
                fam = CounterMetricFamily(f"{prefix}_{c.name.lower()}", helps[c], labels=["shard"])
                for s in range(snap.shape[0]):
                    fam.add_metric([str(s)], float(snap[s, c]))
                yield fam
            fam = CounterMetricFamily(f"{prefix}_dropped", dropped_help, labels=["reason", "shard"])
            for c in drops:
                for s in range(snap.shape[0]):
                    fam.add_metric([c.name.lower(), str(s)], float(snap[s, c]))
            yield fam

        class _Collector:
            def collect(self):  # type: ignore[no-untyped-def]
                yield from families("thc_aggregator", server.counters.copy(), Counter, DROP_COUNTERS, _HELP,
                                    "packets dropped, by reason")
                yield from families("thc_aggregator_dar", server.dar_counters.copy(), DarCounter,
                                    DAR_DROP_COUNTERS, _DAR_HELP, "DAR fragments dropped, by reason")

        registry = CollectorRegistry()
        registry.register(_Collector())
        httpd, _thread = start_http_server(self.cfg.metrics_port, addr=self.cfg.host, registry=registry)
        self._metrics = httpd


_HELP = {c: (c.__doc__ or c.name) for c in Counter}
_HELP.update({
    Counter.RX: "packets received", Counter.ACCEPTED: "contributions added to a bank",
    Counter.NEW_ROUND: "banks started by the first packet of a newer round",
    Counter.COMPLETED: "slot rounds completed", Counter.RETAINED: "retained results sent again by unicast",
    Counter.DUPLICATE: "duplicates before completion", Counter.STRAGGLER: "straggler notices sent",
    Counter.ELEMENTS: "elements aggregated",
})


_DAR_HELP = {
    DarCounter.RX: "DAR_DATA fragments received", DarCounter.ACCEPTED: "DAR fragments stored",
    DarCounter.NEW_ROUND: "DAR banks started by a newer round", DarCounter.MESSAGES: "DAR worker messages completed",
    DarCounter.COMPLETED: "DAR slot rounds aggregated (decode, float sum, re-encode)",
    DarCounter.RETAINED: "DAR fragments of completed rounds answered with retained result fragments",
    DarCounter.DUPLICATE: "DAR duplicate fragments", DarCounter.STRAGGLER: "DAR straggler notices sent",
    DarCounter.RESULT_FRAGMENTS: "DAR result fragments built",
    DarCounter.CPU_NS: "aggregator CPU nanoseconds in decode + float sum + re-encode (divide by completed)",
}


class _Stats:
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
