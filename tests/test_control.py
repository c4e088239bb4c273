"""The control plane of thc-aggregator (aggregator/control.py): the protocol without a socket, then
addresses, tokens and the socket thread."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator.control import (
    REFUSED,
    USAGE,
    ControlAddress,
    ControlChannel,
    ControlConfig,
    ControlConfigError,
    apply_command,
    authenticate,
    read_token,
    send_command,
)
from worker_lib.job import JobConfig

JOBS = {1: JobConfig(job=1, workers=2), 3: JobConfig(job=3, workers=4)}


def totals() -> dict[str, int]:
    return {"rx": 7}


def test_add_and_remove_change_a_copy_of_the_table() -> None:
    """add configures (or replaces) a job, remove forgets one; the caller's table is never mutated."""
    reply, new = apply_command("add job=5,workers=3", JOBS, totals)
    assert reply == "ok: job 5 configured" and new is not None and sorted(new) == [1, 3, 5]
    assert new[5].workers == 3 and sorted(JOBS) == [1, 3]
    reply, new = apply_command("remove 0x3", JOBS, totals)
    assert reply == "ok: job 3 removed" and new is not None and sorted(new) == [1]


def test_list_and_stats_answer_without_changing_anything() -> None:
    reply, new = apply_command("list", JOBS, totals)
    assert new is None and [j["job"] for j in json.loads(reply)] == [1, 3]
    reply, new = apply_command(" stats \n", JOBS, totals)
    assert new is None and json.loads(reply) == {"rx": 7}


def test_bad_commands_get_one_line_and_change_nothing() -> None:
    for text, want in (("remove 9", "error: no job 9"),
                       ("remove x", "error: remove takes one job id (remove ID), got 'x'"),
                       ("remove", "error: remove takes one job id"), ("remove 1 3", "error: remove takes one job id"),
                       ("add job=1,workers=99", "error: job 1: workers must be in 1..32"),
                       ("add job=1,workers=2,mtu=9217", "error: job 1: mtu must be in 68..9216"),
                       ("add", "error: add needs the job's id in its spec"),
                       ("add workers=8", "error: add needs the job's id in its spec"),  # would replace job 1
                       ("frobnicate", USAGE), ("", USAGE)):
        reply, new = apply_command(text, JOBS, totals)
        assert new is None and reply.startswith(want) and "\n" not in reply, (text, reply)


# --- who may drive it: addresses, tokens, sockets -------------------------------------------------

TOKEN = b"0123456789abcdef0123"
SECRET_KEY = 0x5EC2E7


def test_list_leaves_the_job_keys_out() -> None:
    jobs = {7: JobConfig(job=7, key=SECRET_KEY, workers=2)}
    reply, _ = apply_command("list", jobs, totals)
    assert json.loads(reply)[0]["job"] == 7 and "key" not in json.loads(reply)[0]
    assert str(SECRET_KEY) not in reply and hex(SECRET_KEY) not in reply
    assert str(SECRET_KEY) not in repr(jobs[7]) and hex(SECRET_KEY) not in repr(jobs[7])  # logs show repr


def test_addresses_parse_and_off_loopback_needs_a_token() -> None:
    assert ControlAddress.parse("./ctl.sock").path == "./ctl.sock"
    assert ControlAddress.parse("127.0.0.1:0") == ControlAddress(host="127.0.0.1", port=0)
    assert ControlAddress.parse("127.0.0.1:9").is_local and not ControlAddress.parse("10.0.0.1:9").is_local
    for bad in ("9500", "localhost:9", "127.0.0.1:70000", "1.2.3:4", "127.0.0.1:x"):
        with pytest.raises(ControlConfigError, match="socket path"):
            ControlAddress.parse(bad)
    with pytest.raises(ControlConfigError, match="control-token-file"):
        ControlConfig(ControlAddress.parse("0.0.0.0:9500"))
    assert ControlConfig(ControlAddress.parse("0.0.0.0:9500"), TOKEN).token == TOKEN


def test_token_file_must_be_private_and_long(tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_bytes(TOKEN + b"\nignored\n")
    f.chmod(0o600)
    assert read_token(f) == TOKEN
    f.chmod(0o640)
    with pytest.raises(ControlConfigError, match="chmod 600"):
        read_token(f)
    f.chmod(0o600)
    f.write_bytes(b"short\n")
    with pytest.raises(ControlConfigError, match="at least 16 bytes"):
        read_token(f)
    with pytest.raises(ControlConfigError, match="No such file"):
        read_token(tmp_path / "missing")


def test_authenticate_wants_the_exact_token_first() -> None:
    assert authenticate(b"list", None) == "list"
    assert authenticate(b"auth=" + TOKEN + b" list", TOKEN) == "list"
    for bad in (b"list", b"auth= list", b"auth=" + TOKEN[:-1] + b" list", b"auth=" + TOKEN + b"x list",
                b"list auth=" + TOKEN, b""):
        assert authenticate(bad, TOKEN) is None, bad


class Channel:
    """A ControlChannel over a fixed job table; ``apply()`` runs as a serving loop would."""

    def __init__(self, cfg: ControlConfig) -> None:
        self.jobs = [JobConfig(job=7, key=SECRET_KEY, workers=2)]
        self.installs: list[tuple[list[int], frozenset[int]]] = []  # (job ids, the ids to start fresh)
        self.ch = ControlChannel(cfg, lambda: self.jobs, totals)
        self.ch.start()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._serve, daemon=True)
        self._loop.start()

    def _serve(self) -> None:
        while not self._stop.wait(0.005):
            self.ch.apply(self.jobs, self._install)

    def _install(self, jobs: list[JobConfig], fresh: frozenset[int]) -> None:
        self.jobs = jobs
        self.installs.append((sorted(j.job for j in jobs), fresh))

    def close(self) -> None:
        self._stop.set()
        self._loop.join()
        self.ch.close()


@pytest.fixture
def udp_channel() -> Iterator[Channel]:
    c = Channel(ControlConfig(ControlAddress.parse("127.0.0.1:0"), TOKEN))
    yield c
    c.close()


def test_token_protected_udp_control(udp_channel: Channel) -> None:
    """With a token: the right one drives it; none or a wrong one is refused, with a reply no larger
    than the request, and nothing changes."""
    addr = udp_channel.ch.address
    assert send_command(addr, "add job=9,workers=3", token=TOKEN) == "ok: job 9 configured"
    assert sorted(j["job"] for j in json.loads(send_command(addr, "list", token=TOKEN))) == [7, 9]
    for token in (None, b"0123456789abcdef012X", TOKEN + b"0"):
        reply = send_command(addr, "remove 9", token=token)
        sent = len("remove 9") + (len(b"auth= " + token) if token else 0)
        assert REFUSED.startswith(reply) and len(reply) <= sent, reply
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a 1-byte probe gets at most 1 byte
        s.settimeout(2)
        s.sendto(b"l", (addr.host, addr.port))
        assert s.recv(65536) == REFUSED.encode()[:1]
    assert sorted(j.job for j in udp_channel.jobs) == [7, 9]
    assert udp_channel.ch.counts == {"control_commands": 2, "control_refused": 4}


@pytest.mark.alone  # the reader must keep up with 5,000 datagrams sent in a burst
def test_a_flood_of_refused_datagrams_is_answered_within_budget(udp_channel: Channel) -> None:
    """Thousands of unauthenticated datagrams: counted, at most ~REFUSALS_PER_S answered per second,
    and the owner's command still goes through."""
    addr = (udp_channel.ch.address.host, udp_channel.ch.address.port)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        t0 = time.monotonic()
        for i in range(5000):
            s.sendto(b"stats %d" % i, addr)
            if i % 200 == 0:
                time.sleep(0.002)  # let the reader keep up: the test counts, it does not overflow buffers
        elapsed = time.monotonic() - t0
        time.sleep(0.3)
        replies = 0
        while True:
            try:
                data = s.recv(65536)
            except BlockingIOError:
                break
            assert REFUSED.encode().startswith(data)
            replies += 1
    assert send_command(udp_channel.ch.address, "stats", token=TOKEN) == '{"rx": 7}'
    refused = udp_channel.ch.counts["control_refused"]
    assert refused >= 4000, refused
    assert replies <= 100 + 100 * (elapsed + 0.5), (replies, elapsed)


def test_an_add_of_an_unchanged_job_starts_it_fresh(tmp_path: Path) -> None:
    """``add`` of a configured id with the same settings still installs the job list, naming the id as one
    to start fresh (docs/protocol.md, "A new run needs a fresh job"); a ``remove`` of the last job installs
    the empty list; a refused command installs nothing."""
    c = Channel(ControlConfig(ControlAddress(path=str(tmp_path / "ctl.sock"))))
    try:
        spec = c.jobs[0].spec()
        assert send_command(c.ch.address, f"add {spec}") == "ok: job 7 configured"
        assert send_command(c.ch.address, "add job=9,workers=3") == "ok: job 9 configured"
        assert send_command(c.ch.address, "remove 9") == "ok: job 9 removed"
        assert send_command(c.ch.address, "remove 9") == "error: no job 9"
        assert send_command(c.ch.address, "remove 7") == "ok: job 7 removed"
        assert c.installs == [([7], {7}), ([7, 9], {9}), ([7], set()), ([], set())]
    finally:
        c.close()


def test_unix_socket_is_private_and_replaced_when_stale(tmp_path: Path) -> None:
    path = tmp_path / "ctl.sock"
    c = Channel(ControlConfig(ControlAddress(path=str(path))))
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert send_command(c.ch.address, "remove 7") == "ok: job 7 removed"
        assert json.loads(send_command(c.ch.address, "list")) == []
        with pytest.raises(OSError, match="in use by a running process"):
            ControlChannel(ControlConfig(ControlAddress(path=str(path))), lambda: [], totals)
    finally:
        c.close()
    assert not path.exists()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays: a process that died
    c = Channel(ControlConfig(ControlAddress(path=str(path))))
    try:
        assert send_command(c.ch.address, "stats") == '{"rx": 7}'
    finally:
        c.close()
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        ControlChannel(ControlConfig(ControlAddress(path=str(path))), lambda: [], totals)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: connecting as another user (uid 65534)")
def test_unix_socket_refuses_other_users(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    path = tmp_path / "ctl.sock"
    c = Channel(ControlConfig(ControlAddress(path=str(path))))
    try:
        pid = os.fork()
        if pid == 0:  # the child becomes 'nobody' and tries to drive the aggregator
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                send_command(c.ch.address, "remove 7", timeout=1)
                code = 1
            except PermissionError:
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0, "uid 65534 reached a 0600 control socket"
        assert [j.job for j in c.jobs] == [7] and c.ch.counts["control_commands"] == 0
    finally:
        c.close()


def _udp_ipv4(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    """An IPv4+UDP datagram with a chosen source address (UDP checksum 0: none, allowed in IPv4)."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    return ip + struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a raw socket to forge a source address")
def test_a_forged_peer_without_the_token_is_refused_with_a_small_reply(udp_channel: Channel) -> None:
    """A datagram forged from 127.0.0.2 (a victim) asks for `list`: the token is missing, so nothing
    is done and the victim receives at most as many bytes as the forger sent."""
    addr = udp_channel.ch.address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as victim, \
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
        victim.bind(("127.0.0.2", 0))
        victim.settimeout(2)
        payload = b"remove 7"
        raw.sendto(_udp_ipv4("127.0.0.2", addr.host, victim.getsockname()[1], addr.port, payload), (addr.host, 0))
        data = victim.recv(65536)
    assert data == REFUSED.encode()[:len(payload)]
    assert [j.job for j in udp_channel.jobs] == [7] and udp_channel.ch.counts["control_refused"] == 1
