"""``thc-aggregator`` as a process: startup, clean shutdown, SIGHUP reload, stats, metrics, shards,
configuration errors, pcap."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aggregator.cli import main as cli_main
from launchers.aggregator_process import listening_port, stop_process
from tests.cli_support import assert_one_line_refusal, call_main
from worker_lib.job import JobConfig, JobConfigError, load_jobs, parse_job_spec
from worker_lib.thc import lookup_sum
from worker_lib.transport import Transport, TransportConfig
from worker_lib.wire import Header, PacketType
from worker_lib.wire.pcap import read_pcap

K = 64


@contextlib.contextmanager
def aggregator(*args: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """Start thc-aggregator on a free loopback port; always stopped (then killed) at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line + proc.stderr.read()
        proc.first_line = line  # type: ignore[attr-defined]
        yield proc, listening_port(line)
    finally:
        stop_process(proc, timeout=5)


def free_tcp_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def norm_roundtrip(port: int, cfg: JobConfig, shards: int = 1, deadline: float = 3.0) -> float:
    """A 1-worker norm exchange (its own max) through the aggregator."""
    with Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), shards=shards,
                                   deadline=deadline)) as tr:
        return tr.exchange_norm(2.5)[0]


def spec(cfg: JobConfig) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.to_dict().items())


def test_sigterm_stops_cleanly() -> None:
    """SIGTERM (and SIGINT) stop the server with exit code 0 and a final line."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        with aggregator() as (proc, _port):
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=5)
            assert proc.returncode == 0 and "stopped" in out


def test_default_job_and_stats_interval() -> None:
    """Without jobs it serves the default job; --stats-interval prints rates, completions and drops."""
    default = JobConfig()
    with aggregator("--stats-interval", "0.2") as (proc, port):
        one = JobConfig(workers=1)  # same id and key, but n=1 is not what the server has
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"\x01junk", ("127.0.0.1", port))
        s.sendto(Header(type=PacketType.NORM, job=default.job, key=default.key, table_id=default.table_id, worker=9,
                        elems=1, width=32).pack(b"\0\0\0\1"), ("127.0.0.1", port))
        s.close()
        assert one.key == default.key
        time.sleep(0.6)
        proc.terminate()
        out, _ = proc.communicate(timeout=5)
    assert "pkt/s" in out and "elements" in out and "'short': 1" in out and "'bad_worker': 1" in out


def test_job_spec_and_config_errors_are_clear(tmp_path: Path) -> None:
    """Overflowing g*n, too many workers and bad files are refused with messages that say why."""
    with pytest.raises(JobConfigError, match="does not fit 8-bit results"):
        parse_job_spec("job=3,workers=16,result_bits=8")
    with pytest.raises(JobConfigError, match=r"workers must be in 1\.\.32"):
        parse_job_spec("workers=33")
    with pytest.raises(JobConfigError, match="exceeds the mtu"):
        JobConfig(workers=32, elems=1024)
    with pytest.raises(JobConfigError, match="empty job spec: give key=value pairs"):
        parse_job_spec(" ")
    with pytest.raises(JobConfigError,
                       match=r"^job 2: mtu must be in 68\.\.9216 \(IPv4's least to a jumbo frame\), got 9217$"):
        parse_job_spec("job=2,mtu=9217")
    with pytest.raises(JobConfigError, match="workers is given twice \\('2' and '3'\\)"):
        parse_job_spec("job=1,workers=2, workers = 3")
    bad = tmp_path / "jobs.toml"
    bad.write_text("[[job]]\njob = 1\nworkerz = 3\n")
    with pytest.raises(JobConfigError, match="unknown keys \\['workerz'\\]"):
        load_jobs(bad)
    bad.write_text("[[job]]\njob = 2\nworkers = 0\n")  # a setting out of range names the file too
    with pytest.raises(JobConfigError, match=f"^{bad}: job 2: workers must be in 1..32, got 0$"):
        load_jobs(bad)
    bad.write_text("[[job]]\njob = 2\nbits = 2\ngranularity = 5\ntable = [0, 1.5, 3, 5]\n")  # int() gave 1
    with pytest.raises(JobConfigError, match=re.escape("table must be integers (N:N:... in a spec, an array in a "
                                                       "file), got [0, 1.5, 3, 5]")):
        load_jobs(bad)
    bad.write_bytes(b"\xff\xfe[[job]]")
    with pytest.raises(JobConfigError, match=f"^{bad}: not a UTF-8 text file"):
        load_jobs(bad)
    with pytest.raises(JobConfigError, match=f"^job config file {tmp_path}: Is a directory$"):
        load_jobs(tmp_path)
    r = subprocess.run([sys.executable, "-m", "aggregator.cli", "--port", "0", "--job", "workers=16,result_bits=8"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "does not fit" in r.stderr


@pytest.mark.parametrize("kw, says", [
    ({"workers": 4.5}, "workers must be an integer, got 4.5"),
    ({"slots": "8"}, "slots must be an integer, got '8'"),
    ({"threshold": 2.5}, "threshold must be an integer"),
    ({"job": True}, "job must be an integer"),
    ({"leaves": 4}, "leaves must be a sequence of integers, got 4"),
    ({"p": "1/32"}, "p must be a number"),
])
def test_a_job_setting_of_the_wrong_type_is_named(kw: dict, says: str) -> None:
    """JobConfig built in code (not through a spec, whose parser converts): a setting of the wrong type is
    refused by name (a float slot count used to fail later in the transport's arithmetic)."""
    with pytest.raises(JobConfigError, match=re.escape(says)):
        JobConfig(**kw)


def test_sighup_reload_adds_and_removes_jobs(tmp_path: Path) -> None:
    """Jobs added to the file serve after SIGHUP; removed ones are then dropped as unknown."""
    a = JobConfig(job=5, key=0x55, workers=1, slots=4, elems=K)
    b = JobConfig(job=6, key=0x66, workers=1, slots=4, elems=K)
    path = tmp_path / "jobs.toml"
    path.write_text(f"[[job]]\njob = 5\nkey = {a.key}\nworkers = 1\nslots = 4\nelems = {K}\n")
    assert load_jobs(path) == [a]
    with aggregator("--config", str(path)) as (proc, port):
        assert norm_roundtrip(port, a) == 2.5
        path.write_text(f"[[job]]\njob = 6\nkey = {b.key}\nworkers = 1\nslots = 4\nelems = {K}\n")
        proc.send_signal(signal.SIGHUP)
        assert proc.stdout.readline().startswith("reloaded: jobs [6]")
        assert norm_roundtrip(port, b) == 2.5
        from worker_lib.transport import AggregatorUnreachable

        with pytest.raises(AggregatorUnreachable):
            norm_roundtrip(port, a, deadline=0.3)
        path.write_text("[[job]]\njob = 6\nworkers = 99\n")
        proc.send_signal(signal.SIGHUP)
        assert "reload refused" in proc.stdout.readline()
        assert norm_roundtrip(port, b) == 2.5  # the bad file kept the current jobs


def test_metrics_endpoint() -> None:
    """--metrics-port exports the counters (received, completed, drops by reason) for Prometheus."""
    cfg = JobConfig(job=7, key=0x77, workers=1, slots=4, elems=K)
    mport = free_tcp_port()
    with aggregator("--job", spec(cfg), "--metrics-port", str(mport)) as (_proc, port):
        assert norm_roundtrip(port, cfg) == 2.5
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"\x02" * 40, ("127.0.0.1", port))
        s.close()
        text = ""
        for _ in range(50):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.1)
                continue
            if 'thc_aggregator_dropped_total{reason="bad_version",shard="0"} 1.0' in text:
                break
            time.sleep(0.1)
    assert 'thc_aggregator_completed_total{shard="0"} 1.0' in text
    assert 'thc_aggregator_dropped_total{reason="bad_version",shard="0"} 1.0' in text


@pytest.mark.parametrize("kw, says", [
    ({"shards": 0}, "shards must be in 1..64"),
    ({"member": 2, "members": 2}, "member must be in 0..members-1"),
    ({"batch": 0}, "batch must be in 1..4096"),
    ({"batch": 5000}, "batch must be in 1..4096"),
    ({"stats_interval": -1.0}, "stats_interval must be >= 0"),
])
def test_server_config_refuses_out_of_range_settings(kw: dict, says: str) -> None:
    """ServerConfig checks every range itself, not only through thc-aggregator's argparse types: a library
    user gets the same refusal."""
    from aggregator.server import ServerConfig

    with pytest.raises(ValueError, match=says):
        ServerConfig(**kw)
    assert ServerConfig(shards=2, member=1, members=3).global_shard(1) == (3, 6)


def test_a_member_serves_only_its_share_of_the_slots() -> None:
    """--member 1/2 --shards 2: of 4 global shards this aggregator holds 2 and 3, so its port + 0 answers
    slot 2 (2 mod 4) and drops slot 0 (member 0's) as wrong_shard; port + 1 answers slot 3."""
    cfg = JobConfig(job=8, key=0x88, workers=1, slots=8, elems=K)
    with aggregator("--job", spec(cfg), "--shards", "2", "--member", "1/2") as (_proc, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(0.3)

        def norm(slot: int) -> bytes:
            return Header(type=PacketType.NORM, job=cfg.job, key=cfg.key, table_id=cfg.table_id, worker=0,
                          slot=slot, round=1, elems=1, width=32).pack(b"\x40\0\0\0")

        s.sendto(norm(0), ("127.0.0.1", port))
        with pytest.raises(TimeoutError):
            s.recv(100)
        for slot, at in ((2, port), (3, port + 1)):
            s.sendto(norm(slot), ("127.0.0.1", at))
            hdr, _ = Header.parse(s.recv(100))
            assert hdr.type == PacketType.NORM_RESULT and hdr.slot == slot
        s.close()


def test_shards_serve_their_slots_exactly() -> None:
    """--shards 2: slot s is served at port base + s mod 2; sums exact; a slot sent to the wrong
    shard is dropped."""
    cfg = JobConfig(job=8, key=0x88, workers=2, slots=4, elems=K)
    rng = np.random.default_rng(0)
    idx = [rng.integers(0, 16, 10 * K).astype(np.uint8) for _ in range(2)]
    with aggregator("--job", spec(cfg), "--shards", "2") as (_proc, port):
        import threading

        trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", port), shards=2))
               for w in range(2)]
        out: list = [None, None]
        ths = [threading.Thread(target=lambda w=w: out.__setitem__(w, trs[w].exchange_indices(idx[w])))
               for w in range(2)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout=30)
        for tr in trs:
            tr.close()
        # slot 1 belongs to shard 1: shard 0 must drop it (no answer), shard 1 answers.
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(0.3)
        pkt = Header(type=PacketType.NORM, job=cfg.job, key=cfg.key, table_id=cfg.table_id, worker=0, slot=1,
                     round=100, elems=1, width=32).pack(b"\x40\0\0\0")
        s.sendto(pkt, ("127.0.0.1", port))
        with pytest.raises(TimeoutError):
            s.recv(100)
        s.sendto(pkt, ("127.0.0.1", port + 1))
        s.sendto(Header(type=PacketType.NORM, job=cfg.job, key=cfg.key, table_id=cfg.table_id, worker=1, slot=1,
                        round=100, elems=1, width=32).pack(b"\x40\0\0\0"),
                 ("127.0.0.1", port + 1))
        hdr, _ = Header.parse(s.recv(100))
        s.close()
    want = lookup_sum(cfg.values(), np.stack(idx)).reshape(-1, K)
    assert all(np.array_equal(o.sums, want) for o in out)
    assert hdr.type == PacketType.NORM_RESULT and hdr.contributors == 2


def test_pcap_written_and_readable(tmp_path: Path) -> None:
    """--pcap records every datagram in and out; dpkt reads them back with THC headers intact."""
    cfg = JobConfig(job=9, key=0x99, workers=1, slots=4, elems=K)
    pcap = tmp_path / "agg.pcap"
    with aggregator("--job", spec(cfg), "--pcap", str(pcap)) as (proc, port):
        assert norm_roundtrip(port, cfg) == 2.5
        proc.terminate()
        proc.wait(timeout=5)
    caps = read_pcap(pcap)
    ins = [c for c in caps if c.dst == ("127.0.0.1", port)]
    outs = [c for c in caps if c.src == ("127.0.0.1", port)]
    assert ins and len(ins) == len(outs) == len(caps) // 2  # a retransmission under load adds a pair
    for c in ins:
        assert Header.parse(c.payload)[0].type == PacketType.NORM
    for c in outs:
        hdr, payload = Header.parse(c.payload)
        assert hdr.type == PacketType.NORM_RESULT and c.dst == ins[0].src
        assert payload == np.float32(2.5).byteswap().tobytes()


def test_no_orphan_shards_after_stop() -> None:
    """With --shards 3, stopping the server leaves no shard process behind."""
    with aggregator("--shards", "3") as (proc, _port):
        time.sleep(0.5)
        children = _children(proc.pid)
        assert len(children) >= 3
        proc.terminate()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.05)
    assert not any(_alive(c) for c in children)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_control_commands_add_list_remove() -> None:
    """The control socket adds and removes jobs at runtime, lists them, and reports counters."""
    from aggregator.control import ControlAddress, send_command
    from worker_lib.transport import AggregatorUnreachable

    cfg = JobConfig(job=12, key=0x1212, workers=1, slots=4, elems=K)
    first = JobConfig(job=11, key=0x11, workers=1, slots=4, elems=K)
    with aggregator("--control", "127.0.0.1:0", "--job", spec(first)) as (proc, port):
        ctl = ControlAddress.parse(proc.first_line.split("control=")[1].split()[0])

        def ask(text: str) -> str:
            return send_command(ctl, text)

        assert ask(f"add {spec(cfg)}") == "ok: job 12 configured"
        assert norm_roundtrip(port, cfg) == 2.5
        assert sorted(j["job"] for j in json.loads(ask("list"))) == [11, 12]
        assert json.loads(ask("stats"))["completed"] == 1
        assert ask("remove 12") == "ok: job 12 removed"
        assert ask("remove 12").startswith("error: no job 12")
        assert ask("add job=1,workers=99").startswith("error: job 1: workers must be in 1..32")
        # datagrams larger than the aggregator's rows: refused in the reply (this add used to kill the aggregator)
        assert ask("add job=13,workers=1,mtu=65535").startswith("error: job 13: mtu must be in 68..9216")
        assert norm_roundtrip(port, first) == 2.5
        assert ask("frobnicate").startswith("error: unknown command")
        with pytest.raises(AggregatorUnreachable):
            norm_roundtrip(port, cfg, deadline=0.3)


@pytest.mark.alone  # measures the gaps between answers
def test_control_and_reload_never_stall_a_running_job(tmp_path: Path) -> None:
    """While job 11 exchanges without pause, a job whose table takes seconds to solve is added over
    the control socket, a dar job is added, one is removed, and a config file with another slow table
    is reloaded: no gap between answers grows beyond a fraction of a second."""
    from aggregator.control import ControlAddress, send_command

    cfg = JobConfig(job=11, key=0x11, workers=1, slots=4, elems=K)
    path = tmp_path / "jobs.toml"
    path.write_text(f"[[job]]\njob = 11\nkey = {cfg.key}\nworkers = 1\nslots = 4\nelems = {K}\n")
    sock = tmp_path / "ctl.sock"
    with aggregator("--control", str(sock), "--config", str(path)) as (proc, port):
        stamps: list[float] = []
        stop = threading.Event()

        def exchange() -> None:
            with Transport(TransportConfig(cfg, worker=0, aggregator=("127.0.0.1", port), deadline=5)) as tr:
                while not stop.is_set():
                    tr.exchange_norm(2.5)
                    stamps.append(time.monotonic())

        t = threading.Thread(target=exchange)
        t.start()
        try:
            time.sleep(0.3)
            ctl = ControlAddress(path=str(sock))
            t0 = time.monotonic()
            slow = "job=12,key=0x12,workers=2,granularity=3000,bits=8,slots=8,elems=1024,mtu=9000"
            assert send_command(ctl, f"add {slow}", timeout=60) == "ok: job 12 configured"
            solve_s = time.monotonic() - t0
            dar = "job=13,key=0x13,kind=dar,codec=topk10,length=4096,max_message=32768,workers=2,slots=2"
            assert send_command(ctl, f"add {dar}", timeout=60) == "ok: job 13 configured"
            assert send_command(ctl, "remove 12") == "ok: job 12 removed"
            path.write_text(path.read_text() + "[[job]]\njob = 14\nworkers = 2\ngranularity = 2900\nbits = 8\n"
                            "slots = 8\nelems = 1024\nmtu = 9000\n")
            proc.send_signal(signal.SIGHUP)
            lines = [proc.stdout.readline() for _ in range(4)]
            assert lines[-1].startswith("reloaded: jobs [11, 14]"), lines
            time.sleep(0.2)
        finally:
            stop.set()
            t.join()
    gaps = np.diff(stamps)
    assert solve_s > 0.5, f"the added job solved in {solve_s:.2f} s: too fast to show a stall"
    assert len(stamps) > 100 and gaps.max() < 0.25, f"largest gap {gaps.max():.3f} s while adding {solve_s:.1f} s"


def test_control_socket_is_private_and_token_checked(tmp_path: Path) -> None:
    """--control PATH is a 0600 Unix socket; with --control-token-file, thc-control needs the token;
    list never shows a job's key; an off-loopback address without a token is refused at startup."""
    import stat as stat_mod

    secret = JobConfig(job=11, key=0x5EC2E7, workers=1, slots=4, elems=K)
    tok = tmp_path / "tok"
    tok.write_text("0123456789abcdef01\n")
    tok.chmod(0o600)
    sock = tmp_path / "ctl.sock"
    with aggregator("--control", str(sock), "--control-token-file", str(tok), "--job", spec(secret)) as (proc, port):
        assert f"control=unix:{sock}" in proc.first_line
        assert stat_mod.S_IMODE(sock.stat().st_mode) == 0o600
        ctl = [sys.executable, "-m", "aggregator.control_cli", str(sock)]
        r = subprocess.run([*ctl, "list"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and r.stderr.strip() == \
            "thc-control: the aggregator refused the command: bad or missing token (--token-file)"
        r = subprocess.run([*ctl, "--token-file", str(tok), "list"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and '"job": 11' in r.stdout
        assert str(secret.key) not in r.stdout + proc.first_line and hex(secret.key) not in r.stdout
        r = subprocess.run([*ctl, "--token-file", str(tok), "remove", "9"], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 1 and r.stdout.strip() == "error: no job 9"
        assert norm_roundtrip(port, secret) == 2.5
    assert not sock.exists()
    r = subprocess.run([sys.executable, "-m", "aggregator.cli", "--port", "0", "--control", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "needs" not in r.stderr and "--control-token-file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_server_outlives_the_reader_of_its_status_lines() -> None:
    """thc-aggregator | head: once the pipe's reader is gone, the statistics lines are dropped and the jobs
    keep being served (a BrokenPipeError used to end the server with a traceback)."""
    cfg = JobConfig(job=11, key=0x11, workers=1, slots=4, elems=K)
    with aggregator("--job", spec(cfg), "--stats-interval", "0.05") as (proc, port):
        proc.stdout.close()  # the reader goes; the next statistics line meets a closed pipe
        time.sleep(0.5)
        assert proc.poll() is None and norm_roundtrip(port, cfg) == 2.5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port: must be in 0..65535, got 70000"),
    (["--host", "nonexistent.invalid"], "--host: 'nonexistent.invalid' is not an IPv4 address or a name that resolves"),
    (["--port", "-1"], "--port: must be in 0..65535, got -1"),
    (["--port", "http"], "--port: expected an integer, got 'http'"),
    (["--shards", "0"], "--shards: must be in 1..64, got 0"),
    (["--member", "2/2"], "--member: expected I/N with 0 <= I < N <= 64 (member I of N), got '2/2'"),
    (["--member", "one"], "--member: expected I/N"),
    (["--port", "65535", "--shards", "2"], "2 shards from UDP port 65535 run past port 65535"),
    (["--batch", "100000"], "--batch: must be in 1..4096"),
    (["--stats-interval", "-1"], "--stats-interval: must be in 0..86400"),
    (["--stats-interval", "nan"], "--stats-interval: must be in 0..86400"),
    (["--metrics-port", "99999"], "--metrics-port: must be in 0..65535"),
    (["--log-level", "loud"], "--log-level: expected one of DEBUG"),
    (["--control", "9500"], "--control: control address '9500'"),
    (["--control-token-file", "/nonexistent"], "--control-token-file needs --control"),
    (["--control", "127.0.0.1:0", "--control-token-file", "/nonexistent"], "No such file"),
    (["--job", "workers=0"], "workers must be in 1..32"),
    (["--job", "bits=9"], "bits must be an integer in 1..8"),
    (["--job", "granularity=99999"], "granularity above"),
    (["--job", "key=-1"], "key must be a 32-bit unsigned integer"),
    (["--job", "slots=0"], "slots"),
    (["--job", "p=2"], "p"),
    (["--job", "job=99999999999"], "job"),
    (["--host", "10.255.255.1"], "cannot bind UDP 10.255.255.1"),
    (["--pcap", "/nonexistent/a.pcap"], "cannot write the pcap file"),
    (["--job", "job=2,workers=4", "--job", "job=2,workers=8"], "--job: duplicate job ids [2]"),
    (["--job", ""], "empty job spec"),
])
def test_every_bad_cli_input_is_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Out-of-range and malformed options and job specs: one line on stderr, no traceback, exit 1 or 2.
    In this process (an interpreter per case cost a second each); the next test runs the command."""
    assert_one_line_refusal(*call_main(cli_main, argv, capsys), says)


def test_the_command_refuses_in_one_line() -> None:
    """``python -m aggregator.cli`` hands the refusal's exit status and line to the shell."""
    r = subprocess.run([sys.executable, "-m", "aggregator.cli", "--port", "70000"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].endswith("--port: must be in 0..65535, got 70000"), r.stderr


def test_nothing_is_compiled_or_loaded_after_the_port_is_announced() -> None:
    """Every compiled pass a batch uses is loaded before the aggregator announces its port: with numba's
    cache log on (NUMBA_DEBUG_CACHE), nothing is loaded or compiled while two workers exchange a window
    of uses, read coalesced and answered as segmentation-offload runs. Loaded lazily, three passes took
    a fresh aggregator's first batches 20-35 ms: its workers' first window timed out, every use resent,
    no round trip measured."""
    cfg = JobConfig(workers=2, slots=8, elems=K)
    proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", "--job", spec(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "NUMBA_DEBUG_CACHE": "1"})
    try:
        before = []
        for line in proc.stdout:
            if "listening on" in line:
                break
            before.append(line)
        else:
            raise AssertionError(f"thc-aggregator did not start: {''.join(before)}")
        port = listening_port(line)
        assert any("[cache]" in b for b in before), before  # the log is on: the warm-up's loads show
        idx = np.random.default_rng(1).integers(0, 16, 16 * K).astype(np.uint8)
        trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", port))) for w in range(2)]
        res: list[np.ndarray] = []
        th = threading.Thread(target=lambda: res.append(trs[1].exchange_indices(idx).sums))
        th.start()
        res.append(trs[0].exchange_indices(idx).sums)
        th.join(30)
        for tr in trs:
            tr.close()
        want = lookup_sum(cfg.values(), np.stack([idx, idx])).reshape(-1, K)
        assert len(res) == 2 and all(np.array_equal(r, want) for r in res)
    finally:
        stop_process(proc, timeout=5)
    after = proc.stdout.read()
    assert "[cache]" not in after, after
