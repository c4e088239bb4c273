"""thc-switch refuses bad input with one clear line before it touches a switch.

No P4Runtime server runs here: ``ThcSwitch`` is replaced by a stand-in that records the connection and
refuses it with its own message, so a refusal that comes from the input (and not from the connection)
shows that the input was checked before connecting. Tofino load scripts are checked not to be written."""

from __future__ import annotations

from pathlib import Path

import pytest

import aggregator.p4rt.thc as thc
from aggregator.switch.cli import main
from aggregator.switch.errors import SwitchUnreachable
from tests.cli_support import assert_one_line_refusal, call_main
from tests.p4_support import CHECKED_IN_P4INFO

JOB = "job=1,workers=4,elems=64,result_bits=8"
TIERED = "job=1,leaves=2:2,elems=32"
UP = ["--upstream", "10.0.9.1:9451", "--upstream-mac", "02:00:00:00:09:01", "--upstream-port", "12"]
NO_SWITCH = "stand-in: no switch here"


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The switch addresses thc-switch tried to connect to (every try is refused with NO_SWITCH)."""
    tried: list[str] = []

    def refuse(address: object, **_: object) -> None:
        tried.append(str(address))
        raise SwitchUnreachable(NO_SWITCH)

    monkeypatch.setattr(thc, "ThcSwitch", refuse)
    return tried


@pytest.mark.parametrize(("argv", "says"), [
    (["--switch", "127.0.0.1:70000", "jobs"], "--switch"),
    (["--switch", "127.0.0.1:-1", "jobs"], "--switch"),
    (["--switch", "127.0.0.1:0", "jobs"], "--switch"),
    (["--switch", "unix:", "jobs"], "--switch"),
    (["--timeout", "-1", "jobs"], "--timeout"),
    (["--timeout", "0", "jobs"], "--timeout"),
    (["--wait", "-1", "jobs"], "--wait"),
    (["--device-id", "-1", "jobs"], "--device-id"),
    (["--election-id", "-1", "jobs"], "--election-id"),
    (["remove", "--", "-1"], "job"),
    (["stats", "--target", "tofino", "--elems", "0"], "argument --elems: must be in 1..65528, got 0"),
])
def test_global_options_are_range_checked(argv: list[str], says: str, connections: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A port outside 1..65535, a negative timeout, wait or id is refused as the options are parsed."""
    code, err = call_main(main, argv, capsys)
    assert_one_line_refusal(code, err, says)
    assert connections == []


@pytest.mark.parametrize(("argv", "says"), [
    (["job", "--job", "garbage", "--ports", "a,b"], "argument --ports: expected an integer, got 'a'"),
    (["job", "--job", "garbage", "--ports", "1,2"], "job spec 'garbage'"),
    (["job", "--job", JOB, "--ports", "1,2,3,512"], "argument --ports: must be in 0..511"),
    (["job", "--job", JOB, "--ports", "1,1,1,1"], "argument --ports: 1 given twice"),
    (["job", "--config", "/nonexistent", "--ports", "1"], "/nonexistent does not exist"),
    (["job", "--spine", "--leaf", "0", "--job", TIERED, "--ports", "1,2"], "--spine is for a two-tier job"),
    (["job", "--job", TIERED, "--ports", "1,2", "--leaf", "2", *UP], "--leaf 2: job 1 has 2 leaves"),
    (["job", "--job", TIERED, "--ports", "1,2", "--leaf", "0", *UP[:-1], "-5"], "argument --upstream-port"),
    (["job", "--job", TIERED, "--ports", "1,2", "--leaf", "0", *UP[:3], "zz", *UP[4:]], "--upstream-mac"),
    (["job", "--job", JOB, "--ports", "1,2,3,4", "--fallback-control", "/tmp/thc.sock"], "needs --fallback"),
    (["load", "--p4info", "/nonexistent", "--json", "/nonexistent"], "cannot read P4Info /nonexistent"),
    (["load", "--p4info", str(CHECKED_IN_P4INFO), "--json", "/nonexistent"], "cannot read the BMv2 JSON"),
])
def test_bmv2_input_is_checked_before_connecting(argv: list[str], says: str, connections: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input of job and load is one line of its own, and thc-switch never connects."""
    code, err = call_main(main, argv, capsys)
    assert_one_line_refusal(code, err, says)
    assert connections == []


@pytest.mark.parametrize(("extra", "says"), [
    (["--route", "10.0.0.0/8,00:00:00:00:00:01,99999"], "argument --route: must be in 0..511"),
    (["--route", "10.0.0.0/8,zz,1"], "argument --route: not a MAC address"),
    (["--route", "10.0.0.0/8,00:00:00:00:00:01"], "argument --route: expected PREFIX,MAC,PORT"),
    (["--service", "10.0.0.300,02:00:00:00:01:00"], "argument --service"),
    (["--route", "10.0.0.0/8,00:00:00:00:00:01,1", "--route", "10.0.0.0/8,00:00:00:00:00:02,2"],
     "--route: 10.0.0.0/8 given twice"),
])
def test_bmv2_load_checks_services_and_routes_before_loading(
        extra: list[str], says: str, tmp_path: Path, connections: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --service or --route of load is refused before the program is pushed (it used to be read
    after, leaving the new program and the entries before it on the switch)."""
    blob = tmp_path / "thc.json"
    blob.write_text("{}")
    base = ["load", "--p4info", str(CHECKED_IN_P4INFO), "--json", str(blob)]
    code, err = call_main(main, [*base, *extra], capsys)
    assert_one_line_refusal(code, err, says)
    assert connections == []
    # the same load with good entries gets as far as connecting
    good = ["--service", "10.0.0.100,02:00:00:00:01:00", "--route", "10.0.0.1/32,00:00:00:00:00:01,1"]
    code, err = call_main(main, [*base, *good], capsys)
    assert_one_line_refusal(code, err, NO_SWITCH)
    assert len(connections) == 1


def test_good_bmv2_job_connects(connections: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The checks refuse only bad input: a good job and a good leaf job get as far as connecting."""
    for argv in (["job", "--job", JOB, "--ports", "1,2,3,4"],
                 ["job", "--job", TIERED, "--ports", "1,2", "--leaf", "1", *UP],
                 ["--switch", "unix:/tmp/none.sock", "job", "--job", TIERED, "--ports", "7,8", "--spine"]):
        code, err = call_main(main, argv, capsys)
        assert_one_line_refusal(code, err, NO_SWITCH)
    assert len(connections) == 3


@pytest.mark.parametrize(("extra", "says"), [
    (["--ports", "1,2,3,-4"], "argument --ports: must be in 0..511, got -4"),
    (["--ports", "1,2,3,99999"], "argument --ports: must be in 0..511, got 99999"),
    (["--ports", "1,1,1,1"], "argument --ports: 1 given twice"),
    (["--ports", "a,b,c,d"], "argument --ports: expected an integer, got 'a'"),
    (["--ports", "1,2,3,4", "--route", "10.0.0.0/8,00:00:00:00:00:01,-1"], "argument --route: must be in 0..511"),
    (["--ports", "1,2,3,4", "--route", "10.0.0.0/8,00:00:00:00:00:01,99999"], "argument --route: must be in"),
    (["--ports", "1,2,3,4", "--upstream-port", "-5"], "argument --upstream-port: must be in 0..511"),
    (["--ports", "1,2,3,4", "--job", JOB, "--ports", "5,6,7,8"], "duplicate job ids [1]"),
    (["--ports", "1,2,3,4", "--service", "10.0.0.1,02:00:00:00:01:00", "--service", "10.0.0.1,02:00:00:00:01:01"],
     "--service: 10.0.0.1 given twice"),
])
def test_tofino_plan_refuses_bad_ports_and_repeated_jobs(extra: list[str], says: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """load --target tofino refuses what it would have written into the script (exit 0) before: device
    ports outside 0..511 (PortId_t is 9 bits), a port twice in a job, a job id twice, an address twice."""
    monkeypatch.delenv("SDE", raising=False)
    out = tmp_path / "load.py"
    base = ["load", "--target", "tofino", "--no-run", "--output", str(out), "--job", JOB]
    code, err = call_main(main, [*base, *extra], capsys)
    assert_one_line_refusal(code, err, says)
    assert not out.exists()
    code, err = call_main(main, [*base, "--ports", "0,1,2,511", "--route", "10.0.0.0/8,00:00:00:00:00:01,511"],
                          capsys)
    assert code == 0 and out.exists(), err


@pytest.mark.parametrize(("name", "data", "says"), [
    ("p4info.pb", b"\xff\xff\xff\xff\x0f", "is not a binary P4Info"),
    ("p4info.txt", b"\xff\xfe tables {", "is not a P4Info in protobuf text format"),
    ("p4info.txt", b"tables { bogus: 1 }", "is not a P4Info in protobuf text format"),
])
def test_a_corrupt_p4info_is_one_line(name: str, data: bytes, says: str, tmp_path: Path, connections: list[str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A P4Info that is not one (a truncated binary, text that is not UTF-8 or not the schema) is refused in
    one line naming the file (protobuf's DecodeError and UnicodeDecodeError were tracebacks)."""
    info, blob = tmp_path / name, tmp_path / "thc.json"
    info.write_bytes(data)
    blob.write_text("{}")
    code, err = call_main(main, ["load", "--p4info", str(info), "--json", str(blob)], capsys)
    assert_one_line_refusal(code, err, says)
    assert str(info) in err and connections == []
