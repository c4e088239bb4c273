"""benchmarks.gso: its options say their limits in --help and a bad value is one line (in process)."""

from __future__ import annotations

import pytest

from benchmarks.gso import MAX_DATAGRAMS, main
from tests.cli_support import assert_one_line_refusal, call_main


def test_help_states_the_limits(capsys: pytest.CaptureFixture[str]) -> None:
    """--datagrams' minimum of 64 (one run) is in the help, not only in the error."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--datagrams DATAGRAMS datagrams per mode per round, 64 (one run of 64) to 1,000,000" in text
    assert "--rounds ROUNDS interleaved rounds, 1..1000" in text


@pytest.mark.parametrize(("argv", "says"), [
    (["--datagrams", "10"], f"--datagrams: must be in 64..{MAX_DATAGRAMS}, got 10"),
    (["--rounds", "0"], "--rounds: must be in 1..1000, got 0"),
])
def test_bad_option_is_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by argparse naming the option, before any socket or buffer is made."""
    assert_one_line_refusal(*call_main(main, argv, capsys), says)
