"""Index of a P4Info: names -> ids for tables, match fields, actions, parameters, counters, registers.

Why: P4Runtime speaks numeric ids; the control plane is written with names (``ThcIngress.thc_jobs``).
This index resolves them once, with errors that name what is missing, and reads the compiled
geometry of the THC program (K, b, result width, slots, jobs) from the P4Info itself, so that the
control plane never copies a constant of the P4 program by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import message, text_format
from p4.config.v1 import p4info_pb2

from aggregator.switch.entries import ProgramGeometry, lookup_action, lookup_table
from aggregator.switch.errors import P4InfoError


def load_p4info(path: str | Path) -> p4info_pb2.P4Info:
    """Read a P4Info file: protobuf text (``.txt``/``.txtpb``, what ``p4c --p4runtime-files`` writes) or binary."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise P4InfoError(f"cannot read P4Info {p}: {exc.strerror}") from None
    info = p4info_pb2.P4Info()
    if p.suffix in (".bin", ".pb"):
        try:
            info.ParseFromString(data)
        except message.DecodeError as exc:
            raise P4InfoError(f"{p} is not a binary P4Info: {exc}") from None
    else:
        try:
            text_format.Parse(data.decode(), info)
        except (text_format.ParseError, UnicodeDecodeError) as exc:
            raise P4InfoError(f"{p} is not a P4Info in protobuf text format: {exc}") from None
    return info


@dataclass(frozen=True)
class TableInfo:
    """A table: id, its match fields by name (id, bit width, match type) and the ids of its actions."""

    name: str
    id: int
    fields: dict[str, tuple[int, int, int]]
    action_ids: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class ActionInfo:
    """An action: id and its parameters by name (id, bit width), in declaration order."""

    name: str
    id: int
    params: dict[str, tuple[int, int]]


class P4InfoIndex:
    """Name -> id lookups over one P4Info. Names are the fully qualified ones (``ThcIngress.elem_0.lookup``);
    a unique suffix after a dot (``elem_0.lookup``, ``thc_jobs``) also resolves."""

    def __init__(self, info: p4info_pb2.P4Info) -> None:
        self.info = info
        self.tables: dict[str, TableInfo] = {}
        for t in info.tables:
            fields = {m.name: (m.id, m.bitwidth, m.match_type) for m in t.match_fields}
            self.tables[t.preamble.name] = TableInfo(t.preamble.name, t.preamble.id, fields,
                                                     tuple(a.id for a in t.action_refs), t.size)
        self.actions: dict[str, ActionInfo] = {}
        for a in info.actions:
            self.actions[a.preamble.name] = ActionInfo(a.preamble.name, a.preamble.id,
                                                       {p.name: (p.id, p.bitwidth) for p in a.params})
        self.counters = {c.preamble.name: (c.preamble.id, c.size) for c in info.counters}
        self.registers = {r.preamble.name: (r.preamble.id, r.size, r.type_spec.bitstring.bit.bitwidth)
                          for r in info.registers}

    @staticmethod
    def _find(kind: str, names: dict, name: str):
        if name in names:
            return names[name]
        hits = [k for k in names if k.endswith("." + name)]
        if len(hits) == 1:
            return names[hits[0]]
        if not hits:
            raise P4InfoError(f"the P4Info has no {kind} named {name!r} (is this the THC program?)")
        raise P4InfoError(f"{kind} name {name!r} is ambiguous in the P4Info: {sorted(hits)}")

    def table(self, name: str) -> TableInfo:
        return self._find("table", self.tables, name)

    def action(self, name: str) -> ActionInfo:
        return self._find("action", self.actions, name)

    def counter(self, name: str) -> tuple[int, int]:
        """(id, size) of a counter array."""
        return self._find("counter", self.counters, name)

    def register(self, name: str) -> tuple[int, int, int]:
        """(id, size, bit width) of a register array."""
        return self._find("register", self.registers, name)

    def match_field(self, table: str, field: str) -> tuple[int, int, int]:
        """(id, bit width, match type) of a table's match field."""
        t = self.table(table)
        if field not in t.fields:
            raise P4InfoError(f"table {t.name} has no match field {field!r}; it has {sorted(t.fields)}")
        return t.fields[field]

    def param(self, action: str, param: str) -> tuple[int, int]:
        """(id, bit width) of an action parameter."""
        a = self.action(action)
        if param not in a.params:
            raise P4InfoError(f"action {a.name} has no parameter {param!r}; it has {list(a.params)}")
        return a.params[param]


_LOOKUP = re.compile(r"(?:^|\.)elem_(\d+)\.lookup$")


def program_geometry(idx: P4InfoIndex) -> ProgramGeometry:
    """The THC program's geometry read from its P4Info index (raises P4InfoError if it is not a THC program)."""
    elems = sorted(int(m.group(1)) for n in idx.tables if (m := _LOOKUP.search(n)))
    if not elems and any(n.endswith("thc_leaf_sizes") for n in idx.tables):
        # the spine program (-DTHC_SPINE) looks nothing up: K from its sums, 2 banks of K per slot
        slots = idx.register("slot_gen")[1]
        _, cells, width = idx.register("sums")
        return ProgramGeometry(cells // (2 * slots), 0, width, slots, idx.table("thc_jobs").size, has_lookups=False)
    if not elems or elems != list(range(len(elems))):
        raise P4InfoError("the P4Info has no elem_0.lookup..elem_<K-1>.lookup tables: not a THC program")
    k = len(elems)
    bits = idx.match_field(lookup_table(0), "index")[1]
    result_bits = idx.param(lookup_action(0), "v")[1]
    slots = idx.register("slot_gen")[1]
    jobs = idx.table("thc_jobs").size
    return ProgramGeometry(k, bits, result_bits, slots, jobs)
