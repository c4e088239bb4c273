"""A shard answers a burst exactly as it answers the same datagrams one at a time (issue: batch = one
by one). The engine's differential fuzz (test_fuzz.py) holds its *outputs* to the reference; this
holds the shard's *deliveries* (which bytes go to which address), where a batch's address learning
meets its completions: a worker whose first packet (or new address) comes after the completing packet
in the same batch must get only its retained result, as it would one by one."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.cli import build_parser
from aggregator.server import ServerConfig
from aggregator.shard import Shard, in_arrival_order
from tests.test_fuzz import CFG, UNCOMPRESSED, _damaged, _uncompressed_wire, _wire, damage, packet
from worker_lib.batch_io import sockaddr_in
from worker_lib.job import JobConfig
from worker_lib.udp_offload import enable_gro
from worker_lib.wire import Header, PacketType
from worker_lib.wire.protocol import Counter, DarCounter

SOURCES = [sockaddr_in("127.0.0.1", 40000 + i) for i in range(5)]


class Recorded:
    """A Shard on a loopback socket whose datagrams are fed directly and whose sends are recorded."""

    def __init__(self, jobs: list[JobConfig], engine: str = "compiled") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.shard = Shard(ServerConfig(port=0, batch=64, jobs=jobs, engine=engine), self.sock, 0, jobs)
        self.sent: list[tuple[bytes, bytes]] = []
        self.shard.io.send = self._record  # type: ignore[method-assign]

    def _record(self, buf: np.ndarray, rows: np.ndarray, lengths: np.ndarray, addrs: np.ndarray) -> int:
        for r, ln, a in zip(rows.tolist(), lengths.tolist(), addrs, strict=True):
            self.sent.append((a.tobytes(), buf[r, :ln].tobytes()))
        return len(rows)

    def feed(self, datagrams: list[tuple[bytes, bytes]]) -> None:
        """One receive batch: (source sockaddr_in, bytes) per datagram."""
        io = self.shard.io
        for i, (src, data) in enumerate(datagrams):
            io.rx[i, :len(data)] = np.frombuffer(data, np.uint8)
            io.rx_len[i] = len(data)
            io.rx_addr[i] = np.frombuffer(src, np.uint8)
        self.shard.handle_batch(len(datagrams))

    def close(self) -> None:
        self.shard.close()


@pytest.fixture(params=["compiled", "numpy"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Recorded, Recorded]]:
    a, b = Recorded([CFG, UNCOMPRESSED], request.param), Recorded([CFG, UNCOMPRESSED], request.param)
    yield a, b
    a.close()
    b.close()


def _deliveries(a: Recorded) -> dict[bytes, list[bytes]]:
    """What each destination got, in the order sent: the order of one destination's answers counts (RACK
    reads it), the order across destinations does not."""
    out: dict[bytes, list[bytes]] = {}
    for addr, data in a.sent:
        out.setdefault(addr, []).append(data)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(packet, damage, st.booleans(), st.integers(0, len(SOURCES) - 1)), min_size=1, max_size=48),
       st.integers(2, 48))
def test_bursts_deliver_what_one_by_one_delivers(pair: tuple[Recorded, Recorded], items: list, burst: int) -> None:
    """First contacts, completions, resends, stale rounds, workers changing address, damaged packets,
    two jobs: fed in bursts (vectorized paths) or one at a time, the same datagrams reach the same
    addresses and the counters agree."""
    one, bursts = pair
    one.sent.clear()
    bursts.sent.clear()
    one.shard.set_jobs([])
    bursts.shard.set_jobs([])  # a fresh state machine and address table per example
    one.shard.set_jobs([CFG, UNCOMPRESSED])
    bursts.shard.set_jobs([CFG, UNCOMPRESSED])
    one.shard.agg.counters[:] = 0
    bursts.shard.agg.counters[:] = 0
    datagrams = [(SOURCES[src], _damaged(_wire(p) if thc else _uncompressed_wire(p), dmg))
                 for p, dmg, thc, src in items]
    for d in datagrams:
        one.feed([d])
    for start in range(0, len(datagrams), burst):
        bursts.feed(datagrams[start:start + burst])
    assert _deliveries(bursts) == _deliveries(one)
    assert bursts.shard.agg.counters.tolist() == one.shard.agg.counters.tolist()


def test_first_contact_after_the_completion_gets_only_the_retained_result(pair: tuple[Recorded, Recorded]) -> None:
    """The case that was wrong: workers 0 and 1 complete slot 0 (threshold 2), then worker 2's first
    packet arrives in the same batch. One by one, worker 2 gets one result (the retained copy); the
    burst used to fan the completion out to it as well."""
    one, burst = pair
    cfg = CFG
    data = [(SOURCES[w], Header(**cfg.request_fields(PacketType.DATA, worker=w, slot=0, round=1))
             .pack(bytes(cfg.elems * cfg.bits // 8))) for w in range(3)]
    for d in data:
        one.feed([d])
    burst.feed(data)
    to_w2 = [pkt for addr, pkt in burst.sent if addr == SOURCES[2]]
    assert len(to_w2) == 1 and Header.unpack_from(to_w2[0]).type == PacketType.RESULT
    assert _deliveries(burst) == _deliveries(one)
    assert [a for a, _ in sorted(burst.sent)] == sorted([SOURCES[0], SOURCES[1], SOURCES[2]])


def test_dar_burst_delivers_what_one_by_one_delivers() -> None:
    """A dar job (n = 3, threshold 2): workers 0 and 1 complete the round, worker 2's first fragments
    follow in the same batch, from a new address; then worker 0 resends from another address. Burst
    and one by one deliver the same fragments to the same addresses."""
    from tests.test_dar import dar_spec, fragments, messages
    from worker_lib.job import parse_job_spec

    cfg = parse_job_spec(dar_spec("natural", 3, slots=1, elems=300) + ",threshold=2")
    msgs = messages("natural", 3, uses=1, seed=3)[0]
    frags = [fragments(cfg, msgs[w], w) for w in range(3)]
    datagrams = [(SOURCES[w], f) for w in range(3) for f in frags[w]] + [(SOURCES[4], frags[0][0])]
    one, burst = Recorded([cfg]), Recorded([cfg])
    try:
        for d in datagrams:
            one.feed([d])
        burst.feed(datagrams)
        timing = int(DarCounter.CPU_NS)  # time, not an outcome
        counts = [np.delete(r.shard.dar.counters, timing).tolist() for r in (burst, one)]
        assert counts[0] == counts[1]
        assert _deliveries(burst) == _deliveries(one)
        to_w2 = [pkt for addr, pkt in burst.sent if addr == SOURCES[2]]
        assert 0 < len(to_w2) < len(burst.sent) // 2  # its retained fragments, not the fan-out as well
    finally:
        one.close()
        burst.close()


def test_a_worker_gets_its_answers_in_the_order_its_packets_came(pair: tuple[Recorded, Recorded]) -> None:
    """Slot 0 is complete; then one batch brings slot 1's two requests (a completion, to both workers) and
    worker 0's resend of slot 0 (its retained result, to worker 0 alone). One by one, worker 0 gets slot 1's
    result first; the burst sent the retained result ahead of the completions, and a worker's RACK took slot
    1 for lost and resent it."""
    one, burst = pair
    cfg = CFG

    def request(w: int, slot: int) -> tuple[bytes, bytes]:
        return SOURCES[w], Header(**cfg.request_fields(PacketType.DATA, worker=w, slot=slot, round=1)).pack(
            bytes(cfg.elems * cfg.bits // 8))

    for rec in (one, burst):
        rec.feed([request(0, 0)])
        rec.feed([request(1, 0)])
    one.sent.clear()
    burst.sent.clear()
    batch = [request(0, 1), request(1, 1), request(0, 0)]
    for d in batch:
        one.feed([d])
    burst.feed(batch)
    to_w0 = [Header.unpack_from(pkt).slot for addr, pkt in burst.sent if addr == SOURCES[0]]
    assert to_w0 == [1, 0]
    assert _deliveries(burst) == _deliveries(one)


def test_results_follow_a_worker_to_its_new_address(pair: tuple[Recorded, Recorded]) -> None:
    """Addresses as the state table's destinations, written out: in one burst, job 4's workers 0 and 1
    send slot 0 from SOURCES[0] and [1] and job 9's worker 0 from SOURCES[2] (two jobs in one batch, each
    learnt); then, in a second burst, worker 1 of job 4 sends slot 1 from SOURCES[3] (same host, new port)
    and worker 0 completes it from its old address. The completion of slot 0 goes to SOURCES[0] and [1];
    that of slot 1 to SOURCES[0] and [3], not to the old [1]; job 9 completes nothing and sends nothing.
    A later batch of both jobs teaches job 9 its worker's new address, which job 4's worker has."""
    _, burst = pair
    cfg = CFG

    def data(w: int, slot: int, job: JobConfig = cfg) -> bytes:
        size = job.elems * job.bits // 8 if job.kind == "thc" else job.elems * 4
        return Header(**job.request_fields(PacketType.DATA, worker=w, slot=slot, round=1)).pack(bytes(size))

    burst.feed([(SOURCES[0], data(0, 0)), (SOURCES[2], data(0, 0, UNCOMPRESSED)), (SOURCES[1], data(1, 0))])
    first = sorted(a for a, _ in burst.sent)
    burst.sent.clear()
    burst.feed([(SOURCES[3], data(1, 1)), (SOURCES[0], data(0, 1))])
    second = sorted(a for a, _ in burst.sent)
    assert first == sorted([SOURCES[0], SOURCES[1]])
    assert second == sorted([SOURCES[0], SOURCES[3]])
    book = burst.shard.book.jobs
    assert bytes(book[cfg.job].addr[1]) == SOURCES[3] and bytes(book[UNCOMPRESSED.job].addr[0]) == SOURCES[2]
    # job 9's worker 0 moves to the address job 4's worker 0 has, in a batch of job 4's known workers
    burst.feed([(SOURCES[0], data(0, 1)), (SOURCES[0], data(0, 1, UNCOMPRESSED))])
    assert bytes(book[UNCOMPRESSED.job].addr[0]) == SOURCES[0]


def test_a_gro_shard_takes_every_datagram_one_receive_gives() -> None:
    """With UDP_GRO a receive cuts up to 64 datagrams out of each message, so one batch may hold more rows
    than --batch: the engine must take them all. It was sized by --batch and refused such a batch whole
    ("batch skipped after an internal error"): every datagram in it was lost, and at 10 Gbit/s the workers
    resent 10,000-22,000 of them per run."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    shard = Shard(ServerConfig(port=0, batch=16, gro=True, jobs=[CFG]), sock, 0, [CFG])
    try:
        if not shard.io.gro:
            pytest.skip("the kernel refuses UDP_GRO (udp(7), Linux 5.0+)")
        n = shard.io.batch
        assert n > 16
        shard.io.rx[:n, :4] = 0xAB  # four bytes: shorter than any header, dropped and counted as such
        shard.io.rx_len[:n] = 4
        shard.io.rx_addr[:n] = np.frombuffer(SOURCES[0], np.uint8)
        shard.handle_batch(n)
        assert shard.agg.counters[Counter.RX] == n
        assert shard.agg.counters[Counter.SHORT] == n
    finally:
        shard.close()


@pytest.mark.parametrize(("argv", "gro"), [([], True), (["--no-gro"], False)])
def test_a_shard_reads_coalesced_runs_unless_told_not_to(argv: list[str], gro: bool) -> None:
    """thc-aggregator reads with UDP_GRO by default, where the kernel has it; --no-gro reads datagram by
    datagram (docs/aggregator.md measures why GRO is the default)."""
    args = build_parser().parse_args(["--port", "0", *argv])
    assert args.gro is gro
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        if not enable_gro(probe):
            pytest.skip("the kernel refuses UDP_GRO (udp(7), Linux 5.0+)")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    shard = Shard(ServerConfig(port=0, jobs=[CFG], **({} if gro else {"gro": False})), sock, 0, [CFG])
    try:
        assert shard.io.gro is gro
    finally:
        shard.close()


def test_a_failing_capture_stops_and_the_shard_serves_on(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """--pcap on a disk that fills: the write that fails stops the capture, with one error line, and the
    batch is handled as without a capture (an OSError from the pcap ended the shard, every job with it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    shard = Shard(ServerConfig(port=0, batch=16, jobs=[CFG], pcap=tmp_path / "x.pcap"), sock, 0, [CFG])
    writes = []

    def full_disk(*frame: object) -> None:
        writes.append(frame)
        raise OSError(28, "No space left on device")

    try:
        shard.pcap.write = full_disk  # type: ignore[union-attr, method-assign]
        shard.io.rx[:8, :4] = 0xAB  # shorter than any header: dropped and counted as such
        shard.io.rx_len[:8] = 4
        shard.io.rx_addr[:8] = np.frombuffer(SOURCES[0], np.uint8)
        with caplog.at_level("ERROR", logger="aggregator.shard"):
            shard.handle_batch(8)
            shard.handle_batch(8)
        assert shard.pcap is None and len(writes) == 1
        assert shard.agg.counters[Counter.RX] == 16 and shard.agg.counters[Counter.SHORT] == 16
        said = f"pcap {tmp_path / 'x.pcap'}: capture stopped, the jobs keep being served: [Errno 28] No space left"
        assert [r.getMessage() for r in caplog.records] == [f"{said} on device"]
    finally:
        shard.close()


def test_sends_are_put_in_arrival_order_per_destination() -> None:
    """``in_arrival_order`` (the shard's and the leaf's mixed batches): an answer caused by the batch's last
    packet goes after the completions that earlier packets caused, destination by destination, each
    destination's sends together (one GSO run)."""
    a, b = (np.frombuffer(SOURCES[i], np.uint8) for i in (0, 1))
    rows = np.array([5, 0, 1, 0, 1])  # the answer to a's resend first, then the completions to a, then to b
    addrs = np.stack([a, a, a, b, b])
    src = np.array([0, 1, 0, 0, 0, 2])  # output row -> the input row that caused it: the resend came last
    r, ad = in_arrival_order(rows, addrs, src)
    to = {bytes(x): [int(y) for y, z in zip(r, ad, strict=True) if bytes(z) == bytes(x)] for x in (a, b)}
    assert to == {bytes(a): [0, 1, 5], bytes(b): [0, 1]}
    runs = [bytes(x) for x in ad]
    assert runs in ([bytes(a)] * 3 + [bytes(b)] * 2, [bytes(b)] * 2 + [bytes(a)] * 3)
