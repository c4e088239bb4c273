"""Jobs that fall back (aggregator/placement.py, ``thc-switch job --fallback-control``): a job the switch
cannot take runs on thc-aggregator instead, with the switch's reason; the jobs it can take stay on it.

The switch is the P4Runtime controller (aggregator.p4rt.ThcSwitch) against the fake P4Runtime server of
tests/test_controlplane_p4rt.py running the checked-in BMv2 program's P4Info (K = 32, 4 job rows), so
its refusals are the real control plane's; the fallback is a real thc-aggregator process with a control
socket, and a fallen-back job is then run through it by thc-allreduce, bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.control import ControlAddress, send_command
from aggregator.p4rt import ThcSwitch
from aggregator.placement import Fallback, JobPlacer, PlacementError
from launchers.aggregator_process import local_aggregator
from tests.test_controlplane_p4rt import GEOM, fake_switch  # noqa: F401  (the fixture)
from worker_lib.job import JobConfig

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "10.0.0.100:9451"


def thc_job(job: int, **kw) -> JobConfig:
    """A THC job the program can take unless ``kw`` says otherwise (2 workers on ports 1, 2)."""
    base = dict(job=job, key=0x51510000 + job, workers=2, bits=GEOM.bits, granularity=30, elems=GEOM.elems,
                result_bits=GEOM.result_bits, slots=8)
    return JobConfig(**{**base, **kw})


@pytest.fixture
def aggregator(tmp_path: Path):
    """A thc-aggregator on loopback with a control socket; yields (data address, control address)."""
    control = tmp_path / "ctl.sock"
    with local_aggregator([], extra=["--control", str(control)]) as (host, port):
        yield f"{host}:{port}", ControlAddress(path=str(control))


def test_refused_jobs_run_on_the_aggregator_with_the_switchs_reason(fake_switch, aggregator) -> None:  # noqa: F811
    """A job that fits goes to the switch; an uncompressed job, a job of another K, and a job once the
    job rows are full go to the aggregator, each with the switch's reason; the aggregator then serves
    them (its list shows them) and a fallen-back job's allreduce through it is exact."""
    _fake, addr = fake_switch()
    data, control = aggregator
    with ThcSwitch(addr) as sw:
        placer = JobPlacer(sw, SERVICE, Fallback(control, data))
        homes = [placer.place(thc_job(11), (1, 2))]
        homes.append(placer.place(JobConfig(job=12, key=7, workers=2, kind="uncompressed", slots=8), (1, 2)))
        homes.append(placer.place(thc_job(13, elems=16), (1, 2)))
        last = 14 + GEOM.jobs - 1  # job 11 holds a row: jobs 14 .. last - 1 take the others, last finds none
        for j in range(14, last + 1):
            homes.append(placer.place(thc_job(j), (1, 2)))
    on = {h.job: (h.on, h.address) for h in homes}
    assert all(on[j] == ("switch", SERVICE) for j in [11, *range(14, last)])
    assert on[12] == on[13] == on[last] == ("aggregator", data)
    reasons = {h.job: h.reason for h in homes}
    assert reasons[11] is None
    assert "aggregates THC jobs only" in reasons[12]
    assert "K = 16 elements per packet, the program is compiled for K = 32" in reasons[13]
    assert f"all {GEOM.jobs} job rows of the program are in use" in reasons[last]
    listed = json.loads(send_command(control, "list"))
    assert sorted(j["job"] for j in listed) == [1, 12, 13, last]  # 1: the aggregator's default job
    run = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--aggregator", data, "--workers", "2",
                          "--job", "13", "--key", str(0x51510000 + 13), "--elems", "16", "--slots", "8",
                          "--dim", "4096", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["exact"] is True


def test_nothing_takes_the_job_is_one_clear_error(fake_switch, aggregator, tmp_path: Path) -> None:  # noqa: F811
    """Without a fallback, with a fallback that refuses the job, or with one that is not there, the
    error names the switch's reason and what the fallback said; nothing is left half-installed."""
    _fake, addr = fake_switch()
    data, control = aggregator
    bad = thc_job(21, elems=16)
    with ThcSwitch(addr) as sw:
        with pytest.raises(PlacementError, match=r"K = 16.*no fallback aggregator"):
            JobPlacer(sw, SERVICE, None).place(bad, (1, 2))
        with pytest.raises(PlacementError, match="fallback aggregator too: error: unknown command"):
            # a token the aggregator does not expect makes the command one it does not know
            JobPlacer(sw, SERVICE, Fallback(control, data, token=b"t" * 16)).place(bad, (1, 2))
        with pytest.raises(PlacementError, match="did not answer"):
            JobPlacer(sw, SERVICE, Fallback(ControlAddress(path=str(tmp_path / "none.sock")), data,
                                            timeout=0.3)).place(bad, (1, 2))
        assert sw.jobs() == []
    assert [j["job"] for j in json.loads(send_command(control, "list"))] == [1]


def test_thc_switch_job_falls_back_on_the_command_line(fake_switch, aggregator,  # noqa: F811
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``thc-switch job --fallback-control PATH --fallback HOST:PORT`` prints where the job went, as JSON;
    --fallback-control without --fallback is one error line."""
    from aggregator.switch.cli import main as cli_main

    _fake, addr = fake_switch()
    data, control = aggregator
    base = ["--switch", f"{addr.host}:{addr.port}", "job", "--ports", "1,2", "--fallback-control", control.path]
    assert cli_main([*base, "--job", "job=31,workers=2,elems=16,kind=thc", "--fallback", data]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["on"] == "aggregator" and got["address"] == data and "K = 16" in got["reason"]
    assert cli_main([*base, "--job", f"job=32,workers=2,elems={GEOM.elems},granularity=30", "--fallback", data,
                     "--service-address", SERVICE]) == 0
    assert json.loads(capsys.readouterr().out) == {"job": 32, "on": "switch", "address": SERVICE, "reason": None}
    assert cli_main([*base, "--job", "job=33,workers=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fallback-control needs --fallback HOST:PORT" in err
