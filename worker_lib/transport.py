"""Worker transport: one worker's allreduce through a THC aggregator over UDP.

``Transport`` runs *uses* of the job's slot pool (docs/protocol.md): use u takes slot u mod S with
that slot's next round; at most W <= S uses are open (sent and unanswered) at a time, and no use starts
before the previous use of its slot has finished. Two loss policies decide what a missing result
means:

- ``reliable``: retransmit until the result arrives (exact), or raise ``AggregatorUnreachable`` when
  nothing at all has come back for ``deadline`` seconds;
- ``zero-fill`` (the paper's): after ``retries`` retransmissions the chunk is given up, taken as
  zero in the transformed domain, and reported in ``TransportStats.lost_chunks``.

A straggler notice (the slot has moved on past our round: its result is gone) marks the use lost,
is counted, and calls ``on_straggler``; one that echoes another tensor or chunk than the use's own
datagrams answers a late copy of an earlier use of the slot and is counted as unexpected. Where no
notice can come to a worker of this run (every worker needed, ``reliable``), a notice for the use, or an
answer that cannot hold this worker's own contribution, means that the aggregator's job holds the
rounds of another run: ``AggregatorStateError`` (docs/protocol.md, "A new run needs a fresh job").
``exchange_indices`` / ``exchange_norm`` are the low-level calls (numpy only, no torch);
``worker_lib.allreduce`` adds THC's norm stage, compression and decoding on top. ``exchange_message``
carries one whole codec message of a ``dar`` job (decompress-aggregate-recompress, software aggregator
only) as fragments and reassembles the aggregator's re-encoded average. Both run on one engine,
``_exchange``: a window of uses in flight, timeouts and retransmission, straggler notices, the deadline;
each call gives it the datagrams of its uses, what to resend on a timeout, and how to accept an answer.

When to resend and how many uses to keep in flight is the transport's ``Pacer``
(``worker_lib/pacing.py``): under ``reliable`` the timeout follows the measured round trip (3 times the
lower quartile of clean round trips, floor ``min_timeout``) so that a window queued behind a slow link is
not sent again while it waits, and a lost packet costs its use a few round trips, not a fixed 50 ms;
each use backs its own timeout off (bounded), and the congestion window is cut only by a burst of
losses (and stops growing while a queue grows), so that a
window of large packets does not overflow a slow link's queue again and again while random loss leaves
it open; under ``zero-fill`` both stay fixed (``timeout``, W) so that the workers stay in step.

Usage::

    params = JobConfig(job=1, key=0x54484321, workers=4, bits=4)
    tr = Transport(TransportConfig(params, worker=0, aggregator=("127.0.0.1", 9451)))
    tr.open_run(nonce)         # the same run_nonce() on every worker of the run, handed out by its launcher
    ar = THCAllreduce(tr, THCConfig())               # worker_lib.allreduce
    avg = ar.allreduce(grad, tensor=0, step=s).average
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from worker_lib.batch_io import BatchSocket, sockaddr_to_tuple
from worker_lib.job import JobConfig
from worker_lib.pacing import BURST_RUN, PROBE_USES, TAIL_DUPLICATES, Pacer, extend_loss_runs
from worker_lib.packet_feed import PacketFeed
from worker_lib.resend_timers import due_uses
from worker_lib.result_intake import OWN_SHARE_PROBE, foreign_chunk, has_notice, take_results
from worker_lib.udp_offload import GSO_BYTES, GSO_SEGMENTS, SOL_UDP, UDP_SEGMENT, gso_available
from worker_lib.values import FLOAT32_MAX, is_integer
from worker_lib.wire.index_packets import IndexPacker, index_packets, packs_in_pieces, stamp_uses
from worker_lib.wire.layout import DAR_PREFIX_BYTES, HEADER_BYTES, PacketType, field_offsets
from worker_lib.wire.pcap import PcapWriter
from worker_lib.wire.protocol import ROUND_MASK, Header, fragment_count, serial_newer
from worker_lib.wire.serializer import build_batch, float_bits, header_view

log = logging.getLogger(__name__)

#: A compiled intake of one received batch: (rows, lengths, use_of_slot, done, finished out) -> (answers,
#: pending datagrams, unexpected datagrams); see ``Transport._exchange`` and ``worker_lib.result_intake``.
Intake = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[int, int, int]]

#: ``fill(done)`` of ``Transport.exchange_indices``: writes the indices in order, ``done(n)`` once 0..n-1 are final.
IndexFill = Callable[[Callable[[int], None]], None]

RX_BATCH = 64  #: datagrams read per recvmmsg

LossPolicy = Literal["reliable", "zero-fill"]


_NO_USES = np.zeros(0, np.int64)


class AggregatorUnreachable(ConnectionError):
    """Nothing came back from the aggregator for the configured deadline."""


class AggregatorStateError(RuntimeError):
    """The aggregator's job holds the rounds of another run of the job (an earlier run, or another group
    of workers using the same job id): its answers are not this run's. A new run needs a fresh job."""

    def __init__(self, job: int, slot: int, what: str) -> None:
        super().__init__(f"job {job}, slot {slot}: {what}: {STALE_JOB_ADVICE}")


_CHUNK_AT = field_offsets()["chunk"]  #: the header's chunk field (32 bits, big-endian)


def check_tensor_id(tensor: int) -> None:
    """Refuse (ValueError) a tensor id the header's 32-bit field cannot carry, before any use is claimed: a
    call refused after claiming would leave this worker a use ahead of the others for good."""
    if not is_integer(tensor) or not 0 <= tensor < 1 << 32:
        raise ValueError(f"tensor must be an integer in 0..{(1 << 32) - 1}, got {tensor!r}")


#: What to do about an ``AggregatorStateError`` (also matched in the message of DDP's wrapped exceptions).
STALE_JOB_ADVICE = ("the aggregator holds the state of another run of this job; start each run with a fresh "
                    "job: restart thc-aggregator, add the job again over its control socket (thc-control SOCKET add "
                    "SPEC), or use another job id")


@dataclass
class TransportConfig:
    """One worker's transport settings."""

    params: JobConfig  #: the job, as the aggregator is configured with it
    worker: int
    #: the aggregator (member 0 where several serve the job; in a two-tier job, this worker's leaf)
    aggregator: tuple[str, int] = ("127.0.0.1", 9451)
    #: members 1..N-1 of the aggregators serving the job (thc-aggregator --member I/N), in member order
    more_aggregators: tuple[tuple[str, int], ...] = ()
    shards: int = 1  #: shards of each aggregator (ports PORT..PORT+shards-1)
    loss_policy: LossPolicy = "reliable"
    timeout: float = 0.05  #: seconds before a use is resent until a round trip is measured (zero-fill: always)
    min_timeout: float = 0.002  #: the least adaptive timeout (floor of the measured one; at most ``timeout``)
    max_timeout: float = 2.0  #: the most the adaptive timeout grows to (with a use's backoff)
    max_backoff: int = 1  #: doublings of a use's timeout at most, one per resend (reliable policy; pacing.py)
    adaptive_timeout: bool = True  #: False (and zero-fill): always ``timeout`` (no RTT estimate, no backoff)
    retries: int = 3  #: zero-fill: retransmissions before a chunk is given up
    deadline: float = 10.0  #: seconds without any answer before AggregatorUnreachable
    window: int | None = None  #: uses in flight (default and maximum: the job's slots)
    congestion_control: bool = True  #: a congestion window below ``window`` (reliable policy only; pacing.py)
    initial_window: int = 16  #: the congestion window's first size, in uses
    #: read answers that arrive as one run (the aggregator's GSO answers) as one message (UDP_GRO) where
    #: the kernel has it: less CPU per answer (docs/aggregator.md)
    gro: bool = True
    #: send a run of new uses as one UDP GSO datagram (UDP_SEGMENT) where the kernel has it
    gso: bool = True
    #: the last this many uses of a data exchange go out twice, the copies with its last new uses (reliable
    #: policy; pacing.py, "Tail duplicates"; at most a quarter of the exchange's uses, at least one): a request
    #: lost in an exchange's last round trip costs no recovery; 0 turns it off
    tail_duplicates: int = TAIL_DUPLICATES
    drop_up: float = 0.0  #: simulated loss of sent packets (seeded, for tests and experiments)
    drop_down: float = 0.0  #: simulated loss of received packets
    seed: int = 0
    bind_host: str = "127.0.0.1"
    multicast: str | None = None  #: GROUP:PORT to receive results from (thc-aggregator --multicast)
    on_straggler: Callable[[int, int, int], None] | None = None  #: called with (slot, our round, slot's round)
    #: write what this worker's sockets send and accept (after simulated loss) to this pcap file
    pcap: str | Path | None = None

    def __post_init__(self) -> None:
        p = self.params
        if not is_integer(self.worker) or not 0 <= self.worker < p.workers:
            raise ValueError(f"worker id {self.worker} is not in 0..{p.workers - 1}")
        if self.loss_policy not in ("reliable", "zero-fill"):
            raise ValueError(f"loss_policy must be 'reliable' or 'zero-fill', got {self.loss_policy!r}")
        for name in ("drop_up", "drop_down"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        if not all(math.isfinite(t) and t > 0 for t in (self.timeout, self.deadline, self.min_timeout)):
            raise ValueError("timeout, min_timeout and deadline must be positive and finite")
        if not is_integer(self.shards) or not 1 <= self.shards <= 4096:
            raise ValueError(f"shards must be an integer in 1..4096, got {self.shards!r}")
        if not is_integer(self.retries) or self.retries < 0:
            raise ValueError(f"retries must be a non-negative integer, got {self.retries!r}")
        for host, port in (self.aggregator, *self.more_aggregators):
            if not is_integer(port) or not 1 <= port <= 65535 or (port + self.shards - 1) > 65535:
                raise ValueError(f"aggregator {host}:{port}: the port must be an integer in 1..65535 (and its "
                                 f"{self.shards} shards' ports too)")
        if not 0 <= self.max_backoff <= 16:
            raise ValueError(f"max_backoff must be in 0..16, got {self.max_backoff}")
        if self.max_timeout < self.timeout:
            raise ValueError(f"max_timeout {self.max_timeout} is below timeout {self.timeout}")
        if self.window is not None and not 1 <= self.window <= p.slots:
            raise ValueError(f"window must be in 1..slots={p.slots}")
        if self.initial_window < 1:
            raise ValueError(f"initial_window must be at least 1, got {self.initial_window}")
        if not is_integer(self.tail_duplicates) or self.tail_duplicates < 0:
            raise ValueError(f"tail_duplicates must be a non-negative integer, got {self.tail_duplicates!r}")
        if p.tiered and len(self.destinations) > 1:
            raise ValueError("a two-tier job's worker talks to its leaf alone: no more_aggregators or shards")
        if len(self.destinations) > 4096:
            raise ValueError(f"{len(self.destinations)} aggregator shards in all: at most 4096")

    @property
    def destinations(self) -> list[tuple[str, int]]:
        """Where each slot goes: slot s to entry s mod len, member by member, shard by shard (the
        partition thc-aggregator --member I/N --shards P serves)."""
        return [(host, port + k) for host, port in (self.aggregator, *self.more_aggregators)
                for k in range(self.shards)]


@dataclass
class TransportStats:
    """Counters of one worker's transport (cumulative)."""

    packets_sent: int = 0
    retransmissions: int = 0
    results: int = 0
    stragglers: int = 0
    lost_chunks: int = 0
    dropped_up: int = 0
    dropped_down: int = 0
    unexpected: int = 0
    multicast_results: int = 0  #: results that came through the job's multicast group
    send_blocked: int = 0  #: packets not sent because the send buffer stayed full for a timeout
    gso_sends: int = 0  #: system calls that sent a run of datagrams with UDP segmentation offload
    early_retransmissions: int = 0  #: uses resent because later ones were answered (RACK), not by timeout
    #: uses resent by a tail probe: the last uses of an exchange, once the answers stopped (pacing.py)
    tail_probes: int = 0
    #: extra copies sent of uses that RACK found lost after an exchange's last new use (pacing.py, "Tail copies";
    #: each is counted in ``retransmissions`` too)
    tail_copies: int = 0
    #: second copies of an exchange's last uses, sent with their first (pacing.py, "Tail duplicates"; not
    #: retransmissions: a lossless exchange sends them too)
    tail_duplicates: int = 0
    #: seconds waited with room in the window but no free slot: every slot busy behind the oldest open
    #: use (more slots would have let the worker send on; ``--slots``)
    slot_bound_s: float = 0.0
    #: seconds waited with the window full (the pacer's limit, or the path's)
    window_bound_s: float = 0.0
    #: seconds waited with room to send but the next use's datagram not computed yet (``exchange_indices``'
    #: ``fill``: the codec quantizes while the first chunks are on their way)
    feed_bound_s: float = 0.0
    #: seconds from an exchange's last new use sent to its end: draining the last answers and
    #: recovering the last losses, with nothing new to send meanwhile
    tail_s: float = 0.0
    #: receive system calls that returned datagrams (datagrams per batch = datagrams received / this)
    receive_batches: int = 0
    datagrams_received: int = 0
    #: received messages that held a run of several datagrams (UDP_GRO: the aggregator's GSO answers, whole)
    coalesced_receives: int = 0
    #: times the retransmission engine waited for the network (select): each costs a wake-up and a pass of
    #: its bookkeeping, so this, not the datagrams, sets its CPU per exchange
    waits: int = 0
    lost: list[tuple[int, int]] = field(default_factory=list)  #: (tensor, chunk) given up

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if k != "lost"}


def data_sums_type(job: JobConfig) -> type:
    """The type of a DATA run's sums in ``UseResults``: THC's 8-bit results as uint8 (a 2^22-coordinate
    step's sums are 4 MiB so, 16 as int32: fewer pages to fault in and zero, and what the decoder reads
    fastest); 16-bit ones as int32 (torch has few operations for uint16), as the uncompressed job's;
    THC's 32-bit results as int64."""
    if job.kind == "uncompressed" or job.result_bits == 16:
        return np.int32
    return np.uint8 if job.result_bits == 8 else np.int64


def run_nonce(rng: np.random.Generator | None = None) -> float:
    """A run's nonce for ``Transport.open_run``: a positive normal float32 value from 2^31 or so, drawn
    once per run by whoever starts its workers and handed to each of them."""
    rng = rng or np.random.default_rng()
    bits = int(rng.integers(0x00800000, 0x7F000000))
    return float(np.array([bits], np.uint32).view(np.float32)[0])


@dataclass
class UseResults:
    """Answers to a run of uses: sums (or norm bits), contributor counts, bitmaps, and what was lost."""

    #: (C, K) sums (DATA): THC's 8-bit results as uint8, 16-bit ones and an uncompressed job's as int32,
    #: THC's 32-bit ones as int64; or (C,) int64 norm bits (NORM)
    sums: np.ndarray
    contributors: np.ndarray  #: (C,) int64, 0 where lost
    bitmap: np.ndarray  #: (C,) int64
    lost: np.ndarray  #: (C,) bool


class MessageResult(NamedTuple):
    """The answer to a dar use: the re-encoded average (``bits`` exact bits in ``payload``) and how many
    workers' messages it averages; an empty payload, 0 bits and 0 contributors when the use was lost."""

    payload: np.ndarray
    bits: int
    contributors: int


class Transport:
    """A worker's UDP endpoint to the aggregator (one socket, all shards)."""

    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        p = cfg.params
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        # A window of packets queued behind a shaped link must not overflow the send buffer (the
        # kernel's default is about 200 kB; a full one would cost a retransmission timeout).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.sock.bind((cfg.bind_host, 0))
        self.sock.setblocking(False)
        self.socks = [self.sock]
        if cfg.multicast:
            self.socks.append(_multicast_socket(cfg.multicast, cfg.bind_host))
        #: the ``worker`` field of this worker's packets: its local id at its leaf in a two-tier job
        self.wire_worker = p.tier_of(cfg.worker)[1] if p.tiered else cfg.worker
        self.next_use = 0
        #: ``open_run`` found the job fresh: where it decides (``in_step``), answers need no further check
        self.opened = False
        self.slot_round = [0] * p.slots
        self.stats = TransportStats()
        self._rng = np.random.default_rng([cfg.seed, cfg.worker])
        # Answers are read RX_BATCH at a time (recvmmsg) into rows as long as the job's path MTU allows,
        # and judged as arrays: no Python per datagram on the receive path.
        stride = max(p.mtu, HEADER_BYTES + DAR_PREFIX_BYTES + 64)
        self._rx = {s.fileno(): BatchSocket(s, batch=RX_BATCH, stride=stride, max_send=1, gro=cfg.gro)
                    for s in self.socks}
        self._dests = cfg.destinations
        self.pcap = PcapWriter(cfg.pcap) if cfg.pcap is not None else None
        # Segmentation offload sends whole runs (the simulated loss takes its share of a run before it goes);
        # the per-datagram paths (pcap, several shards' destinations) keep one datagram per call.
        self.gso = cfg.gso and gso_available(self.sock) and not (cfg.pcap or len(self._dests) > 1)
        # zero-fill keeps a fixed timeout and window: its workers must stay in step (see pacing.py)
        adapt = cfg.loss_policy == "reliable"
        self.pacer = Pacer(timeout=cfg.timeout, min_timeout=min(cfg.min_timeout, cfg.timeout),
                           max_timeout=cfg.max_timeout, max_backoff=cfg.max_backoff,
                           max_window=min(cfg.window or p.slots, p.slots), initial_window=cfg.initial_window,
                           adaptive_timeout=adapt and cfg.adaptive_timeout,
                           congestion_control=adapt and cfg.congestion_control)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def close(self) -> None:
        for s in self.socks:
            s.close()
        if self.pcap is not None:
            self.pcap.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def in_step(self, policy: LossPolicy | None = None) -> bool:
        """Whether every answer must hold this worker's contribution, so that no straggler notice can come
        to it: a job that needs every worker, under ``reliable`` (no use is ever given up). In a two-tier
        job too: a leaf needs all its workers and the spine every leaf, and a leaf passes a spine's notice
        down only for a round it forwarded and has no result for. A notice, or an answer without this
        worker's share, then means the aggregator's job state is another run's (``AggregatorStateError``)."""
        p = self.cfg.params
        return (policy or self.cfg.loss_policy) == "reliable" and p.threshold == p.workers

    # -- low-level calls (numpy only) --------------------------------------------------------------
    def exchange_indices(self, indices: np.ndarray, *, tensor: int = 0, fill: IndexFill | None = None) -> UseResults:
        """Send b-bit indices (any length; padded with index 0 to chunks of K) and return the sums.

        Index 0 stands for table value 0, so the padding adds nothing.

        ``fill``: the indices are still being computed, into ``indices`` itself (a C-contiguous array):
        ``fill(done)``, run on a helper thread, writes them in order and calls ``done(n)`` whenever indices
        0..n-1 are final, and each chunk goes out once it is (``worker_lib.packet_feed``). Whatever ``fill``
        runs after its last ``done`` ends before this returns; its exception is raised here. Widths that do
        not pack whole bytes per chunk, and indices that are not uint8, wait for ``fill`` to end first.
        """
        p = self.cfg.params
        if p.kind != "thc":
            raise ValueError("exchange_indices needs a THC job; use exchange_int32")
        check_tensor_id(tensor)
        if not np.issubdtype(np.asarray(indices).dtype, np.integer):
            raise ValueError(f"indices must be integers, got dtype {np.asarray(indices).dtype}")
        fields = p.request_fields(PacketType.DATA, worker=self.wire_worker, tensor=tensor)
        if fill is not None and not (isinstance(indices, np.ndarray) and indices.flags.c_contiguous
                                     and packs_in_pieces(indices, p.bits, p.elems)):
            fill(lambda _n: None)  # computed first, then sent as any other tensor
            fill = None
        if fill is None:
            # built (and the indices checked) before the uses are claimed: a refused tensor spends none
            pkts = index_packets(fields, indices, p.bits, p.elems)
            slots, rounds = self._claim_uses(pkts.shape[0])
            stamp_uses(pkts, slots, rounds)
            res = self._run_packets(PacketType.DATA, pkts, slots, rounds, tensor=tensor)
        else:
            flat = indices.reshape(-1)
            packer = IndexPacker(fields, p.bits, p.elems, flat.size)
            slots, rounds = self._claim_uses(packer.rows)
            feed = PacketFeed(packer.rows, _packing(fill, flat, packer, slots, rounds))
            res = self._run_packets(PacketType.DATA, packer.packets, slots, rounds, tensor=tensor, feed=feed)
        if not p.tiered and not (self.opened and self.in_step()):  # 0.4 ms for 2^22 indices: only where needed
            chunk = foreign_chunk(res.sums, res.contributors, res.bitmap, res.lost, np.ascontiguousarray(indices,
                                  np.uint8).reshape(-1), p.values(), self.wire_worker, OWN_SHARE_PROBE)
            if chunk >= 0:
                raise AggregatorStateError(p.job, int(slots[chunk]), f"the result of round {int(rounds[chunk])} "
                                           "cannot hold this worker's indices")
        return res

    def exchange_int32(self, values: np.ndarray, *, tensor: int = 0) -> UseResults:
        """Uncompressed jobs: send int32 fixed-point values and return their int32 sums."""
        p = self.cfg.params
        if p.kind != "uncompressed":
            raise ValueError(f"exchange_int32 needs an uncompressed job, not kind {p.kind!r}; use exchange_indices")
        raw = np.asarray(values)
        if not np.issubdtype(raw.dtype, np.integer):
            raise ValueError(f"values must be integers (int32 fixed point), got dtype {raw.dtype}")
        v = raw.astype(np.int64).reshape(-1)
        if v.size and (int(v.min()) < -(1 << 31) or int(v.max()) >= 1 << 31):
            raise ValueError(f"values must fit int32, got {int(v.min())}..{int(v.max())}")
        chunks = max(1, math.ceil(v.size / p.elems))
        padded = np.zeros(chunks * p.elems, ">i4")
        padded[: v.size] = v
        return self.run_uses(PacketType.DATA, padded.view(np.uint8).reshape(chunks, -1), tensor=tensor)

    def exchange_norm(self, norm: float, *, tensor: int = 0) -> tuple[float, int]:
        """Norm stage: publish this worker's norm, return (the job's max norm, contributors).

        Always retransmitted until it completes (it is a barrier), whatever the loss policy.
        """
        if not (math.isfinite(norm) and 0 <= norm <= FLOAT32_MAX):
            raise ValueError(f"a norm must be finite, non-negative and fit float32, got {norm}")
        payload = np.frombuffer(float_bits(norm).to_bytes(4, "big"), np.uint8)[None, :]
        res = self.run_uses(PacketType.NORM, payload, tensor=tensor, policy="reliable")
        bits = int(res.sums[0])
        top = float(np.array([bits], ">u4").view(">f4")[0])
        p = self.cfg.params
        counted = not p.tiered and not res.lost[0] and (int(res.bitmap[0]) >> self.wire_worker) & 1
        if counted and bits < float_bits(norm):  # a max below this worker's own norm (bits order as floats)
            raise AggregatorStateError(p.job, self._last_slot(),
                                       f"a max norm {top} below this worker's own {norm}")
        return top, int(res.contributors[0])

    def _last_slot(self) -> int:
        """The slot of the latest use claimed (the norm stage's one use, where its check fails)."""
        return (self.next_use - 1) % self.cfg.params.slots

    def open_run(self, nonce: float, *, tensor: int = 0) -> None:
        """A run's first use, which every worker of the run makes with the same ``nonce`` (a positive
        float32 value drawn once per run and shared by whoever starts the workers, ``run_nonce``): published
        as a norm, it comes back as the job's max norm unless the aggregator answered with the state of
        another run of the job. Raises ``AggregatorStateError`` then (docs/protocol.md, "A new run needs a
        fresh job"). Why it suffices where every worker is needed under ``reliable``: slot 0 takes a run's
        first use, and an earlier run used slot 0 at least as often as any other slot; round 0 of slot 0
        then meets either that run's retained result (its nonce, or a norm, not this one), a slot two or
        more rounds on (a straggler notice, refused), or a slot that a newer round starts afresh, as every
        other slot then does too."""
        if not (nonce > 0 and float(np.float32(nonce)) == nonce):
            raise ValueError(f"a run's nonce must be a positive float32 value, got {nonce}")
        top, contributors = self.exchange_norm(nonce, tensor=tensor)
        if contributors and top != nonce:
            raise AggregatorStateError(self.cfg.params.job, self._last_slot(),
                                       f"the run's first use came back with {top}, not this run's nonce {nonce}")
        self.opened = True

    def exchange_message(self, payload: np.ndarray, bits: int, *, tensor: int = 0) -> MessageResult:
        """dar jobs: send one codec message (``bits`` exact bits) as one use, return the aggregate.

        The message travels as DAR_DATA fragments of ``elems`` bytes (docs/protocol.md); the use takes
        slot u mod S and that slot's next round like any other use. Timeouts, the loss policy and
        ``AggregatorUnreachable`` work as for the other calls: under ``reliable`` the fragments are
        sent again until the whole result has been reassembled (once some result fragments have come,
        only the fragments whose answers are missing); under ``zero-fill`` the use is given up after
        ``retries`` retransmissions (an empty result). A straggler notice also gives the use up.
        """
        p = self.cfg.params
        if p.kind != "dar" or p.max_message is None:
            raise ValueError("exchange_message needs a dar job (a JobConfig of kind='dar')")
        msg = np.ascontiguousarray(np.asarray(payload, np.uint8).reshape(-1))
        nbytes = -(-int(bits) // 8)
        if bits < 0 or msg.size != nbytes:
            raise ValueError(f"a payload of {msg.size} bytes cannot carry exactly {bits} bits")
        if nbytes > p.max_message:
            raise ValueError(f"a message of {nbytes} bytes exceeds the job's max_message {p.max_message}")
        per = p.elems
        frags = fragment_count(nbytes, per)
        check_tensor_id(tensor)
        slots, rounds = self._claim_uses(1)
        sizes = np.minimum(per, nbytes - np.arange(frags) * per)
        body = np.zeros((frags, DAR_PREFIX_BYTES + per), np.uint8)
        body[:, :DAR_PREFIX_BYTES] = np.array([bits, frags], ">u4").view(np.uint8)
        padded = np.zeros(frags * per, np.uint8)
        padded[:nbytes] = msg
        body[:, DAR_PREFIX_BYTES:] = padded.reshape(frags, per)
        hdr = p.request_fields(PacketType.DAR_DATA, worker=self.cfg.worker, slot=int(slots[0]), round=int(rounds[0]),
                               tensor=tensor, chunk=np.arange(frags), elems=sizes)
        pkts = build_batch(hdr, body)
        rows = [pkts[k, : HEADER_BYTES + DAR_PREFIX_BYTES + int(sizes[k])].tobytes() for k in range(frags)]
        result = np.zeros(fragment_count(p.max_message, per) * per, np.uint8)
        got = np.zeros(fragment_count(p.max_message, per), bool)
        res = {"bits": -1, "frags": -1, "have": 0, "contributors": 0}

        def accept_one(row: np.ndarray, h: Header, n: int) -> bool | None:
            """A result fragment: stored (True once the whole result is here), or None if it is not one."""
            if h.type != PacketType.DAR_RESULT or h.round != rounds[0] or h.width != 8 or \
                    n < HEADER_BYTES + DAR_PREFIX_BYTES:
                return None
            rb, rf = struct.unpack_from(">II", row, HEADER_BYTES)
            rbytes = -(-rb // 8)
            if rbytes > p.max_message or rf != fragment_count(rbytes, per) or h.chunk >= rf or \
                    h.elems != min(per, rbytes - h.chunk * per) or n != HEADER_BYTES + DAR_PREFIX_BYTES + h.elems or \
                    (res["bits"] >= 0 and (rb, rf) != (res["bits"], res["frags"])):
                return None
            res.update(bits=rb, frags=rf, contributors=h.contributors)
            if not got[h.chunk]:
                off = HEADER_BYTES + DAR_PREFIX_BYTES
                result[h.chunk * per: h.chunk * per + h.elems] = row[off:off + h.elems]
                got[h.chunk] = True
                res["have"] += 1
            return res["have"] == res["frags"]

        def accept(_idx: np.ndarray, _hv: np.ndarray, rows: np.ndarray, lens: np.ndarray) -> np.ndarray:
            # fragments are few (one message per use): judged one by one, in arrival order
            out = np.full(len(rows), -1, np.int8)
            for k in range(len(rows)):
                got_one = accept_one(rows[k], Header.unpack_from(rows[k]), int(lens[k]))
                out[k] = -1 if got_one is None else int(got_one)
            return out

        def resend(_i: int) -> range | list[int]:
            # Fragment k is answered with result fragments k, k + frags, ...: once the result's fragment
            # count is known, only the fragments whose answers are missing are sent again.
            if res["frags"] < 0:
                return range(frags)
            return sorted({j % frags for j in np.flatnonzero(~got[:res["frags"]]).tolist()})

        lost = self._exchange(slots, rounds, [rows], accept, resend, tensor=tensor, policy=self.cfg.loss_policy,
                              what=f"dar job {p.job} and this key")
        if lost[0]:
            return MessageResult(np.zeros(0, np.uint8), 0, 0)
        return MessageResult(result[: -(-res["bits"] // 8)].copy(), res["bits"], res["contributors"])

    def run_uses(self, typ: PacketType, payloads: np.ndarray, *, tensor: int = 0,
                 policy: LossPolicy | None = None) -> UseResults:
        """Send one use per payload row (the next uses of the pool) and collect their answers."""
        count = payloads.shape[0]
        check_tensor_id(tensor)  # before the uses are claimed: a refused call spends none
        slots, rounds = self._claim_uses(count)
        hdr = self.cfg.params.request_fields(typ, worker=self.wire_worker, slot=slots, round=rounds, tensor=tensor,
                                             chunk=np.arange(count))
        return self._run_packets(typ, build_batch(hdr, payloads), slots, rounds, tensor=tensor, policy=policy)

    def _run_packets(self, typ: PacketType, pkts: np.ndarray, slots: np.ndarray, rounds: np.ndarray, *,
                     tensor: int, policy: LossPolicy | None = None, feed: PacketFeed | None = None) -> UseResults:
        """Run the claimed uses (``slots``, ``rounds``) whose one datagram each is a row of ``pkts`` and collect
        their answers (the rows of ``feed``, if any, as it makes them ready)."""
        cfg, p = self.cfg, self.cfg.params
        count = pkts.shape[0]
        is_norm = typ == PacketType.NORM
        rows = pkts[:, None]  # rows[i]: use i's one datagram, as a (1, L) view (sendto takes any buffer)
        k = 1 if is_norm else p.elems
        signed = p.kind == "uncompressed"
        sums = np.zeros(count, np.int64) if is_norm else np.zeros((count, k), data_sums_type(p))
        contrib = np.zeros(count, np.int64)
        bitmap = np.zeros(count, np.int64)
        want_type = PacketType.NORM_RESULT if is_norm else PacketType.RESULT
        rdt = np.dtype({8: ">u1", 16: ">u2", 32: ">u4"}[32 if is_norm else p.result_bits])

        size = HEADER_BYTES + k * rdt.itemsize

        def accept(idx: np.ndarray, hv: np.ndarray, rows: np.ndarray, lens: np.ndarray) -> np.ndarray:
            """1 for each datagram that is the result of its use ``idx``, -1 for the others; the results'
            sums, contributor counts and bitmaps are stored."""
            ok = (hv["type"] == want_type) & (hv["round"] == rounds[idx]) & (hv["elems"] == k) & \
                (lens == size) & (hv["width"] == rdt.itemsize * 8)
            use = idx[ok]
            vals = np.ascontiguousarray(rows[ok, HEADER_BYTES:size]).view(rdt)
            if is_norm:
                sums[use] = vals[:, 0]
            elif signed:
                sums[use] = vals.astype(np.uint32).view(np.int32)
            else:
                sums[use] = vals
            contrib[use] = p.result_counts(hv["contributors"][ok], hv["bitmap"][ok])  # workers, at any tier
            bitmap[use] = hv["bitmap"][ok]
            return np.where(ok, 1, -1).astype(np.int8)

        def intake(rows: np.ndarray, lens: np.ndarray, use_of_slot: np.ndarray, done: np.ndarray,
                   finished: np.ndarray) -> tuple[int, int, int]:
            return take_results(rows, lens, p.job, p.key, use_of_slot, done, rounds, int(want_type), k,
                                rdt.itemsize * 8, signed, sums, contrib, bitmap, finished)

        # the compiled intake covers DATA answers of one-tier jobs (whose contributor field counts workers)
        fast = None if is_norm or p.leaves is not None else intake
        with feed or contextlib.nullcontext():  # the feed's work runs beside the engine, and ends before this
            lost = self._exchange(slots, rounds, rows, accept, lambda _i: (0,), tensor=tensor,
                                  policy=policy or cfg.loss_policy, what=f"job {p.job}, this key and table",
                                  paced=not is_norm, block=pkts, intake=fast, feed=feed)
        return UseResults(sums, contrib, bitmap, lost)

    # -- the engine --------------------------------------------------------------------------------
    def _claim_uses(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The slots and rounds of the next ``count`` uses of the pool, in use order."""
        pool = self.cfg.params.slots
        use = np.arange(count, dtype=np.int64)
        slots = (self.next_use + use) % pool
        start = np.asarray(self.slot_round, np.int64)
        rounds = (start[slots] + use // pool) & ROUND_MASK  # use // pool: earlier uses of its slot in this run
        self.slot_round = ((start + np.bincount(slots, minlength=pool)) & ROUND_MASK).tolist()
        self.next_use += count
        return slots, rounds

    def _exchange(self, slots: np.ndarray, rounds: np.ndarray,
                  packets: list[list[bytes]] | list[list[np.ndarray]] | np.ndarray,
                  accept: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                  resend: Callable[[int], Iterable[int]], *,
                  tensor: int, policy: LossPolicy, what: str, paced: bool = True,
                  block: np.ndarray | None = None, intake: Intake | None = None,
                  feed: PacketFeed | None = None) -> np.ndarray:
        """The one retransmission engine: run uses until each is answered or lost; return which were lost.

        Use i (slot ``slots[i]``, round ``rounds[i]``) sends the datagrams ``packets[i]``; at most the
        pacer's window of uses is in flight. A use whose timeout expires sends ``packets[i][k]`` again for
        each k of ``resend(i)`` (under ``zero-fill``, after ``retries`` tries it is lost instead). The
        datagrams of this job for pending uses' slots go, a received batch at a time, to ``accept(uses,
        headers, rows, lengths)``, which returns per datagram 1: its use is complete; 0: accepted, not
        complete; -1: not an answer of the use (counted as unexpected). A straggler notice for the use's
        round marks it lost. Nothing at all for ``deadline`` seconds raises AggregatorUnreachable
        (``what`` names the job in the message).
        ``paced`` False (the norm stage): the uses' timing teaches the pacer nothing, neither round trips
        nor expiries nor answers: a barrier's answer waits for the last worker to reach it (process start,
        compute skew), not for the path. ``block``: the uses' datagrams as the rows of one array (one
        datagram per use, ``packets[i] == [block[i]]``), which lets first sends and resends go out as GSO runs.
        ``intake``: the same as ``accept`` and the matching before it in one compiled pass
        (``worker_lib.result_intake``), used for the batches without a straggler notice.
        """
        cfg, p = self.cfg, self.cfg.params
        in_step = self.in_step(policy)
        count = len(slots)
        lost = np.zeros(count, bool)
        done = np.zeros(count, bool)
        sent_at = np.zeros(count)
        tries = np.zeros(count, np.int64)
        runs = np.zeros(count, np.int64)  # runs of uses lost on their first send (pacing.extend_loss_runs)
        use_of_slot = np.full(p.slots, -1, np.int64)  # the pending use of each slot, -1 none
        base = nxt = 0
        last_answer = last_progress = time.monotonic()
        last_datagram = last_answer  # the latest datagram of any kind: the deadline's message tells the two apart
        done_count = 0  # uses done (answered or given up) when last counted
        # Early retransmission (pacing.py, "Loss seen from later answers"): the latest-sent use answered
        # on its first send, and its round trip. Reliable and paced only: zero-fill's workers must keep
        # to one fixed timeout to stay in step.
        early = paced and policy == "reliable" and self.pacer.adaptive_timeout
        rack_sent, rack_use, rack_rtt = -math.inf, -1, 0.0
        rack_above = -1  # the highest use answered after a resend: open uses first sent before it are lost too
        # When the first datagram for one of these uses came after use i was (re)sent: its timer starts
        # there, not at the send (pacing.py, "Probing"); until then only the oldest open use is timed.
        heard_since = np.full(count, math.inf)
        # Whether the path had spoken, in this exchange, at most a probe gap before use i was (re)sent: its
        # answers then flow, and silence after the send is a loss a tail probe may resend, as silence after
        # an answer is. Answers read in one batch (a worker descheduled while they arrived, or a coalesced
        # receive) can all come before an exchange's last sends, and nothing is heard after those.
        heard_before = np.zeros(count, bool)
        started = last_answer
        spoke_again = -math.inf  # when the path last spoke after a silence longer than a timeout

        probed_for = -math.inf  # last_answer when the tail was last probed, or found with nothing to probe

        def tail_probe(base: int, now: float) -> tuple[np.ndarray, float]:
            """The uses a tail probe resends now (pacing.py, "Tail probes"), and when one next may: once every
            use is sent and nothing came for ``Pacer.probe_gap``, the last ``PROBE_USES`` open uses that the
            path spoke after, or shortly before (``heard_before``); one probe per time the path speaks. Array
            work only when one is due."""
            nonlocal probed_for
            if not early or nxt < count or last_answer == probed_for:
                return _NO_USES, math.inf
            at = last_answer + self.pacer.probe_gap()
            if at > now:
                return _NO_USES, at
            open_ = np.flatnonzero(~done[base:nxt] & ((heard_since[base:nxt] < math.inf) | heard_before[base:nxt]))
            if not open_.size:
                probed_for = last_answer
                return _NO_USES, math.inf
            return open_[-PROBE_USES:] + base, at

        due_buf, rack_buf = np.empty(count, np.int64), np.empty(count, bool)

        def echoes(notice: np.void, datagrams: Iterable) -> bool:
            """Whether a straggler notice answers one of a use's own datagrams (their tensor and chunk, which
            a notice echoes), not a late copy of an earlier use of the slot, whose notice says nothing of
            this use (one-tier notices do not carry the refused round)."""
            return int(notice["tensor"]) == tensor and int(notice["chunk"]) in {
                int.from_bytes(bytes(d[_CHUNK_AT:_CHUNK_AT + 4]), "big") for d in datagrams}

        def deadlines(base: int, nxt: int, now: float, probe_now: bool = False,
                      ) -> tuple[np.ndarray, np.ndarray, float]:
            """The open uses of base..nxt-1 due to be resent at ``now`` and whether RACK found each lost (views
            that the next call overwrites), and the earliest deadline of any open use
            (``worker_lib.resend_timers``: by its timer, or by RACK for a use sent before one answered).
            ``probe_now``: the tail is probed in this pass (or it was since the path last spoke)."""
            pacer = self.pacer
            probing = probe_now or probed_for == last_answer
            rack = rack_use if early else -1
            from_heard = early and pacer.rtt is not None
            args = (base, nxt, now, sent_at, heard_since, tries, done, from_heard, pacer.base_rto(),
                    pacer.backoff_cap(), pacer.backoff_cap(now - last_answer), pacer.max_timeout, rack_sent, rack,
                    rack_rtt, pacer.reorder_margin() if rack >= 0 else 0.0, rack_above, due_buf, rack_buf)
            n, n_early, next_at = due_uses(*args)
            silent = now - last_answer >= pacer.base_rto() / 2
            if from_heard and silent and n - n_early > BURST_RUN and (nxt < count or probing):
                # A stalled path, not a burst of losses (pacing.py, "Probing"): the open uses count as
                # unheard since their sends until it speaks, and the oldest probes it alone. At the end of
                # an exchange, once the tail probe has gone out: its answers show RACK what was lost
                # before it (rack_above), and a peer that is late leaves them unanswered too.
                heard_since[base + 1:nxt] = math.inf
                heard_before[base + 1:nxt] = False
                n, n_early, next_at = due_uses(*args)
            return due_buf[:n], rack_buf[:n], next_at

        def room(base: int, nxt: int) -> int:
            """Uses that may start now: open uses (sent, unanswered, resent or not) stay within the
            pacer's window, and no use reaches the slot of an unfinished one (S uses past the oldest).
            An answered use leaves the window even while an older one waits, as a SACKed segment leaves
            TCP's pipe (RFC 6675): one lost packet must not stop the sending."""
            open_ = nxt - base - int(np.count_nonzero(done[base:nxt]))
            return max(0, min(self.pacer.window() - open_, base + p.slots - nxt, ready() - nxt))

        def ready() -> int:
            """Uses whose datagrams are final: all of them, or the rows ``feed`` has made ready so far."""
            return count if feed is None else feed.ready

        all_sent = math.inf  # when the last new use went out
        # when a tail resend's second copy is due (pacing.py, "Tail copies"); only once every new use is out
        copy_at = np.full(count, math.inf)

        def answered(finished: np.ndarray, sock: socket.socket, heard: float) -> float:
            """Record the uses ``finished`` (marked done, in the order answered) as answered at
            ``last_answer``, the path's previous answer having come at ``heard``: the pacer's round trips and
            window, RACK's latest answered use, the counters. Returns the earliest (last) send among them."""
            nonlocal rack_sent, rack_use, rack_rtt, rack_above, spoke_again
            if paced:
                # A use in flight across a silence of the path (no answer for a whole timeout) measured
                # the silence: a peer stalled or recovering, the aggregator behind. Its sample would raise
                # every timeout and slow this worker's own recovery, which stalls the others in turn
                # (pacing.py, "Timeout"): only uses sent after the path spoke again count. (Shorter
                # silences, a thread descheduled on a shared core, leave the samples as they are: without
                # them the timeouts of a DDP step under 1 % loss fell short and probes tripled.)
                if last_answer - heard > self.pacer.base_rto():
                    spoke_again = last_answer
                again = tries[finished] > 0
                if again.any():
                    rack_above = max(rack_above, int(finished[again].max()))
                clean = finished[~again]
                if clean.size:
                    at = sent_at[clean]
                    measured = at[at >= spoke_again]
                    if measured.size:
                        self.pacer.sample_many(last_answer - measured)
                    latest_at = float(at.max())  # the latest send, and the latest use of that send
                    latest = int(clean[at == latest_at].max())
                    if (latest_at, latest) > (rack_sent, rack_use):
                        rack_sent, rack_use = latest_at, latest
                        rack_rtt = last_answer - rack_sent
                self.pacer.answered(last_answer, int(finished.size))
            self.stats.results += int(finished.size)
            if sock is not self.sock:
                self.stats.multicast_results += int(finished.size)
            return float(sent_at[finished].min())

        def stamp_sent(uses: int | slice | list[int], at: float) -> None:
            """Uses ``uses`` were (re)sent at ``at``: nothing heard since, and whether the path had just spoken
            in this exchange, at most a probe gap before (``heard_before``)."""
            sent_at[uses] = at
            heard_since[uses] = math.inf
            heard_before[uses] = last_answer > started and at - last_answer <= self.pacer.probe_gap()

        def end() -> np.ndarray:
            self.stats.tail_s += max(0.0, time.monotonic() - all_sent)
            return lost

        def receive(socks: list[socket.socket]) -> None:
            """Take every answer waiting on ``socks`` (each read until it is empty): mark the uses it
            finishes, feed the pacer, and restart the timers of the uses the path has spoken since."""
            nonlocal last_answer, last_datagram
            heard = last_answer
            progress = math.inf  # the earliest (last) send of a use answered now
            for sock in socks:
                while True:
                    rows, lens = self._receive_batch(sock)
                    if not len(rows):
                        break
                    last_datagram = time.monotonic()
                    if intake is not None and not has_notice(rows, lens):
                        finished = np.empty(len(rows), np.int64)
                        taken, pending, unexpected = intake(rows, lens, use_of_slot, done, finished)
                        self.stats.unexpected += unexpected
                        if pending:
                            last_answer = time.monotonic()
                        if taken:
                            progress = min(progress, answered(finished[:taken], sock, heard))
                        continue
                    hv = header_view(rows)
                    mine = (lens >= HEADER_BYTES) & (hv["job"] == p.job) & (hv["key"] == p.key)
                    slot = hv["slot"].astype(np.int64)
                    use = np.where(mine & (slot < p.slots), use_of_slot[np.minimum(slot, p.slots - 1)], -1)
                    use[use >= 0] = np.where(done[use[use >= 0]], -1, use[use >= 0])
                    # a late copy of an earlier use of the slot (another round) says nothing of this use;
                    # a straggler notice carries the slot's newer round (checked below)
                    stale = (use >= 0) & (hv["type"] != PacketType.STRAGGLER) & \
                        (hv["round"] != rounds[np.maximum(use, 0)])
                    use[stale] = -1
                    pending = use >= 0
                    self.stats.unexpected += int(np.count_nonzero(~pending))
                    if not pending.any():
                        continue
                    last_answer = time.monotonic()
                    notice = pending & (hv["type"] == PacketType.STRAGGLER)
                    for k in np.flatnonzero(notice).tolist():  # rare: one per use at most
                        i = int(use[k])
                        ours = int(rounds[i])
                        # not newer than the use's round, or caused by a late copy of an earlier use
                        if done[i] or not serial_newer(int(hv["round"][k]), ours) or not echoes(hv[k], packets[i]):
                            self.stats.unexpected += 1
                            continue
                        if in_step:
                            raise AggregatorStateError(p.job, int(slots[i]), f"a straggler notice for round {ours} "
                                                       f"(the slot is at round {int(hv['round'][k])})")
                        self.stats.stragglers += 1
                        if cfg.on_straggler is not None:
                            cfg.on_straggler(int(slots[i]), ours, int(hv["round"][k]))
                        self._finish_lost(i, int(slots[i]), tensor, done, lost, use_of_slot)
                    cand = np.flatnonzero(pending & ~notice)
                    cand = cand[~done[use[cand]]]  # not given up by a notice of this batch
                    if not cand.size:
                        continue
                    verdict = accept(use[cand], hv[cand], rows[cand], lens[cand])
                    self.stats.unexpected += int(np.count_nonzero(verdict < 0))
                    finished = use[cand[verdict > 0]]
                    # a use answered twice in one batch counts once (the later copy is unexpected)
                    first = np.sort(np.unique(finished, return_index=True)[1])
                    self.stats.unexpected += finished.size - first.size
                    finished = finished[first]
                    if not finished.size:
                        continue
                    done[finished] = True
                    use_of_slot[slots[finished]] = -1
                    progress = min(progress, answered(finished, sock, heard))
            if last_answer > heard:  # the path spoke: the timers of the uses sent before start now
                since = heard_since[base:nxt]
                at = sent_at[base:nxt]
                since[(since == math.inf) & (at < last_answer)] = last_answer
                if early:  # and those of uses first sent after a use answered now start again (pacing.py)
                    since[(at >= progress) & (tries[base:nxt] == 0)] = last_answer

        while base < count:
            while done[base]:  # the oldest open use first: its timeout is backed off apart (pacing.py)
                base += 1
                if base == count:
                    return end()
            now = time.monotonic()
            # Resend or give up what is due (each resend backs that use's timeout off, see pacing.py);
            # the tail probe first: the timers it finds due with it may be a stall's
            probe = tail_probe(base, now)[0]
            due, by_rack, _ = deadlines(base, nxt, now, probe.size > 0)
            if due.size or probe.size:
                # Answers that came while this thread did not run (descheduled on a busy core, or the GIL
                # held by the training loop) wait in the socket: they are not losses. Take them first.
                spoke = last_answer
                receive(self.socks)
                if last_answer != spoke:  # the path spoke: no probe now. (Else keep this one: a stall found
                    probe = tail_probe(base, now)[0]  # with it took the probed uses' hearing away)
                due, by_rack, _ = deadlines(base, nxt, now, probe.size > 0)
            early_due = due[by_rack]  # resent because later answers showed them lost
            self.stats.early_retransmissions += early_due.size
            if due.size and paced:
                burst = extend_loss_runs(runs, due[tries[due] == 0], self.pacer.burst_run())
                self.pacer.expired(now, int(due.size), burst=burst)
            if probe.size:  # not expiries: they teach the pacer nothing
                probed_for = last_answer
                probe = np.setdiff1d(probe, due, assume_unique=True)
                self.stats.tail_probes += int(probe.size)
                due = np.union1d(due, probe)
            runs_of_block = block is not None and self.gso
            again = []  # uses of one datagram each, resent in one run with this pass's first sends
            # second copies of earlier tail resends, now due and still unanswered
            copies = np.flatnonzero((copy_at[base:nxt] <= now) & ~done[base:nxt]) + base if nxt == count else _NO_USES
            if copies.size:
                copy_at[copies] = math.inf
                copies = np.setdiff1d(copies, due, assume_unique=True)
                self.stats.tail_copies += int(copies.size)
            for i, resent_now in [*((i, True) for i in due.tolist()), *((i, False) for i in copies.tolist())]:
                if resent_now:  # (else the second copy of an earlier resend)
                    if policy == "zero-fill" and tries[i] >= cfg.retries:
                        self._finish_lost(i, int(slots[i]), tensor, done, lost, use_of_slot)
                        continue
                    tries[i] += 1
                    copy_at[i] = math.inf  # a second copy only if nothing goes after it (below)
                if runs_of_block:
                    again.append(i)
                    continue
                for k in resend(i):
                    self.stats.retransmissions += 1
                    self._send(packets[i][k], int(slots[i]))
                stamp_sent(i, time.monotonic())
            # New uses, after the resends were chosen: the answers taken for them may have made room.
            first = time.monotonic()
            n = room(base, nxt)
            use_of_slot[slots[nxt:nxt + n]] = np.arange(nxt, nxt + n)
            # With the exchange's last new uses, second copies of its last open uses (pacing.py, "Tail duplicates")
            dups = _NO_USES
            if early and n and nxt + n == count and cfg.tail_duplicates:
                lo = max(base, count - min(cfg.tail_duplicates, max(1, count // 4)))
                # not the uses this pass sends again (``again`` holds them only when they go in the run)
                dups = np.setdiff1d(np.flatnonzero(~done[lo:count]) + lo, np.concatenate([due, copies]),
                                    assume_unique=True)
                self.stats.tail_duplicates += int(dups.size)
            if runs_of_block and (n or again):
                # one system call for all (a copy only with resends or duplicates: C-contiguous, as sendmsg
                # needs); the resends go after the new uses and are stamped after the call: an answer to a use
                # first sent in this pass must not make a resend look sent earlier than it (RACK would resend
                # it again). Duplicates are not stamped: their uses' timers run from the first copies.
                if again or dups.size:
                    self._send_run(block[np.concatenate([np.arange(nxt, nxt + n), np.asarray(again, np.int64), dups])])
                else:
                    self._send_run(block[nxt:nxt + n])
            else:
                for i in [*range(nxt, nxt + n), *dups.tolist()]:
                    for data in packets[i]:
                        self._send(data, int(slots[i]))
            stamp_sent(slice(nxt, nxt + n), first)
            if again:
                self.stats.retransmissions += len(again)
                stamp_sent(again, time.monotonic())
            nxt += n
            if n and nxt == count:
                all_sent = time.monotonic()
            if nxt == count and early_due.size and (again or not n):
                # Nothing is sent after these resends (a pass's run sends its new uses first, here the
                # exchange's last), so nothing sent later can show one lost again: each gets a second copy
                # a least round trip later unless answered by then (pacing.py, "Tail copies")
                least = self.pacer.base_rtt
                copy_at[early_due] = now + (least + self.pacer.reorder_margin() if math.isfinite(least) else 0.0)
            if (now_done := int(np.count_nonzero(done))) != done_count:
                done_count, last_progress = now_done, now
            if now - last_answer > cfg.deadline or now - last_progress > cfg.deadline:
                where = ", ".join(f"{h}:{p}" for h, p in (cfg.aggregator, *cfg.more_aggregators))
                # answers that finish nothing (stale rounds, notices of no newer round) must not hold a
                # worker past its deadline either
                heard = "no answer" if now - last_datagram > cfg.deadline else "no use answered or given up"
                raise AggregatorUnreachable(
                    f"worker {cfg.worker}: {heard} from the aggregator at {where} (shards={cfg.shards}) "
                    f"for {cfg.deadline:.1f} s: is thc-aggregator running there with {what}, and are the job's "
                    f"other workers sending?")
            while base < count and done[base]:
                base += 1
            if base >= count or room(base, nxt):
                continue
            next_at = deadlines(base, nxt, now)[2]
            next_at = min(next_at, tail_probe(base, now)[1])
            if nxt == count:
                pending = copy_at[base:nxt][~done[base:nxt]]
                if pending.size:
                    next_at = min(next_at, float(pending.min()))
            wait = max(0.0, next_at - now) if next_at < math.inf else 0.0
            waited = time.monotonic()
            fed = feed is not None and nxt < count  # a new piece of rows wakes the engine as an answer does
            starved = nxt == ready()
            readable, _, _ = select.select([*self.socks, feed] if fed else self.socks, [], [], max(wait, 0.0005))
            self.stats.waits += 1
            if nxt < count:  # blocked from sending: by the feed, the slots or the window
                waited = time.monotonic() - waited
                if starved:
                    self.stats.feed_bound_s += waited
                elif nxt - base >= p.slots:
                    self.stats.slot_bound_s += waited
                else:
                    self.stats.window_bound_s += waited
            if fed and feed in readable:
                feed.drain()  # raises where the feed's work failed
                readable.remove(feed)
            receive(readable)
        return end()

    def _finish_lost(self, i: int, slot: int, tensor: int, done: np.ndarray, lost: np.ndarray,
                     use_of_slot: np.ndarray) -> None:
        done[i] = True
        lost[i] = True
        use_of_slot[slot] = -1
        self.stats.lost_chunks += 1
        self.stats.lost.append((tensor, i))

    def _receive_batch(self, sock: socket.socket) -> tuple[np.ndarray, np.ndarray]:
        """The datagrams waiting on ``sock``, up to RX_BATCH (one recvmmsg): their rows (C-contiguous,
        one datagram each) and lengths; none when nothing waits. The simulated loss takes its share
        first; accepted datagrams go to the pcap, if any."""
        bs = self._rx[sock.fileno()]
        runs = bs.gro_messages
        n = bs.recv()
        if n:
            self.stats.receive_batches += 1
            self.stats.datagrams_received += n
            self.stats.coalesced_receives += bs.gro_messages - runs
        rows, lens, srcs = bs.rx[:n], bs.rx_len[:n], bs.rx_addr[:n]
        if n and self.cfg.drop_down:
            keep = self._rng.random(n) >= self.cfg.drop_down
            if not keep.all():  # the copies only where a datagram is dropped
                self.stats.dropped_down += n - int(np.count_nonzero(keep))
                rows, lens, srcs = rows[keep], lens[keep], srcs[keep]
        if self.pcap is not None:
            here = sock.getsockname()
            for k in range(len(rows)):
                self.pcap.write(sockaddr_to_tuple(srcs[k]), here, bytes(rows[k, :lens[k]]))
        return rows, lens

    def _send_run(self, rows: np.ndarray) -> None:
        """Send equal-length datagrams (the rows of a C-contiguous array) to the only shard, up to
        ``GSO_SEGMENTS`` per system call with UDP_SEGMENT: the kernel cuts the run into the datagrams,
        one pass through the socket layer for all of them. A kernel or path that refuses it (an error
        other than a full buffer) turns segmentation off for this transport, with one log line, and
        the run goes out datagram by datagram. The simulated loss (``drop_up``) drops its share of the run
        first, as it would drop them one by one: a lossy run still measures the sends a real one makes."""
        if self.cfg.drop_up:
            keep = self._rng.random(rows.shape[0]) >= self.cfg.drop_up
            if not keep.all():  # the copy only where a datagram is dropped
                lost = rows.shape[0] - int(np.count_nonzero(keep))
                self.stats.dropped_up += lost
                self.stats.packets_sent += lost  # sent, and lost on the way
                rows = rows[keep]
        length = rows.shape[1]
        per = max(1, min(GSO_SEGMENTS, GSO_BYTES // length))
        dest = self._dests[0]
        cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", length))]
        for start in range(0, rows.shape[0], per):
            run = rows[start:start + per]
            if run.shape[0] == 1:
                self._send(run[0], 0, simulate_loss=False)
                continue
            try:
                try:
                    self.sock.sendmsg([run], cmsg, 0, dest)
                except BlockingIOError:  # the send buffer is full: wait for it, as _send does
                    select.select([], [self.sock], [], self.cfg.timeout)
                    self.sock.sendmsg([run], cmsg, 0, dest)
            except (BlockingIOError, ConnectionRefusedError):
                self.stats.send_blocked += run.shape[0]  # the timeouts resend it
            except OSError as exc:
                log.warning("worker %d: UDP segmentation offload refused (%s); sending datagram by datagram",
                            self.cfg.worker, exc)
                self.gso = False
                for row in rows[start:]:
                    self._send(row, 0, simulate_loss=False)
                return
            self.stats.packets_sent += run.shape[0]
            self.stats.gso_sends += 1

    def _send(self, data: bytes | np.ndarray, slot: int, *, simulate_loss: bool = True) -> None:
        """Send one datagram to the shard of ``slot`` (``simulate_loss`` False: ``drop_up`` has had its say)."""
        cfg = self.cfg
        self.stats.packets_sent += 1
        if simulate_loss and cfg.drop_up and self._rng.random() < cfg.drop_up:
            self.stats.dropped_up += 1
            return
        dest = self._dests[slot % len(self._dests)]
        try:
            self.sock.sendto(data, dest)
        except BlockingIOError:
            # The send buffer is full (packets wait behind a slower link): wait until it drains rather
            # than lose the packet and a retransmission timeout.
            select.select([], [self.sock], [], cfg.timeout)
            try:
                self.sock.sendto(data, dest)
            except (BlockingIOError, ConnectionRefusedError):
                self.stats.send_blocked += 1
                return  # still full, or an ICMP error: the timeout retransmits
        except ConnectionRefusedError:
            return  # an ICMP error from an earlier packet: the timeout retransmits
        if self.pcap is not None:
            self.pcap.write(self.sock.getsockname(), dest, bytes(data))


def _packing(fill: IndexFill, indices: np.ndarray, packer: IndexPacker, slots: np.ndarray,
             rounds: np.ndarray) -> Callable[[Callable[[int], None]], None]:
    """A ``PacketFeed``'s work: ``fill`` the indices, and as they become final pack their whole chunks (every row
    once the last index is final) into ``packer``'s rows, stamp their uses and publish them."""

    def work(publish: Callable[[int], None]) -> None:
        packed = 0

        def done(n: int) -> None:
            nonlocal packed
            rows = packer.rows if n >= indices.size else n // packer.elems
            if rows > packed:
                packer.pack(indices, packed, rows)
                stamp_uses(packer.packets[packed:rows], slots[packed:rows], rounds[packed:rows])
                packed = rows
                publish(rows)

        fill(done)

    return work


def _multicast_socket(spec: str, iface: str) -> socket.socket:
    host, _, port = spec.rpartition(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # the default ~200 kB overflows in a burst
    s.bind((host, int(port)))
    mreq = socket.inet_aton(host) + socket.inet_aton(iface)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    s.setblocking(False)
    return s
