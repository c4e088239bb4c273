"""The Tofino control plane: the bfrt_python scripts of aggregator/bfrt.py and thc-switch --target tofino.

Expected entries are computed here from the job's table values and configuration, and the BMv2
P4Runtime updates for the same job are decoded back through the checked-in P4Info: both targets must get
the same logical entries. The scripts themselves run only on a switch with the SDE (docs/tofino.md); here a
fake ``run_bfshell.sh`` stands in to check that thc-switch runs them and reads the counters back."""

from __future__ import annotations

import ast
import json
import re
import stat
from pathlib import Path

import pytest
from google.protobuf import text_format
from p4.config.v1 import p4info_pb2

import p4gen.tofino as gen_tofino
from aggregator.bfrt import (
    DEFAULT_TOFINO_GEOMETRY,
    EGRESS_REGISTERS,
    INGRESS_REGISTERS,
    LEAF_INGRESS_REGISTERS,
    BfrtUnavailable,
    TofinoJob,
    TofinoPlan,
    TofinoProgram,
    bfrt_load_script,
    bfrt_stats_script,
    bfshell,
    parse_stats_output,
    stats_from_raw,
)
from aggregator.p4rt import JobRefused, P4InfoIndex, ProgramGeometry, program_geometry
from aggregator.p4rt.thc import job_updates
from aggregator.switch.cli import main as cli_main
from aggregator.switch.entries import Placement, Uplink
from aggregator.switch.errors import SwitchError
from tests.p4_support import CHECKED_IN_P4INFO, P4_DIR, preprocess
from worker_lib.job import JobConfig
from worker_lib.wire.protocol import Counter, TierCounter

TOFINO_PROGRAM = P4_DIR / "tofino" / "thc.p4"
GEN = 0x1234
CALL = re.compile(r"^ing\.([\w.]+)\.add_with_(\w+)\((.*)\)$")


def sample_job(elems: int = 64) -> JobConfig:
    """A THC job of 3 workers, 8-bit sums; K = 64 is the default Tofino program's, 32 the BMv2 one's."""
    return JobConfig(job=7, key=0x54484321, workers=3, threshold=2, elems=elems, result_bits=8, slots=16)


def parse_calls(script: str) -> list[tuple[str, str, dict[str, int]]]:
    """(table, action, keyword arguments) of every ``ing.<table>.add_with_<action>(...)`` line."""
    out = []
    for line in script.splitlines():
        m = CALL.match(line)
        if m:
            call = ast.parse(f"f({m.group(3)})", mode="eval").body
            assert isinstance(call, ast.Call)
            out.append((m.group(1), m.group(2), {k.arg: ast.literal_eval(k.value) for k in call.keywords}))
    return out


def logical(calls: list[tuple[str, str, dict[str, int]]], key_bits: int) -> list[tuple[str, str, dict[str, int]]]:
    """The calls without what Tofino's ternary lookup tables add to a logical entry, after checking it:
    every key's mask is all ones (an exact match: 16 bits of job row, ``key_bits`` of indices) and the
    priority is 0 (entries never overlap)."""
    out = []
    for table, action, kw in calls:
        if table.endswith(".lookup"):
            kw = dict(kw)
            key = "index" if "index" in kw else "indices"
            assert (kw.pop("job_index_mask"), kw.pop(f"{key}_mask"), kw.pop("MATCH_PRIORITY")) == (
                0xFFFF, (1 << key_bits) - 1, 0), (table, kw)
        out.append((table, action, kw))
    return out


def job_call(cfg: JobConfig, job_index: int, slot_base: int, mcast_grp: int) -> tuple[str, str, dict[str, int]]:
    """The thc_jobs entry of a job (bfrt key names)."""
    return ("thc_jobs", "job_config", {
        "job": cfg.job, "key": cfg.key, "table_id": cfg.table_id, "workers": cfg.workers,
        "threshold": cfg.threshold, "slots": cfg.slots, "slot_base": slot_base, "job_index": job_index,
        "mcast_grp": mcast_grp, "gen": GEN})


def expected_pair_calls(cfg: JobConfig, job_index: int, slot_base: int, mcast_grp: int,
                        ) -> list[tuple[str, str, dict[str, int]]]:
    """The Tofino program's entries of a job with 4-bit indices and 8-bit sums: lookup m takes indices
    2m and 2m + 1 (the byte m of the DATA payload: i0 in its top nibble) and returns T[i0] in the top byte
    and T[i1] in the low byte of a 16-bit value (two lanes of the RESULT payload, in order)."""
    assert cfg.bits == 4 and cfg.result_bits == 8
    t = [int(v) for v in cfg.values()]
    out = [(f"lookup_{m}.lookup", "value", {"job_index": job_index, "indices": byte, "v": t[byte >> 4] * 256 +
                                            t[byte & 15]})
           for m in range(cfg.elems // 2) for byte in range(256)]
    return [*out, job_call(cfg, job_index, slot_base, mcast_grp)]


def expected_job_calls(cfg: JobConfig, job_index: int, slot_base: int, mcast_grp: int,
                       ) -> list[tuple[str, str, dict[str, int]]]:
    """The lookup and job entries of a job on the BMv2 program's geometry (one lookup per element), from
    its table values and configuration (bfrt key names)."""
    values = [int(v) for v in cfg.values()]
    assert len(values) == 1 << cfg.bits
    out = [(f"elem_{e}.lookup", "value", {"job_index": job_index, "index": i, "v": v})
           for e in range(cfg.elems) for i, v in enumerate(values)]
    return [*out, job_call(cfg, job_index, slot_base, mcast_grp)]


def test_default_geometry_is_the_generators() -> None:
    """The control plane's Tofino geometry is the one p4gen/tofino.py renders thc.p4 with: Tofino 1, K =
    64 of 4 bits, 8-bit sums, lookups of two adjacent indices named lookup_<m> keyed on indices."""
    assert DEFAULT_TOFINO_GEOMETRY == ProgramGeometry(64, 4, 8, 4096, 8, lookup_indices=2, lookup_control="lookup",
                                                      lookup_key="indices")
    assert gen_tofino.TofinoGeometry().elems == 64 and gen_tofino.TofinoGeometry(target="tofino2").elems == 160


def test_reset_covers_every_register_of_the_program() -> None:
    """The load script clears every Register declared in p4src/tofino/thc.p4 (ingress and egress), with the
    data fields of its cell type, and nothing else."""
    text = preprocess(TOFINO_PROGRAM.read_text(), set())
    element, rest = text.split("control ThcIngress(", 1)
    element = element[element.index("control ThcLookup("):]
    ingress, egress = rest.split("control ThcEgress(", 1)
    ing_regs = set(re.findall(r"^\s*Register<[^\n]*?>\(\w+\) (\w+);", ingress, re.M))
    egr_regs = set(re.findall(r"^\s*Register<[^\n]*?>\(\w+\) (\w+);", egress, re.M))
    assert ing_regs == set(INGRESS_REGISTERS)
    assert egr_regs == set(EGRESS_REGISTERS)
    script = bfrt_load_script(TofinoPlan())
    cleared = set(re.findall(r"^(?:ing|egr)\.(\w+)\.clear\(\)$", script, re.M))
    assert cleared == ing_regs | egr_regs
    # The sums (ThcWord's one register per instance) need no reset: a FRESH or NEWER packet
    # overwrites its bank's sums (OP_SET).
    assert re.findall(r"^\s*Register<[^\n]*?>\(\w+\) (\w+);", element, re.M) == ["sums"]
    # Plain cells (no struct): bfrt names the single data field f1.
    cells = set(re.findall(r"^\s*Register<([^,]+),[^\n]*?>\(\w+\) \w+;", text, re.M))
    assert cells <= {"bit<8>", "bit<16>", "bit<32>"}, cells
    assert all(fields == ("f1",) for fields in {**INGRESS_REGISTERS, **EGRESS_REGISTERS}.values())


def test_bfrt_script_installs_the_expected_entries() -> None:
    """Lookup entries (job row, two indices) -> their T values in two lanes for the 32 lookups of the 64
    elements, the job entry with the job's configuration, PRE nodes (rid = row * 32 + worker, one port
    each) and the group of those nodes."""
    cfg = sample_job()
    script = bfrt_load_script(TofinoPlan(jobs=(TofinoJob(cfg, (5, 6, 9)),)), generation=GEN)
    calls = logical(parse_calls(script), 2 * cfg.bits)
    assert calls == expected_pair_calls(cfg, job_index=0, slot_base=0, mcast_grp=1)
    nodes = re.findall(r"bfrt\.pre\.node\.entry\(MULTICAST_NODE_ID=(\d+), MULTICAST_RID=(\d+), "
                       r"MULTICAST_LAG_ID=\[\], DEV_PORT=\[(\d+)\]\)\.push\(\)", script)
    assert sorted((int(r), int(p)) for _, r, p in nodes) == [(0, 5), (1, 6), (2, 9)]
    m = re.search(r"bfrt\.pre\.mgid\.entry\(MGID=1, MULTICAST_NODE_ID=\[([\d, ]+)\]", script)
    assert m and sorted(int(x) for x in m.group(1).split(",")) == sorted(int(n) for n, _, _ in nodes)
    ports = sorted(int(p) for p in re.findall(r"bfrt\.port\.port\.add\(DEV_PORT=(\d+),", script))
    assert ports == [5, 6, 9]


def test_script_order_makes_the_job_live_last() -> None:
    """Ports, then register reset, then lookups and the group, then the job entry, then completion."""
    script = bfrt_load_script(TofinoPlan(jobs=(TofinoJob(sample_job(), (1, 2, 3)),)), generation=GEN)
    lines = script.splitlines()
    pos = {key: next(i for i, ln in enumerate(lines) if ln.startswith(key))
           for key in ("bfrt.port.port.add", "ing.slot_state.clear", "ing.lookup_0.lookup.", "bfrt.pre.mgid",
                       "ing.thc_jobs.", "bfrt.complete_operations")}
    assert list(pos.values()) == sorted(pos.values())
    assert max(i for i, ln in enumerate(lines) if ln.startswith("ing.lookup_")) < pos["ing.thc_jobs."]


def test_both_targets_get_the_same_logical_entries() -> None:
    """The BMv2 P4Runtime updates (decoded through the P4Info) and the bfrt script hold the same
    entries for the same job and placement, and both equal the ones computed from the job's table."""
    if not CHECKED_IN_P4INFO.exists():
        pytest.skip(f"{CHECKED_IN_P4INFO} is missing (compile p4src/bmv2/thc.p4 with p4c-bm2-ss)")
    idx = P4InfoIndex(text_format.Parse(CHECKED_IN_P4INFO.read_text(), p4info_pb2.P4Info()))
    # The BMv2 program's geometry (K = 32) on both targets: the Tofino control plane takes any geometry.
    cfg, ports, geometry = sample_job(32), (5, 6, 9), program_geometry(idx)
    place = Placement(job_index=0, slot_base=0, generation=GEN)
    ups = job_updates(idx, geometry, cfg, ports, place)
    tables = {t.id: t for t in idx.tables.values()}
    actions = {a.id: a for a in idx.actions.values()}
    bmv2 = []
    groups = []
    for up in ups:
        if up.entity.HasField("packet_replication_engine_entry"):
            g = up.entity.packet_replication_engine_entry.multicast_group_entry
            groups.append((g.multicast_group_id, sorted((r.egress_port, r.instance) for r in g.replicas)))
            continue
        te = up.entity.table_entry
        t, a = tables[te.table_id], actions[te.action.action.action_id]
        names = {fid: name for name, (fid, _w, _m) in t.fields.items()}
        pnames = {pid: name for name, (pid, _w) in a.params.items()}
        kw = {names[m.field_id].rsplit(".", 1)[-1]: int.from_bytes(m.exact.value, "big") for m in te.match}
        kw.update({pnames[p.param_id]: int.from_bytes(p.value, "big") for p in te.action.action.params})
        # Names below their control, but an element's table with its instance (elem_3.lookup).
        table = ".".join(t.name.split(".")[-2:]) if ".elem_" in t.name else t.name.rsplit(".", 1)[-1]
        bmv2.append((table, a.name.rsplit(".", 1)[-1], kw))
    plan = TofinoPlan(jobs=(TofinoJob(cfg, ports),), program=TofinoProgram(geometry=geometry))
    tofino = logical(parse_calls(bfrt_load_script(plan, generation=GEN)), cfg.bits)
    expected = expected_job_calls(cfg, job_index=0, slot_base=0, mcast_grp=1)
    assert bmv2 == expected
    assert tofino == expected
    assert groups == [(1, [(5, 0), (6, 1), (9, 2)])]


def test_services_routes_and_two_jobs() -> None:
    """Service and LPM route entries; a second job gets the next row, the next slot range, group 2 and
    its own PRE node ids and replication ids (row 1: 32 + worker)."""
    a = sample_job()
    b = JobConfig(job=8, key=1, workers=2, elems=64, result_bits=8, slots=8)
    plan = TofinoPlan(jobs=(TofinoJob(a, (1, 2, 3)), TofinoJob(b, (4, 5))),
                      services=(("10.0.0.100", "02:00:00:00:01:00"),),
                      routes=(("10.0.1.0/24", "00:00:00:00:00:07", 7),))
    calls = parse_calls(bfrt_load_script(plan, generation=GEN))
    assert ("thc_service", "thc_serve", {"dstAddr": 0x0A000064, "switch_mac": 0x020000000100}) in calls
    assert ("ipv4_lpm", "ipv4_forward", {"dstAddr": 0x0A000100, "dstAddr_p_length": 24,
                                         "dst_mac": 7, "port": 7}) in calls
    jobs = [kw for t, _, kw in calls if t == "thc_jobs"]
    assert [(j["job"], j["job_index"], j["slot_base"], j["mcast_grp"]) for j in jobs] == [(7, 0, 0, 1), (8, 1, 16, 2)]
    script = bfrt_load_script(plan, generation=GEN)
    nodes = [tuple(map(int, x)) for x in re.findall(r"MULTICAST_NODE_ID=(\d+), MULTICAST_RID=(\d+)", script)]
    assert len({n for n, _ in nodes}) == 5
    assert sorted(r for _, r in nodes) == [0, 1, 2, 32, 33]


def test_a_job_the_program_cannot_aggregate_is_refused() -> None:
    """K other than the compiled 64, or more ports than workers: JobRefused, naming the problem."""
    with pytest.raises(JobRefused, match="K = 16"):
        bfrt_load_script(TofinoPlan(jobs=(TofinoJob(JobConfig(workers=2, elems=16, result_bits=8), (1, 2)),)))
    with pytest.raises(JobRefused, match="ports"):
        bfrt_load_script(TofinoPlan(jobs=(TofinoJob(sample_job(), (1, 2)),)))


def test_stats_mapping() -> None:
    """Counter names from the program's four counters: thc_stats at Counter's indices, RX, ACCEPTED =
    NORM + DATA accepted, ELEMENTS = DATA accepted x K, COMPLETED."""
    stats = [100 + i for i in range(len(Counter))]
    out = stats_from_raw({"thc_stats": stats, "thc_rx": [50], "thc_accepted": [3, 4], "thc_completed": [2]}, 32)
    assert out["RX"] == 50 and out["ACCEPTED"] == 7 and out["ELEMENTS"] == 128 and out["COMPLETED"] == 2
    assert out["STRAGGLER"] == 100 + Counter.STRAGGLER.value and out["BAD_KEY"] == 100 + Counter.BAD_KEY.value
    assert set(out) == {c.name for c in Counter}


def test_stats_script_reads_the_programs_counters() -> None:
    """The stats script reads thc_stats, thc_rx, thc_accepted and thc_completed, whose sizes are the
    program's; its output line parses back; a missing line is an error, not zeros."""
    text = TOFINO_PROGRAM.read_text()
    sizes = dict((n, s) for s, n in re.findall(r"Counter<bit<64>, bit<32>>\((\w+), CounterType_t\.PACKETS\) (\w+);",
                                              text))
    script = bfrt_stats_script()
    assert sizes["thc_rx"] == "1" and "_cells(ing.thc_rx, 1)" in script
    assert sizes["thc_accepted"] == "2" and "_cells(ing.thc_accepted, 2)" in script
    assert sizes["thc_stats"] == "THC_NUM_COUNTERS" and f"_cells(ing.thc_stats, {len(Counter)})" in script
    raw = {"thc_stats": [0] * len(Counter), "thc_rx": [9], "thc_accepted": [1, 1], "thc_completed": [1]}
    assert parse_stats_output("noise\nTHC_STATS " + json.dumps(raw) + "\n", 32)["RX"] == 9
    with pytest.raises(SwitchError, match="THC_STATS"):
        parse_stats_output("bfshell> nothing\n", 32)


def test_without_the_sde_scripts_are_written_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """thc-switch load --target tofino writes the script and says why it did not run it; stats fails
    with a one-line error naming $SDE."""
    monkeypatch.delenv("SDE", raising=False)
    with pytest.raises(BfrtUnavailable, match=r"\$SDE"):
        bfshell()
    out = tmp_path / "load.py"
    rc = cli_main(["load", "--target", "tofino", "--job", "job=7,workers=2,elems=64,result_bits=8",
                   "--ports", "1,2", "--output", str(out)])
    assert rc == 0 and "ing.thc_jobs.add_with_job_config(job=0x7," in out.read_text()
    assert "script not run" in capsys.readouterr().err
    assert cli_main(["stats", "--target", "tofino"]) == 1
    assert "$SDE" in capsys.readouterr().err


def test_with_an_sde_thc_switch_runs_the_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Where $SDE/run_bfshell.sh exists, load runs the script with -b and stats parses its output
    (a fake bfshell stands in for the SDE's: it logs its arguments and prints counters)."""
    sde = tmp_path / "sde"
    sde.mkdir()
    log = tmp_path / "calls.txt"
    raw = {"thc_stats": [0] * len(Counter), "thc_rx": [11], "thc_accepted": [1, 2], "thc_completed": [1]}
    shell = sde / "run_bfshell.sh"
    shell.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho 'THC_STATS {json.dumps(raw)}'\n")
    shell.chmod(shell.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("SDE", str(sde))
    script = tmp_path / "load.py"
    rc = cli_main(["load", "--target", "tofino", "--job", "job=7,workers=2,elems=64,result_bits=8",
                   "--ports", "1,2", "--output", str(script)])
    assert rc == 0 and log.read_text().split() == ["-b", str(script)]
    capsys.readouterr()
    assert cli_main(["stats", "--target", "tofino"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["RX"] == 11 and got["ELEMENTS"] == 2 * 64 and got["ACCEPTED"] == 3
    assert cli_main(["stats", "--target", "tofino2"]) == 0  # Tofino 2's program: K = 160 by default
    assert json.loads(capsys.readouterr().out)["ELEMENTS"] == 2 * 160
    assert cli_main(["stats", "--target", "tofino", "--elems", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["ELEMENTS"] == 2 * 16


def test_script_names_exist_in_the_tofino_program() -> None:
    """Every table, action, key and parameter the load script names is declared in p4src/tofino/thc.p4 with
    that name (bfrt_python keys are the last component of the P4 key's name; LPM adds <key>_p_length,
    a ternary key <key>_mask and the entry MATCH_PRIORITY)."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", TOFINO_PROGRAM.read_text(), flags=re.S)
    code = re.sub(r"@\w+\([^)]*\)\s*", "", code)  # annotations (@noWarn, @stage) are not names
    actions = {name: [p.split()[-1] for p in params.split(",") if p.strip()]
               for name, params in re.findall(r"action (\w+)\(([^)]*)\)", code)}
    tables = {name: (re.findall(r"([\w.]+): (exact|lpm|ternary);", keys), acts.replace(" ", "").split(";"))
              for name, keys, acts in re.findall(
                  r"table (\w+) \{\s*key = \{([^}]*)\}\s*actions = \{([^}]*)\}", code)}
    plan = TofinoPlan(jobs=(TofinoJob(sample_job(), (1, 2, 3)),), services=(("10.0.0.100", "02:00:00:00:01:00"),),
                      routes=(("10.0.1.0/24", "00:00:00:00:00:07", 7),))
    calls = parse_calls(bfrt_load_script(plan, generation=GEN))
    assert {t for t, _, _ in calls} == {f"lookup_{m}.lookup" for m in range(32)} | {"thc_jobs", "thc_service",
                                                                                      "ipv4_lpm"}
    instances = re.findall(r"ThcLookup\(\) (lookup_\d+);", code)
    assert instances == [f"lookup_{m}" for m in range(32)]
    suffix = {"lpm": ["_p_length"], "ternary": ["_mask"], "exact": []}
    for table, action, kw in calls:
        table = table.rsplit(".", 1)[-1]  # a lookup's table (lookup_3.lookup) is ThcLookup's lookup
        assert table in tables, f"no table {table} in the Tofino program"
        keys, acts = tables[table]
        assert action in acts, f"table {table} has no action {action}"
        names = {k.rsplit(".", 1)[-1] + sfx for k, kind in keys for sfx in ["", *suffix[kind]]}
        if any(kind == "ternary" for _, kind in keys):
            names.add("MATCH_PRIORITY")
        assert set(kw) == names | set(actions[action]), (table, action, sorted(kw))


def test_cli_geometry_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """--geometry tells thc-switch the program was generated for another K: a K = 16 job is refused by the
    default (K = 64) and installed with 8 lookup tables (two indices each) under --geometry 16,4,16,4096,8;
    a geometry the generator refuses is one line; --target tofino2 takes K = 160 by default."""
    monkeypatch.delenv("SDE", raising=False)
    spec = "job=3,workers=2,elems=16,result_bits=16"
    assert cli_main(["load", "--target", "tofino", "--job", spec, "--ports", "1,2", "--no-run"]) == 1
    assert "K = 16" in capsys.readouterr().err
    out = tmp_path / "load.py"
    assert cli_main(["load", "--target", "tofino", "--job", spec, "--ports", "1,2", "--no-run",
                     "--geometry", "16,4,16,4096,8", "--output", str(out)]) == 0
    tables = {t for t, _, _ in parse_calls(out.read_text())}
    assert tables == {f"lookup_{m}.lookup" for m in range(8)} | {"thc_jobs"}
    assert cli_main(["load", "--target", "tofino", "--job", spec, "--ports", "1,2", "--no-run",
                     "--geometry", "96,4,8,4096,8"]) == 1
    assert "at most 64 for tofino" in capsys.readouterr().err
    spec160 = "job=3,workers=2,elems=160,result_bits=8"
    assert cli_main(["load", "--target", "tofino2", "--job", spec160, "--ports", "1,2", "--no-run",
                     "--output", str(out)]) == 0
    assert {t for t, _, _ in parse_calls(out.read_text())} == {f"lookup_{m}.lookup" for m in range(80)} | {"thc_jobs"}


# ---- the leaf of two-tier jobs (p4gen.tofino --leaf) ----

LEAF_JOB = JobConfig(job=5, key=0x54484321, leaves=(3, 5), workers=8, elems=64, result_bits=8, slots=16)
UPLINK = Uplink(leaf=0, leaves=2, ip="10.0.9.1", port=9451, mac="02:00:00:00:09:01", out_port=12)
UPLINK_CALL = re.compile(r"^ing\.thc_uplink\.set_default_with_uplink\((.*)\)$", re.M)


def leaf_program() -> str:
    """The leaf program of the default geometry, as the compiler sees it (THC_LEAF blocks kept)."""
    return preprocess(gen_tofino.render(leaf=True), set())


def leaf_plan(*jobs: TofinoJob, uplink: Uplink | None = UPLINK, leaf: bool = True) -> TofinoPlan:
    return TofinoPlan(jobs=jobs, program=TofinoProgram(leaf=leaf), uplink=uplink)


def test_leaf_script_installs_the_leafs_job_and_its_uplink() -> None:
    """A leaf plan installs leaf 0's one-tier job (3 local workers, threshold 3), the uplink as
    thc_uplink's default action with the action's parameters as the leaf program declares them, brings
    the uplink's port up and also resets the leaf's register."""
    script = bfrt_load_script(leaf_plan(TofinoJob(LEAF_JOB, (1, 2, 3))), generation=GEN)
    [(_, _, job)] = [c for c in parse_calls(script) if c[0] == "thc_jobs"]
    assert (job["workers"], job["threshold"], job["slots"]) == (3, 3, 16)
    [args] = UPLINK_CALL.findall(script)
    call = ast.parse(f"f({args})", mode="eval").body
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert kw == {"leaf": 0, "leaves": 2, "parent_ip": 0x0A000901, "parent_port": 9451,
                  "parent_mac": 0x020000000901, "parent_out": 12}
    params = re.search(r"action uplink\(([^)]*)\)", leaf_program()).group(1)
    assert [p.split()[-1] for p in params.split(",")] == list(kw)
    assert "table thc_uplink {\n        actions" in leaf_program()  # keyless: its default action is the entry
    assert 12 in {int(p) for p in re.findall(r"bfrt\.port\.port\.add\(DEV_PORT=(\d+),", script)}
    cleared = set(re.findall(r"^ing\.(\w+)\.clear\(\)$", script, re.M))
    ingress = leaf_program().split("control ThcIngress(", 1)[1].split("control ThcEgress(", 1)[0]
    assert cleared == set(re.findall(r"^\s*Register<[^\n]*?>\(\w+\) (\w+);", ingress, re.M))
    assert cleared == set(INGRESS_REGISTERS) | set(LEAF_INGRESS_REGISTERS)
    assert "leaf program (python -m p4gen.tofino --leaf)" in script


def test_leaf_plans_refuse_what_the_leaf_program_cannot_serve() -> None:
    """One line each: an uplink without the leaf program, a two-tier job without an uplink, a one-tier
    job on a leaf, a leaf index the job has not, partials wider than the program's sums."""
    cases = [
        (leaf_plan(TofinoJob(LEAF_JOB, (1, 2, 3)), leaf=False), "an uplink needs the leaf program"),
        (leaf_plan(TofinoJob(LEAF_JOB, (1, 2, 3)), uplink=None, leaf=False), "two-tier jobs with an uplink"),
        (leaf_plan(TofinoJob(LEAF_JOB, (1, 2, 3)), uplink=None), "two-tier jobs with an uplink"),
        (leaf_plan(TofinoJob(sample_job(), (1, 2, 3))), "has one tier"),
        (leaf_plan(TofinoJob(LEAF_JOB, (1, 2, 3)), uplink=Uplink(2, 3, "10.0.9.1", 9451, "02:00:00:00:09:01", 1)),
         "leaf 2 of 3"),
        (leaf_plan(TofinoJob(JobConfig(job=6, leaves=(9, 9), workers=18, elems=64, result_bits=16, slots=8),
                             tuple(range(9)))), "16-bit sums"),
    ]
    for plan, message in cases:
        with pytest.raises(JobRefused, match=message):
            bfrt_load_script(plan)


def test_leaf_stats_add_the_tier_counters() -> None:
    """The leaf's stats script also reads thc_tier_stats (TierCounter's size in the leaf program) and
    thc_forwarded; the read-back names them; the one-tier script reads neither."""
    sizes = dict((n, s) for s, n in re.findall(r"Counter<bit<64>, bit<32>>\((\w+), CounterType_t\.PACKETS\) (\w+);",
                                              leaf_program()))
    assert sizes["thc_tier_stats"] == "THC_NUM_TIER_COUNTERS" and sizes["thc_forwarded"] == "1"
    script = bfrt_stats_script(TofinoProgram(leaf=True))
    assert f"_cells(ing.thc_tier_stats, {len(TierCounter)})" in script and "_cells(ing.thc_forwarded, 1)" in script
    assert "thc_tier_stats" not in bfrt_stats_script()
    raw = {"thc_stats": [0] * len(Counter), "thc_rx": [9], "thc_accepted": [1, 1], "thc_completed": [1],
           "thc_tier_stats": [0, 4, 2], "thc_forwarded": [7]}
    out = stats_from_raw(raw, 64)
    assert (out["FORWARDED"], out["FORWARDED_AGAIN"], out["STALE_PARENT"], out["COMPLETED"]) == (7, 4, 2, 1)


def test_cli_loads_a_leaf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """thc-switch load --target tofino --leaf ... writes the leaf's script; the uplink's options without
    --leaf, or --leaf without them, are one line each."""
    monkeypatch.delenv("SDE", raising=False)
    out = tmp_path / "leaf.py"
    base = ["load", "--target", "tofino", "--job", LEAF_JOB.spec(), "--ports", "1,2,3", "--no-run"]
    up = ["--upstream", "10.0.9.1:9451", "--upstream-mac", "02:00:00:00:09:01", "--upstream-port", "12"]
    assert cli_main([*base, "--leaf", "0", *up, "--output", str(out)]) == 0
    assert out.read_text() == bfrt_load_script(leaf_plan(TofinoJob(LEAF_JOB, (1, 2, 3))),
                                               generation=_generation(out.read_text()))
    assert cli_main([*base, *up]) == 1
    assert "give --leaf L too" in capsys.readouterr().err
    assert cli_main([*base, "--leaf", "0"]) == 1
    assert "--upstream, --upstream-mac, --upstream-port" in capsys.readouterr().err


def _generation(script: str) -> int:
    return int(re.search(r"gen=(0x[0-9a-f]+)", script).group(1), 16)
