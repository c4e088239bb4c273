"""Worker transport against a real aggregator server on loopback: served from a thread here, so that its
counters can be read, or, for the tests that time resends, from a process of its own (``serving_apart``);
tests/test_allreduce.py runs separate processes throughout. The tests of one recovery mechanism (RACK, probes,
copies, runs) that count a use's sends turn tail duplicates off (``tail_duplicates=0``): those send an
exchange's last uses twice."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregator.control import ControlAddress, send_command
from aggregator.server import AggregatorServer, ServerConfig
from launchers.aggregator_process import local_aggregator
from tests.transport_support import opened_runs
from worker_lib import pacing
from worker_lib.allreduce import THCAllreduce
from worker_lib.job import JobConfig
from worker_lib.pacing import PROBE_USES, TAIL_DUPLICATES, Pacer
from worker_lib.thc import SignKey, THCCodec, THCConfig, THCWorker, lookup_sum
from worker_lib.transport import (
    AggregatorStateError,
    AggregatorUnreachable,
    Transport,
    TransportConfig,
    TransportStats,
    UseResults,
    run_nonce,
)
from worker_lib.udp_offload import gso_available
from worker_lib.wire import Header
from worker_lib.wire.layout import PacketType
from worker_lib.wire.protocol import Counter

# Timeouts of a fraction of a second, and what was resent before them: alone, not beside another test.
pytestmark = pytest.mark.alone

K = 64


@contextlib.contextmanager
def serving(*jobs: JobConfig, shards: int = 1, multicast: bool = False) -> Iterator[AggregatorServer]:
    """An aggregator on a free loopback port, served from a thread (its counters can be read), stopped and
    joined at the end. The tests that time resends use ``serving_apart``."""
    srv = AggregatorServer(ServerConfig(port=0, jobs=list(jobs), shards=shards, poll_timeout=0.01,
                                        multicast=multicast), out=lambda s: None)
    th = threading.Thread(target=srv.serve, name="aggregator", daemon=True)
    th.start()
    try:
        yield srv
    finally:
        srv.stop()
        th.join(timeout=10)
        assert not th.is_alive(), "the aggregator did not stop"


@contextlib.contextmanager
def serving_apart(*jobs: JobConfig) -> Iterator[int]:
    """An aggregator in a process of its own (``thc-aggregator``) on a free loopback port; yields the port.
    For the tests that time resends: served from a thread of this process, the aggregator waited for the
    GIL behind the workers' threads (up to the 5 ms switch interval at a time), and on a busy machine its
    answers came late enough to read as losses or stalls."""
    with local_aggregator(list(jobs)) as (_, port):
        yield port


def run_workers(srv: AggregatorServer, cfg: JobConfig, indices: list[np.ndarray], *, workers: list[int] | None = None,
                **kw: object) -> tuple[list[UseResults], list[Transport]]:
    """Each listed worker exchanges its indices in its own thread; returns results and transports."""
    ids = list(range(cfg.workers)) if workers is None else workers
    trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port),
                                     shards=srv.cfg.shards, **kw)) for w in ids]
    out: list[UseResults | BaseException | None] = [None] * len(ids)

    def go(k: int) -> None:
        try:
            out[k] = trs[k].exchange_indices(indices[ids[k]])
        except BaseException as exc:  # surfaced below
            out[k] = exc

    ths = [threading.Thread(target=go, args=(k,)) for k in range(len(ids))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=60)
    for tr in trs:
        tr.close()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out, trs  # type: ignore[return-value]


def oracle(cfg: JobConfig, indices: list[np.ndarray], members: list[int]) -> np.ndarray:
    """Independent sums: lookup_sum over the members' indices, chunked to (chunks, K)."""
    sums = lookup_sum(cfg.values(), np.stack([indices[w] for w in members]))
    return sums.reshape(-1, cfg.elems)


def random_indices(cfg: JobConfig, chunks: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << cfg.bits, chunks * cfg.elems).astype(np.uint8) for _ in range(cfg.workers)]


def test_sums_equal_lookup_sum() -> None:
    """4 workers: every chunk's sums equal lookup_sum of their indices, as uint8 (the job's 8-bit results in
    their own width); contributors 4, bitmap 0b1111."""
    cfg = JobConfig(workers=4, slots=8, elems=K)
    assert cfg.result_bits == 8
    idx = random_indices(cfg, 20)
    with serving(cfg) as srv:
        res, _ = run_workers(srv, cfg, idx)
    want = oracle(cfg, idx, [0, 1, 2, 3])
    for r in res:
        assert r.sums.dtype == np.uint8 and np.array_equal(r.sums, want)
        assert (r.contributors == 4).all() and (r.bitmap == 0b1111).all() and not r.lost.any()


@pytest.mark.parametrize(("up", "down"), [(0.01, 0.0), (0.1, 0.0), (0.0, 0.01), (0.0, 0.1)])
def test_reliable_exact_under_loss(up: float, down: float) -> None:
    """Seeded loss up or down, 1% and 10%: reliable stays bit exact (no double counting)."""
    cfg = JobConfig(workers=4, slots=4, elems=K)
    idx = random_indices(cfg, 40, seed=int(up * 100 + down * 1000))
    with serving(cfg) as srv:
        res, trs = run_workers(srv, cfg, idx, drop_up=up, drop_down=down, timeout=0.02, seed=3)
        counters = srv.counters.sum(axis=0)
    want = oracle(cfg, idx, [0, 1, 2, 3])
    for r in res:
        assert np.array_equal(r.sums, want) and not r.lost.any()
    dropped = sum(t.stats.dropped_up + t.stats.dropped_down for t in trs)
    assert dropped > 0 and sum(t.stats.retransmissions for t in trs) > 0
    assert counters[Counter.ACCEPTED] == 4 * 40  # each contribution added exactly once


def test_lost_result_after_slot_moved_on_gets_shadow_copy() -> None:
    """With 2 slots and a worker losing half its results, retransmissions are answered from the
    retained bank after faster workers started the next round; sums stay exact."""
    cfg = JobConfig(workers=3, slots=2, elems=K)
    idx = random_indices(cfg, 30, seed=5)
    with serving(cfg) as srv:
        trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port), timeout=0.02,
                                         drop_down=0.5 if w == 0 else 0.0, seed=11)) for w in range(3)]
        out: list[UseResults | None] = [None] * 3
        ths = [threading.Thread(target=lambda w=w: out.__setitem__(w, trs[w].exchange_indices(idx[w])))
               for w in range(3)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=60)
        counters = srv.counters.sum(axis=0)
        for tr in trs:
            tr.close()
    want = oracle(cfg, idx, [0, 1, 2])
    assert all(o is not None and np.array_equal(o.sums, want) for o in out)
    assert trs[0].stats.dropped_down > 0 and counters[Counter.RETAINED] > 0
    assert counters[Counter.ACCEPTED] == 3 * 30


def test_zero_fill_reports_exactly_what_it_lost() -> None:
    """zero-fill with upstream loss and no retransmission: a chunk whose contribution was lost is lost
    for every worker (full threshold), reported as such; every other chunk is exact."""
    cfg = JobConfig(workers=4, slots=8, elems=K)
    idx = random_indices(cfg, 32, seed=7)
    with serving(cfg) as srv:
        res, trs = run_workers(srv, cfg, idx, loss_policy="zero-fill", retries=0, timeout=0.8, drop_up=0.1, seed=2)
    want = oracle(cfg, idx, [0, 1, 2, 3])
    lost_sets = [set(np.flatnonzero(r.lost).tolist()) for r in res]
    assert lost_sets[0] and all(s == lost_sets[0] for s in lost_sets)
    for r, tr in zip(res, trs, strict=True):
        ok = ~r.lost
        assert np.array_equal(r.sums[ok], want[ok])
        assert (r.contributors[r.lost] == 0).all() and (r.sums[r.lost] == 0).all()
        assert tr.stats.lost_chunks == int(r.lost.sum()) == len(tr.stats.lost)
    assert sum(t.stats.dropped_up for t in trs) >= len(lost_sets[0])


def test_straggler_notices_and_partial_threshold() -> None:
    """3 of 4: the round completes without the slow worker; when it arrives, it gets straggler
    notices (callback and counter) for rounds that are gone and the retained 3-worker result for the
    latest one; it never adds to the sums, and it finishes."""
    cfg = JobConfig(workers=4, threshold=3, slots=2, elems=K)
    idx = random_indices(cfg, 6, seed=9)
    notices: list[tuple[int, int, int]] = []
    with serving(cfg) as srv:
        fast, _ = run_workers(srv, cfg, idx, workers=[0, 1, 2], timeout=0.05)
        slow_tr = Transport(TransportConfig(cfg, worker=3, aggregator=("127.0.0.1", srv.port), timeout=0.05,
                                            on_straggler=lambda *a: notices.append(a)))
        slow = slow_tr.exchange_indices(idx[3])
        slow_tr.close()
        counters = srv.counters.sum(axis=0)
    want = oracle(cfg, idx, [0, 1, 2])
    for r in fast:
        assert np.array_equal(r.sums, want) and (r.contributors == 3).all() and (r.bitmap == 0b0111).all()
    assert slow_tr.stats.stragglers == len(notices) > 0 and slow.lost.sum() == len(notices)
    got = ~slow.lost
    assert got.any() and np.array_equal(slow.sums[got], want[got]) and (slow.bitmap[got] == 0b0111).all()
    for slot, ours, current in notices:
        assert (current - ours) % 65536 >= 2 and 0 <= slot < 2
    assert counters[Counter.ACCEPTED] == 3 * 6 and counters[Counter.STRAGGLER] == len(notices)


def test_a_run_on_a_job_another_run_moved_on_fails_clearly() -> None:
    """A new run's workers start every slot at round 0. Where an earlier run of the job left the slots two or
    more rounds ahead, the aggregator answers with straggler notices, which within one run of a one-tier,
    every-worker job under ``reliable`` cannot come: the transport raises AggregatorStateError (it used to
    mark the uses lost, and a training went on with zeros). Under zero-fill the notices keep their meaning."""
    cfg = JobConfig(workers=1, slots=2, elems=K)
    idx = random_indices(cfg, 6, seed=3)  # 6 chunks on 2 slots: each slot ends at round 2
    with serving(cfg) as srv:
        first, _ = run_workers(srv, cfg, idx)
        assert np.array_equal(first[0].sums, oracle(cfg, idx, [0]))
        with pytest.raises(AggregatorStateError, match=r"slot 0: a straggler notice for round 0 \(the slot is at "
                                                       r"round 2\).*start each run with a fresh job"):
            run_workers(srv, cfg, idx)
        lossy, trs = run_workers(srv, cfg, idx, loss_policy="zero-fill", timeout=0.05)
        assert lossy[0].lost.any() and trs[0].stats.stragglers == lossy[0].lost.sum()


def test_a_result_retained_from_another_run_is_refused() -> None:
    """Where an earlier run's round of a slot is still complete in its bank, the aggregator answers a new
    run's use of that round with the earlier run's result (``retained``). The transport checks answers
    against its own indices (a sum holds this worker's table value and at most contributors - 1 others) and
    raises AggregatorStateError; the norm stage refuses a max norm below this worker's own."""
    cfg = JobConfig(workers=1, slots=8, elems=K)
    with serving(cfg) as srv:
        run_workers(srv, cfg, random_indices(cfg, 3, seed=1))
        with pytest.raises(AggregatorStateError, match="slot 0: the result of round 0 cannot hold this worker's"):
            run_workers(srv, cfg, random_indices(cfg, 3, seed=2))
    with serving(cfg) as srv:
        for norm in (5.0, 7.0):
            with Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv.port))) as tr:
                if norm == 5.0:
                    assert tr.exchange_norm(norm) == (5.0, 1)
                else:
                    with pytest.raises(AggregatorStateError, match=r"a max norm 5\.0 below this worker's own 7\.0"):
                        tr.exchange_norm(norm)


def test_a_run_opened_on_another_runs_job_is_refused() -> None:
    """4 workers (where a retained result of another run mostly passes the own-share probe): a run opened
    with ``open_run`` and its nonce, then a second run of the same job opened with another nonce: slot 0's
    round 0 answers with the first run's nonce, and every worker raises AggregatorStateError before any
    data is exchanged. On a fresh job the same opening passes, and the data that follows is exact."""
    cfg = JobConfig(workers=4, slots=8, elems=K)
    idx = random_indices(cfg, 3, seed=4)
    first, second = 3.0, 2.5  # a second nonce above the first is refused as a max norm below its own
    nonces = {run_nonce(np.random.default_rng(seed)) for seed in range(50)}
    assert len(nonces) == 50 and all(n > 0 and float(np.float32(n)) == n for n in nonces)
    with serving(cfg) as srv:
        local = [("127.0.0.1", srv.port)] * cfg.workers
        for r in opened_runs(cfg, local, first, idx):
            assert isinstance(r, UseResults) and np.array_equal(r.sums, oracle(cfg, idx, [0, 1, 2, 3]))
        for r in opened_runs(cfg, local, second, idx):
            assert isinstance(r, AggregatorStateError) and f"came back with {first}, not this run's nonce" in str(r)
    with serving(cfg) as srv:
        local = [("127.0.0.1", srv.port)] * cfg.workers
        assert all(isinstance(r, UseResults) for r in opened_runs(cfg, local, second, idx))
    with pytest.raises(ValueError, match="positive float32"):
        Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", 9))).open_run(0.1)


@pytest.mark.parametrize("shards", [1, 2])
def test_an_add_over_the_control_socket_gives_the_next_run_a_fresh_job(tmp_path: Path, shards: int) -> None:
    """docs/protocol.md, "A new run needs a fresh job": ``add`` of a configured id resets its registers, even
    with the same settings, and its reply comes once every shard has done so. Two runs of 4 workers, each
    opened with its own nonce, with an ``add`` of the unchanged spec between them: both exact (the second
    was refused when an unchanged ``add`` kept the registers). Then ``remove`` of the only job: its packets
    are unknown (an empty job list used to count as no change, and the job was still served). A
    ``thc-aggregator`` process: its shard processes are forked from a single thread, as in use."""
    cfg = JobConfig(workers=4, slots=8, elems=K)
    idx = random_indices(cfg, 3, seed=5)
    ctl = ControlAddress(path=str(tmp_path / "ctl.sock"))
    with local_aggregator([cfg], shards=shards, extra=["--control", ctl.path]) as where:
        for nonce in (3.0, 2.5):
            for r in opened_runs(cfg, [where] * cfg.workers, nonce, idx, shards=shards):
                assert isinstance(r, UseResults), r
                assert np.array_equal(r.sums, oracle(cfg, idx, [0, 1, 2, 3]))
            assert send_command(ctl, f"add {cfg.spec()}") == "ok: job 1 configured"
        assert send_command(ctl, "remove 1") == "ok: job 1 removed"
        with Transport(TransportConfig(cfg, worker=0, aggregator=where, shards=shards, deadline=0.5)) as tr:
            with pytest.raises(AggregatorUnreachable):
                tr.exchange_norm(1.0)
        assert json.loads(send_command(ctl, "stats"))[Counter.UNKNOWN_JOB.label] > 0


@pytest.mark.parametrize("policy", ["reliable", "zero-fill"])
def test_a_notice_caused_by_an_old_copy_is_not_the_uses(policy: str) -> None:
    """A one-tier notice does not carry the round it refuses: only the slot's current round and the refused
    datagram's tensor and chunk. One that echoes another chunk (a late copy of an earlier use of the slot) is
    counted as unexpected and changes nothing, under either policy. One that echoes the open use's own chunk
    raises AggregatorStateError where no notice can come within a run (``reliable``, every worker needed),
    and gives the use up under ``zero-fill``. Forged here, while a relay holds the requests."""
    cfg = JobConfig(workers=1, slots=8, elems=K)
    (idx,) = random_indices(cfg, 3, seed=6)
    with serving(cfg) as srv, delaying_relay(srv.port, 0.3) as port, \
            Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), loss_policy=policy,
                                      timeout=1.0)) as tr, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:

        def notice(slot: int, chunk: int) -> None:
            time.sleep(0.1)  # the uses are out, held by the relay
            forger.sendto(Header(type=int(PacketType.STRAGGLER), job=cfg.job, key=cfg.key, table_id=cfg.table_id,
                                 slot=slot, round=5, tensor=0, chunk=chunk).pack(b""), tr.address)

        th = threading.Thread(target=notice, args=(0, 7))
        th.start()
        res = tr.exchange_indices(idx)
        th.join()
        assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
        assert tr.stats.stragglers == 0 and tr.stats.unexpected >= 1
        th = threading.Thread(target=notice, args=(3, 0))  # the next exchange's first use: slot 3, chunk 0
        th.start()
        if policy == "reliable":
            with pytest.raises(AggregatorStateError, match=r"slot 3: a straggler notice for round 0 \(the slot is"):
                tr.exchange_indices(idx)
        else:
            res = tr.exchange_indices(idx)
            assert res.lost.tolist() == [True, False, False] and tr.stats.stragglers == 1
            assert np.array_equal(res.sums[1:], oracle(cfg, [idx], [0])[1:])
        th.join()


def test_two_jobs_never_touch_each_other() -> None:
    """Two jobs on the same slots at the same time: each gets exactly its own sums."""
    a = JobConfig(job=1, key=0x1111, workers=2, slots=4, elems=K)
    b = JobConfig(job=2, key=0x2222, workers=3, slots=4, elems=K)
    ia, ib = random_indices(a, 12, 1), random_indices(b, 12, 2)
    with serving(a, b) as srv:
        out: dict[str, list[UseResults]] = {}
        ths = [threading.Thread(target=lambda: out.__setitem__("a", run_workers(srv, a, ia)[0])),
               threading.Thread(target=lambda: out.__setitem__("b", run_workers(srv, b, ib)[0]))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=60)
    assert all(np.array_equal(r.sums, oracle(a, ia, [0, 1])) for r in out["a"])
    assert all(np.array_equal(r.sums, oracle(b, ib, [0, 1, 2])) for r in out["b"])


def test_wrong_key_or_table_changes_nothing_and_errors_clearly() -> None:
    """A worker with another key or table is refused: it fails with a clear error after its deadline,
    and the real job's sums are untouched."""
    cfg = JobConfig(workers=2, slots=4, elems=K)
    idx = random_indices(cfg, 8, seed=4)
    with serving(cfg) as srv:
        for bad in (dataclasses.replace(cfg, key=cfg.key ^ 1), dataclasses.replace(cfg, granularity=29)):
            tr = Transport(TransportConfig(bad, worker=1, aggregator=("127.0.0.1", srv.port), timeout=0.02,
                                           deadline=0.3))
            with pytest.raises(AggregatorUnreachable, match="no answer from the aggregator"):
                tr.exchange_indices(idx[1])
            tr.close()
        res, _ = run_workers(srv, cfg, idx)
        counters = srv.counters.sum(axis=0)
    assert all(np.array_equal(r.sums, oracle(cfg, idx, [0, 1])) for r in res)
    assert counters[Counter.BAD_KEY] > 0 and counters[Counter.BAD_TABLE] > 0


def test_unreachable_aggregator_raises_after_deadline() -> None:
    """No aggregator on the port: AggregatorUnreachable once the deadline passes without an answer."""
    cfg = JobConfig(workers=1, slots=4, elems=K)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    tr = Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), deadline=0.4,
                                   timeout=0.05))
    with pytest.raises(AggregatorUnreachable, match=f"127.0.0.1:{port}"):
        tr.exchange_norm(1.0)
    # It waited out the deadline: resent after 0.05 s and again after 0.1 s more, before 0.4 s passed
    # (a count, not a clock reading: a busy machine only makes it more). The hang guard is pytest-timeout.
    assert tr.stats.retransmissions >= 2
    tr.close()


def test_answers_that_finish_nothing_do_not_hold_a_worker_past_its_deadline() -> None:
    """A peer that answers every request with a RESULT of another round (as stale retained results or a
    confused aggregator would): each answer is for an open use's slot, so the path is not silent, but no
    use ever finishes. The worker gives up at its deadline with a clear error instead of waiting forever."""
    cfg = JobConfig(workers=1, slots=4, elems=K)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.settimeout(0.05)
    stop = threading.Event()

    def answer_wrongly() -> None:
        while not stop.is_set():
            try:
                data, addr = peer.recvfrom(65536)
            except TimeoutError:
                continue
            h, _ = Header.parse(data)
            wrong = h.replace(type=2, round=(h.round + 1000) % 65536, width=8, contributors=1, bitmap=1)
            peer.sendto(wrong.pack(bytes(h.elems)), addr)

    th = threading.Thread(target=answer_wrongly, daemon=True)
    th.start()
    # resends at most 0.1 s apart draw an answer each, well inside the 1 s deadline
    tr = Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", peer.getsockname()[1]), deadline=1.0,
                                   timeout=0.02, max_timeout=0.1))
    try:
        started = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match="no use answered or given up"):
            tr.exchange_indices(random_indices(cfg, 4)[0])
        assert time.monotonic() - started < 30
        assert tr.stats.unexpected > 0 and tr.stats.results == 0
    finally:
        stop.set()
        th.join(5)
        tr.close()
        peer.close()


def test_round_wraparound() -> None:
    """Workers whose slot rounds wrap past 65535 during the exchange stay exact."""
    cfg = JobConfig(workers=2, slots=2, elems=K)
    idx = random_indices(cfg, 10, seed=8)
    with serving(cfg) as srv:
        trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port))) for w in range(2)]
        for tr in trs:
            tr.slot_round = [65533, 65534]
        out: list[UseResults | None] = [None, None]
        ths = [threading.Thread(target=lambda w=w: out.__setitem__(w, trs[w].exchange_indices(idx[w])))
               for w in range(2)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=30)
        for tr in trs:
            tr.close()
    assert trs[0].slot_round == [(65533 + 5) % 65536, (65534 + 5) % 65536]
    assert all(o is not None and np.array_equal(o.sums, oracle(cfg, idx, [0, 1])) for o in out)


def test_malformed_traffic_interleaved_leaves_result_intact() -> None:
    """Random bytes and hostile headers sprayed at the aggregator during a job: sums stay exact."""
    cfg = JobConfig(workers=3, slots=4, elems=K)
    idx = random_indices(cfg, 24, seed=6)
    stop = threading.Event()
    with serving(cfg) as srv:
        def spray() -> None:
            rng = np.random.default_rng(0)
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sent = 0
            while not stop.is_set() and sent < 20000:
                kind = sent % 4
                if kind == 0:
                    data = rng.bytes(int(rng.integers(0, 200)))
                elif kind == 1:  # right job, wrong key, plausible slot/round
                    data = Header(type=1, job=cfg.job, key=cfg.key ^ 0xFF, table_id=cfg.table_id, worker=0,
                                  slot=int(rng.integers(0, 4)), elems=K, width=4).pack(bytes(cfg.data_bytes))
                elif kind == 2:  # right key, worker out of range
                    data = Header(type=1, job=cfg.job, key=cfg.key, table_id=cfg.table_id, worker=7, slot=1, elems=K,
                                  width=4).pack(bytes(cfg.data_bytes))
                else:  # right key, truncated payload
                    data = Header(type=1, job=cfg.job, key=cfg.key, table_id=cfg.table_id, worker=1, slot=2, elems=K,
                                  width=4).pack(bytes(5))
                s.sendto(data, ("127.0.0.1", srv.port))
                sent += 1
                if sent % 50 == 0:
                    time.sleep(0.001)
            s.close()

        th = threading.Thread(target=spray)
        th.start()
        try:
            res, _ = run_workers(srv, cfg, idx)
        finally:
            stop.set()
            th.join(timeout=10)
        time.sleep(0.05)
        counters = srv.counters.sum(axis=0)
    assert all(np.array_equal(r.sums, oracle(cfg, idx, [0, 1, 2])) for r in res)
    assert counters[Counter.BAD_KEY] > 0 and counters[Counter.BAD_WORKER] > 0 and counters[Counter.BAD_FORMAT] > 0


def test_thc_allreduce_decodes_like_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """THCAllreduce's average equals the in-process codec's decode of lookup_sum over all workers'
    indices, and its error is THC's (NMSE well below 1 and equal on every worker). Its indices, quantized in
    pieces of one block beside the exchange, are those of one ``compress``."""
    import worker_lib.allreduce

    monkeypatch.setattr(worker_lib.allreduce, "FIRST_PIECE", 1024)
    monkeypatch.setattr(worker_lib.allreduce, "PIECE", 1024)
    cfg = JobConfig(workers=3, slots=16, elems=K)
    d = 3000
    grads = [torch.randn(d, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    with serving(cfg) as srv:
        ars = [THCAllreduce(Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port))),
                            THCConfig(), seed=w) for w in range(3)]
        out: list = [None] * 3
        ths = [threading.Thread(target=lambda w=w: out.__setitem__(w, ars[w].allreduce(grads[w], tensor=2, step=5)))
               for w in range(3)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=60)
        for a in ars:
            a.transport.close()
    for w in range(3):
        alone = THCWorker(THCConfig(), job=cfg.job, worker=w, seed=w)
        alone.begin(grads[w], 2, 5)
        assert np.array_equal(alone.compress(2, out[w].max_norm).indices.numpy(), out[w].indices)
    codec = THCCodec(THCConfig())
    padded = out[0].indices.size
    sums = torch.from_numpy(lookup_sum(cfg.values(), np.stack([o.indices for o in out])))
    scale = codec.scale(out[0].max_norm, padded)
    expect = codec.decode(sums, 3, scale, d, SignKey.derive(cfg.job, 2, 5))
    true = sum(grads) / 3
    for o in out:
        assert torch.allclose(o.average, expect, atol=1e-6)
    assert out[0].max_norm == pytest.approx(max(float(g.norm()) for g in grads), rel=1e-6)
    nmse = float(((out[0].average - true) ** 2).sum() / (true ** 2).sum())
    assert 0 < nmse < 0.2


def test_indices_sent_while_they_are_computed_get_the_same_sums() -> None:
    """``exchange_indices(fill=...)``: indices written piece by piece on the feed's thread (piece ends off the
    chunk boundaries, a pause before each, so that the engine runs out of datagrams and waits on the feed)
    come back with the sums of the same indices sent whole; the waits count in ``feed_bound_s``."""
    cfg = JobConfig(workers=2, slots=8, elems=K)
    idx = random_indices(cfg, 30, seed=4)
    buf = np.zeros_like(idx[0])

    def fill(done: Callable[[int], None]) -> None:
        start = 0
        for stop in (100, 700, 1500, buf.size):
            time.sleep(0.02)
            buf[start:stop] = idx[0][start:stop]
            done(stop)
            start = stop

    with serving(cfg) as srv:
        trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port))) for w in range(2)]
        out: dict[str, UseResults] = {}
        th = threading.Thread(target=lambda: out.__setitem__("w1", trs[1].exchange_indices(idx[1])))
        th.start()
        res = trs[0].exchange_indices(buf, fill=fill)
        th.join(timeout=30)
        for tr in trs:
            tr.close()
    want = oracle(cfg, idx, [0, 1])
    assert np.array_equal(res.sums, want) and np.array_equal(out["w1"].sums, want)
    assert not res.lost.any() and (res.contributors == 2).all()
    assert trs[0].stats.feed_bound_s >= 0.04  # three pauses with every ready datagram sent
    assert trs[0].stats.results == 30


@pytest.mark.parametrize("how", ["raises", "stops short"])
def test_a_fill_that_fails_ends_the_exchange_with_its_error(how: str) -> None:
    """A ``fill`` that raises after its first chunks (or returns before its last index is final) ends the
    exchange at once with that error (or a RuntimeError that says how many datagrams were ready), not at
    the deadline; of its chunks, none past those it made final was sent (those may or may not be: the engine
    may hear of the failure first)."""
    cfg = JobConfig(workers=1, slots=8, elems=K)
    buf = random_indices(cfg, 12, seed=9)[0]

    def fill(done: Callable[[int], None]) -> None:
        done(3 * K)
        if how == "raises":
            raise ArithmeticError("the codec broke")

    with serving(cfg) as srv, Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv.port),
                                                        deadline=5.0)) as tr:
        began = time.monotonic()
        with pytest.raises(ArithmeticError if how == "raises" else RuntimeError,
                           match="the codec broke" if how == "raises" else "3 of 12 rows"):
            tr.exchange_indices(buf, fill=fill)
        assert time.monotonic() - began < 2.0
        assert tr.stats.packets_sent <= 3


def loopback_multicast_problem() -> str | None:
    """Why IP multicast on the loopback interface does not work here (None if it does)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    group = "239.77.0.2"
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rx.bind((group, port))
        mreq = socket.inet_aton(group) + socket.inet_aton("127.0.0.1")
        rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
        rx.settimeout(1.0)
        tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        tx.sendto(b"probe", (group, port))
        rx.recv(16)
    except OSError as exc:
        return f"IP multicast on the loopback interface does not work here: {exc}"
    finally:
        rx.close()
        tx.close()
    return None


def test_multicast_results() -> None:
    """--multicast: each completion is one datagram to the job's group, which every worker receives;
    retained results still come back by unicast."""
    problem = loopback_multicast_problem()
    if problem:
        pytest.skip(problem)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    group = f"239.77.0.1:{probe.getsockname()[1]}"
    probe.close()
    cfg = JobConfig(workers=3, slots=4, elems=K, multicast=group)
    idx = random_indices(cfg, 12, seed=12)
    with serving(cfg, multicast=True) as srv:
        res, trs = run_workers(srv, cfg, idx, multicast=group, drop_down=0.05, timeout=0.02, seed=1)
        counters = srv.counters.sum(axis=0)
    want = oracle(cfg, idx, [0, 1, 2])
    assert all(np.array_equal(r.sums, want) for r in res)
    assert all(t.stats.multicast_results > 0 for t in trs)
    unicast = sum(t.stats.results - t.stats.multicast_results for t in trs)
    assert unicast <= counters[Counter.RETAINED]


def test_uncompressed_job_sums_int32() -> None:
    """An uncompressed job carries int32 fixed-point values; sums (negatives included) are exact."""
    cfg = JobConfig(job=3, key=0x3333, workers=3, kind="uncompressed", slots=4, elems=K)
    rng = np.random.default_rng(3)
    vals = [rng.integers(-(1 << 28), 1 << 28, 5 * K + 7) for _ in range(3)]
    with serving(cfg) as srv:
        trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port))) for w in range(3)]
        out: list = [None] * 3
        ths = [threading.Thread(target=lambda w=w: out.__setitem__(w, trs[w].exchange_int32(vals[w])))
               for w in range(3)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=30)
        for tr in trs:
            tr.close()
    want = np.zeros(6 * K, np.int64)
    want[: 5 * K + 7] = sum(vals)
    assert all(np.array_equal(o.sums.reshape(-1), want) for o in out)


def test_zero_fill_allreduce_zeroes_lost_chunks_in_transformed_domain() -> None:
    """THCAllreduce under zero-fill: a lost chunk's coordinates are zero in the rotated domain and the
    loss is reported; the others decode normally."""
    from worker_lib.thc import RandomizedHadamard

    cfg = JobConfig(workers=2, slots=8, elems=K)
    d = 4096
    grads = [torch.randn(d, generator=torch.Generator().manual_seed(10 + w)) for w in range(2)]
    with serving(cfg) as srv:
        ars = [THCAllreduce(Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", srv.port),
                                                      loss_policy="zero-fill", retries=0, timeout=0.8,
                                                      drop_up=0.15, seed=4)), THCConfig(), seed=w)
               for w in range(2)]
        out: list = [None] * 2
        ths = [threading.Thread(target=lambda w=w: out.__setitem__(w, ars[w].allreduce(grads[w], tensor=1, step=3)))
               for w in range(2)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=60)
        for a in ars:
            a.transport.close()
    lost = out[0].lost
    assert lost.any() and not lost.all() and np.array_equal(lost, out[1].lost)
    rotated = RandomizedHadamard(d, SignKey.derive(cfg.job, 1, 3)).forward(out[0].average).reshape(-1, K)
    scale = float(rotated.abs().max())
    assert float(rotated[torch.from_numpy(lost)].abs().max()) < 1e-4 * scale
    assert float(rotated[torch.from_numpy(~lost)].abs().mean()) > 1e-2 * scale


def test_transport_paces_by_its_policy() -> None:
    """A reliable transport adapts its timeout and window (as configured); zero-fill keeps its workers in
    step: fixed timeout, fixed window W, whatever the samples and expiries say."""
    cfg = JobConfig(workers=1, slots=4, elems=K)
    with Transport(TransportConfig(cfg, worker=0, timeout=0.01, max_timeout=5.0, window=3)) as tr:
        assert (tr.pacer.adaptive_timeout, tr.pacer.congestion_control, tr.pacer.max_window) == (True, True, 3)
    with Transport(TransportConfig(cfg, worker=0, timeout=0.01, adaptive_timeout=False)) as fixed:
        fixed.pacer.sample(0.3)
        fixed.pacer.expired(0.0)
        assert fixed.pacer.rto() == 0.01
    with Transport(TransportConfig(cfg, worker=0, timeout=0.01, loss_policy="zero-fill")) as zf:
        zf.pacer.sample(0.3)
        zf.pacer.expired(1.0)
        assert zf.pacer.rto() == 0.01 and zf.pacer.window() == cfg.slots
    with pytest.raises(ValueError, match="max_timeout"):
        TransportConfig(cfg, worker=0, timeout=0.5, max_timeout=0.1)


def test_a_late_peer_at_the_norm_barrier_teaches_the_pacer_nothing() -> None:
    """The norm stage waits for the last worker to reach it, not for the path: worker 0 waits 0.3 s for
    worker 1 and resends its norm meanwhile, yet its pacer keeps no round trip and its first timeout
    (10 ms) undoubled. (Before, each expiry at the barrier doubled it: the first data window of a lossy
    run then waited up to 0.8 s per lost use.) A data exchange afterwards does measure the path."""
    cfg = JobConfig(workers=2, slots=8, elems=K)
    with serving_apart(cfg) as srv_port, \
            Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv_port), timeout=0.01)) as t0, \
            Transport(TransportConfig(cfg, worker=1, aggregator=("127.0.0.1", srv_port), timeout=0.01)) as t1:
        def late() -> None:
            time.sleep(0.3)
            t1.exchange_norm(2.0)

        th = threading.Thread(target=late)
        th.start()
        assert t0.exchange_norm(1.0) == (2.0, 2)
        th.join(10)
        assert t0.stats.retransmissions >= 5  # it did wait and resend
        assert t0.pacer.rtt is None and t0.pacer.rto() == 0.01
        # 64 uses: should worker 1's thread start more than a timeout late (a busy machine), the first
        # window's uses are all resent and measure nothing (Karn), the later ones do
        idx = np.zeros(64 * K, np.uint8)
        th = threading.Thread(target=t1.exchange_indices, args=(idx,))
        th.start()
        t0.exchange_indices(idx)
        th.join(10)
        assert t0.pacer.rtt is not None


@pytest.mark.parametrize("stale", [False, True])
def test_a_late_peer_costs_one_probe_per_timeout(stale: bool) -> None:
    """Worker 1 starts its exchange 0.3 s after worker 0 (as a slower encoder does in a DDP step), once
    worker 0 knows the round trip: worker 0 resends only its oldest use while it waits (a probe per
    timeout), and nothing else when worker 1 arrives; the answers of the rest are on their way. Before,
    every timeout resent all 8 open uses. ``stale``: a late copy of an answer of the first exchange comes
    as the second starts (the answer to a spurious resend): of another round, it says nothing of the new
    uses of its slot, and starts no timers (it used to: every use went again at the next timeout).
    Exact."""
    cfg = JobConfig(workers=2, slots=8, elems=K)
    resent: list[int] = []

    class Recording(Transport):  # datagram by datagram (gso=False), to see each one
        kept: tuple[np.ndarray, np.ndarray] | None = None  #: an answer of the first exchange
        inject = False

        def _send(self, data: bytes, slot: int) -> None:
            if self.recording:
                resent.append(slot)
            super()._send(data, slot)

        def _receive_batch(self, sock: socket.socket) -> tuple[np.ndarray, np.ndarray]:
            rows, lens = super()._receive_batch(sock)
            if len(rows) and self.kept is None:
                self.kept = (rows[-1:].copy(), lens[-1:].copy())
            elif self.inject and not len(rows):
                self.inject = False
                return self.kept
            return rows, lens

    idx = random_indices(cfg, 8)
    with serving_apart(cfg) as srv_port, \
            Recording(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv_port), gso=False,
                                      tail_duplicates=0)) as t0, \
            Recording(TransportConfig(cfg, worker=1, aggregator=("127.0.0.1", srv_port), gso=False,
                                      tail_duplicates=0)) as t1:
        t0.recording = t1.recording = False
        for _ in range(2):  # both together: worker 0 measures the round trip (a cold numba cache slows the first)
            th = threading.Thread(target=t1.exchange_indices, args=(idx[1],))
            th.start()
            t0.exchange_indices(idx[0])
            th.join(10)
        assert t0.pacer.rtt is not None
        out: dict[str, UseResults] = {}

        def late() -> None:
            time.sleep(0.3)
            out["w1"] = t1.exchange_indices(idx[1])

        th = threading.Thread(target=late)
        th.start()
        t0.recording, t0.inject = True, stale
        res = t0.exchange_indices(idx[0])
        th.join(10)
    assert not t0.inject  # the stale answer was read
    first_slot = 8 % cfg.slots  # the second exchange's first use: use 8 of the pool
    assert resent[:8] == [*range(8)], resent[:8]  # the window's first sends
    assert resent[8:] and set(resent[8:]) == {first_slot}, resent
    want = oracle(cfg, idx, [0, 1])
    assert np.array_equal(res.sums, want) and np.array_equal(out["w1"].sums, want)


def exchange_with_a_stalling_peer(stall_after: int, samples: list[float] | None = None) -> np.ndarray:
    """Worker 1 stops for 0.3 s after its ``stall_after``-th use of an exchange of 2 x 64 uses (its
    thread not scheduled, as on shared cores), while worker 0, which knows the round trip from an exchange
    before, has a window of later uses in flight. Returns how many datagrams worker 0 sent per slot in that
    exchange (datagram by datagram, gso=False, to see each one); ``samples`` gets the round trips worker 0's
    pacer was taught in it. Exact."""
    cfg = JobConfig(workers=2, slots=64, elems=K)
    sent: list[int] = []

    class Recording(Transport):
        recording = False

        def _send(self, data: bytes, slot: int) -> None:
            if self.recording:
                sent.append(slot)
            super()._send(data, slot)

    first_sends: set[bytes] = set()

    class Stalling(Transport):  # counts first sends only: a resend (a loaded machine's) does not move the stall
        stall_after: int | None = None

        def _send(self, data: bytes, slot: int) -> None:
            super()._send(data, slot)
            if self.stall_after is not None and (payload := bytes(data)) not in first_sends:  # a resend repeats it
                first_sends.add(payload)
                if len(first_sends) == self.stall_after:
                    time.sleep(0.3)

    idx = random_indices(cfg, 2 * cfg.slots)
    with serving_apart(cfg) as srv_port, \
            Recording(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv_port), gso=False,
                                      tail_duplicates=0)) as t0, \
            Stalling(TransportConfig(cfg, worker=1, aggregator=("127.0.0.1", srv_port), gso=False,
                                     tail_duplicates=0)) as t1:
        th = threading.Thread(target=t1.exchange_indices, args=(idx[1],))
        th.start()
        t0.exchange_indices(idx[0])  # both together: worker 0 measures the round trip, its window opens
        th.join(10)
        assert t0.pacer.rtt is not None and t0.pacer.base_rto() < 0.1
        out: dict[str, UseResults] = {}
        t1.stall_after = stall_after
        th = threading.Thread(target=lambda: out.__setitem__("w1", t1.exchange_indices(idx[1])))
        th.start()
        t0.recording = True
        if samples is not None:
            taught = t0.pacer.sample_many
            t0.pacer.sample_many = lambda rtts: (samples.extend(map(float, rtts)), taught(rtts))  # type: ignore[method-assign]
        res = t0.exchange_indices(idx[0])
        th.join(10)
    want = oracle(cfg, idx, [0, 1])
    assert np.array_equal(res.sums, want) and np.array_equal(out["w1"].sums, want)
    return np.bincount(sent, minlength=cfg.slots)


def test_a_peer_that_stalls_mid_exchange_costs_one_probe_per_timeout() -> None:
    """Worker 1 stalls after its 40th use of 128: worker 0's window of later uses times out together
    on a silent path. Worker 0 probes with its oldest open use, one per timeout, and resends at most a few
    of the others (before, the whole window went again at the first expiry: 76 resends against 27 in one
    run). Exact."""
    per_slot = exchange_with_a_stalling_peer(40)  # two uses per slot, each sent once, and the probes
    # the use after worker 1's 40th (slot 40), the oldest open one, probes; of the others, at most a few
    # whose timers ran out before the silence was half a timeout long went again, once each (a loaded
    # machine spreads the timers out, and its late answers may cost a spurious resend); never the window
    others = np.delete(per_slot, 40)
    assert (per_slot >= 2).all() and per_slot[40] > 3 and others.max() <= 4, per_slot
    assert np.count_nonzero(others > 2) <= 64 // 4, per_slot


def test_uses_in_flight_across_a_stall_teach_no_round_trip() -> None:
    """Worker 1 stalls 0.3 s after its 40th use: worker 0's uses in flight then are answered 0.3 s after
    their sends, on their first send. Those round trips measured the stall, not the path, and worker 0's
    pacer is not taught them; the uses it sends after the path speaks again are. (Taught, a burst of them
    made the lower quartile, hence every timeout, the stall's length: in a loopback run at 10 % loss each
    way, one worker's timeout reached the 2 s ceiling after its peer's stall, and the other three waited
    for its oldest use for 2 s: 3.3 s against 0.3 s at the median.)"""
    samples: list[float] = []
    exchange_with_a_stalling_peer(40, samples)
    assert samples and max(samples) < 0.15, sorted(samples)[-5:]


def test_a_peer_that_stalls_at_the_end_of_an_exchange_costs_one_probe_per_timeout() -> None:
    """Worker 1 stalls after its 100th use of 128: worker 0 has sent them all, and its last 28 uses
    wait 0.3 s on a silent path. It probes with its oldest open use, one per timeout, as in the middle of
    an exchange; of the others at most a tail probe's worth (``PROBE_USES``) go again, once each, and on a
    loaded machine as many again whose answers came late. (Before, where no
    later use was left to send, every use due was resent: the 27 after the oldest went again, and at 10
    Gbit/s a DDP step whose peer was late resent its last window, 250-360 uses, in about one step in 30.)"""
    per_slot = exchange_with_a_stalling_peer(100)
    oldest = 100 - 64  # the second use of slot 36 is the 101st
    others = np.delete(per_slot, oldest)
    assert (per_slot >= 2).all() and per_slot[oldest] > 3, per_slot
    assert others.max() <= 4 and np.count_nonzero(others > 2) <= 2 * PROBE_USES, per_slot


@contextlib.contextmanager
def delaying_relay(target: int, delay: float, capacity: int | None = None, interval: float = 0.0,
                   drop: Callable[[bytes], bool] | None = None) -> Iterator[int]:
    """A UDP relay on loopback that holds every worker->aggregator datagram ``delay`` seconds (a queue
    behind a slow link; beyond ``capacity`` held datagrams it drops, as a full queue does), passes them
    on at most one per ``interval`` seconds, in order (a link's serialisation), and passes answers
    straight back; yields its port. ``drop(datagram)`` true: that request is lost on the way."""
    front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for s in (front, back):
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    stop = threading.Event()

    def run() -> None:
        held: list[tuple[float, bytes]] = []
        client = None
        last = -math.inf  # when the latest held datagram leaves
        while not stop.is_set():
            now = time.monotonic()
            while held and held[0][0] <= now:
                back.sendto(held.pop(0)[1], ("127.0.0.1", target))
            wait = max(0.0, held[0][0] - now) if held else 0.01
            ready, _, _ = select.select([front, back], [], [], min(wait, 0.01))
            for s in ready:
                with contextlib.suppress(BlockingIOError):
                    while True:
                        data, addr = s.recvfrom(65536)
                        if s is front:
                            client = addr
                            if drop is not None and drop(data):
                                continue
                            if capacity is None or len(held) < capacity:
                                last = max(time.monotonic() + delay, last + interval)
                                held.append((last, data))
                        elif client is not None:
                            front.sendto(data, client)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        yield front.getsockname()[1]
    finally:
        stop.set()
        th.join(5)
        front.close()
        back.close()


def test_adaptive_timeout_stops_spurious_retransmissions() -> None:
    """Behind an 80 ms queue, a fixed 10 ms timeout resends every use several times; the adaptive
    timeout learns the round trip within the first window and then resends (almost) nothing. Both stay
    exact."""
    cfg = JobConfig(workers=1, slots=8, elems=K)
    idx = np.random.default_rng(3).integers(0, 16, 64 * K).astype(np.uint8)
    retx = {}
    for adaptive in (False, True):  # a fresh aggregator each: a new worker would find the slots' rounds moved on
        with serving_apart(cfg) as srv_port, delaying_relay(srv_port, 0.08) as port, \
                Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), timeout=0.01,
                                          adaptive_timeout=adaptive)) as tr:
            res = tr.exchange_indices(idx)
            assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
            retx[adaptive] = tr.stats.retransmissions
    assert retx[False] >= 64 * 2, retx
    assert retx[True] < retx[False] / 4, retx


def test_a_window_queued_behind_a_slow_link_is_not_resent() -> None:
    """A link that passes one request per 2 ms, and a window of 32 uses sent at once: the k-th use of the
    first burst waits k x 2 ms, and later uses about 64 ms each, past a timeout learnt from the burst's
    early, fast answers (3 x the lower quartile of 2..64 ms). Each use's timer starts again whenever a
    use sent before it is answered (the queue ahead of it moves), so nothing is resent; timed once from
    the first answer after its send, the 256 uses took 2,733 resends (which queued as well). Exact."""
    cfg = JobConfig(workers=1, slots=32, elems=K)
    idx = np.random.default_rng(6).integers(0, 16, 256 * K).astype(np.uint8)
    with serving_apart(cfg) as srv_port, delaying_relay(srv_port, 0.0, interval=0.002) as port, \
            Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), timeout=0.2,
                                      congestion_control=False, gso=False)) as tr:
        res = tr.exchange_indices(idx)
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    assert tr.pacer.rtt is not None and tr.pacer.base_rto() < 0.2  # it learnt a timeout below the first
    assert tr.stats.retransmissions <= 2, tr.stats.retransmissions


def test_answers_waiting_in_the_socket_are_taken_before_resending() -> None:
    """Answers come one per ms (a relay passes one request at a time; a window is 8 uses). The worker's
    thread stops for 100 ms right after it found its socket empty (a busy core, or the GIL held by the
    training loop): the rest of the window's answers arrive meanwhile, and when it runs again those uses'
    30 ms timers have expired. It takes the waiting answers before resending anything, so
    nothing is resent (resending first sent the rest of the window again). Exact."""
    cfg = JobConfig(workers=1, slots=8, elems=K)
    idx = np.random.default_rng(8).integers(0, 16, 64 * K).astype(np.uint8)

    class Stalled(Transport):
        stalled = True  # not in the first exchange, which warms the aggregator up (its compiled code loads)
        answered_before = 0

        def _receive_batch(self, sock: socket.socket) -> tuple[np.ndarray, np.ndarray]:
            rows, lens = super()._receive_batch(sock)
            if not len(rows) and self.stats.results > self.answered_before and not self.stalled:
                self.stalled = True
                time.sleep(0.1)
            return rows, lens

    with serving_apart(cfg) as srv_port, delaying_relay(srv_port, 0.0, interval=0.001) as port, \
            Stalled(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), timeout=0.03,
                                    adaptive_timeout=False, congestion_control=False)) as tr:
        tr.exchange_indices(idx)
        tr.answered_before, resent, tr.stalled = tr.stats.results, tr.stats.retransmissions, False
        res = tr.exchange_indices(idx)
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    assert tr.stalled and tr.stats.retransmissions == resent, tr.stats.retransmissions - resent


def exchange_losing(nth: int, policy: str, seed: int, hold_after: int | None = None, window: int = 4,
                    ) -> tuple[list[int], Transport, float]:
    """One worker exchanges 16 uses (window ``window`` of 16 slots, 0.2 s timeouts, datagram by datagram) and its
    ``nth`` datagram (from 1) is lost; checks that the sums are exact; returns the slot of every datagram
    it sent, the transport and the exchange's wall time. ``hold_after``: once it has sent that many
    datagrams, it stops for 50 ms before it next reads its socket (descheduled), so that the answers
    waiting then are read in one batch."""
    cfg = JobConfig(workers=1, slots=16, elems=K)
    sent: list[int] = []

    class Losing(Transport):  # datagram by datagram (gso=False), to drop the nth
        held = False

        def _send(self, data: bytes, slot: int) -> None:
            sent.append(slot)
            if len(sent) != nth:
                super()._send(data, slot)

        def _receive_batch(self, sock: socket.socket) -> tuple[np.ndarray, np.ndarray]:
            if len(sent) == hold_after and not self.held:
                self.held = True
                time.sleep(0.05)
            return super()._receive_batch(sock)

    idx = np.random.default_rng(seed).integers(0, 16, 16 * K).astype(np.uint8)
    with serving_apart(cfg) as srv_port, Losing(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv_port),
                                                     loss_policy=policy, timeout=0.2, min_timeout=0.2,
                                                     window=window, gso=False, tail_duplicates=0)) as tr:
        t0 = time.monotonic()
        res = tr.exchange_indices(idx)
        wall = time.monotonic() - t0
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    return sent, tr, wall


@pytest.mark.parametrize("warm", [False, True])
def test_answers_to_a_tail_probe_show_the_uses_lost_before_it(warm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker sends 64 uses in one go (64 slots, window 64), and the last 20 are lost: the answers stop after use
    43. The tail probe resends the last 8 (56..63); their answers show that uses 44..55, first sent before them,
    are lost too (RACK on the order of first sends): those go again at once, not at their timeouts. Cold (0.5 s
    timeouts: far above a loaded machine's scheduling delays) the 12 go by RACK. Warm (three lossless exchanges
    first: the timeout at its floor, as long as the probe's gap; both floors 50 ms here, not 2, so that a loaded
    machine's round trips stay below them) the timers run out with the probe, and the stall they look like must
    not take the probe away: 8 probed and at least 11 by RACK (the oldest may go by its timer); a lost probe
    left the 20 to go one per timeout. Exact; each lost use is resent once (those RACK found with a second copy
    a round trip later where the first was not answered by then: nothing is left to send after them), and cold
    none waited for its timeout."""
    cfg = JobConfig(workers=1, slots=64, elems=K)
    seen: set[int] = set()
    losing = not warm

    class LosingTheTail(Transport):  # datagram by datagram (gso=False): the first copies of uses 44..63 are lost
        def _send(self, data: bytes, slot: int) -> None:
            first = slot not in seen
            if losing:
                seen.add(slot)
            if not (losing and first and slot >= 44):
                super()._send(data, slot)

    idx = np.random.default_rng(3).integers(0, 16, 64 * K).astype(np.uint8)
    floor = 0.05 if warm else 0.5
    timeouts = {"timeout": floor, "min_timeout": floor}
    if warm:
        monkeypatch.setattr(pacing, "PROBE_MIN_S", floor)
    with serving_apart(cfg) as srv_port, LosingTheTail(TransportConfig(
            cfg, worker=0, aggregator=("127.0.0.1", srv_port), window=64, initial_window=64, gso=False,
            tail_duplicates=0, **timeouts)) as tr:
        if warm:
            for _ in range(3):
                tr.exchange_indices(idx)
            assert tr.pacer.base_rto() == tr.pacer.probe_gap(), (tr.pacer.base_rto(), tr.pacer.probe_gap())
            losing = True
        before = dataclasses.replace(tr.stats)
        t0 = time.monotonic()
        res = tr.exchange_indices(idx)
        wall = time.monotonic() - t0
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    resent, probes, early, copies = (getattr(tr.stats, k) - getattr(before, k) for k in (
        "retransmissions", "tail_probes", "early_retransmissions", "tail_copies"))
    assert resent - copies == 20 and probes == PROBE_USES, tr.stats
    assert copies <= early, tr.stats  # only those found by RACK after the last new use get a second copy
    assert early >= 20 - PROBE_USES - 1 if warm else early == 20 - PROBE_USES, tr.stats
    assert warm or wall < floor, wall  # cold: no use waited for its timeout


@pytest.mark.parametrize("policy", ["reliable", "zero-fill"])
def test_one_lost_use_does_not_stop_the_window(policy: str) -> None:
    """Window 4 of 16 slots, and the very first datagram is lost: uses 1..15 still go out and are
    answered (answered uses leave the window, as SACKed segments leave TCP's pipe; a sliding window would
    have stopped at use 3). Reliable: use 0, sent before answered uses, is resent as soon as those
    answers show it lost (RACK), long before its 0.2 s timeout, hence before use 15 is sent (at most a
    window of new uses goes out per pass). Zero-fill keeps its fixed timeout: use 0 is resent last."""
    sent, tr, wall = exchange_losing(1, policy, seed=5)
    assert sorted(sent) == sorted([*range(16), 0]), sent
    resend_at = sent.index(0, 1)
    assert 0 < tr.stats.tail_s <= wall  # after use 15 went out, the exchange waited for answers
    if policy == "reliable":
        assert resend_at < sent.index(15), sent
        assert tr.stats.early_retransmissions == 1
    else:
        assert resend_at == 16, sent
        assert tr.stats.early_retransmissions == 0
        assert tr.stats.tail_s >= 0.15  # use 0's fixed 0.2 s timeout ran out after the last first send


@pytest.mark.parametrize("policy", ["reliable", "zero-fill"])
def test_a_lost_last_use_is_probed_not_left_to_its_timeout(policy: str) -> None:
    """The exchange's last datagram is lost: no later answer shows it to RACK. Reliable: once the answers
    have stopped for the probe gap (a few ms here), a tail probe resends it, long before its 0.2 s
    timeout. Zero-fill keeps its fixed timeout and probes nothing. Exact."""
    sent, tr, wall = exchange_losing(16, policy, seed=8)
    assert sent == [*range(16), 15], sent
    assert tr.stats.retransmissions == 1
    if policy == "reliable":
        assert tr.stats.tail_probes == 1 and tr.stats.early_retransmissions == 0
        assert wall < 0.12, wall
    else:
        assert tr.stats.tail_probes == 0
        assert wall >= 0.15, wall


def test_a_lost_last_use_sent_after_the_last_answers_is_probed() -> None:
    """A window of 5: uses 10..14 go out together, their answers are read in one batch (the worker stopped
    while they came), and only then is the last use, 15, sent, and lost: nothing is heard after its send.
    The path had just spoken, though, so the silence after it is a loss: a tail probe resends it long
    before its 0.2 s timeout. (Only uses the path spoke after were probed; this one waited for its
    timeout, as happened on a busy machine.)"""
    sent, tr, wall = exchange_losing(16, "reliable", seed=8, hold_after=15, window=5)
    assert sent == [*range(16), 15], sent
    assert tr.held and tr.stats.tail_probes == 1 and tr.stats.retransmissions == 1
    assert wall < 0.15, wall


def _losing_first_sends(slot: int, lost: int) -> tuple[list[bytes], Callable[[bytes], bool]]:
    """A ``delaying_relay`` drop rule that loses the first ``lost`` sends of the use in ``slot``, and the list
    of that use's sends it has seen."""
    seen: list[bytes] = []

    def drop(data: bytes) -> bool:
        if Header.unpack_from(np.frombuffer(data, np.uint8)).slot != slot:
            return False
        seen.append(data)
        return len(seen) <= lost

    return seen, drop


def _sends_per_slot(cfg: JobConfig, drop: Callable[[bytes], bool] | None = None, *, seed: int = 14,
                    delay: float = 0.0, **kw: object) -> tuple[np.ndarray, TransportStats, float]:
    """One worker exchanges 16 uses through ``delaying_relay`` (``delay``; ``drop`` loses requests), with
    ``TransportConfig`` settings ``kw`` (timeouts 0.2 s unless given): how often each slot's request was sent,
    the transport's counters and the exchange's seconds. Checks exactness."""
    seen = np.zeros(cfg.slots, np.int64)

    def count(data: bytes) -> bool:
        seen[Header.unpack_from(np.frombuffer(data, np.uint8)).slot] += 1
        return drop is not None and drop(data)

    idx = np.random.default_rng(seed).integers(0, 16, 16 * K).astype(np.uint8)
    settings = {"timeout": 0.2, "min_timeout": 0.2, **kw}
    with serving_apart(cfg) as srv_port, delaying_relay(srv_port, delay, drop=count) as port, \
            Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), **settings)) as tr:
        t0 = time.monotonic()
        res = tr.exchange_indices(idx)
        wall = time.monotonic() - t0
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    return seen, tr.stats, wall


def _tail_exchange(seed: int, lost: int, delay: float, timeout: float, gso: bool) -> tuple[list[bytes], TransportStats]:
    """One exchange of 16 uses by one worker through ``delaying_relay`` (``delay``) losing the first ``lost``
    sends of use 14, without tail duplicates (``_sends_per_slot``); returns use 14's sends and the counters."""
    sends_of_14, drop = _losing_first_sends(14, lost)
    _, st, _ = _sends_per_slot(JobConfig(workers=1, slots=16, elems=K), drop, seed=seed, delay=delay,
                               timeout=timeout, min_timeout=timeout, gso=gso, tail_duplicates=0)
    return sends_of_14, st


@pytest.mark.parametrize("gso", [False, True])
def test_a_resend_after_the_last_new_use_gets_a_second_copy(gso: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 uses go out at once; use 14 is lost, and so is the first copy of its resend. Use 15's answer shows
    14 lost (RACK) after the exchange's last new use, when nothing sent later could show a resend lost
    again: unanswered a least round trip later, the resend goes again, and that second copy completes the
    use, with no tail probe (before copies, the lost resend waited for the probe's silence and was probed).
    Exact; datagram by datagram and as one GSO run (where the kernel has UDP_SEGMENT). The probe's silence is
    50 ms here, not 2: a worker descheduled past both deadlines (a loaded CI machine) resends the use once, as
    the probe."""
    if gso and not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)):
        pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    monkeypatch.setattr(pacing, "PROBE_MIN_S", 0.05)
    copies_of_14, st = _tail_exchange(seed=11, lost=2, delay=0.0, timeout=0.2, gso=gso)
    assert len(copies_of_14) == 3, len(copies_of_14)
    assert (st.early_retransmissions, st.tail_copies, st.retransmissions, st.tail_probes) == (1, 1, 2, 0), st


def test_a_tail_resend_answered_in_time_gets_no_second_copy() -> None:
    """The same exchange behind a 20 ms relay, and only use 14's first send lost: RACK resends it after the
    last new use, its answer comes one round trip (20 ms) later, before the second copy falls due (the least
    round trip plus a quarter of it, 25 ms): no second copy goes, and the aggregator answers nothing twice
    (sent back to back, as first built, the copy went at once and was answered again for nothing)."""
    sends_of_14, st = _tail_exchange(seed=12, lost=1, delay=0.02, timeout=0.5, gso=False)
    assert len(sends_of_14) == 2, len(sends_of_14)
    assert (st.early_retransmissions, st.tail_copies, st.retransmissions, st.tail_probes) == (1, 0, 1, 0), st
    assert st.unexpected == 0, st


@pytest.mark.skipif(not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
                    reason="the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
def test_a_resend_in_the_run_of_the_last_new_uses_gets_a_second_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Window 4, 6 uses, sent as segmentation-offload runs; use 1's first send and its resend are lost. The
    worker reads the answers of uses 0, 2 and 3 in one batch (it was descheduled while they came), RACK finds
    use 1 lost at once (no reordering margin here), and the same pass sends the last new uses, 4 and 5, and
    then the resend, in one run: nothing is sent after that resend, as after one found once every new use
    is out. Unanswered a least round trip later, it goes again, and that copy completes the use, with no
    tail probe. (Only resends found after the pass that sent the last new use got a copy: this one waited
    for the probe's silence. In DDP steps with 5 % loss, such resends were 44 % of the tail probes.) The probe's
    silence is 150 ms here, not twice the least round trip (40 ms): a worker descheduled for 20 ms on a loaded CI
    machine probed the use before the copy's answer came, a fourth send."""
    monkeypatch.setattr(Pacer, "reorder_margin", lambda self: 0.0)
    monkeypatch.setattr(pacing, "PROBE_MIN_S", 0.15)
    cfg = JobConfig(workers=1, slots=16, elems=K)
    sends_of_1, drop = _losing_first_sends(1, 2)

    class Descheduled(Transport):  # stops for 5 ms before its first read: the first answers come in one batch
        held = False

        def _receive_batch(self, sock: socket.socket) -> tuple[np.ndarray, np.ndarray]:
            if not self.held:
                self.held = True
                time.sleep(0.005)
            return super()._receive_batch(sock)

    idx = np.random.default_rng(13).integers(0, 16, 6 * K).astype(np.uint8)
    with serving_apart(cfg) as srv_port, delaying_relay(srv_port, 0.02, drop=drop) as port, \
            Descheduled(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), timeout=0.2, min_timeout=0.2,
                                        window=4, initial_window=4, gso=True, tail_duplicates=0)) as tr:
        res = tr.exchange_indices(idx)
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    assert len(sends_of_1) == 3, len(sends_of_1)
    st = tr.stats
    assert (st.early_retransmissions, st.tail_copies, st.retransmissions, st.tail_probes) == (1, 1, 2, 0), st


@pytest.mark.parametrize("gso", [False, True])
def test_the_last_uses_of_an_exchange_go_twice(gso: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``tail_duplicates=3``, the last 3 of 16 uses go out twice, with their first copies, and every
    other use once; the copies are counted apart from retransmissions (nothing was lost). With the default
    (32), a quarter of them: a short exchange is all tail. Under zero-fill, whose workers keep to one fixed
    timeout, and with ``tail_duplicates=0``, every use goes once."""
    if gso and not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)):
        pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    cfg = JobConfig(workers=1, slots=16, elems=K)
    # nothing is lost: a timer that fires, or a tail probe after a silence of a few ms (the aggregator
    # descheduled on a loaded machine: it resent the last 8 uses in one CI run), is not the mechanism under test
    slow = {"timeout": 2.0, "min_timeout": 2.0}
    monkeypatch.setattr(Pacer, "probe_gap", lambda self: 2.0)
    seen, st, _ = _sends_per_slot(cfg, tail_duplicates=3, gso=gso, **slow)
    assert seen.tolist() == [1] * 13 + [2] * 3, seen
    assert (st.tail_duplicates, st.retransmissions, st.packets_sent) == (3, 0, 19), st
    seen, st, _ = _sends_per_slot(cfg, gso=gso, **slow)
    assert seen.tolist() == [1] * 12 + [2] * 4 and st.tail_duplicates == 4, (seen, st)
    for kw in ({"loss_policy": "zero-fill"}, {"tail_duplicates": 0}):
        seen, st, _ = _sends_per_slot(cfg, gso=gso, **slow, **kw)
        assert seen.tolist() == [1] * 16 and st.tail_duplicates == 0, (kw, seen, st)


@pytest.mark.parametrize("gso", [False, True])
def test_a_use_resent_with_the_last_new_use_gets_no_duplicate(gso: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 uses, two in flight at a time; the first send of use 13 is lost. Use 14's answer shows it lost (RACK,
    no reordering margin here) in the pass that sends the last new use, 15, and resends it there. Of the last
    four uses (a quarter of the exchange) 12 and 14 are answered by then and 13 goes again as a resend: only 15
    gets a duplicate, whether the pass sends one segmentation run or datagram by datagram."""
    if gso and not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)):
        pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    monkeypatch.setattr(Pacer, "reorder_margin", lambda self: 0.0)
    sends_of_13, drop = _losing_first_sends(13, 1)
    seen, st, _ = _sends_per_slot(JobConfig(workers=1, slots=16, elems=K), drop, delay=0.01, window=2,
                                  initial_window=2, gso=gso)
    assert seen[15] == 2 and st.tail_duplicates == 1 and st.early_retransmissions == 1, (seen, st)
    assert len(sends_of_13) >= 2, sends_of_13


def test_a_request_lost_among_the_last_uses_is_completed_by_its_duplicate() -> None:
    """The first send of use 14 of 16 is lost. Its duplicate, sent with it (uses 12..15 go twice: a quarter of
    the exchange, fewer than ``TAIL_DUPLICATES``), completes it: nothing is resent, no tail probe, and the
    exchange takes far less than its 0.2 s timeout. (Without duplicates, RACK found the loss from use 15's
    answer and resent it: a round trip more, at an exchange's end where nothing else hides it.)"""
    cfg = JobConfig(workers=1, slots=16, elems=K)
    assert cfg.slots // 4 < TAIL_DUPLICATES
    sends_of_14, drop = _losing_first_sends(14, 1)
    seen, st, wall = _sends_per_slot(cfg, drop=drop)
    assert len(sends_of_14) == 2 and seen.tolist() == [1] * 12 + [2] * 4, (sends_of_14, seen)
    assert (st.tail_duplicates, st.retransmissions, st.tail_probes) == (4, 0, 0), st
    assert wall < 0.15, wall


@pytest.mark.skipif(not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
                    reason="the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
def test_resends_leave_as_runs_and_stay_exact() -> None:
    """The first copy of every fourth use's datagram is lost on the way (64 uses: 16 lost). The uses that
    a pass finds due go out again together, as one segmentation-offload run: every datagram, first
    sends and resends alike, leaves through ``_send_run``, each lost one is resent, and the sums are exact."""
    cfg = JobConfig(workers=1, slots=64, elems=K)
    seen: set[int] = set()

    def first_copy_of_every_fourth(data: bytes) -> bool:
        slot = Header.unpack_from(np.frombuffer(data, np.uint8)).slot
        if slot % 4 or slot in seen:
            return False
        seen.add(slot)
        return True

    runs: list[int] = []

    class Runs(Transport):
        def _send_run(self, rows: np.ndarray) -> None:
            runs.append(rows.shape[0])
            super()._send_run(rows)

    idx = np.random.default_rng(7).integers(0, 16, 64 * K).astype(np.uint8)
    with serving_apart(cfg) as srv_port, delaying_relay(srv_port, 0.0, drop=first_copy_of_every_fourth) as port, \
            Runs(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), timeout=0.05, tail_duplicates=0)) as tr:
        res = tr.exchange_indices(idx)
    assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
    assert len(seen) == 16
    assert tr.stats.retransmissions >= 16, tr.stats.retransmissions  # more only if a stall outlasts a timeout
    assert sum(runs) == 64 + tr.stats.retransmissions, runs


def test_congestion_window_backs_off_a_full_queue() -> None:
    """A queue of 12 packets (40 ms) in front of the aggregator: a fixed window of 64 uses overflows it
    on every burst; the congestion window halves on loss and stays near what the queue holds, so far
    fewer packets are lost and resent. Both stay exact."""
    cfg = JobConfig(workers=1, slots=64, elems=K)
    idx = np.random.default_rng(4).integers(0, 16, 256 * K).astype(np.uint8)
    retx = {}
    for cc in (False, True):
        with serving_apart(cfg) as srv_port, delaying_relay(srv_port, 0.04, capacity=12) as port, \
                Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), timeout=0.01,
                                          congestion_control=cc)) as tr:
            res = tr.exchange_indices(idx)
            assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
            retx[cc] = tr.stats.retransmissions
            if cc:
                assert 2 <= tr.pacer.window() <= 24
    assert retx[True] < retx[False] / 2, retx


@pytest.mark.skipif(not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
                    reason="the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
def test_gso_run_arrives_as_the_datagrams() -> None:
    """A run of 100 datagrams sent with UDP segmentation offload (two system calls: at most 64 segments
    each) arrives at a plain socket as the same 100 datagrams, in order; and an exchange sent that way
    is exact, with fewer system calls than datagrams."""
    cfg = JobConfig(workers=1, slots=128, elems=K)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sink.bind(("127.0.0.1", 0))
    sink.settimeout(5)
    rows = np.random.default_rng(9).integers(0, 256, (100, 300), dtype=np.uint8)
    with sink, Transport(TransportConfig(cfg, worker=0, aggregator=sink.getsockname())) as tr:
        assert tr.gso
        tr._send_run(rows)
        got = [sink.recv(65536) for _ in range(100)]
        assert tr.stats.gso_sends == 2 and tr.stats.packets_sent == 100
    assert got == [r.tobytes() for r in rows]
    idx = np.random.default_rng(2).integers(0, 16, 128 * K).astype(np.uint8)
    with serving(cfg) as srv, Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv.port))) as tr:
        res = tr.exchange_indices(idx)
        assert np.array_equal(res.sums, oracle(cfg, [idx], [0])) and not res.lost.any()
        assert 0 < tr.stats.gso_sends < tr.stats.packets_sent


def test_misuse_is_refused_before_a_use_is_claimed() -> None:
    """A call refused for its arguments raises ValueError naming them before it claims a use: a refused
    tensor id used to claim one, leaving this worker a use ahead of the job's others for good (every later
    exchange timed out); a norm beyond float32 waited out the deadline. Bad settings are refused at once."""
    cfg = JobConfig(workers=1, slots=8, elems=K)
    with serving(cfg) as srv:
        with Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", srv.port), deadline=5)) as tr:
            for call, says in ((lambda: tr.exchange_norm(1.0, tensor=-1), "tensor must be an integer in 0..4294967295"),
                               (lambda: tr.exchange_norm(1.0, tensor=1 << 40), "tensor must be an integer"),
                               (lambda: tr.exchange_indices(np.zeros(K, np.uint8), tensor=-1), "tensor must be"),
                               (lambda: tr.exchange_indices(np.full(K, 3.7)), "indices must be integers"),
                               (lambda: tr.exchange_norm(1e40), "fit float32"),
                               (lambda: tr.exchange_int32(np.ones(K, np.int32)), "needs an uncompressed job")):
                with pytest.raises(ValueError, match=says):
                    call()
            assert tr.next_use == 0
            assert tr.exchange_norm(2.5) == (2.5, 1)
    flat = JobConfig(job=2, workers=1, kind="uncompressed", slots=8, elems=K)
    tr = Transport(TransportConfig(flat, worker=0, aggregator=("127.0.0.1", 9)))
    for values, says in ((np.array([2**33]), "values must fit int32"), (np.array([2.7]), "values must be integers")):
        with pytest.raises(ValueError, match=says):
            tr.exchange_int32(values)
    assert tr.next_use == 0
    tr.close()
    for kw, says in (({"deadline": math.nan}, "deadline must be positive and finite"),
                     ({"shards": 0}, "shards must be an integer in 1..4096"),
                     ({"retries": -1}, "retries must be a non-negative integer"),
                     ({"worker": 0.5}, "worker id 0.5"),
                     ({"aggregator": ("127.0.0.1", 70000)}, "the port must be an integer in 1..65535")):
        with pytest.raises(ValueError, match=says):
            TransportConfig(cfg, **{"worker": 0, "aggregator": ("127.0.0.1", 9), **kw})
