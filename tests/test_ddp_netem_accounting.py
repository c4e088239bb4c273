"""benchmarks.ddp_netem's accounting of what loss resends: the size of an answer the aggregator sends again,
and its count read from a running aggregator's control socket (the figures are worked out by hand)."""

from __future__ import annotations

import argparse
import json
import math
import socket
import threading
from pathlib import Path

import pytest

from benchmarks.ddp_netem import answer_bytes, answers_resent


def _args(workers: int) -> argparse.Namespace:
    return argparse.Namespace(workers=workers, mtu=1500)


def test_an_answer_carries_the_results_at_their_width() -> None:
    """A THC rank sent 10 datagrams of 704 payload bytes (1,408 4-bit indices) and resent 2: an answer holds
    1,408 8-bit results (two or four workers' sums), 1,408 bytes, with the 32-byte THC header and 28 of IP and
    UDP 1,468; by unicast or by multicast alike (a retained answer goes to its asker alone). gloo: none."""
    hook = {"transport_packets_sent": 12, "transport_retransmissions": 2, "bytes_sent": 7040}
    assert answer_bytes(hook, "thc", _args(2)) == pytest.approx(1468)
    assert answer_bytes(hook, "thc-mcast", _args(4)) == pytest.approx(1468)
    assert answer_bytes(hook, "gloo", _args(2)) == 0.0
    assert answer_bytes({}, "thc", _args(2)) == 0.0


def test_answers_sent_again_are_read_from_the_control_socket(tmp_path: Path) -> None:
    """The benchmark asks the aggregator's control socket for "stats" and adds its one-tier and DAR retained
    counters; a fake aggregator answers with totals as thc-aggregator's are shaped."""
    path = tmp_path / "agg.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    asked: list[bytes] = []

    def serve() -> None:
        data, peer = server.recvfrom(4096)
        asked.append(data)
        server.sendto(json.dumps({"rx": 900, "retained": 117, "duplicate": 38, "dar_retained": 5}).encode(), peer)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert answers_resent(path) == 122.0
    finally:
        thread.join(5)
        server.close()
    assert asked == [b"stats"]


def test_an_aggregator_that_does_not_answer_gives_no_reading(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """No socket at the path (the aggregator gone): nan and one warning line, so that the run goes on and its
    verdict counts the resent requests alone."""
    assert math.isnan(answers_resent(tmp_path / "gone.sock"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: no counters from the aggregator's control socket")
