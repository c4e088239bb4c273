"""The BMv2 program is generated from its template for a geometry; it compiles with p4c-bm2-ss."""

from __future__ import annotations

import re

import pytest

import p4gen.bmv2 as gen
from tests.p4_support import CHECKED_IN_P4INFO, P4_DIR, compile_bmv2, need_tools
from tests.test_p4_headers import parse_header

PROGRAM = P4_DIR / "bmv2" / "thc.p4"


def test_checked_in_program_is_current() -> None:
    """p4src/bmv2/thc.p4 is exactly what p4gen/bmv2.py renders from the template with the defaults."""
    assert PROGRAM.read_text() == gen.render(), "run: python -m p4gen.bmv2"


@pytest.mark.parametrize(("elems", "bits", "rbits"), [(8, 2, 8), (32, 4, 8), (64, 4, 16), (16, 8, 16)])
def test_payload_headers_follow_the_geometry(elems: int, bits: int, rbits: int) -> None:
    """K index fields of b bits (MSB-first order i0..), K sums; K instances of ThcElement (the one lookup
    table), instance e applied once, to index e and sum e."""
    text = gen.render(gen.Geometry(elems=elems, bits=bits, result_bits=rbits))
    data = parse_header(text, "thc_data_h")
    assert data == [(f"i{e}", bits) for e in range(elems)]
    res = re.search(r"header thc_result_h \{(.*?)\}", text, re.S).group(1)
    assert re.findall(r"bit<THC_RESULT_BITS> (s\d+);", res) == [f"s{e}" for e in range(elems)]
    assert f"#define THC_RESULT_BITS {rbits}" in text
    assert [int(x) for x in re.findall(r"ThcElement\(\) elem_(\d+);", text)] == list(range(elems))
    applied = re.findall(r"elem_(\d+)\.apply\(meta\.job_index, hdr\.data\.i(\d+), meta\.sum_base \+ (\d+), "
                         r"meta\.keep, meta\.add, hdr\.result\.s(\d+)\);", text)
    assert applied == [(str(e),) * 4 for e in range(elems)]
    # thc_jobs, lookup, ipv4_lpm, thc_service, the leaf's thc_uplink and the spine's thc_leaf_sizes
    assert len(re.findall(r"^\s+table \w+ \{", text, re.M)) == 6
    stores = re.findall(r"sums\.write\(meta\.sum_base \+ (\d+), hdr\.result\.s(\d+)\);", text)
    assert stores == [(str(e), str(e)) for e in range(elems)]  # the leaf stores the parent's sums
    assert "@" not in re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S).replace("@name", "")


@pytest.mark.parametrize("bad", [dict(elems=12), dict(bits=0), dict(bits=9), dict(result_bits=32),
                                 dict(result_bits=12), dict(slots=0), dict(jobs=4096)])
def test_bad_geometry_is_refused(bad: dict) -> None:
    """Geometries the program cannot have are refused with a message naming the parameter."""
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        gen.Geometry(**bad)


def test_no_table_value_is_hard_coded() -> None:
    """The lookup tables have no const entries: every value comes from the control plane."""
    text = PROGRAM.read_text()
    assert "const entries" not in text and "entries = {" not in text


def test_program_compiles_without_warnings(tmp_path) -> None:
    """p4c-bm2-ss compiles the checked-in program with no warning, and its P4Info is the checked-in one."""
    _json, p4info, log = compile_bmv2(PROGRAM, tmp_path)
    warnings = [ln for ln in log.splitlines() if "warning" in ln.lower()]
    assert not warnings, "\n".join(warnings)
    assert p4info.read_text() == CHECKED_IN_P4INFO.read_text(), \
        "p4src/bmv2/thc.p4info.txtpb is stale: copy the P4Info p4c writes for p4src/bmv2/thc.p4"


@pytest.mark.parametrize(("elems", "rbits"), [(64, 16)])
def test_other_geometry_compiles(tmp_path, elems: int, rbits: int) -> None:
    """A program rendered for K=64 and 16-bit sums compiles too."""
    src = tmp_path / "thc_alt.p4"
    src.write_text(gen.render(gen.Geometry(elems=elems, result_bits=rbits)))
    compile_bmv2(src, tmp_path / "out")


def test_checked_in_p4info_matches_the_default_geometry() -> None:
    """The checked-in P4Info describes the program rendered with the default geometry (K, b, width, slots,
    jobs as the control plane reads them back)."""
    from aggregator.p4rt import P4InfoIndex, load_p4info, program_geometry

    geom = program_geometry(P4InfoIndex(load_p4info(CHECKED_IN_P4INFO)))
    d = gen.Geometry()
    assert (geom.elems, geom.bits, geom.result_bits, geom.slots, geom.jobs) == \
        (d.elems, d.bits, d.result_bits, d.slots, d.jobs)


def test_need_tools_names_what_is_missing() -> None:
    """A missing tool skips the test with its name in the reason (tests/p4_support.py's helper)."""
    with pytest.raises(pytest.skip.Exception, match="thc-no-such-tool-xyz"):
        need_tools("sh", "thc-no-such-tool-xyz")
    assert "sh" in need_tools("sh")
