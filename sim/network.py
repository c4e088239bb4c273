"""Workers and the reference aggregator connected in process, packet by packet, with seeded loss.

This is the network of the simulations: every worker's norm and chunks become real THC packets
(``worker_lib.wire``), go through ``aggregator.engine.Aggregator`` (the state machine that
``thc-aggregator`` serves and the P4 programs are held to), and the packets it emits come back.
Uses of the slot pool follow docs/protocol.md: use u takes slot u mod S with round (u div S) mod 2^16,
the norm stage of a tensor is one use and each chunk of K indices another. ``SimulatedNetwork.step``
is the exchange of all n workers for ``worker_lib.allreduce.thc_allreduce``, the allreduce path the
real workers run over UDP.

Loss follows the transport's ``zero-fill`` policy without retransmission (the paper's methodology:
a packet is dropped with a fixed probability): an upstream DATA packet that is lost never reaches
the aggregator, so under a full threshold its chunk never completes and every worker takes it as
zero in the rotated domain, while under a partial threshold the chunk may complete without it; a
RESULT lost on its way to one worker makes that worker alone zero-fill the chunk. The norm stage is
always retransmitted by the transport (it is a barrier), so it is modelled as lossless.

Stragglers send after everyone else ("late"): under a partial threshold the aggregator has completed
without them and answers with the retained result, which is what a late worker of a real run gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from aggregator.engine import Aggregator
from worker_lib.job import JobConfig
from worker_lib.transport import UseResults
from worker_lib.wire.bits import pack_bits
from worker_lib.wire.layout import HEADER_BYTES, PacketType
from worker_lib.wire.protocol import use_slot_round
from worker_lib.wire.serializer import (
    bits_float,
    build_batch,
    decode_sums,
    float_bits,
    header_view,
)


@dataclass(frozen=True)
class LinkLoss:
    """Independent drop probabilities of worker->aggregator and aggregator->worker packets."""

    up: float = 0.0
    down: float = 0.0

    def __post_init__(self) -> None:
        for name, p in (("up", self.up), ("down", self.down)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"drop probability {name} must lie in [0, 1), got {p}")


@dataclass
class NetworkStats:
    """Counters of one simulated run."""

    packets_up: int = 0
    dropped_up: int = 0
    packets_down: int = 0
    dropped_down: int = 0
    lost_chunks: int = 0  # (worker, chunk) pairs taken as zero
    contributors: list[int] = field(default_factory=list)  # of every completed chunk


class JobNetwork:
    """What every simulated network of one job shares (this one-tier network, ``sim.tiered``'s two tiers
    and flat design): the uses of the slot pool, the send order of a use, seeded loss, the chunking of
    a tensor, and the network as one step's exchange."""

    def __init__(self, job: JobConfig, loss: LinkLoss, seed: int) -> None:
        self.job = job
        self.loss = loss
        self.rng = np.random.default_rng(seed)
        self.uses = 0

    def _next_use(self) -> tuple[int, int]:
        u = self.uses
        self.uses += 1
        return use_slot_round(u, self.job.slots)

    def _order(self, late: np.ndarray) -> np.ndarray:
        """Send order of one use: on-time workers shuffled, then the late ones."""
        on_time = np.flatnonzero(~late)
        return np.concatenate([self.rng.permutation(on_time), np.flatnonzero(late)])

    def _lost(self, p: float) -> bool:
        """Whether a packet on a link with drop probability ``p`` is lost (no draw when p is 0)."""
        return bool(p) and bool(self.rng.random() < p)

    def _chunks(self, indices: np.ndarray) -> int:
        """Chunks of K indices in each worker's (padded-length) row of ``indices``."""
        length, k = indices.shape[1], self.job.elems
        if length % k:
            raise ValueError(f"a tensor of {length} indices is not a whole number of {k}-index chunks")
        return length // k

    def _nothing_back(self, chunks: int) -> list[UseResults]:
        """Each worker's results before any answer: zero sums, contributors and bitmaps, every chunk lost."""
        k = self.job.elems
        return [UseResults(np.zeros((chunks, k), np.int64), np.zeros(chunks, np.int64), np.zeros(chunks, np.int64),
                           np.ones(chunks, bool)) for _ in range(self.job.workers)]

    def step(self, late: np.ndarray) -> StepExchange:
        """This network as the exchange of one allreduce (``worker_lib.allreduce.thc_allreduce``) in which
        the ``late`` workers send after the others."""
        return StepExchange(self, late)


class SimulatedNetwork(JobNetwork):
    """n workers of one job and an in-process reference aggregator."""

    def __init__(self, job: JobConfig, loss: LinkLoss, seed: int) -> None:
        super().__init__(job, loss, seed)
        self.aggregator = Aggregator([job], max_batch=max(64, 2 * job.workers + 2))
        self.stats = NetworkStats()

    def _run(self, rows: np.ndarray, senders: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Feed packets through the aggregator; return (header, payload) of every packet delivered to
        each worker, after downstream loss."""
        inbox: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self.job.workers)]
        stride = self.aggregator.stride
        buf = np.zeros((len(rows), stride), np.uint8)
        buf[:, : rows.shape[1]] = rows
        out = self.aggregator.process(buf, np.full(len(rows), rows.shape[1]))
        heads = header_view(out.buf[: out.count]) if out.count else []
        for m in range(out.count):
            targets = range(self.job.workers) if out.fanout[m] else [int(senders[out.src[m]])]
            head, payload = heads[m].copy(), out.buf[m, HEADER_BYTES: out.length[m]].copy()
            for w in targets:
                self.stats.packets_down += 1
                if self.loss.down and self.rng.random() < self.loss.down:
                    self.stats.dropped_down += 1
                    continue
                inbox[w].append((head, payload))
        return inbox

    def norm_stage(self, norms: np.ndarray, late: np.ndarray, tensor: int = 0) -> np.ndarray:
        """Max of the norms as each worker learns it (reliable: retransmitted until it completes)."""
        slot, rnd = self._next_use()
        order = self._order(late)
        job = self.job
        heads = job.request_fields(PacketType.NORM, worker=order, slot=slot, round=rnd, tensor=tensor, chunk=0)
        payload = np.array([float_bits(float(norms[w])) for w in order], dtype=">u4").view(np.uint8)
        rows = build_batch(heads, payload.reshape(len(order), 4))
        self.stats.packets_up += len(order)
        inbox = self._run_lossless(rows, order)
        result = np.zeros(job.workers)
        for w in range(job.workers):
            norm_results = [p for h, p in inbox[w] if h["type"] == PacketType.NORM_RESULT]
            if not norm_results:
                raise RuntimeError(f"worker {w} got no norm result: the job's threshold was not reached")
            result[w] = bits_float(int(np.frombuffer(norm_results[0][:4].tobytes(), ">u4")[0]))
        return result

    def _run_lossless(self, rows: np.ndarray, senders: np.ndarray) -> list[list[tuple]]:
        """Run packets with no loss in either direction (the norm barrier)."""
        saved, self.loss = self.loss, LinkLoss()
        try:
            return self._run(rows, senders)
        finally:
            self.loss = saved

    def data_stage(self, indices: np.ndarray, late: np.ndarray, tensor: int = 0) -> list[UseResults]:
        """Send each worker's (padded-length) indices chunk by chunk; collect what comes back to each
        worker: (chunks, K) int64 sums, contributors and bitmaps (0 where lost) and the lost chunks."""
        job = self.job
        n, k = indices.shape[0], job.elems
        chunks = self._chunks(indices)
        packed = pack_bits(indices.reshape(n * chunks, k), job.bits).reshape(n, chunks, -1)
        res = self._nothing_back(chunks)
        for c in range(chunks):
            slot, rnd = self._next_use()
            order = self._order(late)
            self.stats.packets_up += len(order)
            if self.loss.up:
                kept = self.rng.random(len(order)) >= self.loss.up
                self.stats.dropped_up += int((~kept).sum())
                order = order[kept]
            if order.size == 0:
                continue
            heads = job.request_fields(PacketType.DATA, worker=order, slot=slot, round=rnd, tensor=tensor, chunk=c)
            inbox = self._run(build_batch(heads, packed[order, c]), order)
            for w in range(n):
                r = res[w]
                for h, payload in inbox[w]:
                    if h["type"] != PacketType.RESULT or not r.lost[c]:
                        continue
                    r.sums[c] = decode_sums(payload, job.result_bits, k)
                    r.contributors[c] = int(h["contributors"])
                    r.bitmap[c] = int(h["bitmap"])
                    r.lost[c] = False
            done = max(int(r.contributors[c]) for r in res)
            if done:
                self.stats.contributors.append(done)
        self.stats.lost_chunks += sum(int(r.lost.sum()) for r in res)
        return res

class StagedNetwork(Protocol):
    """What ``StepExchange`` drives: the norm stage and the data stage of all n workers of a job (this
    module's one-tier network, ``sim.tiered``'s two tiers and flat design)."""

    def norm_stage(self, norms: np.ndarray, late: np.ndarray, tensor: int = 0) -> np.ndarray: ...

    def data_stage(self, indices: np.ndarray, late: np.ndarray, tensor: int = 0) -> list[UseResults]: ...


@dataclass
class StepExchange:
    """The simulated network as the allreduce's exchange for all n workers of one step."""

    net: StagedNetwork
    late: np.ndarray  #: (workers,) bool: these send after everyone else

    def exchange_norms(self, norms: np.ndarray, *, tensor: int) -> np.ndarray:
        return self.net.norm_stage(norms, self.late, tensor)

    def exchange_indices(self, indices: np.ndarray, *, tensor: int) -> list[UseResults]:
        return self.net.data_stage(indices, self.late, tensor)
