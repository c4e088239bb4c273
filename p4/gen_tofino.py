#!/usr/bin/env python3
"""Render the Tofino (TNA) THC program p4/tofino/thc.p4 from its template for a given geometry.

Why generated: P4 has no loop over header fields, tables or registers, and the program needs one
b-bit field per element of the DATA payload, one looked-up value and one sum per element, one lookup
table per element (a table is applied at most once per pass) and one sum register per element (a
register is accessed by at most one RegisterAction per pass on Tofino). Everything else lives in the
hand-written template p4/tofino/thc.p4.in; only the lines at its ``@...@`` markers come from here.

The checked-in p4/tofino/thc.p4 is rendered with the defaults of ``TofinoGeometry`` (K = 32 indices of 4
bits, 8-bit sums, 4096 slots, 8 jobs, recirculation port 68); tests/test_p4_tofino.py checks that it is
what this script writes now. p4/tofino/README.md explains the limits (why K <= 32 per pass)::

    python p4/gen_tofino.py                                  # rewrite p4/tofino/thc.p4 (defaults)
    python p4/gen_tofino.py --elems 16 --result-bits 16 --output /tmp/thc16.p4
    python p4/gen_tofino.py --check                          # exit 1 if thc.p4 is out of date
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from worker_lib.wire.codegen import P4Geometry, fill_markers, write_or_check

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "tofino" / "thc.p4.in"
OUTPUT = HERE / "tofino" / "thc.p4"
INCLUDE_DIR = HERE / "include"
MARKERS = ("@CONFIG@", "@PAYLOAD_HEADERS@", "@SUM_REGISTERS@", "@LOOKUP_TABLES@", "@SUM_APPLY@",
           "@LOOKUP_APPLY@")

# Stateful ALUs of one Tofino 1 pipe (12 MAU stages x 4; public figure) minus what the program's state
# needs besides the sums: pass 1 slot, tag, seen bitmap, count; pass 2 norm, result bitmap; egress
# worker ip, port, mac hi, mac lo. See p4/tofino/README.md.
SALUS_PER_PIPE = 12 * 4
STATE_SALUS = 4 + 2 + 4
MAX_ELEMS = 32  # the largest multiple of 8 <= SALUS_PER_PIPE - STATE_SALUS (= 38)


@dataclass(frozen=True)
class TofinoGeometry(P4Geometry):
    """Compile-time constants of the Tofino program: the shared fields of ``P4Geometry`` (K at most 32:
    one stateful ALU per sum, see MAX_ELEMS; at most 65536 slots) and recirc_port, the recirculation
    port of the pipe the workers are on (68 on pipe 0 of a Tofino 1)."""

    slots: int = 4096
    recirc_port: int = 68

    MAX_ELEMS: ClassVar[int] = MAX_ELEMS
    ELEMS_WHY: ClassVar[str] = f"one stateful ALU per sum: {SALUS_PER_PIPE} per pipe, {STATE_SALUS} for the state"
    MAX_SLOTS: ClassVar[int] = 1 << 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recirc_port < 512:
            raise ValueError(f"recirc_port must be a 9-bit port number, got {self.recirc_port}")


def _config(g: TofinoGeometry) -> str:
    return g.config_lines(extra=[
        f"const PortId_t THC_RECIRC_PORT = {g.recirc_port};     // recirculation port of the workers' pipe"])


def _payload_headers(g: TofinoGeometry) -> str:
    vals = [f"    bit<THC_RESULT_BITS> v{e};" for e in range(g.elems)]
    return g.payload_headers(between=[
        "// T[index] of every element, looked up in pass 1 and carried to pass 2 (recirculation).",
        "header thc_values_h {", *vals, "}", ""])


def _sum_registers(g: TofinoGeometry) -> str:
    out = []
    for e in range(g.elems):
        t = "bit<THC_RESULT_BITS>"
        out += [
            f"Register<{t}, bit<32>>(THC_BANKS) sums_{e};",
            f"RegisterAction<{t}, bit<32>, {t}>(sums_{e}) sum_set_{e} = {{",
            f"    void apply(inout {t} v, out {t} rv) {{ v = hdr.values.v{e}; rv = hdr.values.v{e}; }}",
            "};",
            f"RegisterAction<{t}, bit<32>, {t}>(sums_{e}) sum_add_{e} = {{",
            f"    void apply(inout {t} v, out {t} rv) {{ v = v + hdr.values.v{e}; rv = v; }}",
            "};",
            f"RegisterAction<{t}, bit<32>, {t}>(sums_{e}) sum_get_{e} = {{",
            f"    void apply(inout {t} v, out {t} rv) {{ rv = v; }}",
            "};",
        ]
    return "\n".join(out)


def _lookup_tables(g: TofinoGeometry) -> str:
    out = []
    for e in range(g.elems):
        out += [
            f"action value_{e}(bit<THC_RESULT_BITS> v) {{",
            f"    hdr.values.v{e} = v;",
            "}",
            f"table lookup_{e} {{",
            f"    key = {{ meta.job_index: exact; hdr.data.i{e}: exact; }}",
            f"    actions = {{ value_{e}; }}",
            f"    size = {g.jobs << g.bits};",
            f"    default_action = value_{e}(0);",
            "}",
        ]
    return "\n".join(out)


def _sum_apply(g: TofinoGeometry) -> str:
    out = []
    for e in range(g.elems):
        out += [
            "if (op == OP_SET) {",
            f"    hdr.result.s{e} = sum_set_{e}.execute(bank);",
            "} else if (op == OP_ADD) {",
            f"    hdr.result.s{e} = sum_add_{e}.execute(bank);",
            "} else {",
            f"    hdr.result.s{e} = sum_get_{e}.execute(bank);",
            "}",
        ]
    return "\n".join(out)


def render(geometry: TofinoGeometry | None = None, template: str | None = None) -> str:
    """The program text for ``geometry`` (defaults: ``TofinoGeometry()``)."""
    g = geometry or TofinoGeometry()
    text = TEMPLATE.read_text() if template is None else template
    parts = {"@CONFIG@": _config(g), "@PAYLOAD_HEADERS@": _payload_headers(g),
             "@SUM_REGISTERS@": _sum_registers(g), "@LOOKUP_TABLES@": _lookup_tables(g),
             "@SUM_APPLY@": _sum_apply(g), "@LOOKUP_APPLY@": g.lookup_apply()}
    text = fill_markers(text, parts)
    header = (f"// GENERATED by p4/gen_tofino.py from p4/tofino/thc.p4.in for K={g.elems}, b={g.bits}, "
              f"result_bits={g.result_bits}, slots={g.slots}, jobs={g.jobs}, recirc_port={g.recirc_port}. "
              "Do not edit.\n")
    return header + text


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: render, write or check the program."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    TofinoGeometry.add_arguments(ap)
    d = TofinoGeometry()
    ap.add_argument("--recirc-port", type=int, default=d.recirc_port,
                    help=f"recirculation port (default {d.recirc_port}: pipe 0 of a Tofino 1)")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT})")
    ap.add_argument("--check", action="store_true", help="exit 1 if --output differs from the rendering")
    args = ap.parse_args(argv)
    try:
        g = TofinoGeometry(args.elems, args.bits, args.result_bits, args.slots, args.jobs, args.recirc_port)
    except ValueError as exc:
        ap.error(str(exc))
    return write_or_check(render(g), args.output, check=args.check, script="p4/gen_tofino.py")


if __name__ == "__main__":
    sys.exit(main())
