"""``thc-aggregator --role leaf|spine``: the two-tier state machines served over UDP.

A leaf serves its local workers on its port and talks to its parent (the spine) from the same socket;
a spine (``SpineAggregator``) serves the leaves. Datagrams are read and written in batches
(recvmmsg/sendmmsg, ``worker_lib.batch_io``). A leaf applies each batch with the batch engine
(``aggregator.leaf_engine.LeafEngine``, compiled or numpy, as ``--engine`` says), or with ``--engine
reference`` the reference (``aggregator.tiers.LeafAggregator``) one datagram at a time; the spine runs
the reference (docs/aggregator.md, "Two tiers", has the figures).

Addresses are learned as docs/protocol.md says: the sender of every packet that passes validation is
the address of its (job, worker) -- a spine's workers are its leaves -- and a packet for every worker
of the job goes to each learned one. A leaf's packets from the parent's address are the parent's.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Literal

import numpy as np

from aggregator.leaf_engine import LeafEngine
from aggregator.shard import AddressBook, WorkerAddresses, in_arrival_order
from aggregator.tiers import Dest, LeafAggregator, SpineAggregator
from worker_lib.batch_io import BatchSocket, sockaddr_in, udp_socket
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.protocol import Counter, TierCounter

log = logging.getLogger(__name__)

Role = Literal["leaf", "spine"]
ENGINES = ("compiled", "numpy", "reference")  #: a leaf's state machine (a spine's is the reference)


@dataclass
class TierServerConfig:
    """What a leaf or spine serves, and where."""

    role: Role
    jobs: list[JobConfig]
    host: str = "127.0.0.1"
    port: int = 9451
    leaf: int | None = None  #: a leaf's index in the jobs' ``leaves``
    upstream: tuple[str, int] | None = None  #: a leaf's parent (the spine)
    batch: int = 256
    poll_timeout: float = 0.05
    stats_interval: float = 0.0
    #: a leaf: drop this fraction of the packets to and from the parent (seeded; tests and experiments
    #: of loss on the leaf-spine link, where tc netem is not available)
    parent_loss: float = 0.0
    seed: int = 0
    engine: str = "compiled"  #: a leaf: ENGINES; a spine runs the reference

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 0.0 <= self.parent_loss < 1.0:
            raise ValueError(f"parent loss must be in [0, 1), got {self.parent_loss}")
        if self.role not in ("leaf", "spine"):
            raise ValueError(f"role must be leaf or spine, got {self.role!r}")
        if not self.jobs:
            raise JobConfigError(f"--role {self.role} needs a two-tier job: --job 'leaves=4:4,...'")
        for cfg in self.jobs:
            if not cfg.tiered:
                raise JobConfigError(f"job {cfg.job} has one tier: --role {self.role} serves jobs with "
                                     f"leaves=N0:N1:...")
        if self.role == "leaf":
            if self.leaf is None or self.upstream is None:
                raise ValueError("--role leaf needs --leaf L (its index) and --upstream HOST:PORT (the spine)")
        elif self.leaf is not None or self.upstream is not None or self.parent_loss:
            raise ValueError("--leaf, --upstream and --parent-loss are for --role leaf")


class TierServer:
    """One UDP socket serving a leaf or a spine until ``stop``."""

    def __init__(self, cfg: TierServerConfig, *, out: Callable[[str], None] = print) -> None:
        self.cfg, self.out = cfg, out
        self.machine: LeafAggregator | SpineAggregator | LeafEngine
        if cfg.role == "spine":
            self.machine, self.parent = SpineAggregator(cfg.jobs), b""
        else:
            self.parent = sockaddr_in(socket.gethostbyname(cfg.upstream[0]), cfg.upstream[1])
            self.machine = (LeafAggregator(cfg.leaf, cfg.jobs) if cfg.engine == "reference" else
                            LeafEngine(cfg.leaf, cfg.jobs, max_batch=cfg.batch, compiled=cfg.engine == "compiled"))
        self.engine = self.machine if isinstance(self.machine, LeafEngine) else None
        self.sock = udp_socket(cfg.host, cfg.port)
        if self.engine is not None:  # batches: the engine's rows, the shard's address book
            self.io = BatchSocket(self.sock, batch=cfg.batch, stride=self.engine.engine.stride, max_send=4096)
            self.book = AddressBook()
            self.book.jobs = {job.job: WorkerAddresses(job.leaf(cfg.leaf)) for job in cfg.jobs}
        else:  # one datagram at a time: answers copied into a send buffer, addresses in a dict
            longest = max(32 + job.elems * job.result_bits // 8 for job in cfg.jobs)
            self.io = BatchSocket(self.sock, batch=cfg.batch, stride=max(longest, 1500), max_send=4096)
            self.addresses: dict[int, dict[int, bytes]] = {job.job: {} for job in cfg.jobs}  # job -> worker -> sockaddr
            self._tx = np.zeros((self.io.max_send, longest), np.uint8)
        self.port = self.sock.getsockname()[1]
        self._running = True
        self._rng = np.random.default_rng(cfg.seed)
        self.parent_dropped = 0  #: packets to or from the parent dropped by ``parent_loss``

    @property
    def jobs(self) -> list[JobConfig]:
        return self.cfg.jobs

    def stop(self) -> None:
        self._running = False

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.stop()
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def totals(self) -> dict[str, int]:
        """Non-zero counters by label (``Counter`` and, for a leaf, ``TierCounter``)."""
        out = {c.label: int(self.machine.counters[c]) for c in Counter if self.machine.counters[c]}
        if self.cfg.role == "leaf":
            tier = self.machine.tier_counters  # type: ignore[union-attr]
            out.update({c.label: int(tier[c]) for c in TierCounter if tier[c]})
            if self.parent_dropped:
                out["parent_dropped"] = self.parent_dropped
        return out

    def serve(self) -> None:
        """Handle datagrams until ``stop`` (a signal handler may call it)."""
        next_stats = time.monotonic() + self.cfg.stats_interval
        while self._running:
            if self.io.wait(self.cfg.poll_timeout):
                self.step()
            if self.cfg.stats_interval and time.monotonic() >= next_stats:
                next_stats += self.cfg.stats_interval
                self.out("thc-aggregator " + " ".join(f"{k}={v}" for k, v in self.totals().items()))
        self.sock.close()

    def step(self) -> int:
        """Receive one batch, handle its datagrams in arrival order, send what they caused."""
        if self.engine is not None:
            return self._step_engine()
        n = self.io.recv()
        sends: list[tuple[bytes, bytes]] = []  # (packet, sockaddr)
        machine = self.machine
        for i in range(n):
            packet = self.io.rx[i, :self.io.rx_len[i]].tobytes()
            src = self.io.rx_addr[i].tobytes()
            from_parent = bool(self.parent) and src[:8] == self.parent[:8]
            if from_parent and self._lose():
                continue
            try:
                # only a leaf has a parent (a spine's self.parent is empty)
                outs = machine.handle(packet, from_parent=True) if from_parent else machine.handle(packet)
            except Exception:  # a server never crashes on a packet; the reference raising is a bug to log
                log.exception("packet of %d bytes from %s raised; dropped", len(packet), src[:8].hex())
                continue
            hdr = machine.last_valid
            if hdr is not None and hdr.job in self.addresses:
                self.addresses[hdr.job][hdr.worker] = src
            for dest, out in outs:
                if dest == Dest.PARENT:
                    if not self._lose():
                        sends.append((out, self.parent))
                elif dest == Dest.SENDER:
                    sends.append((out, src))
                else:
                    job = int.from_bytes(out[2:4], "big")
                    sends.extend((out, a) for a in self.addresses.get(job, {}).values())
        self._send(sends)
        return n

    def _step_engine(self) -> int:
        """A leaf's batch through the leaf engine: the same datagrams to the same addresses as the
        reference handling them one by one, each address's in the same order."""
        io = self.io
        n = io.recv()
        if n == 0:
            return 0
        rx, lengths, addr = io.rx[:n], io.rx_len[:n], io.rx_addr[:n]
        from_parent = (addr[:, :8] == np.frombuffer(self.parent[:8], np.uint8)).all(axis=1)
        if self.cfg.parent_loss and from_parent.any():
            lost = np.zeros(n, bool)
            lost[from_parent] = self._losses(int(from_parent.sum()))
            if lost.any():
                kept = np.flatnonzero(~lost)
                rx, lengths, addr, from_parent = (np.ascontiguousarray(x[kept]) for x in (rx, lengths, addr,
                                                                                          from_parent))
        assert self.engine is not None
        out = self.engine.process(rx, lengths, from_parent)
        self.book.start_batch()
        good = self.engine.last_good
        self.book.learn(addr, good, self.engine.last_job, self.engine.last_worker)
        m = out.count
        if m == 0:
            return n
        dest = out.dest[:m]
        sel_rows: list[np.ndarray] = []
        sel_addr: list[np.ndarray] = []
        uni = np.flatnonzero(dest == Dest.SENDER)
        if uni.size:
            sel_rows.append(uni)
            sel_addr.append(addr[out.src[uni]])
        up = np.flatnonzero(dest == Dest.PARENT)
        if up.size:
            up = up[~self._losses(up.size)]
        if up.size:
            sel_rows.append(up)
            sel_addr.append(np.repeat(np.frombuffer(self.parent, np.uint8)[None, :], up.size, axis=0))
        fan = np.flatnonzero(dest == Dest.ALL)
        if fan.size:
            self.book.fan_out(addr, fan, out.job[fan], out.src[fan], sel_rows, sel_addr)
        if sel_rows:
            r, a = np.concatenate(sel_rows), np.concatenate(sel_addr)
            if len(sel_rows) > 1:  # each destination's sends in the order of their packets, as the reference's
                r, a = in_arrival_order(r, a, out.src)
            io.send(out.buf, r, out.length[r], a)
        return n

    def _lose(self) -> bool:
        """Whether ``parent_loss`` drops the next packet on the parent link."""
        return bool(self._losses(1)[0])

    def _losses(self, count: int) -> np.ndarray:
        """Which of the next ``count`` packets on the parent link ``parent_loss`` drops (counted)."""
        if not self.cfg.parent_loss:
            return np.zeros(count, bool)
        lost = self._rng.random(count) < self.cfg.parent_loss
        self.parent_dropped += int(lost.sum())
        return lost

    def _send(self, sends: list[tuple[bytes, bytes]]) -> None:
        for start in range(0, len(sends), self.io.max_send):
            part = sends[start:start + self.io.max_send]
            lengths = np.array([len(p) for p, _ in part], np.int64)
            for k, (p, _) in enumerate(part):
                self._tx[k, :len(p)] = np.frombuffer(p, np.uint8)
            addrs = np.frombuffer(b"".join(a for _, a in part), np.uint8).reshape(len(part), -1)
            self.io.send(self._tx, np.arange(len(part)), lengths, addrs)
