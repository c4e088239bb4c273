#!/usr/bin/env python3
"""Render the Tofino THC program p4src/tofino/thc.p4 (TNA, or T2NA for Tofino 2) from its template.

Why generated: P4 has no loop over header fields or control instances, and the program needs one
field per lookup key of the DATA payload (two adjacent b-bit indices where 2 b <= 8), one 32-bit word
of packed sums per stateful ALU (four 8-bit or two 16-bit lanes), and one instance each of the controls
ThcLookup (a lookup table: a table is applied at most once per pass) and ThcWord (a sum register: a
register is accessed by at most one RegisterAction per pass on Tofino). Those controls, and everything
else, are P4 in the hand-written template p4src/tofino/thc.p4.in; only the lines at its ``@...@``
markers come from here (with the validation TCAM rows, each commented).

The checked-in p4src/tofino/thc.p4 is rendered with the defaults of ``TofinoGeometry`` (Tofino 1, K = 64
indices of 4 bits, 8-bit sums, 4096 slots, 8 jobs, recirculation port 68); tests/test_p4_tofino.py
checks that it is what this script writes now. p4src/tofino/README.md explains the limits of K::

    python -m p4gen.tofino                                  # rewrite p4src/tofino/thc.p4 (defaults)
    python -m p4gen.tofino --target tofino2 --elems 96 --output /tmp/t2/thc.p4
    python -m p4gen.tofino --elems 16 --result-bits 16 --output /tmp/thc16.p4
    python -m p4gen.tofino --check                          # exit 1 if thc.p4 is out of date
    python -m p4gen.tofino --leaf --elems 32 --output /tmp/leaf/thc.p4   # the leaf of two-tier jobs

``--leaf`` renders the leaf of two-tier jobs (docs/protocol.md, "Two tiers"): the same template with
THC_LEAF defined and the validation rows of the parent's packets in front of the workers'.
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

# Stateful ALUs: one per 32-bit word of packed sums (four 8-bit or two 16-bit lanes, THC_LANES), and 9
# for the state besides the sums (pass 1 slot, tag, seen bitmap, count; pass 2 norm, result bitmap;
# egress worker ip, port + mac hi, mac lo). A lookup takes two adjacent indices where 2 b <= 8 (256
# entries per job) and returns both values in their lanes. The largest K each target compiles to is
# what bf-p4c placed (p4src/tofino/README.md has the resource tables and what stops a larger K).
TARGETS = {  # target -> (architecture include, most elements per packet, default recirculation port)
    "tofino": ("tna.p4", 64, 68),     # Tofino 1, 12 stages; port 68: pipe 0's recirculation port
    "tofino2": ("t2na.p4", 160, 6),   # Tofino 2, 20 stages; port 6: a recirculation port of pipe 0
}
#: The largest K of the leaf of two-tier jobs (``--leaf``), per target: what leaves the leaf's register and
#: tables the stages and ALUs they need. bf-p4c compiles the leaf at these K (Tofino 1 in all 12 ingress
#: stages, Tofino 2 in 16 of 20; docs/tofino.md, "The leaf of two-tier jobs").
LEAF_MAX_ELEMS = {"tofino": 32, "tofino2": 128}
MAX_WORKERS = 32  # one 32-bit bitmap cell per bank
WORD_BITS = 32  # a sum register cell: the lanes of one stateful ALU
MAX_LOOKUP_KEY_BITS = 8  # adjacent indices of one lookup: at most 2^8 entries per job


@dataclass(frozen=True)
class TofinoGeometry(P4Geometry):
    """Compile-time constants of the Tofino program: the shared fields of ``P4Geometry``, the target
    (``tofino``: Tofino 1, TNA; ``tofino2``: Tofino 2, T2NA; see TARGETS for the largest K of each) and
    recirc_port, the recirculation port of the pipe the workers are on (None: the target's default).
    K defaults to the largest the target compiles."""

    elems: int = None  # type: ignore[assignment]  # None: the target's largest K
    slots: int = 4096
    recirc_port: int | None = None
    target: str = "tofino"

    MAX_ELEMS: ClassVar[int] = max(k for _, k, _ in TARGETS.values())
    ELEMS_WHY: ClassVar[str] = "the largest K that bf-p4c fits into a Tofino 2's 20 stages"
    MAX_SLOTS: ClassVar[int] = 1 << 16

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        _, most, port = TARGETS[self.target]
        if self.elems is None:
            object.__setattr__(self, "elems", most)
        super().__post_init__()
        if self.elems > most:
            raise ValueError(f"elems (K) must be at most {most} for {self.target} (the largest K that bf-p4c "
                             f"places in its stages; p4src/tofino/README.md), got {self.elems}")
        if self.recirc_port is None:
            object.__setattr__(self, "recirc_port", port)
        if not 0 <= self.recirc_port < 512:
            raise ValueError(f"recirc_port must be a 9-bit port number, got {self.recirc_port}")

    @property
    def arch(self) -> str:
        """The compilers' --arch for the target: tna (Tofino 1) or t2na (Tofino 2), its include's name."""
        return TARGETS[self.target][0].removesuffix(".p4")

    @property
    def lanes(self) -> int:
        """Sums per 32-bit register cell (four 8-bit, two 16-bit)."""
        return WORD_BITS // self.result_bits

    @property
    def lookup_indices(self) -> int:
        """Adjacent indices one lookup takes: 2 where their key fits 8 bits (b <= 4), else 1."""
        return 2 if 2 * self.bits <= MAX_LOOKUP_KEY_BITS else 1

    @property
    def words(self) -> int:
        """32-bit sum words (stateful ALUs) of the payload: K / lanes."""
        return self.elems // self.lanes

    @property
    def lookups(self) -> int:
        """Lookup tables of the payload: K / lookup_indices."""
        return self.elems // self.lookup_indices


def _config(g: TofinoGeometry) -> str:
    q = g.lookup_indices
    return g.config_lines(after_result_bits=[
        f"#define THC_LANES {g.lanes}                  // sums per 32-bit register cell",
        f"#define THC_LOOKUP_INDICES {q}         // adjacent indices per lookup",
        f"#define THC_LOOKUP_KEY_BITS {q * g.bits}        // their key: THC_LOOKUP_INDICES * b",
        f"#define THC_LOOKUP_VALUE_BITS {q * g.result_bits}     // their values, one lane each",
    ], extra=[f"const PortId_t THC_RECIRC_PORT = {g.recirc_port};     // recirculation port of the workers' pipe"])


def _payload_headers(g: TofinoGeometry) -> str:
    """The DATA payload as the lookups' keys (adjacent indices) and the RESULT payload as 32-bit words of
    lanes: the same bytes as the protocol's K indices and K sums (both MSB first), in the fields the
    tables and registers take whole."""
    q = g.lookup_indices
    keys = [f"    bit<THC_LOOKUP_KEY_BITS> k{m};  // indices {m * q}..{m * q + q - 1}" if q > 1 else
            f"    bit<THC_LOOKUP_KEY_BITS> k{m};" for m in range(g.lookups)]
    words = [f"    bit<32> w{j};  // sums {j * g.lanes}..{j * g.lanes + g.lanes - 1}" for j in range(g.words)]
    return "\n".join([
        f"// DATA payload: K b-bit table indices, MSB-first, taken {q} at a time (one lookup key each).",
        "header thc_data_h {", *keys, "}", "",
        f"// RESULT payload: K unsigned sums, big-endian, {g.lanes} to a 32-bit word (one register cell each).",
        "header thc_result_h {", *words, "}",
    ])


def lookup_instance(m: int) -> str:
    """The instance name of lookup ``m`` (``lookup_3``): its table is ``<ingress>.lookup_3.lookup``
    (aggregator.switch.entries.lookup_table)."""
    return f"lookup_{m}"


def _instances(g: TofinoGeometry) -> str:
    return "\n".join([*(f"ThcLookup() {lookup_instance(m)};" for m in range(g.lookups)),
                      *(f"ThcWord() word_{j};" for j in range(g.words))])


def _applies(g: TofinoGeometry) -> str:
    """Per word: its lookups, each writing its lanes (the first lookup the top bits), then its register."""
    per, width = g.lanes // g.lookup_indices, g.lookup_indices * g.result_bits
    lines = []
    for j in range(g.words):
        for h in range(per):
            m = j * per + h
            top = WORD_BITS - 1 - h * width
            lane = f"hdr.result.w{j}" if per == 1 else f"hdr.result.w{j}[{top}:{top - width + 1}]"
            lines.append(f"{lookup_instance(m)}.apply(hdr.bridge.job_index, hdr.data.k{m}, {lane});")
        lines.append(f"word_{j}.apply(hdr.bridge.op, bank, hdr.result.w{j});")
    return "\n".join(lines)


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
# A leaf's keys besides (its parent: address and port, the leaf index bound, and a RESULT's payload and a
# notice's bitmap, whose top half must be 0).
LEAF_VALIDATE_KEYS = (
    ("uplink_hit", "meta.lf.uplink_hit"), ("parent_ip_diff", "meta.lf.parent_ip_diff"),
    ("parent_port_diff", "meta.lf.parent_port_diff"), ("leaves_left", "meta.lf.leaves_left"),
    ("result_valid", "hdr.result.isValid()"), ("bitmap_hi", "hdr.thc.bitmap[31:16]"),
)
Pattern = dict  # key name -> (value, mask); a bool key -> True/False
#: A packet from the leaf's parent: the uplink is configured and the source address and port are its.
FROM_PARENT: Pattern = {"uplink_hit": (1, 0xFF), "parent_ip_diff": (0, 0xFFFFFFFF), "parent_port_diff": (0, 0xFFFF)}


def validate_keys(leaf: bool = False) -> tuple[tuple[str, str], ...]:
    """The validate table's keys (name in patterns, P4 expression): a leaf's add LEAF_VALIDATE_KEYS."""
    return VALIDATE_KEYS + (LEAF_VALIDATE_KEYS if leaf else ())


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
    """One entry of the validate table: its pattern, the counter it rejects with (None: valid), the
    comment that says which check it encodes, and the action of a valid packet (a leaf's parent's:
    validated_parent)."""

    pattern: Pattern
    counter: str | None
    note: str
    valid: str = "validated"

    @property
    def action(self) -> str:
        """The P4 action call of this entry."""
        return f"{self.valid}()" if self.counter is None else f"reject({self.counter})"


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


def parent_checks(g: TofinoGeometry) -> tuple[Check, ...]:
    """The checks of a packet from a leaf's parent (docs/protocol.md, "Leaf state table"), in order."""
    full16 = 0xFFFF
    result_t, norm_result_t, notice_t = int(PacketType.RESULT), int(PacketType.NORM_RESULT), int(PacketType.STRAGGLER)
    assert (norm_result_t, notice_t) == (4, 5), "the type check below takes NORM_RESULT and STRAGGLER as 4 and 5"
    udp_thc = 8 + HEADER_BYTES
    result = {"type": (result_t, 0xFF), "result_valid": True, "elems": (g.elems, full16),
              "width": (g.result_bits, 0xFF), "udp_length": (udp_thc + g.elems * g.result_bits // 8, full16)}
    norm = {"type": (norm_result_t, 0xFF), "norm_valid": True, "elems": (1, full16), "width": (32, 0xFF),
            "udp_length": (udp_thc + 4, full16)}
    notice = {"type": (notice_t, 0xFF), "elems": (0, full16), "width": (0, 0xFF), "bitmap_hi": (0, full16),
              "udp_length": (udp_thc, full16)}
    local = validation_checks(g)
    return (
        *local[:3],  # the header is there, its version
        Check("THC_CTR_BAD_TYPE", "from the parent, type is neither RESULT, NORM_RESULT nor STRAGGLER",
              passes=({"type": (result_t, 0xFF)}, {"type": (norm_result_t, 0xFE)}),
              labels=("RESULT", "NORM_RESULT or STRAGGLER")),
        *local[4:7],  # job, key, table
        Check("THC_CTR_BAD_WORKER", "from the parent, leaf index >= the job's leaves",
              fail=({"leaves_left": (0, 0xFF)},)),
        local[8],  # slot
        Check("THC_CTR_BAD_FORMAT", "from the parent, elems, width or UDP length not those of the job's "
                                    "RESULT, of a NORM_RESULT or of a STRAGGLER naming a round",
              passes=(result, norm, notice), labels=("RESULT", "NORM_RESULT", "STRAGGLER")),
    )


def leaf_validation_entries(g: TofinoGeometry) -> list[TcamRow]:
    """A leaf's validate entries: the parent's checks on packets from the parent (valid ones go to
    validated_parent), then every other packet through the workers' checks."""
    parent = []
    for row in validation_entries(parent_checks(g)):
        merged = _conjoin(FROM_PARENT, row.pattern)
        assert merged is not None
        parent.append(TcamRow(merged, row.counter, row.note, valid="validated_parent"))
    return parent + validation_entries(validation_checks(g))


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


def table_entries(g: TofinoGeometry, leaf: bool = False) -> list[TcamRow]:
    """The validate table's entries of the program (one tier's, or a leaf's)."""
    return leaf_validation_entries(g) if leaf else validation_entries(validation_checks(g))


def _validate_entries(rows: list[TcamRow], keys: tuple[tuple[str, str], ...]) -> str:
    lines = []
    for row in rows:
        lines.append(f"// {row.note}")
        cells = []
        for name, _ in keys:
            v = row.pattern.get(name)
            if v is None:
                cells.append("_")
            elif isinstance(v, bool):
                cells.append("true" if v else "false")
            else:
                cells.append(f"{v[0]:#x} &&& {v[1]:#x}")
        lines.append(f"({', '.join(cells)}) : {row.action};")
    return "\n".join(lines)


def render(geometry: TofinoGeometry | None = None, template: str | None = None, *, leaf: bool = False) -> str:
    """The program text for ``geometry`` (defaults: ``TofinoGeometry()``); ``leaf``: the leaf of two-tier
    jobs (THC_LEAF defined, the parent's validation rows)."""
    g = geometry or TofinoGeometry(elems=LEAF_MAX_ELEMS["tofino"] if leaf else None)
    if leaf and g.elems > LEAF_MAX_ELEMS[g.target]:
        raise ValueError(f"elems (K) must be at most {LEAF_MAX_ELEMS[g.target]} for the leaf on {g.target} (the "
                         f"leaf's tables need the stages the lookups of a larger K take; docs/tofino.md), "
                         f"got {g.elems}")
    text = TEMPLATE.read_text() if template is None else template
    keys, rows = validate_keys(leaf), table_entries(g, leaf)
    parts = {"@ARCH_INCLUDE@": f"#include <{TARGETS[g.target][0]}>", "@CONFIG@": _config(g),
             "@PAYLOAD_HEADERS@": _payload_headers(g), "@ELEMENT_INSTANCES@": _instances(g),
             "@ELEMENT_APPLY@": _applies(g),
             "@WORKER_BIT_ENTRIES@": _worker_bit_entries(),
             "@VALIDATE_KEYS@": "\n".join(f"{expr}: ternary;" for _, expr in keys),
             "@VALIDATE_ENTRIES@": _validate_entries(rows, keys), "@VALIDATE_SIZE@": f"size = {len(rows)};"}
    text = fill_markers(text, parts)
    role = ", leaf of two-tier jobs" if leaf else ""
    header = (f"// GENERATED by p4gen/tofino.py from p4src/tofino/thc.p4.in for {g.target}{role}, K={g.elems}, "
              f"b={g.bits}, result_bits={g.result_bits}, slots={g.slots}, jobs={g.jobs}, recirc_port={g.recirc_port}. "
              "Do not edit.\n")
    return header + ("#define THC_LEAF\n" if leaf else "") + text


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: render, write or check the program."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    TofinoGeometry.add_arguments(ap, elems_default=", ".join(f"{k} for {t}" for t, (_, k, _) in TARGETS.items()))
    ap.set_defaults(elems=None)
    d = TofinoGeometry()
    ap.add_argument("--target", choices=tuple(TARGETS), default=d.target,
                    help=f"tofino (Tofino 1, tna.p4) or tofino2 (Tofino 2, t2na.p4) (default {d.target})")
    ap.add_argument("--recirc-port", type=int,
                    help="recirculation port of the workers' pipe (default: 68 on tofino, 6 on tofino2; pipe 0)")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT})")
    ap.add_argument("--check", action="store_true", help="exit 1 if --output differs from the rendering")
    ap.add_argument("--leaf", action="store_true",
                    help="render the leaf of two-tier jobs (write it with --output; K defaults to the leaf's largest: "
                         + ", ".join(f"{k} for {t}" for t, k in LEAF_MAX_ELEMS.items()) + "; docs/tofino.md)")
    args = ap.parse_args(argv)
    if args.leaf and args.elems is None:
        args.elems = LEAF_MAX_ELEMS[args.target]
    try:
        g = TofinoGeometry(args.elems, args.bits, args.result_bits, args.slots, args.jobs, args.recirc_port,
                           args.target)
        text = render(g, leaf=args.leaf)
    except ValueError as exc:
        ap.error(str(exc))
    if args.leaf and args.output == OUTPUT:
        ap.error(f"--leaf needs --output: {OUTPUT} is the one-tier program")
    return write_or_check(text, args.output, check=args.check, script="p4gen/tofino.py")


if __name__ == "__main__":
    sys.exit(main())
