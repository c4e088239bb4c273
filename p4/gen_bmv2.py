#!/usr/bin/env python3
"""Render the BMv2 THC program p4/bmv2/thc.p4 from its template for a given geometry.

Why generated: P4 has no loop over header fields or tables, and the program needs one b-bit field per
element of the DATA payload, one result-width field per element of the RESULT payload, and one lookup
table per element (a P4 table is applied at most once per packet). Everything else lives in the
hand-written template p4/bmv2/thc.p4.in; only the lines at its ``@...@`` markers come from here.

The checked-in p4/bmv2/thc.p4 is rendered with the defaults of ``Geometry`` (K = 32 elements of 4 bits,
8-bit sums, 1024 slots, 8 jobs); tests/test_p4_program.py checks it is what this script writes now.
Other geometries go to another directory (compile with ``-I p4/include``)::

    python p4/gen_bmv2.py                                   # rewrite p4/bmv2/thc.p4 (defaults)
    python p4/gen_bmv2.py --elems 64 --bits 4 --result-bits 16 --output /tmp/thc64.p4
    python p4/gen_bmv2.py --check                           # exit 1 if thc.p4 is out of date
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from worker_lib.wire.codegen import fill_markers, write_or_check
from worker_lib.wire.layout import MAX_WORKERS, RESULT_WIDTHS

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "bmv2" / "thc.p4.in"
OUTPUT = HERE / "bmv2" / "thc.p4"
INCLUDE_DIR = HERE / "include"
MARKERS = ("@CONFIG@", "@PAYLOAD_HEADERS@", "@ELEMENT_TABLES@", "@ELEMENT_APPLY@")


@dataclass(frozen=True)
class Geometry:
    """Compile-time constants of the BMv2 program.

    elems: K, indices per DATA packet (a multiple of 8, so the payload is whole bytes);
    bits: b, the index width (1..8); result_bits: width of a sum register and of a RESULT element
    (8 or 16: BMv2 results of 32 bits would work but the protocol's 32-bit results are for uncompressed
    jobs, which this program does not aggregate); slots: slots of all jobs together; jobs: how many jobs
    can be configured at once.
    """

    elems: int = 32
    bits: int = 4
    result_bits: int = 8
    slots: int = 1024
    jobs: int = 8

    def __post_init__(self) -> None:
        if self.elems < 8 or self.elems % 8 or self.elems >= 1 << 16:
            raise ValueError(f"elems (K) must be a positive multiple of 8 below 65536, got {self.elems}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits (b) must be in 1..8, got {self.bits}")
        if self.result_bits not in RESULT_WIDTHS or self.result_bits == 32:
            raise ValueError(f"result_bits must be 8 or 16 for THC jobs, got {self.result_bits}")
        if not 1 <= self.slots <= 1 << 20:
            raise ValueError(f"slots must be in 1..2^20, got {self.slots}")
        if not 1 <= self.jobs <= (1 << 16) // MAX_WORKERS:
            raise ValueError(f"jobs must be in 1..{(1 << 16) // MAX_WORKERS} (replication ids are 16 bits), "
                             f"got {self.jobs}")

    @property
    def data_bytes(self) -> int:
        return self.elems * self.bits // 8

    @property
    def result_bytes(self) -> int:
        return self.elems * self.result_bits // 8


def _config(g: Geometry) -> str:
    return "\n".join([
        f"const bit<32> THC_K = {g.elems};              // elements per packet",
        f"const bit<16> THC_K16 = {g.elems};",
        f"const bit<8> THC_INDEX_BITS = {g.bits};        // b",
        f"#define THC_RESULT_BITS {g.result_bits}           // width of a sum",
        f"const bit<THC_RESULT_BITS> THC_RESULT_ONES = {(1 << g.result_bits) - 1};",
        f"const bit<16> THC_DATA_BYTES = {g.data_bytes};    // K * b / 8",
        f"const bit<16> THC_RESULT_BYTES = {g.result_bytes};  // K * result width / 8",
        f"const bit<32> THC_SLOTS = {g.slots};          // slots of all jobs together",
        f"const bit<32> THC_JOBS = {g.jobs};               // jobs configured at once",
    ])


def _payload_headers(g: Geometry) -> str:
    data = [f"    bit<{g.bits}> i{e};" for e in range(g.elems)]
    res = [f"    bit<THC_RESULT_BITS> s{e};" for e in range(g.elems)]
    return "\n".join([
        "// DATA payload: K b-bit table indices, MSB-first (index 0 in the top bits of byte 0).",
        "header thc_data_h {", *data, "}", "",
        "// RESULT payload: K unsigned sums, big-endian.",
        "header thc_result_h {", *res, "}",
    ])


def _element_tables(g: Geometry) -> str:
    out = []
    for e in range(g.elems):
        out += [
            f"action value_{e}(bit<THC_RESULT_BITS> v) {{",
            "    bit<THC_RESULT_BITS> x;",
            f"    sums.read(x, meta.sum_base + {e});",
            "    x = (x & meta.keep) + (v & meta.add);",
            f"    sums.write(meta.sum_base + {e}, x);",
            f"    hdr.result.s{e} = x;",
            "}",
            f"table lookup_{e} {{",
            f"    key = {{ meta.job_index: exact; hdr.data.i{e}: exact; }}",
            f"    actions = {{ value_{e}; }}",
            f"    size = {g.jobs << g.bits};",
            f"    default_action = value_{e}(0);",
            "}",
        ]
    return "\n".join(out)


def _element_apply(g: Geometry) -> str:
    return "\n".join(f"lookup_{e}.apply();" for e in range(g.elems))


def render(geometry: Geometry | None = None, template: str | None = None) -> str:
    """The program text for ``geometry`` (defaults: ``Geometry()``)."""
    g = geometry or Geometry()
    text = TEMPLATE.read_text() if template is None else template
    parts = {"@CONFIG@": _config(g), "@PAYLOAD_HEADERS@": _payload_headers(g),
             "@ELEMENT_TABLES@": _element_tables(g), "@ELEMENT_APPLY@": _element_apply(g)}
    text = fill_markers(text, parts)
    header = (f"// GENERATED by p4/gen_bmv2.py from p4/bmv2/thc.p4.in for K={g.elems}, b={g.bits}, "
              f"result_bits={g.result_bits}, slots={g.slots}, jobs={g.jobs}. Do not edit.\n")
    return header + text


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: render, write or check the program."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    d = Geometry()
    ap.add_argument("--elems", type=int, default=d.elems, help=f"K, indices per packet (default {d.elems})")
    ap.add_argument("--bits", type=int, default=d.bits, help=f"b, bits per index (default {d.bits})")
    ap.add_argument("--result-bits", type=int, default=d.result_bits, choices=(8, 16),
                    help=f"width of a sum (default {d.result_bits})")
    ap.add_argument("--slots", type=int, default=d.slots, help=f"slots of all jobs (default {d.slots})")
    ap.add_argument("--jobs", type=int, default=d.jobs, help=f"jobs configured at once (default {d.jobs})")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT})")
    ap.add_argument("--check", action="store_true", help="exit 1 if --output differs from the rendering")
    args = ap.parse_args(argv)
    try:
        g = Geometry(args.elems, args.bits, args.result_bits, args.slots, args.jobs)
    except ValueError as exc:
        ap.error(str(exc))
    return write_or_check(render(g), args.output, check=args.check, script="p4/gen_bmv2.py")


if __name__ == "__main__":
    sys.exit(main())
