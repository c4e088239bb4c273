"""``thc-allreduce``: worker processes + a real ``thc-aggregator`` process on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launchers.aggregator_process import listening_port, stop_process
from worker_lib.udp_offload import enable_gro
from worker_lib.wire import Header, PacketType
from worker_lib.wire.pcap import read_pcap


def allreduce(*args: str, timeout: float = 120) -> dict:
    r = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--json", *args],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_four_workers_bit_exact() -> None:
    """4 worker processes through a started thc-aggregator: sums equal the state machine's bit for bit,
    every worker decodes the same average, with THC's error (NMSE well below 1)."""
    s = allreduce("--workers", "4", "--dim", "65536")
    assert s["exact"] is True and s["consistent_average"] is True
    assert s["decoded_vs_reference_max_abs"] is not None and s["decoded_vs_reference_max_abs"] < 1e-5
    assert 0 < s["nmse"] < 0.2 and s["seconds"] > 0
    # the default K at a 1500-byte MTU is 1440: 46 chunks (the last one partial), the norm, and the run's
    # opening (Transport.open_run)
    assert s["lost_chunks"] == 0 and s["results"] == 4 * (-(-65536 // 1440) + 2)


def test_several_aggregators_share_the_slots() -> None:
    """Two aggregators (members 0/2 and 1/2, two shards each) serve one job: each slot's packets go to the
    member and shard that own it; the sums stay exact, also under loss."""
    s = allreduce("--workers", "3", "--dim", "65536", "--aggregators", "2", "--shards", "2")
    assert s["exact"] is True and s["consistent_average"] is True and len(s["aggregator"].split(",")) == 2
    assert s["results"] == 3 * (-(-65536 // 1440) + 2)  # the chunks, the norm, the run's opening
    lossy = allreduce("--workers", "3", "--dim", "32768", "--aggregators", "2", "--drop-up", "0.05",
                      "--drop-down", "0.05", "--seed", "4")
    assert lossy["exact"] is True and lossy["dropped_up"] + lossy["dropped_down"] > 0


@pytest.mark.parametrize(("up", "down"), [("0.01", "0.01"), ("0.1", "0"), ("0", "0.1")])
def test_reliable_under_loss(up: str, down: str) -> None:
    """Seeded loss up and down: reliable stays exact; the drops were real and retransmitted."""
    s = allreduce("--workers", "4", "--dim", "32768", "--elems", "256", "--slots", "16", "--drop-up", up,
                  "--drop-down", down, "--timeout", "0.02", "--seed", "3")
    assert s["exact"] is True and s["lost_chunks"] == 0
    assert s["dropped_up"] + s["dropped_down"] > 0 and s["retransmissions"] > 0


def test_zero_fill_completes_and_reports() -> None:
    """zero-fill under 10% loss without retransmission completes; received chunks are exact, lost ones
    are counted, and the decoded average degrades gracefully."""
    s = allreduce("--workers", "3", "--dim", "32768", "--elems", "256", "--loss-policy", "zero-fill",
                  "--retries", "0", "--drop-up", "0.1", "--drop-down", "0.1", "--timeout", "0.3", "--seed", "5")
    assert s["exact"] is True and s["loss_policy"] == "zero-fill" and s["lost_chunks"] > 0
    assert s["nmse"] < 1.0


def test_against_a_running_aggregator_default_job(tmp_path: Path) -> None:
    """--aggregator HOST:PORT uses the aggregator's default job (job 1, default key, 4 workers); with
    --pcap each worker captures its own traffic: its data and norm packets to the aggregator and the
    results it accepted, as many as its counters say, all parseable."""
    proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        port = listening_port(line)
        s = allreduce("--aggregator", f"127.0.0.1:{port}", "--dim", "20000", "--steps", "2",
                      "--pcap", str(tmp_path / "run.pcap"))
        assert s["exact"] is True and s["aggregator"] == f"127.0.0.1:{port}" and s["steps"] == 2
        assert not (tmp_path / "run.pcap").exists()
        sent = received = 0
        for w in range(4):
            caps = read_pcap(tmp_path / f"run.worker{w}.pcap")
            up = [c for c in caps if c.dst == ("127.0.0.1", port)]
            down = [c for c in caps if c.src == ("127.0.0.1", port)]
            assert len(up) + len(down) == len(caps) and up and down
            assert {Header.parse(c.payload)[0].worker for c in up} == {w}
            assert {Header.parse(c.payload)[0].type for c in up} == {PacketType.DATA, PacketType.NORM}
            assert {Header.parse(c.payload)[0].type for c in down} <= {PacketType.RESULT, PacketType.NORM_RESULT,
                                                                          PacketType.STRAGGLER}
            sent += len(up)
            received += len(down)
        # Every datagram a worker sent or accepted is in its capture (late duplicates count as unexpected).
        assert sent == s["packets_sent"] and received == s["results"] + s["stragglers"] + s["unexpected"]
    finally:
        stop_process(proc)


def test_summary_and_help() -> None:
    """The human summary names exactness and NMSE; --help documents the options; bad input is clear."""
    r = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--workers", "2", "--dim", "5000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "exact         True" in r.stdout and "NMSE" in r.stdout
    h = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert "--loss-policy" in h.stdout and "--aggregator" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--workers", "40"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--workers: must be in 1..32" in bad.stderr


@pytest.mark.parametrize("args", [("--workers", "1", "--dim", "1"),
                                  ("--workers", "2", "--dim", "3000", "--elems", "720")])
def test_lengths_that_do_not_fill_a_chunk(args: tuple[str, ...]) -> None:
    """Tensors shorter than a chunk or not a multiple of K: padded with index 0, still exact."""
    s = allreduce(*args)
    assert s["exact"] is True and s["decoded_vs_reference_max_abs"] < 1e-5


@pytest.mark.parametrize("argv, says", [
    (["--aggregator", "127.0.0.1:70000"], "--aggregator: expected HOST:PORT with a port in 1..65535"),
    (["--aggregator", "[::1]:9451"], "--aggregator: '[::1]' is not an IPv4 address or a name that resolves to one"),
    (["--aggregator", "nonexistent.invalid:9451"], "--aggregator: 'nonexistent.invalid' is not an IPv4"),
    (["--aggregator", "127.0.0.1:9451", "--aggregators", "2"], "--aggregators N starts N aggregators"),
    (["--aggregators", "0"], "--aggregators: must be in 1..64, got 0"),
    (["--workers", "0"], "--workers: must be in 1..32, got 0"),
    (["--drop-up", "2"], "--drop-up: must be in 0..0.99, got 2"),
    (["--timeout", "-1"], "--timeout: must be in 0.0001..60"),
    (["--dim", "0"], "--dim: must be in 1..2147483648, got 0"),
    (["--p", "3"], "p must lie in (0, 1)"),
    (["--leaf-engine", "numpy"], "--parent-loss and --leaf-engine are for two tiers (--leaves)"),
    (["--retries", "2"], "--retries counts the resends before zero-fill gives a chunk up"),
    (["--tail-duplicates", "-1"], "--tail-duplicates: must be in 0..65536, got -1"),
    (["--pcap", "/nonexistent/dir/x.pcap", "--dim", "64"],
     "thc-aggregator exited at start (exit code 1): thc-aggregator: cannot write the pcap file"),
])
def test_bad_options_get_one_line(argv: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, "-m", "launchers.allreduce", *argv], capture_output=True, text=True,
                       timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln and not ln.startswith(("usage:", " "))]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1 and says in lines[0], r.stderr


@pytest.mark.parametrize("gro", [True, False])
def test_answers_come_coalesced_unless_told_not_to(gro: bool) -> None:
    """The aggregator sends each worker the completions of one batch as one GSO run; with UDP_GRO (the
    default) the workers read such runs whole, with --no-gro (the workers and the aggregator started here)
    datagram by datagram. The sums are exact either way."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        if gro and not enable_gro(probe):
            pytest.skip("the kernel refuses UDP_GRO (udp(7), Linux 5.0+)")
    s = allreduce("--workers", "2", "--dim", "262144", *([] if gro else ["--no-gro"]))
    assert s["exact"] is True and s["gro"] is gro
    assert (s["coalesced_receives"] > 0) is gro, s["coalesced_receives"]
    assert s["waits"] > 0  # the engine's waits for the network are counted (its wake-ups)


@pytest.mark.parametrize(("argv", "most"), [((), 2 * 32), (("--tail-duplicates", "0"), 0)])
def test_the_last_uses_of_each_exchange_go_twice_unless_told_not_to(argv: tuple[str, ...], most: int) -> None:
    """Each worker sends a second copy of those of the last 32 uses of its one data exchange that are still
    unanswered when it sends the last (docs/protocol.md, "Tail duplicates"), at least that last one; none with
    --tail-duplicates 0. Exact either way."""
    s = allreduce("--workers", "2", "--dim", "262144", *argv)
    assert s["exact"] is True and min(most, 2) <= s["tail_duplicates"] <= most, s
