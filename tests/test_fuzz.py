"""Fuzzing the parser and the state machine with hypothesis.

- Random bytes never crash the batch engine and are all counted.
- Valid-but-hostile sequences match an independent, deliberately naive model of the state table
  (dicts and loops, written from docs/protocol.md): the reference (aggregator/state.py) and every path
  of the batch engine (aggregator/engine.py).
- Differential: the engine, fed in batches of any size, produces the reference's packets byte for
  byte, its counters, and its slot and bank state, on valid, damaged and truncated packets of a THC
  and an uncompressed job, sharded or not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.engine import Aggregator
from aggregator.state import ReferenceAggregator
from worker_lib.job import JobConfig
from worker_lib.wire import HEADER_BYTES, Header, PacketType, pack_bits
from worker_lib.wire.protocol import Counter

K = 8
CFG = JobConfig(job=4, key=0xABCD, workers=3, threshold=2, bits=2, granularity=10, table=(0, 2, 7, 10), slots=2,
                elems=K, result_bits=8)
OUTCOMES = (Counter.ACCEPTED, Counter.DUPLICATE, Counter.RETAINED, Counter.STRAGGLER, Counter.KIND_MISMATCH)


def _batch(wires: list[bytes], stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Datagrams as the server receives them: one per row of a (len, stride) buffer, and their lengths."""
    buf = np.zeros((len(wires), stride), np.uint8)
    for i, w in enumerate(wires):
        buf[i, :len(w)] = np.frombuffer(w, np.uint8)
    return buf, np.array([len(w) for w in wires])


@pytest.mark.parametrize("compiled", [False, True])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=80), min_size=1, max_size=40))
def test_random_bytes_never_crash_and_are_counted(compiled: bool, packets: list[bytes]) -> None:
    """Any datagrams: no exception, no output for garbage, and every packet lands in exactly one counter
    (both engines)."""
    agg = Aggregator([CFG], max_batch=64, compiled=compiled)
    agg.process(*_batch(packets, agg.stride))
    c = agg.counters
    from worker_lib.wire.protocol import DROP_COUNTERS

    assert c[Counter.RX] == len(packets)
    assert sum(int(c[d]) for d in DROP_COUNTERS) + sum(int(c[o]) for o in OUTCOMES) == len(packets)


def _model_step(state: dict, pkt: dict, threshold: int) -> list[tuple[bool, dict]]:
    """The state table, naively: state[(slot, bank)] = dict(round, kind, members, vals, done)."""
    values = list(CFG.table)
    s, r, w, t = pkt["slot"], pkt["round"], pkt["worker"], pkt["type"]
    b = r % 2
    cur = state.get(("cur", s))
    bank = state.get((s, b))
    newer = cur is None or 0 < (r - cur) % 65536 < 32768
    contrib = [values[i] for i in pkt["indices"]] if t == PacketType.DATA else [pkt["norm_bits"]]
    if newer:
        state[("cur", s)] = r
        bank = state[(s, b)] = {"round": r, "kind": t, "members": [w], "vals": contrib, "done": False}
    elif bank is not None and bank["round"] == r:
        if bank["kind"] != t:
            return []
        if bank["done"]:
            return [(False, bank)]
        if w in bank["members"]:
            return []
        bank["members"].append(w)
        if t == PacketType.DATA:
            bank["vals"] = [a + c for a, c in zip(bank["vals"], contrib, strict=True)]
        else:
            bank["vals"] = [max(bank["vals"][0], contrib[0])]
    else:
        return [(False, {"straggler": state[("cur", s)]})]
    if len(bank["members"]) >= threshold:
        bank["done"] = True
        return [(True, bank)]
    return []


packet = st.fixed_dictionaries({
    "type": st.sampled_from([PacketType.DATA, PacketType.DATA, PacketType.NORM]),
    "worker": st.integers(0, CFG.workers - 1),
    "slot": st.integers(0, CFG.slots - 1),
    "round": st.sampled_from([0, 1, 2, 3, 65534, 65535, 32768]),
    "indices": st.lists(st.integers(0, 3), min_size=K, max_size=K),
    "norm_bits": st.integers(0, 0x7F7FFFFF),
})


# The engine's paths: packet-at-a-time checks and state table; vectorized checks, then slot groups
# wherever possible; vectorized checks with the state table packet by packet; vectorized checks with
# the compiled state table (aggregator/compiled.py). None: the reference.
PATHS = [{"scalar_below": 1000}, {"scalar_below": 0, "group_min": 1}, {"scalar_below": 0, "group_min": 1000},
         {"compiled": True}, None]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(packet, min_size=1, max_size=40), st.integers(1, 16), st.sampled_from([2, 3]), st.sampled_from(PATHS))
def test_hostile_sequences_match_naive_model(pkts: list[dict], batch: int, threshold: int, path: dict) -> None:
    """Valid packets in any order (duplicates, old and new rounds, wraparound, mixed kinds), processed
    in batches of any size, under a partial and a full threshold, produce exactly the model's packets
    (each caused by the same packet as in the model), in the reference and on every engine path."""
    _check_against_model(pkts, batch, threshold, path)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 16), st.sampled_from([2, 3]), st.floats(0, 0.3),
       st.sampled_from(PATHS))
def test_workerlike_traffic_matches_naive_model(seed: int, batch: int, threshold: int, mess: float,
                                                path: dict) -> None:
    """Traffic shaped like real workers' (every worker sends every slot of successive rounds, norms
    first, near wraparound), locally reordered, with a fraction ``mess`` of packets dropped or
    duplicated: the common case the aggregator takes in whole-slot groups, and its edges."""
    rng = np.random.default_rng(seed)
    pkts = []
    for use in range(-4, 4):  # each use of a slot advances its round; a norm stage, then a data stage
        kind = PacketType.NORM if use % 2 == 0 else PacketType.DATA
        for w in rng.permutation(CFG.workers).tolist():
            for s in range(CFG.slots):
                p = {"type": kind, "worker": w, "slot": s, "round": use & 0xFFFF,
                     "indices": rng.integers(0, 4, K).tolist(), "norm_bits": int(rng.integers(0, 0x7F7FFFFF))}
                u = rng.random()
                if u < mess / 2:
                    continue
                pkts.extend([p, p] if u < mess else [p])
    order = np.argsort(np.arange(len(pkts)) + rng.uniform(0, 4, len(pkts)))  # local reordering
    _check_against_model([pkts[i] for i in order], batch, threshold, path)


def _check_against_model(pkts: list[dict], batch: int, threshold: int, path: dict | None) -> None:
    """Feed ``pkts`` to the engine on ``path`` in batches of ``batch`` (or, with ``path`` None, to the
    reference one by one) and compare every output with the naive model's."""
    cfg = dataclasses.replace(CFG, threshold=threshold)
    if path is None:
        agg = _ReferenceBatches(ReferenceAggregator([cfg]))
    else:
        agg = Aggregator([cfg], max_batch=16, **path)
    model: dict = {}
    wires = [_wire(p) for p in pkts]
    for start in range(0, len(pkts), batch):
        res = agg.process(*_batch(wires[start:start + batch], agg.stride))
        # Each packet causes at most one output; slots are independent, so outputs are matched to the
        # packet that caused them rather than by position.
        got = {int(res.src[m]): pkt for m, pkt in enumerate(res.packets())}
        assert len(got) == res.count
        expect = {i: e for i, p in enumerate(pkts[start:start + batch]) for e in _model_step(model, p, threshold)}
        assert sorted(got) == sorted(expect)
        for i, (fan, data) in got.items():
            efan, ebank = expect[i]
            hdr, payload = Header.parse(data)
            assert fan == efan
            if "straggler" in ebank:
                assert hdr.type == PacketType.STRAGGLER and hdr.round == ebank["straggler"]
                continue
            assert hdr.round == ebank["round"] and hdr.contributors == len(ebank["members"])
            assert hdr.bitmap == sum(1 << m for m in ebank["members"])
            if ebank["kind"] == PacketType.DATA:
                assert hdr.type == PacketType.RESULT and list(payload) == ebank["vals"]
            else:
                assert hdr.type == PacketType.NORM_RESULT and int.from_bytes(payload, "big") == ebank["vals"][0]


def _wire(p: dict) -> bytes:
    if p["type"] == PacketType.DATA:
        payload = pack_bits(np.array(p["indices"]), CFG.bits).tobytes()
    else:
        payload = p["norm_bits"].to_bytes(4, "big")
    return Header(**CFG.request_fields(p["type"], worker=p["worker"], slot=p["slot"], round=p["round"])).pack(payload)


# Up to three byte writes (header fields, norm bytes, payload) or a truncation: two wrong fields at
# once test the order of the checks, 0x7F/0x80/0xFF make negative, infinite and NaN norms.
_pos = st.one_of(st.integers(0, HEADER_BYTES + 3), st.integers(0, 45))
_byte = st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]) | st.integers(0, 255)
damage = st.one_of(st.none(), st.lists(st.tuples(_pos, _byte), min_size=1, max_size=3), st.integers(0, 44),
                   st.sampled_from(["inf", "negative"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(packet, damage), min_size=1, max_size=24))
def test_scalar_and_vectorized_paths_agree(items: list) -> None:
    """Valid packets, some with one byte changed (any header field, or the norm) or cut short: the
    packet-at-a-time validation of small batches and the vectorized one drop the same packets for the
    same reasons and produce the same outputs."""
    wires = [_damaged(_wire(p), dmg) for p, dmg in items]
    scalar = Aggregator([CFG], max_batch=32, scalar_below=1000)
    vector = Aggregator([CFG], max_batch=32, scalar_below=0, group_min=1)
    buf, lengths = _batch(wires, scalar.stride)
    got_s = scalar.process(buf, lengths)
    out_s = sorted(zip(got_s.src[:got_s.count].tolist(), got_s.packets(), strict=True))
    got_v = vector.process(buf, lengths)
    out_v = sorted(zip(got_v.src[:got_v.count].tolist(), got_v.packets(), strict=True))
    assert np.array_equal(scalar.counters, vector.counters)
    assert out_s == out_v
    assert np.array_equal(scalar.last_good, vector.last_good)


class _Results:
    """The engine's ``Outputs`` interface (``src``, ``count``, ``packets()``) over the reference's outputs."""

    def __init__(self, outputs: list[tuple[int, tuple[bool, bytes]]]) -> None:
        self.src = np.array([i for i, _ in outputs], np.int64)
        self.count = len(outputs)
        self._packets = [o for _, o in outputs]

    def packets(self) -> list[tuple[bool, bytes]]:
        return self._packets


class _ReferenceBatches:
    """The reference fed a batch buffer one packet at a time, answering like ``Aggregator.process``."""

    def __init__(self, ref: ReferenceAggregator) -> None:
        self.ref, self.stride = ref, 256

    def process(self, buf: np.ndarray, lengths: np.ndarray) -> _Results:
        return _Results([(i, o) for i, n in enumerate(lengths) for o in self.ref.handle(buf[i, :n].tobytes())])


UNCOMPRESSED = JobConfig(job=9, key=0x5EED, workers=3, threshold=2, kind="uncompressed", slots=2, elems=K)


def _uncompressed_wire(p: dict) -> bytes:
    """``p`` as a packet of the uncompressed job: DATA carries K int32 values (from its indices and norm)."""
    if p["type"] == PacketType.DATA:
        ints = (np.array(p["indices"], np.int64) - 2) * (p["norm_bits"] | 1) * 1021  # large, both signs: wraps
        payload = ints.astype(np.int32).astype(">i4").tobytes()
    else:
        payload = p["norm_bits"].to_bytes(4, "big")
    fields = UNCOMPRESSED.request_fields(p["type"], worker=p["worker"], slot=p["slot"], round=p["round"])
    return Header(**fields).pack(payload)


def _damaged(wire: bytes, dmg: object) -> bytes:
    """A packet with ``dmg`` applied: byte writes, a truncation, or an infinite/NaN or negative norm."""
    w = bytearray(wire)
    if isinstance(dmg, list):
        for pos, value in dmg:
            w[pos % len(w)] = value
    elif isinstance(dmg, int):
        w = w[:dmg]
    elif dmg == "inf":  # exponent all ones: an infinite or NaN norm (or payload bytes of a DATA packet)
        w[HEADER_BYTES] |= 0x7F
        w[HEADER_BYTES + 1] |= 0x80
    elif dmg == "negative":
        w[HEADER_BYTES] |= 0x80
    return bytes(w)


def _assert_same_state(engine: Aggregator, ref: ReferenceAggregator) -> None:
    """Every slot and bank of every job holds the same state in the engine as in the reference."""
    for j, job in ref.jobs.items():
        js = engine.jobs[j]
        for s, slot in enumerate(job.slots):
            assert bool(js.used[s]) == slot.used
            if slot.used:
                assert int(js.cur_round[s]) == slot.round
            for b, bank in enumerate(slot.banks):
                i = 2 * s + b
                if bank.round is None:
                    assert js.bank_round[i] < 0
                    continue
                assert (int(js.bank_round[i]), int(js.kind[i]), int(js.bitmap[i]), int(js.count[i]),
                        bool(js.complete[i])) == (bank.round, bank.kind, bank.bitmap, bank.count, bank.complete)
                if bank.kind == PacketType.NORM:
                    assert int(js.norm[i]) == bank.norm
                else:
                    # the compiled engine's narrow banks hold the low bits of the sums (aggregator.engine.bank_dtype)
                    assert np.array_equal(js.sums[s, b], bank.sums.astype(js.sums.dtype))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(packet, damage, st.booleans()), min_size=1, max_size=48), st.integers(1, 20),
       st.sampled_from(PATHS[:4]), st.sampled_from([(0, 1), (1, 2)]))
def test_engine_matches_reference(items: list, batch: int, path: dict, shard: tuple[int, int]) -> None:
    """The batch engine is the reference, faster: for packets of a THC and an uncompressed job (valid,
    damaged, truncated; duplicates, stale and new rounds, wraparound, both kinds), fed in batches of
    any size on any engine path, under sharding or not, it sends the reference's packets byte for byte
    (each caused by the same packet), counts the same, and leaves every slot and bank as the reference
    does."""
    _check_engine_against_reference(items, batch, path, shard)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(packet, damage, st.booleans()), min_size=1, max_size=48), st.integers(1, 32),
       st.sampled_from([(0, 1), (1, 2)]))
def test_compiled_engine_matches_reference(items: list, batch: int, shard: tuple[int, int]) -> None:
    """The compiled state table (aggregator/compiled.py) alone, on the same packets: the reference's bytes,
    counters and registers."""
    _check_engine_against_reference(items, batch, {"compiled": True}, shard)


def _check_engine_against_reference(items: list, batch: int, path: dict, shard: tuple[int, int]) -> None:
    wires = [_damaged(_wire(p) if thc else _uncompressed_wire(p), dmg) for p, dmg, thc in items]
    jobs = [CFG, UNCOMPRESSED]
    ref = ReferenceAggregator(jobs, shard=shard[0], shards=shard[1])
    engine = Aggregator(jobs, max_batch=32, shard=shard[0], shards=shard[1], **path)
    for start in range(0, len(wires), batch):
        chunk = wires[start:start + batch]
        res = engine.process(*_batch(chunk, engine.stride))
        got = sorted(zip(res.src[:res.count].tolist(), res.packets(), strict=True))
        want = [(i, o) for i, w in enumerate(chunk) for o in ref.handle(w)]
        assert got == want
    assert engine.counters.tolist() == ref.counters
    _assert_same_state(engine, ref)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(0, 2**32 - 1), st.integers(1, 40))
def test_compiled_lookup_of_every_index_width(bits: int, seed: int, count: int) -> None:
    """b = 1..8 (the compiled loop has its own code for 2, 4 and 8 bits and a bit window for the rest):
    the same results, counters and sums as the numpy engine, for packets of random indices and rounds."""
    g = max(30, (1 << bits) - 1)
    cfg = JobConfig(job=2, key=5, workers=2, threshold=2, bits=bits, granularity=g, slots=2, elems=16,
                    result_bits=16)
    rng = np.random.default_rng(seed)
    wires = [Header(**cfg.request_fields(PacketType.DATA, worker=int(rng.integers(2)), slot=int(rng.integers(2)),
                                         round=int(rng.integers(3))))
             .pack(pack_bits(rng.integers(0, 1 << bits, cfg.elems).astype(np.uint8), bits).tobytes())
             for _ in range(count)]
    numpy_engine, compiled = Aggregator([cfg], max_batch=64), Aggregator([cfg], max_batch=64, compiled=True)
    for agg in (numpy_engine, compiled):
        agg.process(*_batch(wires, agg.stride))
    assert sorted(compiled.out.packets()) == sorted(numpy_engine.out.packets())
    assert compiled.counters.tolist() == numpy_engine.counters.tolist()
    assert compiled.jobs[2].sums.dtype == np.uint16  # result_bits 16: the compiled engine's narrow banks
    assert np.array_equal(compiled.jobs[2].sums, numpy_engine.jobs[2].sums.astype(np.uint16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 60), st.integers(1, 16), st.sampled_from([8, 16]))
def test_compiled_byte_pairs_into_narrow_banks_match_reference(seed: int, count: int, batch: int,
                                                               result_bits: int) -> None:
    """4-bit indices go a byte at a time into the compiled engine's narrow banks, two registers per word
    (aggregator.compiled, aggregator.engine.bank_dtype): the reference's bytes, counters and registers, for
    packets of random workers, rounds and indices (mostly the top index, so that 8 workers' sums reach the
    job's largest, 8 x 30 = 240, and no carry may cross into the next register unseen)."""
    cfg = JobConfig(job=3, key=9, workers=8, threshold=8, bits=4, granularity=30, slots=2, elems=16,
                    result_bits=result_bits)
    rng = np.random.default_rng(seed)
    wires = [Header(**cfg.request_fields(PacketType.DATA, worker=int(rng.integers(8)), slot=int(rng.integers(2)),
                                         round=int(rng.integers(2))))
             .pack(pack_bits(np.where(rng.random(cfg.elems) < 0.7, 15, rng.integers(0, 16, cfg.elems))
                             .astype(np.uint8), 4).tobytes())
             for _ in range(count)]
    ref, engine = ReferenceAggregator([cfg]), Aggregator([cfg], max_batch=16, compiled=True)
    assert engine.jobs[3].sums.dtype == (np.uint8 if result_bits == 8 else np.uint16)
    for start in range(0, count, batch):
        chunk = wires[start:start + batch]
        res = engine.process(*_batch(chunk, engine.stride))
        got = sorted(zip(res.src[:res.count].tolist(), res.packets(), strict=True))
        assert got == [(i, o) for i, w in enumerate(chunk) for o in ref.handle(w)]
    assert engine.counters.tolist() == ref.counters
    _assert_same_state(engine, ref)
