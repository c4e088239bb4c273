"""The P4 header and constants are generated from the Python wire layout and agree with it."""

from __future__ import annotations

import re

import pytest

import p4gen.headers as gen
from tests.p4_support import INCLUDE_DIR
from worker_lib.wire.layout import FIELDS, HEADER_BYTES, THC_UDP_PORT, VERSION, Field, PacketType
from worker_lib.wire.protocol import Counter

HEADER_FILE = INCLUDE_DIR / "thc_headers.p4"


def parse_header(text: str, name: str) -> list[tuple[str, int]]:
    """(field, bits) of ``header <name> { bit<W> field; ... }`` in P4 source text, in order."""
    m = re.search(r"header\s+" + re.escape(name) + r"\s*\{(.*?)\}", text, re.S)
    assert m, f"no header {name} in the P4 text"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    fields = re.findall(r"bit<(\d+)>\s+(\w+)\s*;", body)
    assert len(fields) == body.count(";"), f"header {name} has declarations that are not bit<W> fields"
    return [(f, int(w)) for w, f in fields]


def parse_consts(text: str) -> dict[str, int]:
    """``const bit<W> NAME = VALUE;`` and ``#define NAME VALUE`` of P4 text."""
    out = {n: int(v, 0) for n, v in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*(\w+)\s*;", text)}
    out.update({n: int(v, 0) for n, v in re.findall(r"#define\s+(\w+)\s+(\d+)", text)})
    return out


def test_checked_in_header_file_is_current() -> None:
    """p4src/include/thc_headers.p4 is exactly what p4gen/headers.py produces from the layout now."""
    assert HEADER_FILE.read_text() == gen.render(), "run: python -m p4gen.headers"


def test_header_fields_match_layout_in_name_width_and_order() -> None:
    """The P4 thc_h header has the layout's fields, widths and order (keywords get a trailing _)."""
    got = parse_header(HEADER_FILE.read_text(), "thc_h")
    want = [(gen.p4_name(f.name), f.bits) for f in FIELDS]
    assert got == want
    assert sum(w for _, w in got) == 8 * HEADER_BYTES
    for (p4name, _), f in zip(got, FIELDS, strict=True):
        assert p4name.rstrip("_") == f.name


def test_constants_match_python() -> None:
    """Port, version, packet types and counter indices in P4 are the Python values."""
    c = parse_consts(HEADER_FILE.read_text())
    assert c["THC_UDP_PORT"] == THC_UDP_PORT
    assert c["THC_VERSION"] == VERSION
    assert c["THC_HEADER_BYTES"] == HEADER_BYTES
    assert {t.name: int(t) for t in PacketType} == {k[len("THC_TYPE_"):]: v for k, v in c.items()
                                                    if k.startswith("THC_TYPE_")}
    assert {x.name: int(x) for x in Counter} == {k[len("THC_CTR_"):]: v for k, v in c.items()
                                                 if k.startswith("THC_CTR_")}
    assert c["THC_NUM_COUNTERS"] == len(Counter)


def test_p4_keywords_are_renamed_and_names_stay_unique() -> None:
    """Layout names that are P4 keywords get a suffix; others are unchanged; no two P4 names collide."""
    assert gen.p4_name("type") == "type_" and gen.p4_name("key") == "key_"
    assert gen.p4_name("slot") == "slot"
    names = [gen.p4_name(f.name) for f in FIELDS]
    assert len(set(names)) == len(names)
    assert not set(names) & gen.P4_KEYWORDS


def test_generator_follows_a_changed_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of the layout changes the generated header (so the currency test can catch drift)."""
    changed = (*FIELDS[:-1], Field("bitmap", 16, "x"), Field("pad", 16, "y"))
    monkeypatch.setattr(gen, "FIELDS", changed)
    text = gen.render()
    assert parse_header(text, "thc_h")[-2:] == [("bitmap", 16), ("pad", 16)]
    assert text != HEADER_FILE.read_text()


def test_check_mode_detects_a_stale_file(tmp_path) -> None:
    """``python -m p4gen.headers --check`` fails on an edited file and passes on a fresh one."""
    out = tmp_path / "h.p4"
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text().replace("bit<16> slot;", "bit<8> slot;"))
    assert gen.main(["--check", "--output", str(out)]) == 1


def test_parser_uses_the_generated_names() -> None:
    """The shared parser selects on the generated field names and constants."""
    text = (INCLUDE_DIR / "thc_parser.p4").read_text()
    assert "select(thc.version, thc.type_)" in text
    assert "THC_UDP_PORT: parse_thc" in text
