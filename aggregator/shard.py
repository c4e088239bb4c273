"""One shard of ``thc-aggregator``: a UDP socket, the batch engine and the DAR path, and the loop
between them.

A shard owns the slots s with s mod P == shard. Each ``step`` waits (or busy-polls), recvmmsg-s a batch
into a preallocated buffer, routes DAR_DATA by its type byte to ``aggregator.dar.DarAggregator`` and
everything else to the batch engine (which drops DAR types as ``bad_type`` exactly as a switch does),
learns the senders' addresses, then sendmmsg-s every result: completions to the job's workers (their
learned addresses) or to its multicast group, and unicast answers (retained results, straggler
notices) to their senders.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import signal
import socket
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from aggregator.dar import DarAggregator, DarOutputs
from aggregator.engine import Aggregator, Outputs
from worker_lib.batch_io import BatchSocket, sockaddr_in, sockaddr_to_tuple, udp_socket
from worker_lib.job import JobConfig
from worker_lib.wire.layout import MAX_WORKERS, PacketType
from worker_lib.wire.protocol import Counter, DarCounter

if TYPE_CHECKING:
    from aggregator.server import ServerConfig

log = logging.getLogger(__name__)

_DAR_DATA = int(PacketType.DAR_DATA)  # a plain int: an enum member's look-up costs a microsecond per batch


# Two per-batch questions as compiled loops: as numpy expressions each cost 10-35 us per batch of 64 (a few
# microseconds per operation on this machine), about as much as the batch's state table.
@njit(cache=True, nogil=True)
def _any_dar(rx: np.ndarray, lens: np.ndarray, n: int) -> bool:
    """Whether one of rows 0..n-1 is a DAR_DATA datagram (its type byte, in a datagram of 2 bytes or more)."""
    for i in range(n):
        if rx[i, 1] == _DAR_DATA and lens[i] >= 2:
            return True
    return False


#: row 0 of the engine's outputs, once per destination of a one-output send (a job's workers or its group)
_FIRST_ROW = np.zeros(MAX_WORKERS, np.int64)


@njit(cache=True, nogil=True)
def _all_at(rx_addr: np.ndarray, rows: np.ndarray, jobs: np.ndarray, workers: np.ndarray, job: int,
            addr: np.ndarray, known: np.ndarray) -> bool:
    """Whether every row is of ``job`` and comes from its worker's known address (``rx_addr`` and ``addr``
    rows: sockaddr_in as two words): then the batch teaches nothing."""
    for k in range(rows.size):
        w, r = workers[k], rows[k]
        if jobs[k] != job or not known[w] or rx_addr[r, 0] != addr[w, 0] or rx_addr[r, 1] != addr[w, 1]:
            return False
    return True


def warm_up_shard() -> None:
    """Load the per-batch questions' compiled code (``_any_dar``, ``_all_at``) with the types a batch gives
    them, before the first batch (``AggregatorServer`` calls it before it announces its port)."""
    rx, words = np.zeros((1, 8), np.uint8), np.zeros((1, 2), np.uint64)
    ints = np.zeros(1, np.int64)
    _any_dar(rx, ints, 1)
    _all_at(words, ints, ints, ints, 0, words, np.zeros(1, bool))


def bind_shards(host: str, port: int, shards: int, attempts: int = 50) -> list[socket.socket]:
    """Bind ``shards`` consecutive UDP ports from ``port`` (port 0: any free consecutive range)."""
    if port != 0:
        if port + shards > 65536:
            raise OSError(f"{shards} shards from UDP port {port} run past port 65535")
        socks: list[socket.socket] = []
        try:
            for i in range(shards):
                socks.append(udp_socket(host, port + i))
        except OSError as exc:
            for s in socks:
                s.close()
            raise OSError(f"cannot bind UDP {host}:{port + len(socks)}: {exc.strerror or exc}") from None
        return socks
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


class WorkerAddresses:
    """Learned worker addresses of one job (n sockaddr_in), preallocated at configuration."""

    def __init__(self, cfg: JobConfig) -> None:
        self.addr = np.zeros((cfg.workers, 16), np.uint8)
        self.addr_words = self.addr.view(np.uint64)  # (workers, 2): the same addresses as two words each
        self.known = np.zeros(cfg.workers, bool)
        self.group = None
        if cfg.multicast:
            host, _, port = cfg.multicast.rpartition(":")
            self.group = np.frombuffer(sockaddr_in(host, int(port)), np.uint8)[None, :]
        self._known_addr: np.ndarray | None = None

    def known_addresses(self) -> np.ndarray:
        """The learned addresses, (known workers, 16): kept until the next ``learn`` changes one."""
        if self._known_addr is None:
            self._known_addr = self.addr[self.known]
        return self._known_addr

    def learn(self, worker: int, address: np.ndarray) -> None:
        """Worker ``worker`` is at ``address`` (a sockaddr_in row)."""
        self.addr[worker] = address
        self.known[worker] = True
        self._known_addr = None


class AddressBook:
    """The learned worker addresses of a set of jobs, and where each completion of a batch goes: the
    addresses known when its packet arrived, as if the batch were handled one packet at a time."""

    def __init__(self) -> None:
        self.jobs: dict[int, WorkerAddresses] = {}
        #: per job taught a new address by the current batch: (addresses and known before it, its rows, workers)
        self._moves: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def start_batch(self) -> None:
        self._moves.clear()

    def learn(self, rx_addr: np.ndarray, rows: np.ndarray, jobs: np.ndarray, workers: np.ndarray) -> None:
        """Remember the source address (``rx_addr`` row) of worker ``workers[k]`` of job ``jobs[k]`` (rx row
        ``rows[k]``, ascending). Where the batch teaches a job a new address, the table before the batch
        and the batch's teaching rows are kept, for ``destinations``."""
        if rows.size == 0:
            return
        tab = self.jobs.get(int(jobs[0]))
        if tab is not None and _all_at(rx_addr.view(np.uint64), rows, jobs, workers, int(jobs[0]), tab.addr_words,
                                       tab.known):
            return  # the common batch: one job's workers, each at the address it had
        for j in np.unique(jobs).tolist():
            sel = jobs == j
            tab = self.jobs.get(j)
            if tab is None:
                continue
            r, w = rows[sel], workers[sel]
            a = rx_addr[r]
            if (~tab.known[w]).any() or (tab.addr[w] != a).any():
                self._moves[j] = (tab.addr.copy(), tab.known.copy(), r, w)
                for row, wk in zip(r.tolist(), w.tolist(), strict=True):  # in order: the last one stays
                    tab.learn(wk, rx_addr[row])

    def fan_out(self, rx_addr: np.ndarray, outputs: np.ndarray, jobs: np.ndarray, rx_rows: np.ndarray,
                rows: list[np.ndarray], addrs: list[np.ndarray], multicast: bool = False) -> None:
        """Append to ``rows`` / ``addrs`` the sends of the completions ``outputs`` (output rows) of ``jobs``,
        caused by rx rows ``rx_rows``: destination by destination, each worker's results in a row (one GSO
        run each). One destination set serves all of a job's completions, unless this batch taught the job
        an address: then each completion gets the set known at its own packet."""
        one = bool((jobs == jobs[0]).all())  # the common batch: one job's completions
        for j in [int(jobs[0])] if one else np.unique(jobs).tolist():
            sel = slice(None) if one else jobs == j
            ms, src = outputs[sel], rx_rows[sel]
            groups = [slice(None)] if j not in self._moves else [slice(i, i + 1) for i in range(ms.size)]
            for g in groups:
                dests = self.destinations(rx_addr, j, int(src[g][-1]), multicast)
                if dests is None:
                    continue
                rows.append(np.concatenate([ms[g]] * len(dests)))  # (np.tile costs 5-8 us here)
                addrs.append(np.repeat(dests, ms[g].size, axis=0))

    def destinations(self, rx_addr: np.ndarray, job: int, row: int, multicast: bool = False) -> np.ndarray | None:
        """Addresses a completion of ``job`` caused by rx row ``row`` goes to: its multicast group (where
        ``multicast``), or the workers whose addresses were known once that row had been learned."""
        tab = self.jobs.get(job)
        if tab is None:
            return None
        if multicast and tab.group is not None:
            return tab.group
        moves = self._moves.get(job)
        if moves is None:
            dests = tab.known_addresses()
        else:
            addr, known, rows, workers = moves
            addr, known = addr.copy(), known.copy()
            k = int(np.searchsorted(rows, row, side="right"))
            for r, w in zip(rows[:k].tolist(), workers[:k].tolist(), strict=True):
                addr[w] = rx_addr[r]
                known[w] = True
            dests = addr[known]
        return dests if len(dests) else None


def in_arrival_order(rows: np.ndarray, addrs: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sends ``rows`` (output rows) to ``addrs`` (sockaddr_in rows), destination by destination (one GSO
    run each where lengths agree), each destination's in the order of the packets that caused them (``src``:
    the input row of each output), as one-by-one handling sends them. Answers went ahead of the batch's
    completions: a retained result answered to a worker's duplicate of a late use reached it before the
    completion of an earlier use of the same batch, and RACK (worker_lib/pacing.py) took that one for lost
    and resent it (all 12 first uses of a 16-use exchange, in a test on a loaded machine)."""
    dest = np.ascontiguousarray(addrs[:, :8]).view(np.uint64).ravel()  # family, port and IPv4 address
    order = np.lexsort((src[rows], dest))
    return rows[order], addrs[order]


class Shard:
    """One shard: a socket, a state machine, and the loop between them."""

    def __init__(self, cfg: ServerConfig, sock: socket.socket, shard: int, jobs: Sequence[JobConfig],
                 counters: np.ndarray | None = None, dar_counters: np.ndarray | None = None) -> None:
        self.cfg, self.shard = cfg, shard
        # answers leave as segmentation-offload runs (one per destination; a multicast group is one)
        self.io = BatchSocket(sock, batch=cfg.batch, stride=cfg.stride, gso=True, gro=cfg.gro)
        if cfg.multicast:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(cfg.host))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        index, count = cfg.global_shard(shard)
        # as many rows as one receive gives: with UDP_GRO up to 64 datagrams per message, more than --batch
        self.agg = Aggregator(shard=index, shards=count, max_batch=self.io.batch, stride=cfg.stride,
                              compiled=cfg.engine == "compiled")
        if counters is not None:
            self.agg.counters = counters
        self.dar = DarAggregator(shard=index, shards=count, stride=cfg.stride)
        if dar_counters is not None:
            self.dar.counters = dar_counters
        self.book = AddressBook()
        self.set_jobs(jobs)
        self.pcap = None
        if cfg.pcap is not None:
            from worker_lib.wire.pcap import PcapWriter

            path = cfg.pcap if cfg.shards == 1 else cfg.pcap.with_suffix(f".shard{shard}{cfg.pcap.suffix}")
            self.pcap = PcapWriter(path)
        self.local = sockaddr_to_tuple(sockaddr_in(*sock.getsockname()))

    def set_jobs(self, jobs: Sequence[JobConfig], fresh: Collection[int] = ()) -> None:
        """Apply a job list: new or changed jobs are (re)configured, missing ones removed, and the jobs
        ``fresh`` names configured anew even where unchanged (registers, rounds and worker addresses
        cleared: a control ``add`` of a configured id)."""
        wanted = {j.job: j for j in jobs}
        for jid in list(self.agg.jobs):
            if jid not in wanted or wanted[jid].kind == "dar":
                self.agg.remove_job(jid)
                self.book.jobs.pop(jid, None)
        for jid in list(self.dar.jobs):
            if jid not in wanted or wanted[jid].kind != "dar":
                self.dar.remove_job(jid)
                self.book.jobs.pop(jid, None)
        for jid, cfg in wanted.items():
            table = self.dar if cfg.kind == "dar" else self.agg
            cur = table.jobs.get(jid)
            if cur is None or cur.cfg != cfg or jid in fresh:
                table.add_job(cfg)
                self.book.jobs[jid] = WorkerAddresses(cfg)

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
        if n:
            self.handle_batch(n)
        return n

    def handle_batch(self, n: int) -> None:
        """Process and answer the ``n`` datagrams in ``io.rx`` (sources in ``io.rx_addr``): the same
        datagrams to the same addresses as handling them one at a time, in order."""
        io = self.io
        self.book.start_batch()
        if self.pcap is not None:
            for i in range(n):
                self._capture(sockaddr_to_tuple(io.rx_addr[i]), self.local, io.rx[i, : io.rx_len[i]].tobytes())
        if not _any_dar(io.rx, io.rx_len, n):
            out = self.agg.process(io.rx[:n], io.rx_len[:n])
            good = self.agg.last_good
            self.book.learn(io.rx_addr, good, self.agg.last_job[good], self.agg.last_worker[good])
            if out.count:
                self._send(out, np.arange(n))
            return
        is_dar = (io.rx[:n, 1] == _DAR_DATA) & (io.rx_len[:n] >= 2)
        dar_rows = np.flatnonzero(is_dar)
        rest = np.flatnonzero(~is_dar)
        self.agg.counters[Counter.RX] += dar_rows.size  # rx counts every datagram; the rest add theirs
        if rest.size:  # a batch mixing kinds (rare): the state machine gets the others, compacted
            out = self.agg.process(np.ascontiguousarray(io.rx[rest]), io.rx_len[rest])
            good = self.agg.last_good
            self.book.learn(io.rx_addr, rest[good], self.agg.last_job[good], self.agg.last_worker[good])
            if out.count:
                self._send(out, rest)
        sub = io.rx[:n] if rest.size == 0 else np.ascontiguousarray(io.rx[dar_rows])
        dout = self.dar.process(sub, io.rx_len[dar_rows])
        if dout.good_rows:
            self.book.learn(io.rx_addr, dar_rows[dout.good_rows], np.asarray(dout.good_jobs),
                            np.asarray(dout.good_workers))
        if dout.sends:
            self._send_dar(dout, dar_rows)

    def _destinations(self, job: int, row: int) -> np.ndarray | None:
        return self.book.destinations(self.io.rx_addr, job, row, self.cfg.multicast)

    def _send_dar(self, out: DarOutputs, rx_rows: np.ndarray) -> None:
        """Send the DAR path's datagrams (result fragments fanned out, unicast answers to senders);
        ``rx_rows[i]`` is the rx row of the DAR path's input row i."""
        for snd in out.sends:
            if snd.fanout:
                dests = self._destinations(snd.job, int(rx_rows[snd.src]))
                if dests is None:
                    continue
                rows = np.repeat(snd.rows, len(dests))
                lengths = np.repeat(snd.lengths, len(dests))
                addrs = np.tile(dests, (snd.rows.size, 1))
            else:
                rows, lengths = snd.rows, snd.lengths
                addrs = np.repeat(self.io.rx_addr[rx_rows[snd.src]][None, :], snd.rows.size, axis=0)
            self.io.send(snd.buf, rows, lengths, addrs)
            self._pcap_sent(snd.buf, rows, addrs, lengths)

    def _send(self, out: Outputs, rx_rows: np.ndarray) -> None:
        """Send the engine's outputs: completions to the job's destinations, answers to their senders;
        ``rx_rows[i]`` is the rx row of the engine's input row i."""
        m = out.count
        if m == 1:  # one output: a completion to its destinations, or an answer (a lone resend's) to its sender,
            row = int(rx_rows[out.src[0]])  # straight to the socket (the general path below costs 10 us more)
            dests = self._destinations(int(out.job[0]), row) if out.fanout[0] else self.io.rx_addr[row:row + 1]
            if dests is not None:
                rows = _FIRST_ROW[:len(dests)]
                lengths = out.length[rows]
                self.io.send(out.buf, rows, lengths, dests)
                self._pcap_sent(out.buf, rows, dests, lengths)
            return
        fan = out.fanout[:m]
        rows_l: list[np.ndarray] = []
        addr_l: list[np.ndarray] = []
        uni = np.flatnonzero(~fan)
        if uni.size:
            rows_l.append(uni)
            addr_l.append(self.io.rx_addr[rx_rows[out.src[uni]]])
        fo = np.flatnonzero(fan)
        if fo.size:
            self.book.fan_out(self.io.rx_addr, fo, out.job[fo], rx_rows[out.src[fo]], rows_l, addr_l,
                              self.cfg.multicast)
        if not rows_l:
            return
        rows = np.concatenate(rows_l)
        addrs = np.concatenate(addr_l)
        # each destination's in packet order where the engine's may differ: several groups (answers and
        # completions, several jobs), or several answers (it emits retained results and notices kind by kind)
        if len(rows_l) > 1 or uni.size > 1:
            rows, addrs = in_arrival_order(rows, addrs, out.src)
        lengths = out.length[rows]
        self.io.send(out.buf, rows, lengths, addrs)
        self._pcap_sent(out.buf, rows, addrs, lengths)

    def _pcap_sent(self, buf: np.ndarray, rows: np.ndarray, addrs: np.ndarray, lengths: np.ndarray) -> None:
        """Write what was just sent to the pcap, if any."""
        if self.pcap is not None:
            for r, a, ln in zip(rows.tolist(), addrs, lengths.tolist(), strict=True):
                self._capture(self.local, sockaddr_to_tuple(a), buf[r, :ln].tobytes())

    def _capture(self, src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> None:
        """One datagram to the pcap. A capture that fails (a full disk: the writes flush every 8 kB) stops, with
        one log line, and the jobs keep being served: a debugging aid must not end the service."""
        if self.pcap is None:
            return
        try:
            self.pcap.write(src, dst, payload)
        except OSError as exc:
            log.error("pcap %s: capture stopped, the jobs keep being served: %s", self.pcap.path, exc)
            self._close_pcap()

    def _close_pcap(self) -> None:
        pcap, self.pcap = self.pcap, None
        if pcap is not None:
            with contextlib.suppress(OSError):  # what the failed flush left is lost with the capture
                pcap.close()

    def close(self) -> None:
        self._close_pcap()
        self.io.sock.close()


def shard_process(cfg: ServerConfig, sock: socket.socket, shard: int, jobs: list[JobConfig],
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
                sh.set_jobs(*conn.recv())
                conn.send(True)  # installed: the server may now answer the command that changed the jobs
    finally:
        sh.close()
