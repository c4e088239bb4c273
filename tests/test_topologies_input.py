"""The BMv2 topologies' commands refuse bad options at parse time, in one line naming the option, before
any namespace, switch or Mininet network is built (in process: no root, no Mininet needed)."""

from __future__ import annotations

import pytest

from tests.cli_support import assert_one_line_refusal, call_main
from topologies import star, tree, worker

JOB = ["--job", "job=1,key=0x54484321,workers=4,elems=32,result_bits=8", "--worker", "0"]

REFUSALS = [
    (star.main, ["--chunks", "0"], "--chunks: must be in 1..1048576, got 0"),
    (star.main, ["--seed", "-1"], "--seed: must be in 0..4294967295, got -1"),
    (tree.main, ["--chunks", "0"], "--chunks: must be in 1..1048576, got 0"),
    (tree.main, ["--seed", "-1"], "--seed: must be in 0..4294967295, got -1"),
    (worker.main, [*JOB, "--chunks", "-1"], "--chunks: must be in 1..1048576, got -1"),
    (worker.main, [*JOB, "--chunks", "0"], "--chunks: must be in 1..1048576, got 0"),
    (worker.main, [*JOB, "--seed", "-1"], "--seed: must be in 0..4294967295, got -1"),
    (worker.main, [*JOB, "--bind", "999.1.1.1"], "--bind: not an IPv4 address of this host: '999.1.1.1'"),
    # a well-formed address that is not this host's
    (worker.main, [*JOB, "--bind", "192.0.2.77"], "--bind: not an IPv4 address of this host: '192.0.2.77'"),
    (worker.main, [*JOB, "--timeout", "0"], "--timeout: must be in 0.0001..60, got 0"),
    (worker.main, [*JOB, "--deadline", "-1"], "--deadline: must be in 0.01..86400, got -1"),
]


@pytest.mark.parametrize(("main", "argv", "says"), REFUSALS,
                         ids=[f"{m.__module__.split('.')[-1]} {' '.join(a[-2:])}" for m, a, _ in REFUSALS])
def test_bad_option_is_one_line_at_parse_time(main, argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2 with argparse's one line; without the check star and tree built the whole topology first
    and worker.py failed in numpy or the socket layer without naming the option. (Seen as not root here,
    so that an option that slips through fails this test at the root check instead of building Mininet.)"""
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert_one_line_refusal(*call_main(main, argv, capsys), says)


def test_worker_binds_loopback_and_any() -> None:
    """The addresses the topologies use pass: any (the default) and one of this host's."""
    assert worker.local_address("0.0.0.0") == "0.0.0.0"
    assert worker.local_address("127.0.0.1") == "127.0.0.1"
