"""Shared steps of the scripts that render code from templates (p4gen/bmv2.py, p4gen/tofino.py).

Both P4 generators fill ``@MARKER@`` lines of a hand-written template with generated blocks and then
either write the result or check that the checked-in file is current; the steps live here once, with
the compile-time constants both programs share (``P4Geometry``) and the blocks they render alike.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from worker_lib.wire.layout import MAX_WORKERS, RESULT_WIDTHS


def fill_markers(text: str, parts: dict[str, str]) -> str:
    """Replace each ``@MARKER@`` line (alone on its line) with its block, indented like the marker."""
    for marker, body in parts.items():
        found = re.findall(rf"^([ ]*){marker}[ ]*$", text, flags=re.M)
        if len(found) != 1:
            raise ValueError(f"template must contain {marker} exactly once, alone on its line")
        indent = found[0]
        block = "\n".join(indent + line if line else line for line in body.split("\n"))
        text = re.sub(rf"^[ ]*{marker}[ ]*$", lambda _m, b=block: b, text, count=1, flags=re.M)
    return text


def write_or_check(text: str, output: Path, *, check: bool, script: str) -> int:
    """Write ``text`` to ``output``, or with ``check`` return 1 (and say so) if the file differs."""
    if check:
        current = output.read_text() if output.exists() else ""
        if current != text:
            sys.stderr.write(f"{output} is out of date: run python {script}\n")
            return 1
        return 0
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as exc:
        sys.stderr.write(f"{script}: cannot write {output}: {exc.strerror}\n")
        return 1
    return 0


@dataclass(frozen=True)
class P4Geometry:
    """The compile-time constants both THC P4 programs share, validated against the protocol.

    elems: K, indices per DATA packet (a multiple of 8, so the payload is whole bytes); bits: b, the
    index width (1..8); result_bits: width of a sum register and of a RESULT element (8 or 16: the
    protocol's 32-bit results are for uncompressed jobs, which the switch programs do not aggregate);
    slots: slots of all jobs together; jobs: jobs configured at once (rows of 32 workers: replication
    ids are job_index * 32 + worker, 16 bits). A target bounds K and the slots with ``MAX_ELEMS``,
    ``ELEMS_WHY`` and ``MAX_SLOTS``.
    """

    elems: int = 32
    bits: int = 4
    result_bits: int = 8
    slots: int = 1024
    jobs: int = 8

    MAX_ELEMS: ClassVar[int] = (1 << 16) - 8
    ELEMS_WHY: ClassVar[str] = "the header's elems field is 16 bits"
    MAX_SLOTS: ClassVar[int] = 1 << 20

    def __post_init__(self) -> None:
        if self.elems < 8 or self.elems % 8 or self.elems > self.MAX_ELEMS:
            raise ValueError(f"elems (K) must be a multiple of 8 in 8..{self.MAX_ELEMS} ({self.ELEMS_WHY}), "
                             f"got {self.elems}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits (b) must be in 1..8, got {self.bits}")
        if self.result_bits not in RESULT_WIDTHS or self.result_bits == 32:
            raise ValueError(f"result_bits must be 8 or 16 for THC jobs, got {self.result_bits}")
        if not 1 <= self.slots <= self.MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{self.MAX_SLOTS}, got {self.slots}")
        if not 1 <= self.jobs <= (1 << 16) // MAX_WORKERS:
            raise ValueError(f"jobs must be in 1..{(1 << 16) // MAX_WORKERS} (replication ids are 16 bits), "
                             f"got {self.jobs}")

    @property
    def data_bytes(self) -> int:
        """DATA payload bytes: K * b / 8."""
        return self.elems * self.bits // 8

    @property
    def result_bytes(self) -> int:
        """RESULT payload bytes: K * result width / 8."""
        return self.elems * self.result_bits // 8

    def config_lines(self, *, after_result_bits: Sequence[str] = (), extra: Sequence[str] = ()) -> str:
        """The program's constants block (target-specific lines after THC_RESULT_BITS and at the end)."""
        return "\n".join([
            f"const bit<32> THC_K = {self.elems};              // elements per packet",
            f"const bit<16> THC_K16 = {self.elems};",
            f"const bit<8> THC_INDEX_BITS = {self.bits};        // b",
            f"#define THC_RESULT_BITS {self.result_bits}           // width of a sum",
            *after_result_bits,
            f"const bit<16> THC_DATA_BYTES = {self.data_bytes};    // K * b / 8",
            f"const bit<16> THC_RESULT_BYTES = {self.result_bytes};  // K * result width / 8",
            f"const bit<32> THC_SLOTS = {self.slots};          // slots of all jobs together",
            f"const bit<32> THC_JOBS = {self.jobs};               // jobs configured at once",
            *extra,
        ])

    def payload_headers(self, *, between: Sequence[str] = ()) -> str:
        """The DATA (K b-bit indices) and RESULT (K sums) payload headers, with ``between`` lines between."""
        data = [f"    bit<{self.bits}> i{e};" for e in range(self.elems)]
        res = [f"    bit<THC_RESULT_BITS> s{e};" for e in range(self.elems)]
        return "\n".join([
            "// DATA payload: K b-bit table indices, MSB-first (index 0 in the top bits of byte 0).",
            "header thc_data_h {", *data, "}", "",
            *between,
            "// RESULT payload: K unsigned sums, big-endian.",
            "header thc_result_h {", *res, "}",
        ])

    @staticmethod
    def element_instance(e: int) -> str:
        """The name of element ``e``'s instance of the per-element control (``elem_3``): its lookup table
        is ``<ingress>.elem_3.lookup`` for the control planes (aggregator.switch.entries.lookup_table)."""
        return f"elem_{e}"

    def element_instances(self, control: str) -> str:
        """One instantiation of the per-element ``control`` per element, in element order."""
        return "\n".join(f"{control}() {self.element_instance(e)};" for e in range(self.elems))

    def element_applies(self, args: str) -> str:
        """Each element's apply line, in element order: ``args`` with ``{e}`` replaced by the element."""
        return "\n".join(f"{self.element_instance(e)}.apply({args.format(e=e)});" for e in range(self.elems))

    @classmethod
    def add_arguments(cls, ap: argparse.ArgumentParser, elems_default: str | None = None) -> None:
        """The generator CLI options of the shared fields, with this target's defaults (``elems_default``:
        how the help states K's default, where it is not one number)."""
        d = cls()
        ap.add_argument("--elems", type=int, default=d.elems,
                        help=f"K, indices per packet (default {elems_default or d.elems})")
        ap.add_argument("--bits", type=int, default=d.bits, help=f"b, bits per index (default {d.bits})")
        ap.add_argument("--result-bits", type=int, default=d.result_bits, choices=(8, 16),
                        help=f"width of a sum (default {d.result_bits})")
        ap.add_argument("--slots", type=int, default=d.slots, help=f"slots of all jobs (default {d.slots})")
        ap.add_argument("--jobs", type=int, default=d.jobs, help=f"jobs configured at once (default {d.jobs})")
