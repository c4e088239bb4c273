"""Two tiers in the simulations: n workers under L leaves and one spine, packet by packet through the
reference state machines (``aggregator.tiers``), and the flat design beside it.

``TieredNetwork`` is ``sim.network.SimulatedNetwork``'s counterpart for a two-tier job
(``JobConfig.leaves``): every norm and chunk becomes the workers' real DATA / NORM packets, each leaf
forwards its PARTIAL to the spine, and the spine's answers travel back down through the leaves. Loss
follows the same zero-fill methodology (no retransmission, the norm stage lossless), on two kinds of
link: the workers' (``loss``) and the leaves' to the spine (``spine_loss``), each way. A late worker
("straggler") sends after everyone else; with a threshold below n the spine completes without the
leaves still waiting for theirs, and those leaves get the retained result when they forward late.

``FlatNetwork`` is the flat design at the same scale: one aggregator for all n workers, which the wire
cannot carry past 32 workers (one job's bitmap), so it is the one-tier state table's outcome computed
without packets: a chunk completes with the first ``threshold`` workers whose packets arrive (on-time
ones first, in random order), every worker receives the completion through its own lossy link, and a
late worker that arrives after it also gets the retained result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aggregator.tiers import Dest, LeafAggregator, SpineAggregator
from sim.network import JobNetwork, LinkLoss, NetworkStats
from worker_lib.job import JobConfig
from worker_lib.transport import UseResults
from worker_lib.wire import Header, PacketType, bits_float, float_bits, pack_bits
from worker_lib.wire.protocol import TierCounter
from worker_lib.wire.serializer import decode_sums


@dataclass
class TierStats(NetworkStats):
    """``NetworkStats`` and the leaf-spine links' packets (both ways)."""

    packets_spine: int = 0
    dropped_spine: int = 0
    forwarded: list[int] = field(default_factory=list)  #: partials the leaves sent, per data stage


class TieredNetwork(JobNetwork):
    """n workers of a two-tier job, their leaves and the spine, in process."""

    def __init__(self, job: JobConfig, loss: LinkLoss, spine_loss: LinkLoss, seed: int) -> None:
        if not job.tiered:
            raise ValueError("TieredNetwork needs a two-tier job (JobConfig.leaves)")
        super().__init__(job, loss, seed)
        self.spine_loss = spine_loss
        self.leaves = [LeafAggregator(leaf, [job]) for leaf in range(len(job.leaves))]
        self.spine = SpineAggregator([job])
        self.first = np.cumsum((0, *job.leaves))  #: global id of each leaf's local worker 0
        self.stats = TierStats()

    def _packet(self, typ: PacketType, worker: int, slot: int, rnd: int, tensor: int, chunk: int,
                payload: bytes) -> tuple[int, bytes]:
        leaf, local = self.job.tier_of(worker)
        hdr = Header(**self.job.request_fields(typ, worker=local, slot=slot, round=rnd, tensor=tensor, chunk=chunk))
        return leaf, hdr.pack(payload)

    def _run(self, packets: list[tuple[int, int, bytes]], lossy: bool) -> list[list[bytes]]:
        """Send (worker, leaf, packet) in order; return the packets each worker receives."""
        inbox: list[list[bytes]] = [[] for _ in range(self.job.workers)]
        for worker, leaf, pkt in packets:
            self.stats.packets_up += 1
            if lossy and self._lost(self.loss.up):
                self.stats.dropped_up += 1
                continue
            local = worker - int(self.first[leaf])
            self._deliver(leaf, self.leaves[leaf].handle(pkt), local, inbox, lossy)
        return inbox

    def _deliver(self, leaf: int, outs: list, sender: int, inbox: list[list[bytes]], lossy: bool) -> None:
        """Carry a leaf's outputs: up to the spine (and the spine's answers back down), or to workers."""
        for dest, pkt in outs:
            if dest != Dest.PARENT:
                for local in (range(self.job.leaves[leaf]) if dest == Dest.ALL else [sender]):
                    self.stats.packets_down += 1
                    if lossy and self._lost(self.loss.down):
                        self.stats.dropped_down += 1
                        continue
                    inbox[int(self.first[leaf]) + local].append(pkt)
                continue
            self.stats.packets_spine += 1
            if lossy and self._lost(self.spine_loss.up):
                self.stats.dropped_spine += 1
                continue
            for fanout, answer in self.spine.handle(pkt):
                for target in (range(len(self.leaves)) if fanout else [leaf]):
                    self.stats.packets_spine += 1
                    if lossy and self._lost(self.spine_loss.down):
                        self.stats.dropped_spine += 1
                        continue
                    self._deliver(target, self.leaves[target].handle(answer, from_parent=True), -1, inbox, lossy)

    def norm_stage(self, norms: np.ndarray, late: np.ndarray, tensor: int = 0) -> np.ndarray:
        """Max of the norms as each worker learns it (reliable: modelled lossless, a barrier)."""
        slot, rnd = self._next_use()
        packets = [(w, *self._packet(PacketType.NORM, int(w), slot, rnd, tensor, 0,
                                     float_bits(float(norms[w])).to_bytes(4, "big")))
                   for w in self._order(late).tolist()]
        inbox = self._run(packets, lossy=False)
        out = np.zeros(self.job.workers)
        for w, got in enumerate(inbox):
            answers = [p for p in got if Header.parse(p)[0].type == PacketType.NORM_RESULT]
            if not answers:
                raise RuntimeError(f"worker {w} got no norm result: the job's threshold was not reached")
            out[w] = bits_float(int.from_bytes(answers[0][32:36], "big"))
        return out

    def data_stage(self, indices: np.ndarray, late: np.ndarray, tensor: int = 0) -> list[UseResults]:
        """Each worker's indices chunk by chunk through both tiers; what comes back to each worker."""
        job, n, k = self.job, self.job.workers, self.job.elems
        chunks = self._chunks(indices)
        packed = pack_bits(indices.reshape(n * chunks, k), job.bits).reshape(n, chunks, -1)
        res = self._nothing_back(chunks)
        before = sum(leaf.tier_counters[TierCounter.FORWARDED] for leaf in self.leaves)
        for c in range(chunks):
            slot, rnd = self._next_use()
            packets = [(w, *self._packet(PacketType.DATA, w, slot, rnd, tensor, c, packed[w, c].tobytes()))
                       for w in self._order(late).tolist()]
            done = 0
            for w, got in enumerate(self._run(packets, lossy=True)):
                for pkt in got:
                    h = Header.parse(pkt)[0]
                    if h.type != PacketType.RESULT or h.round != rnd:
                        continue
                    r = res[w]
                    r.sums[c] = decode_sums(pkt[32:], job.result_bits, k)
                    r.contributors[c] = int(job.result_counts(np.array([h.contributors]), np.array([h.bitmap]))[0])
                    r.bitmap[c], r.lost[c] = h.bitmap, False
                    done = max(done, int(r.contributors[c]))
                    break
            if done:
                self.stats.contributors.append(done)
        self.stats.forwarded.append(sum(leaf.tier_counters[TierCounter.FORWARDED] for leaf in self.leaves) - before)
        self.stats.lost_chunks += sum(int(r.lost.sum()) for r in res)
        return res


class FlatNetwork(JobNetwork):
    """The flat design for a job of any size: one aggregator, its state table's outcome without packets
    (module docstring). ``job`` gives the table, K, S and the threshold (its ``leaves`` are ignored)."""

    def __init__(self, job: JobConfig, loss: LinkLoss, seed: int) -> None:
        super().__init__(job, loss, seed)
        self.values = job.values()
        self.stats = NetworkStats()

    def norm_stage(self, norms: np.ndarray, late: np.ndarray, tensor: int = 0) -> np.ndarray:
        self._next_use()
        first = self._order(late)[: self.job.threshold]
        bits = max(float_bits(float(norms[w])) for w in first.tolist())
        self.stats.packets_up += self.job.workers
        self.stats.packets_down += self.job.workers
        return np.full(self.job.workers, bits_float(bits))

    def data_stage(self, indices: np.ndarray, late: np.ndarray, tensor: int = 0) -> list[UseResults]:
        job, n, k = self.job, self.job.workers, self.job.elems
        chunks = self._chunks(indices)
        res = self._nothing_back(chunks)
        up, down = self.loss.up, self.loss.down
        for c in range(chunks):
            self._next_use()
            order = self._order(late)
            self.stats.packets_up += n
            kept = order[self.rng.random(n) >= up] if up else order
            self.stats.dropped_up += n - kept.size
            if kept.size < job.threshold:
                continue  # never completes: every worker zero-fills the chunk
            summed = kept[: job.threshold]
            sums = self.values[indices[summed, c * k:(c + 1) * k]].sum(axis=0)
            # the completion to every worker, and the retained result to each one that arrives after it
            second = np.isin(np.arange(n), kept[job.threshold:])
            arrived = self.rng.random((n, 2)) >= down
            arrived[:, 1] &= second
            got = arrived.any(axis=1)
            self.stats.packets_down += n + int(second.sum())
            self.stats.dropped_down += n + int(second.sum()) - int(arrived.sum())
            for w in np.flatnonzero(got).tolist():
                r = res[w]
                r.sums[c], r.contributors[c], r.lost[c] = sums, job.threshold, False
            self.stats.contributors.append(job.threshold)
        self.stats.lost_chunks += sum(int(r.lost.sum()) for r in res)
        return res


#: Bytes in front of a THC header on the wire: Ethernet (14 + 4 FCS), IPv4 (20), UDP (8).
WIRE_OVERHEAD = 46


def step_time(job: JobConfig, coords: int, rate_bps: float, *, tiers: bool) -> float:
    """Seconds one allreduce of ``coords`` coordinates takes in a link-rate model with software
    aggregators (``thc-aggregator`` hosts, full-duplex NICs at ``rate_bps``): every NIC must carry its
    bytes, the busiest one sets the time (transfers pipelined, latency and CPU not counted).

    Flat: one aggregator receives every worker's DATA and sends every worker its RESULT. Two tiers
    (``job.leaves``): leaf l carries n_l workers' DATA and RESULTs and one PARTIAL and RESULT per chunk
    to and from the spine, which carries one PARTIAL and one RESULT per leaf and chunk. A worker's own
    link carries its DATA and RESULT in both designs (the bound when switches aggregate at line rate).
    """
    k = job.elems
    chunks = -(-coords // k)
    head = WIRE_OVERHEAD + 32
    data, result = head + k * job.bits // 8, head + k * job.result_bits // 8
    worker = chunks * max(data, result)
    if not tiers:
        busiest = job.workers * worker
    else:
        if not job.tiered:
            raise ValueError(f"job {job.job} has one tier: its two-tier step time needs leaves=")
        leaves = job.leaves
        partial = [head + k * job.partial_bits(leaf) // 8 for leaf in range(len(leaves))]
        leaf = max(chunks * max(n * data + result, p + n * result) for n, p in zip(leaves, partial, strict=True))
        spine = chunks * max(sum(partial), len(leaves) * result)
        busiest = max(worker, leaf, spine)
    return busiest * 8 / rate_bps


def step_time_rows(coords: int, rate_bps: float, per_leaf: int = 32, bits: int = 4, granularity: int = 20,
                   workers: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)) -> list[dict]:
    """The link-rate model's step time of the flat and the two-tier design, and of a worker's link (the
    line-rate switch bound), at each worker count with ``per_leaf`` workers a leaf."""
    rows = []
    for n in workers:
        leaves = tuple(len(a) for a in np.array_split(np.arange(n), -(-n // per_leaf)))
        job = JobConfig(workers=n, leaves=leaves, bits=bits, granularity=granularity)
        one = JobConfig(workers=1, bits=bits, granularity=granularity, result_bits=job.result_bits, elems=job.elems)
        rows.append({"workers": n, "leaves": len(leaves), "coords": coords, "rate_gbps": rate_bps / 1e9,
                     "result_bits": job.result_bits, "elems": job.elems,
                     "flat_s": step_time(job, coords, rate_bps, tiers=False),
                     "two_tiers_s": step_time(job, coords, rate_bps, tiers=True),
                     "worker_link_s": step_time(one, coords, rate_bps, tiers=False)})
    return rows
