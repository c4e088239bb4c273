"""Widths chosen for the user (worker_lib.thc.widths, ``granularity=auto`` in job specs, thc-table): the sums
of n workers never overflow the result width, the refusals say what to change, and the cost is reported."""

from __future__ import annotations

import json

import pytest

from worker_lib.cli import table_cli
from worker_lib.job import JobConfigError, parse_job_spec
from worker_lib.thc.table import solve_table
from worker_lib.thc.widths import WidthError, choose_widths


@pytest.mark.parametrize("result_bits", [8, 16])
def test_the_chosen_sums_never_overflow(result_bits: int) -> None:
    """For every worker count the width allows, g * n < 2^width, the table fits (g >= 2^b - 1), b is at
    most 4, and a table of the chosen (b, g) exists."""
    for n in range(1, 33):
        c = choose_widths(n, result_bits)
        assert c.granularity * n < 1 << result_bits and (1 << c.bits) - 1 <= c.granularity <= 255
        assert 1 <= c.bits <= 4 and c.result_bits == result_bits
        assert len(solve_table(c.bits, c.granularity, 1 / 32).values) == 1 << c.bits


def test_forced_choices_worked_out_by_hand() -> None:
    """8-bit sums: 16 workers leave g <= 15, which 4-bit indices need exactly; 32 workers leave g <= 7, so
    bits=auto takes b = 3 and g = 7; a lone worker takes b = 4; 16-bit sums do not bind at 32 workers."""
    assert (choose_widths(16).bits, choose_widths(16).granularity) == (4, 15)
    c = choose_widths(32)
    assert (c.bits, c.granularity, c.result_bits) == (3, 7, 8)
    assert choose_widths(1).bits == 4
    wide = choose_widths(32, 16, 4)
    assert wide.granularity * 32 < 1 << 16 and abs(wide.cost) < 1e-12


def test_the_search_is_needed_and_the_cost_is_reported() -> None:
    """The rounding objective is not monotone in g (at b = 4, g = 28 rounds worse than 15), so the largest
    allowed g is not always taken: 9 workers allow g <= 28 and get a g that rounds at least as well as 15.
    The cost is the objective against that of sums that do not bind, and grows as sums narrow."""
    assert solve_table(4, 28, 1 / 32).objective > solve_table(4, 15, 1 / 32).objective
    c9 = choose_widths(9)
    assert c9.granularity != 28 and c9.objective <= solve_table(4, 15, 1 / 32).objective
    costs = [choose_widths(n).cost for n in (2, 4, 8, 16)]
    assert costs == sorted(costs) and costs[0] < 0.01 < costs[-1]
    assert "+" in choose_widths(8).describe(8) and "g = " in choose_widths(8).describe(8)


@pytest.mark.parametrize(("kwargs", "says"), [
    (dict(workers=32, bits=4), "use result_bits=16, bits=3 (or bits=auto), or fewer workers"),
    (dict(workers=256), "256 workers overflow 8-bit sums even with g = 1: use result_bits=16"),
    (dict(workers=0), "workers must be at least 1"),
    (dict(workers=4, result_bits=12), "result_bits must be 8, 16 or 32"),
])
def test_impossible_widths_are_refused_saying_what_to_change(kwargs: dict, says: str) -> None:
    with pytest.raises(WidthError) as exc:
        choose_widths(**kwargs)
    assert says in str(exc.value)


def test_job_specs_take_auto() -> None:
    """``granularity=auto`` in a job spec chooses g for the job's workers and result width; ``bits=auto``
    chooses b too; a spec that cannot fit is one JobConfigError naming the fix."""
    j = parse_job_spec("job=3,workers=8,granularity=auto")
    assert j.bits == 4 and j.granularity * 8 < 256 and j.result_bits == 8 and j.values().max() == j.granularity
    j = parse_job_spec("job=3,workers=32,granularity=auto,bits=auto")
    assert (j.bits, j.granularity, j.result_bits) == (3, 7, 8)
    j = parse_job_spec("job=3,workers=32,granularity=auto,result_bits=16")
    assert j.bits == 4 and j.result_bits == 16 and j.granularity * 32 < 1 << 16
    for spec, says in [("job=3,workers=32,granularity=auto", "use result_bits=16"),
                       ("job=3,bits=auto", "add granularity=auto"),
                       ("job=3,granularity=auto,kind=uncompressed", "for THC jobs"),
                       ("job=3,granularity=auto,table=0:1:2:3", "drop table=")]:
        with pytest.raises(JobConfigError) as exc:
            parse_job_spec(spec)
        assert says in str(exc.value), spec


def test_thc_table_auto(capsys: pytest.CaptureFixture[str]) -> None:
    """thc-table --granularity auto --workers N prints the choice and its table; without --workers, or
    with widths that cannot fit, it is one error line and exit 2."""
    assert table_cli.main(["--bits", "auto", "--granularity", "auto", "--p", "1/32", "--workers", "32",
                           "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["bits"], out["granularity"], out["result_bits"]) == (3, 7, 8) and out["table"] == list(range(8))
    assert table_cli.main(["--bits", "4", "--granularity", "auto", "--p", "1/32", "--workers", "8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("auto widths for 8 workers and 8-bit sums: b = 4") and "T_{b=4, g=" in text
    assert table_cli.main(["--bits", "4", "--granularity", "auto", "--p", "1/32", "--workers", "32"]) == 2
    assert "use result_bits=16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        table_cli.main(["--bits", "4", "--granularity", "auto", "--p", "1/32"])
    assert exc.value.code == 2 and "needs --workers" in capsys.readouterr().err
