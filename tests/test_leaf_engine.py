"""The leaf on the batch engine (aggregator.leaf_engine) against the reference leaf (aggregator.tiers):
random traffic from the local workers (new rounds, resends, stragglers, the other kind, garbage) and from
the parent (a reference spine's answers to the partials, some lost, some repeated, stale ones, notices),
cut into random batches. Each batch must cause the same packets, to the same destinations, as the
reference handling its packets one by one (in any order across slots), and the counters must agree."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.leaf_engine import LeafEngine
from aggregator.tiers import Dest, LeafAggregator, SpineAggregator
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire import Header, PacketType, float_bits, pack_bits
from worker_lib.wire.protocol import Counter, TierCounter
from worker_lib.wire.serializer import batch_of

K = 16
JOBS = {
    "thc": JobConfig(job=3, leaves=(3, 5), workers=8, elems=K, slots=4),
    "narrow-partials": JobConfig(job=4, leaves=(4, 8), workers=12, elems=K, slots=3),  # partials 8 bits, sums 16
    "uncompressed": JobConfig(job=5, kind="uncompressed", leaves=(2, 3), workers=5, elems=K, slots=3),
}


def request(cfg: JobConfig, worker: int, slot: int, rnd: int, rng: np.random.Generator) -> bytes:
    """Local worker ``worker``'s packet for (slot, round): NORM on rounds 3 mod 4, else DATA (random
    payload); tensor and chunk name the use, as a worker's do."""
    kind = PacketType.NORM if rnd % 4 == 3 else PacketType.DATA
    hdr = Header(**cfg.request_fields(kind, worker=worker, slot=slot, round=rnd), tensor=slot, chunk=rnd)
    if kind == PacketType.NORM:
        return hdr.pack(float_bits(float(rng.random() * 10)).to_bytes(4, "big"))
    if cfg.kind == "uncompressed":
        return hdr.pack(rng.integers(-1000, 1000, K).astype(">i4").tobytes())
    return hdr.pack(pack_bits(rng.integers(0, 1 << cfg.bits, (1, K)), cfg.bits).tobytes())


def other_leaf(cfg: JobConfig, leaf: int, partial: bytes, rng: np.random.Generator) -> bytes:
    """Leaf ``leaf``'s partial for the same use as ``partial``."""
    hdr = Header.parse(partial)[0]
    n = cfg.leaves[leaf]
    if hdr.type == PacketType.PARTIAL_NORM:
        body = float_bits(float(10 + rng.random())).to_bytes(4, "big")  # above this leaf's: the spine's max
    else:
        width = cfg.partial_bits(leaf)
        top = min(cfg.granularity * n, (1 << width) - 1) if cfg.kind == "thc" else 1000
        body = rng.integers(0, top + 1, K).astype({8: ">u1", 16: ">u2", 32: ">u4"}[width]).tobytes()
    return hdr.replace(worker=leaf, contributors=n, bitmap=(1 << n) - 1,
                       width=32 if hdr.type == PacketType.PARTIAL_NORM else cfg.partial_bits(leaf)).pack(body)


def traffic(cfg: JobConfig, leaf: int, seed: int, steps: int = 1500):
    """(packet, from_parent, the reference's answers) as the test feeds them; a packet None ends a batch."""
    rng = np.random.default_rng(seed)
    ref = LeafAggregator(leaf, [cfg])
    spine = SpineAggregator([cfg])
    n = cfg.leaves[leaf]
    rounds = [0] * cfg.slots
    answers: list[bytes] = []  # the parent's packets, to send (some again)
    for _ in range(steps):
        u = rng.random()
        if u < 0.03 and len(answers) >= 4:  # a burst: the parent's answers back to back, in a batch of their own
            yield None, False, []  # (the end of the batch before)
            for packet in answers:
                yield packet, True, ref.handle(packet, from_parent=True)
            answers = []
            continue
        if u < 0.12 and answers:
            packet = answers[int(rng.integers(0, len(answers)))] if rng.random() < 0.3 else answers.pop(0)
            yield packet, True, ref.handle(packet, from_parent=True)
            continue
        if u < 0.14:  # garbage from a worker's address or the parent's
            junk = bytes(rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8))
            parent = bool(rng.random() < 0.5)
            yield junk, parent, ref.handle(junk, from_parent=parent)
            continue
        slot = int(rng.integers(0, cfg.slots))
        if rng.random() < 0.06:
            rounds[slot] += 1
        rnd = max(0, rounds[slot] - int(rng.choice([0, 0, 0, 1, 2])))
        packet = request(cfg, int(rng.integers(0, n)), slot, rnd, rng)
        outs = ref.handle(packet)
        yield packet, False, outs
        for dest, out in outs:
            if dest != Dest.PARENT or rng.random() < 0.15:  # partials to the spine, some lost
                continue
            got = []
            if rng.random() < 0.1:  # another leaf is two rounds ahead on this slot: the spine refuses ours
                ahead = Header.parse(out)[0]
                got += spine.handle(other_leaf(cfg, 1 - leaf, ahead.replace(round=ahead.round + 2).pack(
                    Header.parse(out)[1]), rng))
            got += spine.handle(out)
            for other in range(len(cfg.leaves)):
                if other != leaf and rng.random() < 0.9:
                    got += spine.handle(other_leaf(cfg, other, out, rng))
            answers += [p for fan, p in got if Header.parse(p)[0].worker == leaf or fan]


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize(("name", "leaf"), [("thc", 0), ("thc", 1), ("narrow-partials", 0), ("uncompressed", 1)])
def test_batches_equal_the_reference_packet_by_packet(name: str, leaf: int, compiled: bool) -> None:
    if compiled:
        pytest.importorskip("numba")
    cfg = JOBS[name]
    engine = LeafEngine(leaf, [cfg], max_batch=64, compiled=compiled)
    rng = np.random.default_rng(leaf)
    kinds = set()

    def run(batch: list[tuple[bytes, bool, list]]) -> None:
        out = engine.process(*batch_of([p for p, _, _ in batch], engine.engine.stride),
                             np.array([f for _, f, _ in batch]))
        want = sorted((Dest(d), p) for _, _, outs in batch for d, p in outs)
        assert sorted(out.packets()) == want, f"batch of {len(batch)}"
        kinds.update((d, Header.parse(p)[0].type) for d, p in want)

    batch: list[tuple[bytes, bool, list]] = []
    size = 1
    for item in traffic(cfg, leaf, seed=17 + leaf):
        if item[0] is None:  # a burst of the parent's answers follows, in one batch
            if batch:
                run(batch)
            batch, size = [], 48
            continue
        batch.append(item)
        if len(batch) == size:
            run(batch)
            batch, size = [], int(rng.integers(1, 48))
    if batch:
        run(batch)
    ref = LeafAggregator(leaf, [cfg])
    for packet, parent, _ in traffic(cfg, leaf, seed=17 + leaf):  # the same traffic, to read the counters
        if packet is not None:
            ref.handle(packet, from_parent=parent)
    assert {c.name: int(engine.counters[c]) for c in Counter} == {c.name: ref.counters[c] for c in Counter}
    assert engine.tier_counters.tolist() == ref.tier_counters
    # the traffic exercised every kind of answer
    assert {(Dest.PARENT, PacketType.PARTIAL), (Dest.ALL, PacketType.RESULT), (Dest.SENDER, PacketType.RESULT),
            (Dest.SENDER, PacketType.STRAGGLER), (Dest.ALL, PacketType.STRAGGLER)} <= kinds, kinds
    assert ref.tier_counters[TierCounter.FORWARDED_AGAIN] and ref.tier_counters[TierCounter.STALE_PARENT]


def test_a_parent_packet_after_a_workers_packet_of_its_slot_sees_that_packet() -> None:
    """Within one batch: the last worker's DATA completes the round (the partial goes up), the parent's
    RESULT for it follows, and a resend after that gets the retained result; in reverse order the RESULT
    finds nothing FORWARDED (stale_parent)."""
    cfg = JOBS["thc"]
    rng = np.random.default_rng(1)
    packets = [request(cfg, w, 2, 0, rng) for w in range(3)]
    ref = LeafAggregator(0, [cfg])
    [(_, partial)] = [o for p in packets for o in ref.handle(p)]
    spine = SpineAggregator([cfg])
    spine.handle(partial)
    [(_, result)] = spine.handle(other_leaf(cfg, 1, partial, rng))
    for order, stale in (([0, 1, 2, "r", 1], 0), (["r", 0, 1, 2], 1)):
        engine = LeafEngine(0, [cfg])
        batch = [result if i == "r" else packets[i] for i in order]
        out = engine.process(*batch_of(batch, engine.engine.stride), np.array([i == "r" for i in order])).packets()
        assert engine.tier_counters[TierCounter.STALE_PARENT] == stale
        if not stale:
            assert [(d, Header.parse(p)[0].type) for d, p in out] == [
                (Dest.PARENT, PacketType.PARTIAL), (Dest.ALL, PacketType.RESULT), (Dest.SENDER, PacketType.RESULT)]


def test_a_leaf_engine_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(JobConfigError, match="not a two-tier job"):
        LeafEngine(0, [JobConfig(workers=4, elems=K)])
    with pytest.raises(JobConfigError, match=r"leaf 2 is not in 0\.\.1"):
        LeafEngine(2, [JOBS["thc"]])


def test_a_burst_of_the_parents_answers_is_applied_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common case, the parent's RESULTs and NORM_RESULTs for distinct banks in a batch of their own,
    goes through the vectorized path (the one-by-one one must not be called) and equals the reference:
    sums, norms, contributors and bitmaps stored, answers multicast, an answer for a bank that was never
    forwarded counted stale."""
    cfg = JobConfig(job=6, leaves=(3, 5), workers=8, elems=K, slots=8)
    rng = np.random.default_rng(3)
    ref, engine, spine = LeafAggregator(0, [cfg]), LeafEngine(0, [cfg]), SpineAggregator([cfg])
    results = []
    for slot in range(7):  # rounds 0 (DATA) and 3 (NORM) of slots 0..6; slot 7 never forwarded
        rnd = 3 if slot % 3 == 0 else 0
        for w in range(3):
            packet = request(cfg, w, slot, rnd, rng)
            outs = ref.handle(packet)
            assert sorted(engine.handle(packet)) == sorted(outs)
        [(_, partial)] = outs
        spine.handle(partial)
        results += [p for fan, p in spine.handle(other_leaf(cfg, 1, partial, rng)) if fan]
    stray = Header.parse(results[1])[0].replace(slot=7).pack(Header.parse(results[1])[1])
    batch = [*results, stray]
    monkeypatch.setattr(LeafEngine, "_parent", lambda *a: pytest.fail("the one-by-one path was taken"))
    got = engine.process(*batch_of(batch, engine.engine.stride), np.ones(len(batch), bool)).packets()
    want = [o for p in batch for o in ref.handle(p, from_parent=True)]
    assert sorted(got) == sorted(want) and len(want) == 7
    assert {Header.parse(p)[0].type for _, p in want} == {PacketType.RESULT, PacketType.NORM_RESULT}
    for slot in range(7):  # the retained answers: what the engine's banks now hold
        rnd = 3 if slot % 3 == 0 else 0
        packet = request(cfg, 1, slot, rnd, rng)
        assert engine.handle(packet) == ref.handle(packet)
    assert engine.tier_counters.tolist() == ref.tier_counters and engine.tier_counters[TierCounter.STALE_PARENT] == 1
    assert {c.name: int(engine.counters[c]) for c in Counter} == {c.name: ref.counters[c] for c in Counter}
