"""worker_lib.batch_io.BatchSocket: a batch of rows reaches its addresses as the same datagrams, in order,
with and without segmentation offload (runs to one address of one length leave as one message)."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

from aggregator.server import ServerConfig
from aggregator.shard import Shard
from tests.test_transport import loopback_multicast_problem
from worker_lib.batch_io import BatchSocket, _cut_runs, sockaddr_in, udp_socket
from worker_lib.job import JobConfig
from worker_lib.udp_offload import SOL_UDP, UDP_SEGMENT, gso_available


def _receivers(n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind(("127.0.0.1", 0))
        s.settimeout(5)
        out.append(s)
    return out


@pytest.mark.parametrize("gso", [False, True])
def test_rows_arrive_as_their_datagrams(gso: bool) -> None:
    """200 datagrams to 3 receivers: runs to one receiver (one of 150 of equal length: more than 64
    segments), lengths that change inside a run, a run of one, receivers that alternate. Each receiver
    gets exactly its rows, in order; with offload fewer messages than datagrams are sent."""
    if gso and not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)):
        pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    rx = _receivers(3)
    addrs = np.stack([np.frombuffer(sockaddr_in(*s.getsockname()), np.uint8) for s in rx])
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, (256, 600), dtype=np.uint8)
    dest = np.array([0] * 150 + [1] * 20 + [2] + [0, 1] * 10 + [2] * 9)
    lengths = np.array([544] * 150 + [300] * 10 + [200] * 10 + [50] + [544] * 29)
    rows = rng.permutation(256)[:200]
    tx = BatchSocket(udp_socket("127.0.0.1", 0), batch=8, gso=gso)
    try:
        assert tx.send(buf, rows, lengths, addrs[dest]) == 200
        assert tx.send_errors == 0
        for r, s in enumerate(rx):
            want = [buf[rows[k], :lengths[k]].tobytes() for k in np.flatnonzero(dest == r)]
            got = [s.recv(65536) for _ in want]
            assert got == want
            s.settimeout(0.05)
            with pytest.raises(TimeoutError):
                s.recv(65536)
        if gso:
            # runs of more than one datagram: the 150 (64 + 64 + 22), the 10 + 10 of two lengths, the last 9
            assert tx.gso
            assert tx.gso_messages == 6, tx.gso_messages
        else:
            assert tx.gso_messages == 0
    finally:
        tx.sock.close()
        for s in rx:
            s.close()


def test_runs_are_cut_at_the_byte_limit() -> None:
    """A run of 100 datagrams of 1,400 bytes to one receiver leaves as messages of at most 46 datagrams
    (65,507 // 1,400: the most one UDP message may carry), 46 + 46 + 8, and arrives whole and in order."""
    if not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)):
        pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    (rx,) = _receivers(1)
    addr = np.frombuffer(sockaddr_in(*rx.getsockname()), np.uint8)
    buf = np.random.default_rng(3).integers(0, 256, (100, 1400), dtype=np.uint8)
    tx = BatchSocket(udp_socket("127.0.0.1", 0), batch=8, gso=True)
    try:
        assert tx.send(buf, np.arange(100), np.full(100, 1400), np.repeat(addr[None, :], 100, axis=0)) == 100
        assert tx.gso and tx.gso_messages == 3, tx.gso_messages
        assert [rx.recv(65536) for _ in range(100)] == [row.tobytes() for row in buf]
    finally:
        tx.sock.close()
        rx.close()


def test_a_run_to_a_multicast_group_arrives_as_its_datagrams() -> None:
    """A multicast job's results leave as segmentation-offload runs too: 100 datagrams from a multicast
    aggregator's shard to a group on the loopback interface reach two members, each exactly those
    datagrams in order, from 2 messages."""
    if not gso_available(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)):
        pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    problem = loopback_multicast_problem()
    if problem:
        pytest.skip(problem)
    group = "239.77.0.3"
    probe = _receivers(1)[0]
    port = probe.getsockname()[1]  # a free port
    probe.close()
    membership = socket.inet_aton(group) + socket.inet_aton("127.0.0.1")
    members = []
    for _ in range(2):
        m = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        m.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        m.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        m.bind((group, port))
        m.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
        m.settimeout(5)
        members.append(m)
    # the socket a multicast aggregator's shard sends from (it sets the interface and loopback itself)
    cfg = ServerConfig(port=0, host="127.0.0.1", multicast=True,
                       jobs=[JobConfig(workers=2, multicast=f"{group}:{port}")])
    shard = Shard(cfg, udp_socket("127.0.0.1", 0), 0, cfg.jobs)
    tx, sock = shard.io, shard.io.sock
    assert tx.gso  # before the send: a refused run would also turn it off
    buf = np.random.default_rng(2).integers(0, 256, (100, 1056), dtype=np.uint8)
    dest = np.repeat(np.frombuffer(sockaddr_in(group, port), np.uint8)[None, :], 100, axis=0)
    try:
        assert tx.send(buf, np.arange(100), np.full(100, 1056), dest) == 100
        assert tx.gso and tx.gso_messages == 2, tx.gso_messages  # 64 + 36
        for m in members:
            assert [m.recv(65536) for _ in range(100)] == [row.tobytes() for row in buf]
            m.settimeout(0.05)
            with pytest.raises(TimeoutError):
                m.recv(65536)
    finally:
        sock.close()
        for m in members:
            m.close()


def _gro_receiver(batch: int, *, segmented: bool = False) -> BatchSocket:
    """A loopback socket that reads with UDP_GRO, ``batch`` datagrams per receive; the test skips where the
    kernel lacks UDP_GRO, or UDP_SEGMENT where the test sends ``segmented`` runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        if segmented and not gso_available(probe):
            pytest.skip("the kernel has no UDP_SEGMENT (udp(7), Linux 4.18+)")
    rx = BatchSocket(udp_socket("127.0.0.1", 0), batch=batch, gro=True)
    if not rx.gro:
        rx.sock.close()
        pytest.skip("the kernel refuses UDP_GRO (udp(7), Linux 5.0+)")
    return rx


def test_gro_receive_cuts_runs_back_into_their_datagrams() -> None:
    """A receiver with UDP_GRO gets runs sent with UDP_SEGMENT as one message each and cuts them back:
    the 150 datagrams of one length (runs of 64, 64, 22), then datagrams of other lengths and single ones,
    arrive as the same bytes, lengths, sources and order as sent; some messages did carry several."""
    rx = _gro_receiver(128, segmented=True)
    tx = BatchSocket(udp_socket("127.0.0.1", 0), batch=8, gso=True)
    try:
        rng = np.random.default_rng(3)
        buf = rng.integers(0, 256, (256, 600), dtype=np.uint8)
        lengths = np.array([544] * 150 + [300] * 10 + [200] * 10 + [50] + [37])
        rows = rng.permutation(256)[:lengths.size]
        me = np.frombuffer(sockaddr_in(*rx.sock.getsockname()), np.uint8)
        assert tx.send(buf, rows, lengths, np.repeat(me[None, :], lengths.size, axis=0)) == lengths.size
        got: list[bytes] = []
        srcs = set()
        while len(got) < lengths.size and rx.wait(2.0):
            n = rx.recv()
            got += [rx.rx[i, :rx.rx_len[i]].tobytes() for i in range(n)]
            srcs |= {rx.rx_addr[i].tobytes() for i in range(n)}
        assert got == [buf[r, :length].tobytes() for r, length in zip(rows, lengths, strict=True)]
        assert srcs == {sockaddr_in(*tx.sock.getsockname())}
        assert rx.gro_messages >= 3  # at least the three runs of 544-byte datagrams came whole
    finally:
        tx.sock.close()
        rx.sock.close()


def test_gro_receive_of_single_datagrams_gives_the_batch_asked_for() -> None:
    """Datagrams sent one per message (no GSO) reach a UDP_GRO socket one per message: one receive still
    takes at least the ``batch`` the socket was made with (not a quarter of it, the messages one call
    reads), in order, and the next receive the rest."""
    rx = _gro_receiver(128)
    tx = BatchSocket(udp_socket("127.0.0.1", 0), batch=256)
    try:
        rng = np.random.default_rng(5)
        buf = rng.integers(0, 256, (200, 64), dtype=np.uint8)
        lengths = rng.integers(20, 65, 200)
        me = np.frombuffer(sockaddr_in(*rx.sock.getsockname()), np.uint8)
        assert tx.send(buf, np.arange(200), lengths, np.repeat(me[None, :], 200, axis=0)) == 200
        assert rx.wait(2.0)
        time.sleep(0.1)  # loopback queues them within the send (one softirq pass); this covers a deferred one
        first = rx.recv()
        assert 128 <= first < 200, first
        got = [rx.rx[i, :rx.rx_len[i]].tobytes() for i in range(first)]
        while len(got) < 200 and rx.wait(2.0):
            n = rx.recv()
            got += [rx.rx[i, :rx.rx_len[i]].tobytes() for i in range(n)]
        assert got == [buf[i, :length].tobytes() for i, length in enumerate(lengths)]
        assert rx.gro_messages == 0
    finally:
        tx.sock.close()
        rx.sock.close()


def test_cutting_a_message_stops_at_the_last_row() -> None:
    """A message of more datagrams than rows are left (a local sender's run past GSO_SEGMENTS) fills the
    rows and drops the rest, rather than write past the buffer."""
    raw = np.arange(2 * 64, dtype=np.uint8).reshape(2, 64) % 251
    rx, rx_len, rx_addr = np.zeros((3, 16), np.uint8), np.zeros(3, np.int64), np.zeros((3, 16), np.uint8)
    addrs = np.full((2, 16), 7, np.uint8)
    n = _cut_runs(raw, np.array([50, 10]), np.array([10, 10]), addrs, rx, rx_len, rx_addr)
    assert n == 3
    assert rx_len.tolist() == [10, 10, 10]
    assert [rx[i, :10].tolist() for i in range(3)] == [raw[0, 10 * i:10 * i + 10].tolist() for i in range(3)]
    assert (rx_addr == 7).all()


def test_a_run_longer_than_the_rows_is_cut_short_not_written_past_them() -> None:
    """A local sender may pass up to 128 segments in one UDP_SEGMENT send (this kernel; the GRO of a NIC stops
    at 64), and loopback hands the run whole to a UDP_GRO socket: a socket whose rows hold 64 takes the
    first 64 datagrams and drops the rest, as a full socket buffer would."""
    rx = _gro_receiver(4, segmented=True)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        run = np.arange(128 * 8, dtype=np.uint16).astype(np.uint8)
        try:
            tx.sendmsg([run.tobytes()], [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", 8))], 0, rx.sock.getsockname())
        except OSError as exc:
            pytest.skip(f"the kernel refuses a run of 128 segments ({exc}; Linux before 6.x allows 64)")
        assert rx.wait(2.0)
        assert rx.batch == 64
        assert rx.recv() == 64
        assert rx.rx_len[:64].tolist() == [8] * 64
        assert rx.rx[:64, :8].reshape(-1).tolist() == run[:512].tolist()
    finally:
        tx.close()
        rx.sock.close()
