#!/usr/bin/env python3
"""Render the Tofino (TNA) THC program p4src/tofino/thc.p4 from its template for a given geometry.

Why generated: P4 has no loop over header fields or control instances, and the program needs one
b-bit field per element of the DATA payload, one sum per element, and one instance per element of the
per-element control ThcElement, which holds the element's lookup table (a table is applied at most once
per pass) and its sum register (a register is accessed by at most one RegisterAction per pass on
Tofino). That control, and everything else, is P4 in the hand-written template p4src/tofino/thc.p4.in;
only the lines at its ``@...@`` markers come from here (with the validation TCAM rows, each commented).

The checked-in p4src/tofino/thc.p4 is rendered with the defaults of ``TofinoGeometry`` (K = 24 indices of 4
bits, 8-bit sums, 4096 slots, 8 jobs, recirculation port 68); tests/test_p4_tofino.py checks that it is
what this script writes now. p4src/tofino/README.md explains the limits (why K <= 24)::

    python -m p4gen.tofino                                  # rewrite p4src/tofino/thc.p4 (defaults)
    python -m p4gen.tofino --elems 16 --result-bits 16 --output /tmp/thc16.p4
    python -m p4gen.tofino --check                          # exit 1 if thc.p4 is out of date
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

from p4gen import P4SRC
from p4gen.codegen import P4Geometry, fill_markers, write_or_check
from worker_lib.wire.layout import HEADER_BYTES, VERSION, PacketType

TEMPLATE = P4SRC / "tofino" / "thc.p4.in"
OUTPUT = P4SRC / "tofino" / "thc.p4"
INCLUDE_DIR = P4SRC / "include"
MARKERS = ("@CONFIG@", "@PAYLOAD_HEADERS@", "@ELEMENT_INSTANCES@", "@ELEMENT_APPLY@",
           "@WORKER_BIT_ENTRIES@", "@VALIDATE_KEYS@", "@VALIDATE_ENTRIES@", "@VALIDATE_SIZE@")

# One stateful ALU per sum; one Tofino 1 pipe has 12 stages x 4, and the state needs 9 besides the sums
# (pass 1 slot, tag, seen bitmap, count; pass 2 norm, result bitmap; egress worker ip, port + mac hi,
# mac lo). The ALUs would allow K = 32 sums, but the stages do not: bf-p4c 9.13.4 places K = 24 in
# Tofino 1's 12 stages and K = 32 needs 14 (the sums wait for the lookups, and the lookups for free
# logical tables). See p4src/tofino/README.md.
MAX_ELEMS = 24
MAX_WORKERS = 32  # one 32-bit bitmap cell per bank


@dataclass(frozen=True)
class TofinoGeometry(P4Geometry):
    """Compile-time constants of the Tofino program: the shared fields of ``P4Geometry`` (K at most 32:
    one stateful ALU per sum, see MAX_ELEMS; at most 65536 slots) and recirc_port, the recirculation
    port of the pipe the workers are on (68 on pipe 0 of a Tofino 1)."""

    elems: int = MAX_ELEMS
    slots: int = 4096
    recirc_port: int = 68

    MAX_ELEMS: ClassVar[int] = MAX_ELEMS
    ELEMS_WHY: ClassVar[str] = "the largest K that bf-p4c fits into Tofino 1's 12 stages"
    MAX_SLOTS: ClassVar[int] = 1 << 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recirc_port < 512:
            raise ValueError(f"recirc_port must be a 9-bit port number, got {self.recirc_port}")


def _config(g: TofinoGeometry) -> str:
    return g.config_lines(extra=[
        f"const PortId_t THC_RECIRC_PORT = {g.recirc_port};     // recirculation port of the workers' pipe"])


def _payload_headers(g: TofinoGeometry) -> str:
    return g.payload_headers()


def _worker_bit_entries() -> str:
    # Tofino shifts only by constants, so 1 << worker is a constant table.
    return "\n".join(f"{w} : set_wbit(32w0x{1 << w:08x});" for w in range(MAX_WORKERS))


# ---- validation as one TCAM table ----
# The protocol's checks (docs/protocol.md, in order), each as a TCAM pattern: a check either has a FAIL
# pattern (the failure is an equality, e.g. workers_left == 0) or only PASS patterns (the pass is an
# equality, e.g. version == 1; a disjunction gives several patterns). Fields not named are wildcards.
# Why one table: as a chain of ifs, every branch became a table of its own, and Tofino 1 has 16 logical
# tables per stage, which the lookups need.
VALIDATE_KEYS = (  # (name used in patterns, P4 key expression)
    ("thc_valid", "hdr.thc.isValid()"), ("udp_short", "meta.udp_short"), ("version", "hdr.thc.version"),
    ("type", "hdr.thc.type_"), ("job_hit", "meta.job_hit"), ("key_diff", "meta.key_diff"),
    ("table_diff", "meta.table_diff"), ("workers_left", "meta.workers_left"), ("slots_left", "meta.slots_left"),
    ("data_valid", "hdr.data.isValid()"), ("norm_valid", "hdr.norm.isValid()"), ("elems", "hdr.thc.elems"),
    ("width", "hdr.thc.width"), ("udp_length", "hdr.udp.length"), ("norm_sign_exp", "hdr.norm.value[31:23]"),
)
Pattern = dict  # key name -> (value, mask); a bool key -> True/False


@dataclass(frozen=True)
class Check:
    """One validation check: its counter, what failing it means (``why``, the comment of its rows), and
    FAIL patterns or PASS patterns (exactly one of the two; ``labels`` names each PASS pattern)."""

    counter: str
    why: str
    fail: tuple[Pattern, ...] = ()
    passes: tuple[Pattern, ...] = ()
    labels: tuple[str, ...] = ()


class TcamRow(NamedTuple):
    """One entry of the validate table: its pattern, the counter it rejects with (None: valid), and the
    comment that says which check it encodes."""

    pattern: Pattern
    counter: str | None
    note: str


def validation_checks(g: TofinoGeometry) -> tuple[Check, ...]:
    """The checks of docs/protocol.md in their order, for the program of geometry ``g``."""
    full16, full32 = 0xFFFF, 0xFFFFFFFF
    data_t, norm_t = int(PacketType.DATA), int(PacketType.NORM)
    udp_thc = 8 + HEADER_BYTES
    data = {"type": (data_t, 0xFF), "data_valid": True, "elems": (g.elems, full16), "width": (g.bits, 0xFF),
            "udp_length": (udp_thc + g.data_bytes, full16)}
    norm = {"type": (norm_t, 0xFF), "norm_valid": True, "elems": (1, full16), "width": (32, 0xFF),
            "udp_length": (udp_thc + 4, full16)}
    assert data_t ^ norm_t == 2, "the type check below assumes DATA and NORM differ in bit 1 only"
    return (
        Check("THC_CTR_SHORT", "no THC header parsed", fail=({"thc_valid": False},)),
        Check("THC_CTR_SHORT", "UDP payload shorter than the THC header", passes=({"udp_short": (0, full16)},)),
        Check("THC_CTR_BAD_VERSION", f"version is not {VERSION}", passes=({"version": (VERSION, 0xFF)},)),
        Check("THC_CTR_BAD_TYPE", "type is neither DATA nor NORM", passes=({"type": (data_t, 0xFF ^ 2)},)),
        Check("THC_CTR_UNKNOWN_JOB", "job not configured", fail=({"job_hit": (0, 0xFF)},)),
        Check("THC_CTR_BAD_KEY", "key is not the job's", passes=({"key_diff": (0, full32)},)),
        Check("THC_CTR_BAD_TABLE", "table id is not the job's", passes=({"table_diff": (0, full16)},)),
        Check("THC_CTR_BAD_WORKER", "worker id >= n", fail=({"workers_left": (0, 0xFF)},)),
        Check("THC_CTR_BAD_SLOT", "slot >= the job's slots", fail=({"slots_left": (0, full16)},)),
        Check("THC_CTR_BAD_FORMAT", "elems, width or UDP length not those of the job's DATA or of a NORM",
              passes=(data, norm), labels=("DATA", "NORM")),
        Check("THC_CTR_BAD_NORM", "NORM with the sign bit set, or an all-ones exponent (infinite or NaN)",
              fail=({"type": (norm_t, 0xFF), "norm_sign_exp": (0x100, 0x100)},
                    {"type": (norm_t, 0xFF), "norm_sign_exp": (0xFF, 0xFF)})),
    )


def validation_entries(checks: tuple[Check, ...]) -> list[TcamRow]:
    """Priority-ordered TCAM entries whose first match is the first failing check (counter None: valid).
    A FAIL pattern goes before the entries of the later checks; a check with only PASS patterns is
    conjoined into every later entry (which keeps its note, with the PASS pattern's label if the check
    has several), followed by a catch-all for its counter."""
    if not checks:
        return [TcamRow({}, None, "every check passes: valid")]
    head, rest = checks[0], validation_entries(checks[1:])
    if head.fail:
        return [TcamRow(dict(p), head.counter, head.why) for p in head.fail] + rest
    out: list[TcamRow] = []
    for k, p in enumerate(head.passes):
        label = f" [{head.labels[k]}]" if head.labels else ""
        for row in rest:
            merged = _conjoin(p, row.pattern)
            if merged is not None:
                out.append(TcamRow(merged, row.counter, row.note + label))
    return [*out, TcamRow({}, head.counter, head.why)]


def _conjoin(a: Pattern, b: Pattern) -> Pattern | None:
    """The pattern matching what both match, or None where no key can (ternary: value/mask pairs)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, bool) or isinstance(out[k], bool):
            if out[k] != v:
                return None
        else:
            (v1, m1), (v2, m2) = out[k], v
            if (v1 ^ v2) & m1 & m2:
                return None
            out[k] = ((v1 & m1) | (v2 & m2), m1 | m2)
    return out


def _validate_entries(g: TofinoGeometry) -> str:
    lines = []
    for pat, counter, note in validation_entries(validation_checks(g)):
        lines.append(f"// {note}")
        cells = []
        for name, _ in VALIDATE_KEYS:
            v = pat.get(name)
            if v is None:
                cells.append("_")
            elif isinstance(v, bool):
                cells.append("true" if v else "false")
            else:
                cells.append(f"{v[0]:#x} &&& {v[1]:#x}")
        action = "validated()" if counter is None else f"reject({counter})"
        lines.append(f"({', '.join(cells)}) : {action};")
    return "\n".join(lines)


def _validate_keys() -> str:
    return "\n".join(f"{expr}: ternary;" for _, expr in VALIDATE_KEYS)


# Each element's ThcElement: job row, its index, the operation, the bank, its sum (RESULT field).
ELEMENT_ARGS = "hdr.bridge.job_index, hdr.data.i{e}, hdr.bridge.op, bank, hdr.result.s{e}"


def render(geometry: TofinoGeometry | None = None, template: str | None = None) -> str:
    """The program text for ``geometry`` (defaults: ``TofinoGeometry()``)."""
    g = geometry or TofinoGeometry()
    text = TEMPLATE.read_text() if template is None else template
    parts = {"@CONFIG@": _config(g), "@PAYLOAD_HEADERS@": _payload_headers(g),
             "@ELEMENT_INSTANCES@": g.element_instances("ThcElement"),
             "@ELEMENT_APPLY@": g.element_applies(ELEMENT_ARGS),
             "@WORKER_BIT_ENTRIES@": _worker_bit_entries(), "@VALIDATE_KEYS@": _validate_keys(),
             "@VALIDATE_ENTRIES@": _validate_entries(g),
             "@VALIDATE_SIZE@": f"size = {len(validation_entries(validation_checks(g)))};"}
    text = fill_markers(text, parts)
    header = (f"// GENERATED by p4gen/tofino.py from p4src/tofino/thc.p4.in for K={g.elems}, b={g.bits}, "
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
    return write_or_check(render(g), args.output, check=args.check, script="p4gen/tofino.py")


if __name__ == "__main__":
    sys.exit(main())
