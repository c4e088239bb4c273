"""examples/train_ddp.py refuses bad options in one line before any rank trains (in process, through its
``main`` without torchrun: the refusal comes before the launch check, so no rank is needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.train_ddp import build_parser, check_args, hook_config, job_config, main
from tests.cli_support import assert_one_line_refusal, call_main

REFUSALS = [
    (["--threads", "0"], "--threads: must be in 1..1024, got 0"),
    (["--lr", "-1"], "--lr: must be in 1e-09..100, got -1"),
    (["--lr", "nan"], "--lr: must be in 1e-09..100, got nan"),
    (["--compression", "thc", "--timeout", "0"], "--timeout: must be in 0.0001..60, got 0"),
    (["--compression", "thc", "--deadline", "-1"], "--deadline: must be in 0.01..86400, got -1"),
    (["--compression", "thc", "--shards", "0"], "--shards: must be in 1..64, got 0"),
    (["--steps", "0"], "--steps: must be in 1..1000000000, got 0"),
    (["--batch-size", "0"], "--batch-size: must be in 1..1048576, got 0"),
    (["--width", "0"], "--width: must be in 1..65536, got 0"),
    (["--in-features", "0"], "--in-features: must be in 1..65536, got 0"),
    (["--layers", "-1"], "--layers: must be in 0..64, got -1"),
    (["--momentum", "1.5"], "--momentum: must be in 0..0.999, got 1.5"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb: must be in 0.001..65536, got 0"),
    (["--bits", "9"], "--bits: must be in 1..8, got 9"),
    (["--slots", "0"], "--slots: must be in 1..65536, got 0"),
    (["--mtu", "10"], "--mtu: must be in 68..9216, got 10"),
    (["--elems", "0"], "--elems: must be in 8..65528, got 0"),
    (["--job-id", "70000"], "--job-id: must be in 0..65535, got 70000"),
    (["--key", "-1"], "--key: must be in 0..4294967295, got -1"),
    (["--seed", "-1"], "--seed: must be in 0..4294967295, got -1"),
    (["--p", "1/0"], "--p: not a number or a fraction like 1/32"),
    (["--log-every", "-1"], "--log-every: must be in 0..1000000000, got -1"),
    (["--steps", "5", "--warmup", "5"], "--warmup (5) must be less than --steps (5): no step would be timed"),
    (["--json-out", "/nonexistent-thc/x.json"], "--json-out /nonexistent-thc/x.json: the folder /nonexistent-thc "
                                                "does not exist"),
]


@pytest.mark.parametrize(("argv", "says"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_bad_option_is_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bad value is refused by the parser (exit 2, one line naming the option), not by torch, the
    optimizer or the aggregator after the ranks started, nor taken for a run that reports 'final loss nan'."""
    monkeypatch.delenv("RANK", raising=False)
    assert_one_line_refusal(*call_main(main, argv, capsys), says)


def test_json_out_folder_is_checked_on_rank_0_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only rank 0 writes --json-out, so only rank 0 needs its folder (other nodes may lack it); a
    folder given as the file is refused."""
    p = build_parser()
    missing = str(tmp_path / "missing" / "x.json")
    assert check_args(p, p.parse_args(["--json-out", missing]), rank=1).json_out == Path(missing)
    assert check_args(p, p.parse_args(["--json-out", str(tmp_path / "x.json")])).json_out == tmp_path / "x.json"
    with pytest.raises(SystemExit) as exited:
        check_args(p, p.parse_args(["--json-out", str(tmp_path)]))
    assert exited.value.code == 2 and "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "warmup"), [([], 1), (["--steps", "1"], 0), (["--steps", "3", "--warmup", "2"], 2),
                                              (["--steps", "3", "--warmup", "0"], 0)])
def test_warmup_default_leaves_a_timed_step(argv: list[str], warmup: int) -> None:
    """--warmup defaults to 1, or 0 with --steps 1, so the defaults always time at least one step."""
    p = build_parser()
    assert check_args(p, p.parse_args(argv)).warmup == warmup


@pytest.mark.parametrize(("argv", "gro"), [([], True), (["--no-gro"], False), (["--gro"], True)])
def test_the_hook_reads_coalesced_answers_unless_told_not_to(argv: list[str], gro: bool) -> None:
    """UDP_GRO is on by default (docs/aggregator.md measures why) and --no-gro turns it off, through to the
    hook's transport settings."""
    p = build_parser()
    args = check_args(p, p.parse_args(["--compression", "thc", *argv]))
    cfg = hook_config(args, job_config(args, 2), [("127.0.0.1", 9451)])
    assert cfg.gro is gro and cfg.transport_config(0, 2).gro is gro


@pytest.mark.parametrize(("argv", "copies"),
                         [([], 32), (["--tail-duplicates", "0"], 0), (["--tail-duplicates", "7"], 7)])
def test_tail_duplicates_reach_the_hooks_transport(argv: list[str], copies: int) -> None:
    """An exchange's last 32 uses go twice by default (docs/protocol.md, "Tail duplicates"); --tail-duplicates
    sets how many (0: none), through to the hook's transport settings."""
    p = build_parser()
    args = check_args(p, p.parse_args(["--compression", "thc", *argv]))
    cfg = hook_config(args, job_config(args, 2), [("127.0.0.1", 9451)])
    assert cfg.tail_duplicates == copies and cfg.transport_config(0, 2).tail_duplicates == copies
