"""Fuzzing the parser and the state machine with hypothesis: random bytes never crash it and are
all counted; valid-but-hostile sequences match an independent, deliberately naive model of the
state table (dicts and loops, written from docs/protocol.md)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.engine import Aggregator
from worker_lib.job import JobConfig
from worker_lib.wire import HEADER_BYTES, Header, PacketType, pack_indices_np
from worker_lib.wire.protocol import Counter

K = 8
CFG = JobConfig(job=4, key=0xABCD, workers=3, threshold=2, bits=2, granularity=10, table=(0, 2, 7, 10), slots=2,
                elems=K, result_bits=8)
OUTCOMES = (Counter.ACCEPTED, Counter.DUPLICATE, Counter.RETAINED, Counter.STRAGGLER, Counter.KIND_MISMATCH)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=80), min_size=1, max_size=40))
def test_random_bytes_never_crash_and_are_counted(packets: list[bytes]) -> None:
    """Any datagrams: no exception, no output for garbage, and every packet lands in exactly one counter."""
    agg = Aggregator([CFG], max_batch=64)
    stride = agg.stride
    buf = np.zeros((len(packets), stride), np.uint8)
    for i, p in enumerate(packets):
        buf[i, : len(p)] = np.frombuffer(p, np.uint8)
    agg.process(buf, np.array([len(p) for p in packets]))
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


# The aggregator's paths: packet-at-a-time checks and state table; vectorized checks, then slot groups
# wherever possible; vectorized checks with the state table packet by packet.
PATHS = [{"scalar_below": 1000}, {"scalar_below": 0, "group_min": 1}, {"scalar_below": 0, "group_min": 1000}]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(packet, min_size=1, max_size=40), st.integers(1, 16), st.sampled_from([2, 3]), st.sampled_from(PATHS))
def test_hostile_sequences_match_naive_model(pkts: list[dict], batch: int, threshold: int, path: dict) -> None:
    """Valid packets in any order (duplicates, old and new rounds, wraparound, mixed kinds), processed
    in batches of any size, under a partial and a full threshold, produce exactly the model's packets
    (each caused by the same packet as in the model), whichever path the aggregator takes."""
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


def _check_against_model(pkts: list[dict], batch: int, threshold: int, path: dict) -> None:
    agg = Aggregator([dataclasses.replace(CFG, threshold=threshold)], max_batch=16, **path)
    model: dict = {}
    wires = []
    for p in pkts:
        if p["type"] == PacketType.DATA:
            payload = pack_indices_np(np.array(p["indices"]), CFG.bits).tobytes()
            fields = {"elems": K, "width": CFG.bits}
        else:
            payload = p["norm_bits"].to_bytes(4, "big")
            fields = {"elems": 1, "width": 32}
        wires.append(Header(type=p["type"], job=CFG.job, key=CFG.key, table_id=CFG.table_id, worker=p["worker"],
                            slot=p["slot"], round=p["round"], **fields).pack(payload))
    for start in range(0, len(pkts), batch):
        chunk = wires[start:start + batch]
        buf = np.zeros((len(chunk), agg.stride), np.uint8)
        for i, wbytes in enumerate(chunk):
            buf[i, : len(wbytes)] = np.frombuffer(wbytes, np.uint8)
        res = agg.process(buf, np.array([len(x) for x in chunk]))
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
        payload, fields = pack_indices_np(np.array(p["indices"]), CFG.bits).tobytes(), {"elems": K, "width": CFG.bits}
    else:
        payload, fields = p["norm_bits"].to_bytes(4, "big"), {"elems": 1, "width": 32}
    return Header(type=p["type"], job=CFG.job, key=CFG.key, table_id=CFG.table_id, worker=p["worker"], slot=p["slot"],
                  round=p["round"], **fields).pack(payload)


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
    wires = []
    for p, dmg in items:
        w = bytearray(_wire(p))
        if isinstance(dmg, list):
            for pos, value in dmg:
                w[pos % len(w)] = value
        elif isinstance(dmg, int):
            w = w[:dmg]
        elif dmg == "inf":  # exponent all ones: an infinite or NaN norm (or payload byte of a DATA packet)
            w[HEADER_BYTES] |= 0x7F
            w[HEADER_BYTES + 1] |= 0x80
        elif dmg == "negative":
            w[HEADER_BYTES] |= 0x80
        wires.append(bytes(w))
    scalar = Aggregator([CFG], max_batch=32, scalar_below=1000)
    vector = Aggregator([CFG], max_batch=32, scalar_below=0, group_min=1)
    buf = np.zeros((len(wires), scalar.stride), np.uint8)
    for i, wb in enumerate(wires):
        buf[i, : len(wb)] = np.frombuffer(wb, np.uint8)
    lengths = np.array([len(wb) for wb in wires])
    got_s = scalar.process(buf, lengths)
    out_s = sorted(zip(got_s.src[:got_s.count].tolist(), got_s.packets(), strict=True))
    got_v = vector.process(buf, lengths)
    out_v = sorted(zip(got_v.src[:got_v.count].tolist(), got_v.packets(), strict=True))
    assert np.array_equal(scalar.counters, vector.counters)
    assert out_s == out_v
    assert np.array_equal(scalar.last_good, vector.last_good)
