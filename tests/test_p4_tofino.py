"""The Tofino (TNA) program: generated from its template, same headers as the wire format, within
Tofino's rules as far as a text check can tell, and accepted by p4c's front end (p4test) with tna.p4.

Where the Tofino back end (bf-p4c, built from p4c's backends/tofino) is on PATH, the program is compiled
for Tofino 1 and the names the control plane uses are checked against the compiler's bfrt.json; elsewhere
that test skips saying so."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import p4gen.tofino as gen
from aggregator.bfrt import (
    EGRESS_REGISTERS,
    INGRESS_REGISTERS,
    LEAF_INGRESS_REGISTERS,
    TofinoJob,
    TofinoPlan,
    TofinoProgram,
    bfrt_load_script,
    bfrt_stats_script,
    tofino_geometry,
)
from aggregator.switch.entries import Uplink
from tests.p4_support import INCLUDE_DIR, P4_DIR, preprocess
from tests.test_p4_headers import parse_consts
from worker_lib.job import JobConfig
from worker_lib.wire.layout import MAX_WORKERS

PROGRAM = P4_DIR / "tofino" / "thc.p4"
TNA_DIRS = ("/usr/local/share/p4c/tna-include", "/usr/share/p4c/tna-include")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def tna_include_dir() -> Path:
    """A directory holding tna.p4: $THC_TNA_INCLUDE, else the usual install places; skip if none."""
    env = os.environ.get("THC_TNA_INCLUDE")
    candidates = [env] if env else list(TNA_DIRS)
    for c in candidates:
        if c and (Path(c) / "tna.p4").is_file():
            return Path(c)
    where = f"THC_TNA_INCLUDE={env}" if env else " or ".join(TNA_DIRS)
    pytest.skip(f"needs tna.p4 (p4c backends/tofino/bf-p4c/p4include) in {where}; set THC_TNA_INCLUDE")


def p4test_path() -> str:
    """The p4test executable (p4c's front-end test driver); skip if absent."""
    path = shutil.which("p4test")
    if path is None:
        pytest.skip("needs p4test (p4c's front end) on PATH: see docs/bmv2.md or the Vagrantfile")
    return path


def run_p4test(program: Path, generation: int = 1) -> subprocess.CompletedProcess[str]:
    """p4test -D__TARGET_TOFINO__=<generation> -I <tna> -I p4src/include <program> (its own directory is
    searched too): 1 for tna.p4, 2 for t2na.p4, which refuses other targets."""
    cmd = [p4test_path(), f"-D__TARGET_TOFINO__={generation}", "-I", str(tna_include_dir()), "-I", str(INCLUDE_DIR),
           str(program)]
    for attempt in range(3):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
        except OSError as exc:
            # Starting p4test once failed in the child with EFAULT ("Bad address"), a fault of the exec
            # with several started from threads at once, not a result of p4test: start it again.
            if exc.errno != errno.EFAULT or attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_checked_in_program_is_current() -> None:
    """p4src/tofino/thc.p4 is exactly what p4gen/tofino.py renders from the template with the defaults."""
    assert PROGRAM.read_text() == gen.render(), "run: python -m p4gen.tofino"


def test_gen_check_flag_detects_a_stale_file(tmp_path: Path) -> None:
    """--check exits 1 for a file that differs from the rendering and 0 for a current one."""
    out = tmp_path / "thc.p4"
    out.write_text("stale\n")
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0


def test_program_uses_the_shared_headers_and_parser() -> None:
    """The THC header comes from p4src/include (generated from the wire layout), not a copy: the Tofino
    program defines no thc_h of its own, includes thc_common.p4, and its ingress parser runs
    ThcHeaderParser; the egress parser stops after the THC header (Tofino 1's 160-byte parse depth),
    so it extracts no payload."""
    text = PROGRAM.read_text()
    assert '#include "thc_common.p4"' in text
    assert not re.search(r"header\s+thc_h\s*\{", text)
    parser = (P4_DIR / "tofino" / "parser.p4").read_text()
    assert '#include "thc_parser.p4"' in parser
    call = "thc_parser.apply(pkt, hdr.ethernet, hdr.ipv4, hdr.udp, hdr.thc, hdr.data, hdr.norm);"
    assert parser.count(call) == 1  # ingress
    egress = parser[parser.index("parser ThcEgressParser"):parser.index("control ThcEgressDeparser")]
    assert "pkt.extract(hdr.thc);" in egress and "hdr.data" not in egress and "hdr.norm" not in egress


@pytest.mark.parametrize(("elems", "bits", "rbits"), [(8, 2, 8), (24, 4, 8), (16, 8, 16), (24, 4, 16), (64, 4, 8)])
def test_payload_headers_follow_the_geometry(elems: int, bits: int, rbits: int) -> None:
    """The payload as the wire has it, cut where the tables and registers take it: the DATA payload in
    lookup keys of two adjacent indices where 2 b <= 8 (else one), the RESULT payload in 32-bit words
    (32 / result width sums each). Every lookup is applied once, to its key, writing exactly the bits its
    elements occupy in the RESULT payload (worked out here from byte offsets); then each word's register
    (ThcWord: one Register, one RegisterAction) is applied once, after its word's lookups."""
    text = gen.render(gen.TofinoGeometry(elems=elems, bits=bits, result_bits=rbits))
    q = 2 if 2 * bits <= 8 else 1
    c = parse_consts(text)
    assert (c["THC_LOOKUP_INDICES"], c["THC_LOOKUP_KEY_BITS"], c["THC_LOOKUP_VALUE_BITS"]) == (q, q * bits, q * rbits)
    assert c["THC_LANES"] == 32 // rbits and c["THC_RESULT_BITS"] == rbits
    data = re.search(r"header thc_data_h \{(.*?)\}", text, re.S).group(1)
    assert re.findall(r"bit<THC_LOOKUP_KEY_BITS> (\w+);", data) == [f"k{m}" for m in range(elems // q)]
    result = re.search(r"header thc_result_h \{(.*?)\}", text, re.S).group(1)
    words = elems * rbits // 32
    assert re.findall(r"bit<32> (\w+);", result) == [f"w{j}" for j in range(words)]
    code = _strip_comments(text)
    assert re.findall(r"ThcLookup\(\) (\w+);", code) == [f"lookup_{m}" for m in range(elems // q)]
    assert re.findall(r"ThcWord\(\) (\w+);", code) == [f"word_{j}" for j in range(words)]
    body = code[code.index("hdr.result.setValid();"):]
    applies = re.findall(r"(lookup|word)_(\d+)\.apply\(([^;]*)\);", body)
    done_words = set()
    for kind, n, args in applies:
        n = int(n)
        if kind == "word":
            assert args == f"hdr.bridge.op, bank, hdr.result.w{n}" and n not in done_words
            done_words.add(n)
            continue
        first = n * q  # element of its first index
        bit = first * rbits  # its offset in the RESULT payload, in bits from the start
        word, top = bit // 32, 31 - bit % 32
        lane = f"hdr.result.w{word}" if q * rbits == 32 else f"hdr.result.w{word}[{top}:{top - q * rbits + 1}]"
        assert args == f"hdr.bridge.job_index, hdr.data.k{n}, {lane}", (n, args)
        assert word not in done_words, f"lookup {n} after its word's register"
    assert [int(n) for kind, n, _ in applies if kind == "lookup"] == list(range(elems // q))
    assert done_words == set(range(words))
    lookup = code[code.index("control ThcLookup("):code.index("control ThcWord(")]
    word = code[code.index("control ThcWord("):code.index("control ThcIngress(")]
    assert "Register" not in lookup and lookup.count("lookup.apply();") == 1
    assert len(re.findall(r"\bRegister<", word)) == len(re.findall(r"\bRegisterAction<", word)) == 1
    assert not re.search(r"@[A-Z_]+@", code), "a template marker was left unfilled"


def test_tofino2_program_includes_t2na() -> None:
    """--target tofino2 renders the same program on t2na.p4, with K = 160 and pipe 0's recirculation port 6
    by default; tofino renders it on tna.p4 with K = 64 and port 68."""
    t2 = gen.render(gen.TofinoGeometry(target="tofino2"))
    t1 = gen.render(gen.TofinoGeometry())
    assert "#include <t2na.p4>" in t2 and "#include <tna.p4>" not in t2
    assert "#include <tna.p4>" in t1 and "#include <t2na.p4>" not in t1
    assert parse_consts(t2)["THC_K"] == 160 and parse_consts(t1)["THC_K"] == 64
    assert "THC_RECIRC_PORT = 6;" in t2 and "THC_RECIRC_PORT = 68;" in t1


def test_consts_match_the_geometry() -> None:
    """The generated constants are the geometry's (data and result bytes from K, b, result width)."""
    g = gen.TofinoGeometry(elems=16, bits=4, result_bits=16, slots=2048, jobs=4, recirc_port=196)
    c = parse_consts(gen.render(g))
    assert (c["THC_K"], c["THC_INDEX_BITS"], c["THC_RESULT_BITS"]) == (16, 4, 16)
    assert (c["THC_DATA_BYTES"], c["THC_RESULT_BYTES"]) == (16 * 4 // 8, 16 * 16 // 8)
    assert (c["THC_SLOTS"], c["THC_JOBS"]) == (2048, 4)
    assert "const PortId_t THC_RECIRC_PORT = 196;" in gen.render(g)


def test_program_keeps_tofinos_register_rules() -> None:
    """Text-level Tofino rules: no v1model register calls (.read/.write), cells of 8/16/32 bits (or a pair
    of 16-bit halves), every register used through RegisterActions, no more registers (ThcWord's once per
    instance) than one pipe's 12 x 4 stateful ALUs, and the worker bitmap is one 32-bit cell (MAX_WORKERS =
    32)."""
    code = _strip_comments(PROGRAM.read_text())
    assert not re.search(r"\.\s*(read|write)\s*\(", code)
    regs = re.findall(r"Register<([^,]+),\s*bit<(?:16|32)>>\((\w+)\)\s+(\w+);", code)
    assert regs, "no Register declarations found"
    words = len(re.findall(r"ThcWord\(\) word_\d+;", code))
    assert words == 64 // 4 and len(regs) - 1 + words <= 12 * 4
    widths = {"bit<8>": 8, "bit<16>": 16, "bit<32>": 32,
              "bit<THC_RESULT_BITS>": parse_consts(code)["THC_RESULT_BITS"]}
    for cell, _size, name in regs:
        assert cell in widths and widths[cell] in (8, 16, 32), f"register {name} has cell type {cell}"
        assert re.search(rf"RegisterAction<[^\n]*?>\({name}\)", code), f"register {name} has no RegisterAction"
    assert MAX_WORKERS == 32 and "Register<bit<32>, bit<32>>(THC_BANKS) bank_seen;" in code
    assert "for (" not in code and "while" not in code


@pytest.mark.parametrize("bad", [dict(elems=12), dict(elems=72), dict(elems=168, target="tofino2"), dict(bits=0),
                                 dict(bits=9), dict(result_bits=32), dict(slots=0), dict(jobs=4096),
                                 dict(recirc_port=512), dict(target="tofino3")])
def test_bad_geometry_is_refused(bad: dict) -> None:
    """Geometries the program cannot have are refused with a message naming the parameter."""
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        gen.TofinoGeometry(**bad)


OTHER_GEOMETRIES = [(8, 4, 8, "tofino"), (16, 4, 16, "tofino"), (16, 8, 16, "tofino"), (160, 4, 8, "tofino2")]
LEAF_GEOMETRIES = [(8, "tofino"), (gen.LEAF_MAX_ELEMS["tofino"], "tofino"), (gen.LEAF_MAX_ELEMS["tofino2"], "tofino2")]


@pytest.fixture(scope="module")
def front_end(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple, tuple[Path, Future]]]:
    """Every p4test run the three tests below check, by key: the program's file and its run, all started at
    once on a pool as wide as the machine. p4test is single-threaded; one after another, the eight took two
    minutes on two cores."""
    p4test_path(), tna_include_dir()  # skip here, not in a pool thread
    root = tmp_path_factory.mktemp("front-end")
    rendered: dict[tuple, tuple[str, str]] = {}
    for elems, bits, rbits, target in OTHER_GEOMETRIES:
        geometry = gen.TofinoGeometry(elems=elems, bits=bits, result_bits=rbits, target=target)
        rendered[("geometry", elems, bits, rbits, target)] = (gen.render(geometry), target)
    for elems, target in LEAF_GEOMETRIES:
        rendered[("leaf", elems, target)] = (gen.render(gen.TofinoGeometry(elems=elems, target=target), leaf=True),
                                             target)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {("program",): (PROGRAM, pool.submit(run_p4test, PROGRAM))}
        for i, (key, (text, target)) in enumerate(rendered.items()):
            out = root / str(i) / "thc.p4"  # next to a copy of parser.p4, which the program includes
            out.parent.mkdir()
            out.write_text(text)
            shutil.copy(P4_DIR / "tofino" / "parser.p4", out.parent / "parser.p4")
            runs[key] = (out, pool.submit(run_p4test, out, 2 if target == "tofino2" else 1))
        yield runs


def test_p4test_front_end_accepts_the_program(front_end: dict[tuple, tuple[Path, Future]]) -> None:
    """p4c's front end (p4test) with tna.p4 accepts p4src/tofino/thc.p4 without errors or warnings."""
    proc = front_end[("program",)][1].result()
    assert proc.returncode == 0, f"p4test failed:\n{proc.stderr}\n{proc.stdout}"
    assert "error" not in proc.stderr.lower() and "warning" not in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize(("elems", "bits", "rbits", "target"), OTHER_GEOMETRIES)
def test_p4test_accepts_other_geometries(front_end: dict[tuple, tuple[Path, Future]], elems: int, bits: int,
                                         rbits: int, target: str) -> None:
    """Other geometries of the generator, and Tofino 2's program on t2na.p4, also pass the front end."""
    proc = front_end[("geometry", elems, bits, rbits, target)][1].result()
    assert proc.returncode == 0, f"p4test failed:\n{proc.stderr}"


def test_p4test_rejects_a_broken_program(tmp_path: Path) -> None:
    """The front-end test can fail: a use of an undeclared name in the program is an error."""
    out = tmp_path / "thc.p4"
    text = PROGRAM.read_text()
    assert "        values = v;\n" in text
    out.write_text(text.replace("        values = v;\n", "        values = v + thc_no_such_name;\n"))
    shutil.copy(P4_DIR / "tofino" / "parser.p4", tmp_path / "parser.p4")
    proc = run_p4test(out)
    assert proc.returncode != 0 and "thc_no_such_name" in proc.stderr


def _reference_first_checks(f: dict, types: tuple[int, ...], senders_left: str) -> str | None:
    """The checks before the format, in docs/protocol.md's order, written out plainly (a packet of one of
    ``types``, its sender index below the field ``senders_left`` says): the first failing check's counter."""
    if not f["thc_valid"] or f["udp_short"] != 0:
        return "THC_CTR_SHORT"
    if f["version"] != 1:
        return "THC_CTR_BAD_VERSION"
    if f["type"] not in types:
        return "THC_CTR_BAD_TYPE"
    if f["job_hit"] == 0:
        return "THC_CTR_UNKNOWN_JOB"
    if f["key_diff"] != 0:
        return "THC_CTR_BAD_KEY"
    if f["table_diff"] != 0:
        return "THC_CTR_BAD_TABLE"
    if f[senders_left] == 0:
        return "THC_CTR_BAD_WORKER"
    if f["slots_left"] == 0:
        return "THC_CTR_BAD_SLOT"
    return None


def _reference_check(f: dict, k: int, b: int) -> str | None:
    """docs/protocol.md's checks of a worker's packet in order: the first failing check's counter."""
    first = _reference_first_checks(f, (1, 3), "workers_left")
    if first is not None:
        return first
    data_ok = f["data_valid"] and f["elems"] == k and f["width"] == b and f["udp_length"] == 40 + k * b // 8
    norm_ok = f["norm_valid"] and f["elems"] == 1 and f["width"] == 32 and f["udp_length"] == 44
    if (f["type"] == 1 and not data_ok) or (f["type"] == 3 and not norm_ok):
        return "THC_CTR_BAD_FORMAT"
    if f["type"] == 3 and (f["norm_sign_exp"] & 0x100 or f["norm_sign_exp"] & 0xFF == 0xFF):
        return "THC_CTR_BAD_NORM"
    return None


def _tcam_first_row(entries: list, f: dict) -> gen.TcamRow:
    for row in entries:
        if all(f[key] == v if isinstance(v, bool) else f[key] & v[1] == v[0] & v[1] for key, v in row.pattern.items()):
            return row
    raise AssertionError(f"no entry matches {f}")


def _tcam_first_match(entries: list, f: dict) -> str | None:
    return _tcam_first_row(entries, f).counter


@pytest.mark.parametrize(("elems", "bits"), [(24, 4), (8, 2)])
def test_validation_table_is_the_protocols_check_order(elems: int, bits: int) -> None:
    """The validate table's entries (first match wins, as in a TCAM) give the counter of the first failing
    check, or validated(), exactly as the checks in docs/protocol.md's order do, over 20000 random header
    values drawn around every check's boundary."""
    g = gen.TofinoGeometry(elems=elems, bits=bits)
    entries = gen.validation_entries(gen.validation_checks(g))
    assert {name for row in entries for name in row.pattern} <= {name for name, _ in gen.VALIDATE_KEYS}
    rng = random.Random(7)
    # Per field: the values that pass its check, then the ones that do not (drawn 1 time in 8).
    choices = {
        "thc_valid": ([True], [False]), "udp_short": ([0], [1, 12]), "version": ([1], [0, 2]),
        "type": ([1, 3], [0, 2, 4, 5, 7]), "job_hit": ([1], [0]), "key_diff": ([0], [1, 1 << 31]),
        "table_diff": ([0], [4]), "workers_left": ([3, 1], [0]), "slots_left": ([9, 1], [0]),
        "data_valid": ([True], [False]), "norm_valid": ([True], [False]), "elems": ([elems, 1], [elems + 8, 0]),
        "width": ([bits, 32], [8, 0]), "udp_length": ([40 + elems * bits // 8, 44], [40, 0]),
        "norm_sign_exp": ([0x7F, 0, 0x80], [0x100, 0xFF, 0x1FF]),
    }
    outcomes = set()
    for _ in range(20000):
        f = {k: rng.choice(bad if rng.random() < 1 / 8 else good) for k, (good, bad) in choices.items()}
        want = _reference_check(f, elems, bits)
        assert _tcam_first_match(entries, f) == want, f
        outcomes.add(want)
    assert len(outcomes) == 11  # the 10 counters of the checks and validated() were all seen
    # The rendered table holds the same entries in the same order.
    text = gen.render(g)
    table = text[text.index("table validate {"):]
    rows = re.findall(r"^\s*// (.*)\n\s*\(.*\) : (reject\((\w+)\)|validated\(\));", table[:table.index("size =")], re.M)
    assert [(note, counter or None) for note, _, counter in rows] == [(r.note, r.counter) for r in entries]
    assert rows[-1][0] == "no THC header parsed" or rows[-1][0].startswith("UDP payload shorter")


def _reference_parent_check(f: dict, k: int, rbits: int) -> str | None:
    """docs/protocol.md's checks of a packet from a leaf's parent, in order, written out plainly."""
    first = _reference_first_checks(f, (2, 4, 5), "leaves_left")
    if first is not None:
        return first
    result_ok = f["result_valid"] and f["elems"] == k and f["width"] == rbits and f["udp_length"] == 40 + k * rbits // 8
    norm_ok = f["norm_valid"] and f["elems"] == 1 and f["width"] == 32 and f["udp_length"] == 44
    notice_ok = f["elems"] == 0 and f["width"] == 0 and f["bitmap_hi"] == 0 and f["udp_length"] == 40
    if not {2: result_ok, 4: norm_ok, 5: notice_ok}[f["type"]]:
        return "THC_CTR_BAD_FORMAT"
    return None


def test_leaf_validation_table_checks_the_parents_packets_and_the_workers() -> None:
    """The leaf's validate table: a packet from the parent (uplink configured, its source address and port)
    meets the parent's checks in the protocol's order and, valid, validated_parent(); any other packet the
    workers' checks and validated(). 30000 random header values around every check's boundary, against
    both checks written out plainly."""
    k, bits, rbits = 24, 4, 8
    g = gen.TofinoGeometry(elems=k, bits=bits, result_bits=rbits)
    entries = gen.table_entries(g, leaf=True)
    assert {name for row in entries for name in row.pattern} <= {name for name, _ in gen.validate_keys(leaf=True)}
    rng = random.Random(11)
    choices = {
        "thc_valid": ([True], [False]), "udp_short": ([0], [1]), "version": ([1], [0, 2]),
        "type": ([1, 3, 2, 4, 5], [0, 6, 8, 9]), "job_hit": ([1], [0]), "key_diff": ([0], [1 << 31]),
        "table_diff": ([0], [4]), "workers_left": ([3, 1], [0]), "slots_left": ([9], [0]),
        "data_valid": ([True], [False]), "norm_valid": ([True], [False]), "elems": ([k, 1, 0], [k + 8]),
        "width": ([bits, 32, rbits, 0], [16]), "udp_length": ([40 + k * bits // 8, 44, 40 + k * rbits // 8, 40], [0]),
        "norm_sign_exp": ([0x7F], [0x100, 0xFF]), "uplink_hit": ([1], [0]), "parent_ip_diff": ([0], [1, 1 << 31]),
        "parent_port_diff": ([0], [0x8000]), "leaves_left": ([1, 5], [0]), "result_valid": ([True], [False]),
        "bitmap_hi": ([0], [1, 0x8000]),
    }
    seen = set()
    for _ in range(30000):
        f = {name: rng.choice(bad if rng.random() < 1 / 8 else good) for name, (good, bad) in choices.items()}
        parent = f["uplink_hit"] == 1 and f["parent_ip_diff"] == 0 and f["parent_port_diff"] == 0
        want = _reference_parent_check(f, k, rbits) if parent else _reference_check(f, k, bits)
        row = _tcam_first_row(entries, f)
        assert (row.counter, row.valid if row.counter is None else None) == \
            (want, ("validated_parent" if parent else "validated") if want is None else None), f
        seen.add((parent, want))
    assert (True, None) in seen and (False, None) in seen and len(seen) >= 20
    text = gen.render(g, leaf=True)
    assert text.splitlines()[1] == "#define THC_LEAF"
    table = text[text.index("table validate {"):]
    assert table.count(": validated_parent();") == sum(r.valid == "validated_parent" and r.counter is None
                                                       for r in entries) >= 3


@pytest.mark.parametrize(("elems", "target"), LEAF_GEOMETRIES)
def test_p4test_accepts_the_leaf_program(front_end: dict[tuple, tuple[Path, Future]], elems: int,
                                         target: str) -> None:
    """The leaf of two-tier jobs (p4gen.tofino --leaf) passes the front end, and it is the template's
    THC_LEAF blocks: the one-tier program has none of its names."""
    out, run = front_end[("leaf", elems, target)]
    proc = run.result()
    assert proc.returncode == 0, f"p4test failed:\n{proc.stderr}"
    assert "warning" not in proc.stderr.lower(), proc.stderr
    leaf, one_tier = (_strip_comments(preprocess(t, set())) for t in (out.read_text(), PROGRAM.read_text()))
    for name in ("thc_uplink", "bank_upstream", "validated_parent", "EMIT_PARTIAL", "thc_tier_stats"):
        assert name in leaf and name not in one_tier


def test_leaf_command_line_needs_an_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--leaf writes elsewhere than the checked-in one-tier program, and says so otherwise."""
    with pytest.raises(SystemExit):
        gen.main(["--leaf"])
    assert "--leaf needs --output" in capsys.readouterr().err
    assert gen.main(["--leaf", "--output", str(tmp_path / "leaf.p4")]) == 0
    assert (tmp_path / "leaf.p4").read_text() == gen.render(leaf=True)
    assert f"K={gen.LEAF_MAX_ELEMS['tofino']}," in (tmp_path / "leaf.p4").read_text().splitlines()[0]
    with pytest.raises(SystemExit):
        gen.main(["--leaf", "--elems", str(gen.LEAF_MAX_ELEMS["tofino"] + 8), "--output", str(tmp_path / "x.p4")])
    assert "for the leaf on tofino" in capsys.readouterr().err


#: The Tofino 2 compiles take bf-p4c about 2 minutes (K = 160) and 5 minutes (the leaf, K = 128) on two cores,
#: more than the whole suite can spare within CI's 15 minutes; they run where THC_LONG_COMPILES=1
#: (docs/tofino.md, "The leaf of two-tier jobs"). Tofino 1's (the checked-in program and the leaf) always run.
LONG_COMPILES = os.environ.get("THC_LONG_COMPILES") == "1"
LONG_COMPILE = pytest.mark.skipif(not LONG_COMPILES, reason=(
    "the Tofino 2 bf-p4c compiles take 2 (K = 160) and 5 (the leaf) minutes on 2 cores, too long for CI's "
    "budget: set THC_LONG_COMPILES=1 to run them"))
LONG_BUILDS = ("tofino2", "tofino2-leaf")
#: (target, leaf) of every bf-p4c compile, by test id.
BF_P4C_BUILDS = {"tofino": ("tofino", False), "tofino2": ("tofino2", False), "tofino-leaf": ("tofino", True),
                 "tofino2-leaf": ("tofino2", True)}


@dataclass
class Build:
    """One bf-p4c compile started in the background."""
    proc: subprocess.Popen
    out: Path
    geometry: gen.TofinoGeometry


@pytest.fixture(scope="module", autouse=True)
def bf_p4c_builds(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Build]]:
    """The compiles of the selected test_bf_p4c_compiles_the_program cases, started with this module's first
    test: bf-p4c runs on one core, so the compiles run beside each other and beside the module's other
    tests, and take about the longest one's time instead of their sum (about 2 minutes of CI). Empty
    without bf-p4c."""
    bf = shutil.which("bf-p4c") or shutil.which("p4c-barefoot")
    builds: dict[str, Build] = {}
    if bf is None:
        yield builds
        return
    selected = {item.callspec.params["build_id"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_bf_p4c_compiles_the_program"}
    try:
        for name, (target, leaf) in BF_P4C_BUILDS.items():
            if name not in selected or (name in LONG_BUILDS and not LONG_COMPILES):
                continue
            root = tmp_path_factory.mktemp(f"bf-p4c-{name}")
            g = gen.TofinoGeometry(target=target, elems=gen.LEAF_MAX_ELEMS[target] if leaf else None)
            program = PROGRAM
            if target != "tofino" or leaf:
                program = root / "src" / "thc.p4"
                program.parent.mkdir()
                program.write_text(gen.render(g, leaf=leaf))
                shutil.copy(P4_DIR / "tofino" / "parser.p4", program.parent / "parser.p4")
            cmd = [bf, "--target", target, "--arch", g.arch, "-I", str(INCLUDE_DIR), "-o", str(root / "out"),
                   str(program)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            builds[name] = Build(proc, root / "out", g)
        yield builds
    finally:
        for b in builds.values():
            if b.proc.poll() is None:
                b.proc.kill()
            b.proc.communicate()


@pytest.mark.parametrize("build_id", [pytest.param(n, marks=LONG_COMPILE) if n in LONG_BUILDS else n
                                      for n in BF_P4C_BUILDS])
def test_bf_p4c_compiles_the_program(bf_p4c_builds: dict[str, Build], build_id: str) -> None:
    """Where the Tofino back end (bf-p4c) is installed, the program compiles for Tofino 1 (the checked-in
    file, K = 64) and Tofino 2 (rendered with --target tofino2, K = 160), and so does the leaf of two-tier
    jobs (p4gen.tofino --leaf, at the largest K the generator allows it); every table, key, action,
    parameter, register and counter that the bfrt load and stats scripts name exists in the compiler's
    bfrt.json under that name."""
    if not bf_p4c_builds:
        pytest.skip("needs bf-p4c or p4c-barefoot (the Tofino compiler back end, p4c backends/tofino or Intel's "
                    "SDE) on PATH; p4src/tofino/README.md says what it reported of this program where it ran")
    target, leaf = BF_P4C_BUILDS[build_id]
    build = bf_p4c_builds[build_id]
    g, out = build.geometry, build.out
    log, _ = build.proc.communicate(timeout=3000)
    assert build.proc.returncode == 0, f"bf-p4c failed:\n{log[-6000:]}"
    assert (out / "pipe" / f"{target}.bin").is_file()

    bfrt = {t["name"]: t for t in json.loads((out / "bfrt.json").read_text())["tables"]}
    if leaf:
        job = JobConfig(job=7, leaves=(3, 2), workers=5, elems=g.elems, result_bits=8, slots=16)
        uplink = Uplink(leaf=0, leaves=2, ip="10.0.9.1", port=9451, mac="02:00:00:00:09:01", out_port=12)
    else:
        job, uplink = JobConfig(job=7, workers=3, threshold=2, elems=g.elems, result_bits=8, slots=16), None
    plan = TofinoPlan(jobs=(TofinoJob(job, (1, 2, 3)),), services=(("10.0.0.100", "02:00:00:00:01:00"),),
                      routes=(("10.0.1.0/24", "00:00:00:00:00:07", 7),),
                      program=TofinoProgram(geometry=tofino_geometry(g), leaf=leaf), uplink=uplink)
    script = bfrt_load_script(plan)
    calls = re.findall(r"^ing\.([\w.]+)\.(?:add|set_default)_with_(\w+)\((.*)\)$", script, re.M)
    assert calls and leaf == any(t == "thc_uplink" for t, _, _ in calls)
    suffix = {"Exact": [""], "LPM": ["", "_p_length"], "Ternary": ["", "_mask"]}
    for table, action, args in calls:
        t = bfrt[f"pipe.ThcIngress.{table}"]
        keys = {k["name"].rsplit(".", 1)[-1] + sfx for k in t["key"] if not k["name"].startswith("$")
                for sfx in suffix[k["match_type"]]}
        keys |= {k["name"][1:] for k in t["key"] if k["name"] == "$MATCH_PRIORITY"}
        control = f"ThcIngress.{table.rpartition('.')[0]}".rstrip(".")  # a lookup's actions are its control's
        spec = next(a for a in t["action_specs"] if a["name"] == f"{control}.{action}")
        given = {kw.split("=", 1)[0].strip() for kw in args.split(",")}
        assert given == keys | {p["name"] for p in spec["data"]}, (table, action)
    ingress = {**INGRESS_REGISTERS, **(LEAF_INGRESS_REGISTERS if leaf else {})}
    for ctl, regs in (("ThcIngress", ingress), ("ThcEgress", EGRESS_REGISTERS)):
        for name, fields in regs.items():
            t = bfrt[f"pipe.{ctl}.{name}"]
            assert t["table_type"] == "Register"
            assert [d["singleton"]["name"].rsplit(".", 1)[-1] for d in t["data"]] == list(fields)
            assert f"{'ing' if ctl == 'ThcIngress' else 'egr'}.{name}.clear()" in script
    counters = [("thc_stats", 20), ("thc_rx", 1), ("thc_accepted", 2), ("thc_completed", 1)]
    counters += [("thc_tier_stats", 3), ("thc_forwarded", 1)] if leaf else []
    stats = bfrt_stats_script(TofinoProgram(leaf=leaf))
    for counter, size in counters:
        assert bfrt[f"pipe.ThcIngress.{counter}"]["size"] == size
        assert f"_cells(ing.{counter}, {size})" in stats
