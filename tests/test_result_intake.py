"""The worker's compiled intake of RESULT batches (worker_lib.result_intake) against a per-datagram
reference written here from docs/protocol.md's header layout, and the transport's two intake paths
(compiled, and numpy for batches with a straggler notice) against each other on loopback."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import worker_lib.transport as transport_mod
from tests.test_transport import oracle, random_indices, run_workers, serving
from worker_lib.job import JobConfig
from worker_lib.result_intake import foreign_chunk, has_notice, take_results

# version, type, job, key, table_id, worker, contributors, slot, round, tensor, chunk, elems, width, flags, bitmap
HEADER = struct.Struct(">BBHIHBBHHIIHBBI")
RESULT, STRAGGLER = 2, 5
JOB, KEY, SLOTS, ELEMS = 7, 0xC0FFEE01, 16, 8


def datagram(*, typ: int = RESULT, job: int = JOB, key: int = KEY, slot: int = 0, rnd: int = 0, elems: int = ELEMS,
             width: int = 8, contributors: int = 2, bitmap: int = 3, values: list[int] | None = None,
             length: int | None = None) -> bytes:
    values = list(range(elems)) if values is None else values
    code = {8: "B", 16: "H", 32: "I"}[width]
    payload = struct.pack(f">{len(values)}{code}", *values)
    head = HEADER.pack(1, typ, job, key, 0, 0, contributors, slot, rnd, 0, 0, elems, width, 0, bitmap)
    data = head + payload
    return data if length is None else (data + bytes(max(0, length - len(data))))[:length]


def batch(packets: list[bytes], stride: int = 256) -> tuple[np.ndarray, np.ndarray]:
    rows = np.zeros((len(packets), stride), np.uint8)
    for i, p in enumerate(packets):
        rows[i, :len(p)] = np.frombuffer(p, np.uint8)
    return rows, np.array([len(p) for p in packets], np.int64)


class State:
    """The open uses of an exchange: use u sits in slot u % SLOTS with round rounds[u]."""

    def __init__(self, uses: int, open_: list[int], width: int, signed: bool = False) -> None:
        self.rounds = np.arange(uses, dtype=np.int64) // SLOTS + 3
        self.use_of_slot = np.full(SLOTS, -1, np.int64)
        self.use_of_slot[np.array(open_, np.int64) % SLOTS] = open_
        self.done = np.zeros(uses, bool)
        wide = width == 32 and not signed
        self.sums = np.zeros((uses, ELEMS), np.int64 if wide else np.int32)
        self.contrib = np.zeros(uses, np.int64)
        self.bitmap = np.zeros(uses, np.int64)
        self.width, self.signed = width, signed

    def take(self, rows: np.ndarray, lens: np.ndarray) -> tuple[int, int, int, list[int]]:
        finished = np.empty(len(rows), np.int64)
        taken, pending, unexpected = take_results(rows, lens, JOB, KEY, self.use_of_slot, self.done, self.rounds,
                                                  RESULT, ELEMS, self.width, self.signed, self.sums, self.contrib,
                                                  self.bitmap, finished)
        return taken, pending, unexpected, finished[:taken].tolist()


def test_answers_are_stored_and_everything_else_is_unexpected() -> None:
    st = State(40, open_=[16, 17, 18, 19, 20, 21], width=8)
    good = datagram(slot=0, rnd=4, values=[9, 8, 7, 6, 5, 4, 3, 255], contributors=2, bitmap=0b11)
    packets = [
        good,                                  # use 16: taken
        datagram(slot=0, rnd=4),               # use 16 again in the same batch: unexpected, not pending
        datagram(slot=1, rnd=4, job=JOB + 1),  # another job
        datagram(slot=1, rnd=4, key=KEY ^ 1),  # wrong key
        datagram(slot=SLOTS, rnd=4),           # slot out of range
        datagram(slot=9, rnd=4),               # slot with no open use
        datagram(slot=1, rnd=5),               # stale or future round: unexpected, not pending
        datagram(slot=2, rnd=4, typ=4),        # not a RESULT
        datagram(slot=3, rnd=4, elems=4, values=[1, 2, 3, 4]),  # another K
        datagram(slot=4, rnd=4, width=16),     # another width
        datagram(slot=5, rnd=4, length=HEADER.size + ELEMS - 1),  # truncated payload
        good[:20],                             # shorter than a header
        datagram(slot=1, rnd=4, values=[1] * ELEMS, contributors=1, bitmap=0b10),  # use 17: taken
    ]
    taken, pending, unexpected, finished = st.take(*batch(packets))
    assert (taken, pending, unexpected) == (2, 6, 11)
    assert finished == [16, 17]
    assert st.sums[16].tolist() == [9, 8, 7, 6, 5, 4, 3, 255]
    assert st.sums[17].tolist() == [1] * ELEMS
    assert (st.contrib[16], st.bitmap[16], st.contrib[17], st.bitmap[17]) == (2, 3, 1, 2)
    assert st.done.nonzero()[0].tolist() == [16, 17]
    assert st.use_of_slot[:2].tolist() == [-1, -1] and st.use_of_slot[2] == 18
    assert not st.sums[18:].any()  # the rejected answers wrote nothing


@pytest.mark.parametrize(("width", "signed", "values", "expect"), [
    (16, False, [0, 1, 0xFFFF, 0x1234, 5, 6, 7, 8], [0, 1, 65535, 4660, 5, 6, 7, 8]),
    (32, False, [0, 0xFFFFFFFF, 0x80000000, 3, 4, 5, 6, 7], [0, 4294967295, 2147483648, 3, 4, 5, 6, 7]),
    (32, True, [0, 0xFFFFFFFF, 0x80000000, 3, 4, 5, 6, 7], [0, -1, -2147483648, 3, 4, 5, 6, 7]),
])
def test_wide_results_are_read_big_endian(width: int, signed: bool, values: list[int], expect: list[int]) -> None:
    st = State(4, open_=[2], width=width, signed=signed)
    taken, pending, unexpected, finished = st.take(*batch([datagram(slot=2, rnd=3, width=width, values=values)]))
    assert (taken, pending, unexpected, finished) == (1, 1, 0, [2])
    assert st.sums[2].tolist() == expect


def reference(st: State, packets: list[bytes]) -> tuple[tuple[int, int, int, list[int]], dict[int, tuple]]:
    """docs/protocol.md's rules for a worker, one datagram at a time, as plain Python over a copy; and per
    answered use its (values, contributors, bitmap)."""
    taken = pending = unexpected = 0
    finished: list[int] = []
    stored: dict[int, tuple] = {}
    use_of_slot, done = st.use_of_slot.copy(), st.done.copy()
    for p in packets:
        if len(p) < HEADER.size:
            unexpected += 1
            continue
        (_v, typ, job, key, _t, _w, contributors, slot, rnd, _tn, _c, elems, width, _f, bitmap) = \
            HEADER.unpack_from(p)
        if job != JOB or key != KEY or slot >= SLOTS or use_of_slot[slot] < 0 or done[use_of_slot[slot]] or \
                rnd != st.rounds[use_of_slot[slot]]:
            unexpected += 1
            continue
        use = int(use_of_slot[slot])
        pending += 1
        if typ != RESULT or elems != ELEMS or width != st.width or \
                len(p) != HEADER.size + ELEMS * width // 8:
            unexpected += 1
            continue
        done[use], use_of_slot[slot] = True, -1
        finished.append(use)
        stored[use] = (list(p[HEADER.size:]), contributors, bitmap)
        taken += 1
    return (taken, pending, unexpected, finished), stored


def test_random_batches_match_the_reference() -> None:
    rng = np.random.default_rng(5)
    for trial in range(300):
        uses = int(rng.integers(SLOTS, 3 * SLOTS))
        first = int(rng.integers(0, uses - SLOTS + 1))
        open_ = [u for u in range(first, first + SLOTS) if rng.random() < 0.7]
        st = State(uses, open_=open_, width=8)
        if open_:  # some answered in an earlier batch
            st.done[rng.choice(open_, size=len(open_) // 4, replace=False)] = True
        packets = []
        for _ in range(int(rng.integers(1, 40))):
            use = int(rng.integers(max(0, first - 2), min(uses, first + SLOTS + 2)))
            fields = dict(slot=use % SLOTS, rnd=int(st.rounds[use]), values=rng.integers(0, 256, ELEMS).tolist())
            flaw = int(rng.integers(0, 12))
            if flaw == 1:
                fields["rnd"] += 1
            elif flaw == 2:
                fields["typ"] = int(rng.integers(0, 10))
            elif flaw == 3:
                fields["length"] = int(rng.integers(0, HEADER.size + ELEMS + 4))
            elif flaw == 4:
                fields["key"] = KEY ^ int(rng.integers(1, 1 << 32))
            elif flaw == 5:
                fields["slot"] = int(rng.integers(0, 1 << 16))
            elif flaw == 6:
                fields["contributors"], fields["bitmap"] = int(rng.integers(0, 33)), int(rng.integers(0, 1 << 32))
            packets.append(datagram(**fields))
        expect, stored = reference(st, packets)
        before = st.sums.copy()
        got = st.take(*batch(packets))
        assert got == expect, f"trial {trial}"
        changed = np.flatnonzero((st.sums != before).any(axis=1))
        assert set(changed.tolist()) <= set(got[3]), f"trial {trial}: a rejected datagram wrote sums"
        for use, (values, contributors, bitmap) in stored.items():
            assert (st.sums[use].tolist(), st.contrib[use], st.bitmap[use]) == (values, contributors, bitmap)


def test_a_notice_in_the_batch_is_seen() -> None:
    rows, lens = batch([datagram(slot=1), datagram(typ=STRAGGLER, slot=2)[:HEADER.size]])
    assert has_notice(rows, lens)
    assert not has_notice(rows[:1], lens[:1])
    lens[1] = HEADER.size - 1  # a notice too short to be a header is not one
    assert not has_notice(rows, lens)


def test_transport_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same lossy exchange with the compiled intake and with the numpy path (forced by making every
    batch look as if it held a notice) gives the same sums, counts and bitmaps: the lookup sums."""
    cfg = JobConfig(workers=2, slots=64, elems=64)
    indices = random_indices(cfg, chunks=300, seed=2)
    outs = []
    for numpy_path in (False, True):
        if numpy_path:
            monkeypatch.setattr(transport_mod, "has_notice", lambda rows, lens: True)
        with serving(cfg) as srv:
            res, trs = run_workers(srv, cfg, indices, drop_up=0.05, drop_down=0.05, timeout=0.02, seed=4)
        outs.append(res)
        assert all(tr.stats.results == 300 for tr in trs)
    want = oracle(cfg, indices, [0, 1])
    for a, b in zip(*outs, strict=True):
        assert np.array_equal(a.sums, want) and np.array_equal(b.sums, want)
        assert a.contributors.tolist() == b.contributors.tolist() == [2] * 300
        assert a.bitmap.tolist() == b.bitmap.tolist() == [3] * 300


def test_foreign_chunk_finds_a_result_without_this_workers_share() -> None:
    """Two workers' sums hold each worker's table value and at most one other: no chunk is foreign to either;
    a chunk of other indices is (the first such chunk is named); chunks lost or without this worker's bit
    are not checked; the bounds T[own] <= sum <= T[own] + (contributors - 1) * max T hold exactly."""
    values = JobConfig().values()
    rng = np.random.default_rng(5)
    k, chunks = 64, 4
    own = rng.integers(0, len(values), chunks * k - 5).astype(np.uint8)  # the last 5 coordinates are padding
    other = rng.integers(0, len(values), chunks * k).astype(np.uint8)
    padded = np.concatenate([own, np.zeros(5, np.uint8)])
    sums = (values[padded].astype(np.int64) + values[other]).reshape(chunks, k).astype(np.uint8)
    contrib, bitmap, lost = np.full(chunks, 2), np.full(chunks, 0b11), np.zeros(chunks, bool)

    def first(s: np.ndarray, mine: np.ndarray = own, worker: int = 0, probe: int = k, b: np.ndarray = bitmap,
              c: np.ndarray = contrib, gone: np.ndarray = lost) -> int:
        return foreign_chunk(s, c, b, gone, mine, values, worker, probe)

    assert first(sums) == -1 and first(sums, other, worker=1) == -1
    stale = sums.copy()
    stale[2] = (values[rng.integers(0, len(values), k)] + values[rng.integers(0, len(values), k)]).astype(np.uint8)
    stale[3] = stale[2]
    assert first(stale) == 2
    assert first(stale, b=np.array([0b11, 0b11, 0b10, 0b10])) == -1  # not counted in those chunks
    assert first(stale, gone=np.array([False, False, True, True])) == -1
    one = values[padded].astype(np.int64).reshape(chunks, k)  # a result of this worker alone
    ones = np.ones(chunks, np.int64)
    assert first(one.astype(np.uint8), c=ones, b=np.full(chunks, 0b01)) == -1
    low, high = one.copy(), one + int(values.max())
    low[1, 7] -= 1 if low[1, 7] > 0 else -1000  # below T[own] (or, where that is 0, far above it)
    assert first(low, c=ones, b=np.full(chunks, 0b01)) == 1
    assert first(high, c=np.full(chunks, 2)) == -1  # one other worker at max T: the upper bound itself
    high[3, 0] += 1
    assert first(high, c=np.full(chunks, 2)) == 3
    assert first(high, c=np.full(chunks, 2), probe=0) == -1  # nothing probed
