"""The THC switch control plane, target-neutral: what a job, a service address or a route needs on a
switch, as logical entries (table, match fields, action, parameters, all by P4 name) and multicast
groups (ports and replication ids), and where a job goes (its row, slot range and generation).

Why: BMv2 (P4Runtime, ids from the P4Info: ``aggregator.p4rt``) and Tofino (bfrt_python, names:
``aggregator.bfrt``) spell entries differently; computing them once as data keeps both targets' entries
the same by construction. This module imports neither grpc nor protobuf.

A job is refused (``JobRefused``) before anything is written if the program cannot aggregate it: not a
THC job, K or b other than the compiled ones, a result width other than the compiled one, g * n that
does not fit the compiled result width, more workers than ports given, no free job row or slot range.
"""

from __future__ import annotations

import ipaddress
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from aggregator.switch.errors import JobRefused
from worker_lib.job import JobConfig
from worker_lib.wire.layout import MAX_WORKERS


@dataclass(frozen=True)
class ProgramGeometry:
    """The compile-time constants of a THC switch program: K elements per packet, b bits per index,
    the width of a sum, slots of all jobs, job rows. Read back from a P4Info by
    ``aggregator.p4rt.p4info.program_geometry``; given for Tofino (``aggregator.bfrt``)."""

    elems: int
    bits: int
    result_bits: int
    slots: int
    jobs: int
    #: adjacent indices one lookup table takes, their values returned side by side (Tofino: 2 where 2 b <= 8)
    lookup_indices: int = 1
    #: the lookup control's instance prefix and index key (BMv2: ``elem_<e>``, ``index``; Tofino:
    #: ``lookup_<m>``, ``indices``)
    lookup_control: str = "elem"
    lookup_key: str = "index"
    #: False for the BMv2 spine program: it adds the leaves' sums and looks nothing up (``bits`` is 0)
    has_lookups: bool = True

    @property
    def lookups(self) -> int:
        """Lookup tables of the program: K / lookup_indices (none in a spine program)."""
        return self.elems // self.lookup_indices if self.has_lookups else 0


def lookup_table(m: int, control: str = "elem") -> str:
    """Lookup table ``m`` relative to the ingress: the programs write their lookup once as a control and
    instantiate it K times as ``elem_<e>`` (BMv2's ThcElement, one index each; p4gen.codegen) or K / 2
    times as ``lookup_<m>`` (Tofino's ThcLookup, two indices each); ``control`` is that prefix
    (``ProgramGeometry.lookup_control``). Its key is (``job_index``, ``ProgramGeometry.lookup_key``)."""
    return f"{control}_{m}.lookup"


def lookup_action(m: int, control: str = "elem") -> str:
    """Lookup table ``m``'s action, ``value(v)``: v = the job's table values of its indices, side by side."""
    return f"{control}_{m}.value"


def lookup_rows(values: list[int], geometry: ProgramGeometry) -> list[tuple[int, int]]:
    """(key, value) of every entry a job needs in each lookup table: the key is ``lookup_indices`` indices
    (the first in the top bits, as they sit in the DATA payload), the value their table values, each in a
    ``result_bits`` lane (the first in the top bits, as the sums sit in the RESULT payload)."""
    b, w = geometry.bits, geometry.result_bits
    rows = []
    for combo in itertools.product(range(1 << b), repeat=geometry.lookup_indices):
        key = value = 0
        for i in combo:
            key = (key << b) | i
            value = (value << w) | values[i]
        rows.append((key, value))
    return rows


JOB_PARAMS = ("key", "table_id", "workers", "threshold", "slots", "slot_base", "job_index", "mcast_grp", "gen")


def mcast_group_of(job_index: int) -> int:
    """Multicast group id of the job in row ``job_index`` (group 0 means none in v1model)."""
    return job_index + 1


def replica_id(job_index: int, worker: int) -> int:
    """Replication id of a worker's copy of a result: the row of its learnt address in the program."""
    return job_index * MAX_WORKERS + worker


@dataclass(frozen=True)
class Placement:
    """Where a job lives in the program's registers: its row (worker addresses, lookup selector,
    multicast group), its first global slot, and the generation that marks its state as current."""

    job_index: int
    slot_base: int
    generation: int

    @property
    def mcast_grp(self) -> int:
        return mcast_group_of(self.job_index)


@dataclass(frozen=True)
class InstalledJob:
    """A ``thc_jobs`` entry as read back from the switch."""

    job: int
    key: int
    table_id: int
    workers: int
    threshold: int
    slots: int
    placement: Placement


_PROGRAMS = {"bmv2": "BMv2", "tofino": "Tofino"}


def check_job(cfg: JobConfig, geometry: ProgramGeometry, ports: tuple[int, ...], target: str = "bmv2") -> None:
    """Raise JobRefused if the compiled program cannot aggregate ``cfg`` with workers on ``ports``.

    ``target`` ("bmv2" or "tofino") only names the program and its generator in the messages."""
    g = geometry
    where = f"job {cfg.job}"
    if cfg.kind != "thc":
        raise JobRefused(f"{where}: the {_PROGRAMS.get(target, target)} program aggregates THC jobs only "
                         f"(kind {cfg.kind!r}); "
                         "serve uncompressed jobs with thc-aggregator")
    if cfg.elems != g.elems:
        raise JobRefused(f"{where}: K = {cfg.elems} elements per packet, the program is compiled for K = {g.elems} "
                         f"(set elems={g.elems}, or regenerate with python -m p4gen.{target} --elems {cfg.elems})")
    if g.has_lookups and cfg.bits != g.bits:
        raise JobRefused(f"{where}: b = {cfg.bits} bits per index, the program is compiled for b = {g.bits}")
    top = cfg.granularity * cfg.workers
    if top >= 1 << g.result_bits:
        raise JobRefused(f"{where}: g * n = {cfg.granularity} * {cfg.workers} = {top} does not fit the program's "
                         f"{g.result_bits}-bit sums (max {(1 << g.result_bits) - 1}); use fewer workers, a smaller "
                         f"granularity, or a program compiled with --result-bits 16")
    if cfg.result_bits != g.result_bits:
        raise JobRefused(f"{where}: result_bits = {cfg.result_bits}, the program sums on {g.result_bits} bits "
                         f"(set result_bits={g.result_bits} so that workers decode its results)")
    values = cfg.values()
    if int(values.max()) >= 1 << g.result_bits or int(values.min()) < 0:
        raise JobRefused(f"{where}: table values {values.min()}..{values.max()} do not fit {g.result_bits} bits")
    if cfg.slots > g.slots:
        raise JobRefused(f"{where}: {cfg.slots} slots, the program has {g.slots} in all")
    if len(ports) != cfg.workers:
        raise JobRefused(f"{where}: {cfg.workers} workers but {len(ports)} switch ports given (one per worker)")


@dataclass(frozen=True)
class Match:
    """One match field of a logical entry: its P4 name (``meta.job_index``), value, and the prefix
    length for an LPM field (None: exact)."""

    field: str
    value: int
    prefix_len: int | None = None


@dataclass(frozen=True)
class LogicalEntry:
    """A target-neutral table entry: table, match fields, action and its parameters, all by P4 name.

    Why: BMv2 (P4Runtime, ids from the P4Info) and Tofino (bfrt_python, names) spell entries
    differently; computing them once as data keeps both targets' entries the same by construction.
    """

    table: str
    match: tuple[Match, ...]
    action: str
    params: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class MulticastGroup:
    """A multicast group of the packet replication engine: (egress port, replication id) per replica."""

    group: int
    replicas: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class JobEntries:
    """Everything a job needs on a switch, in install order: lookup entries, its group, its job entry
    (last, so that no packet of the job is accepted before its tables are in place)."""

    lookups: tuple[LogicalEntry, ...]
    group: MulticastGroup
    job: LogicalEntry


def job_entries(cfg: JobConfig, geometry: ProgramGeometry, ports: tuple[int, ...],
                place: Placement, target: str = "bmv2", threshold: int | None = None) -> JobEntries:
    """The logical entries of a job at ``place`` (raises JobRefused if the program cannot aggregate it).
    ``threshold``: the job entry's completion threshold instead of ``cfg.threshold`` (a spine's counts
    the leaves' workers, while its ``cfg`` has one worker per leaf)."""
    check_job(cfg, geometry, ports, target)
    rows = lookup_rows(cfg.values().tolist(), geometry)
    lookups = tuple(
        LogicalEntry(lookup_table(m, geometry.lookup_control),
                     (Match("job_index", place.job_index), Match(geometry.lookup_key, k)),
                     lookup_action(m, geometry.lookup_control), (("v", v),))
        for m in range(geometry.lookups) for k, v in rows)
    group = MulticastGroup(place.mcast_grp,
                           tuple((int(port), replica_id(place.job_index, w)) for w, port in enumerate(ports)))
    vals = {"key": cfg.key, "table_id": cfg.table_id, "workers": cfg.workers,
            "threshold": cfg.threshold if threshold is None else threshold,
            "slots": cfg.slots, "slot_base": place.slot_base, "job_index": place.job_index,
            "mcast_grp": place.mcast_grp, "gen": place.generation}
    job = LogicalEntry("thc_jobs", (Match("hdr.thc.job", cfg.job),), "job_config",
                       tuple((name, int(vals[name])) for name in JOB_PARAMS))
    return JobEntries(lookups, group, job)


@dataclass(frozen=True)
class Uplink:
    """A leaf switch's parent (docs/protocol.md, "Two tiers"): this leaf's index among the job's
    ``leaves``, their count, and where partials go (the spine's address and UDP port, the next hop's
    MAC and the switch port towards it)."""

    leaf: int
    leaves: int
    ip: str
    port: int
    mac: str
    out_port: int


def uplink_entry(up: Uplink) -> LogicalEntry:
    """The default action of the leaf program's keyless ``thc_uplink`` table."""
    return LogicalEntry("thc_uplink", (), "uplink",
                        (("leaf", up.leaf), ("leaves", up.leaves), ("parent_ip", int(ipaddress.IPv4Address(up.ip))),
                         ("parent_port", up.port), ("parent_mac", mac_int(up.mac)), ("parent_out", up.out_port)))


def check_leaf_job(cfg: JobConfig, geometry: ProgramGeometry, up: Uplink) -> None:
    """Raise JobRefused unless the leaf program can serve leaf ``up.leaf`` of the two-tier job ``cfg``:
    its partials leave at the program's sum width, so the leaf's width (``JobConfig.partial_bits``) must
    be that width, as must the spine's (what the workers decode)."""
    where = f"job {cfg.job}"
    if not cfg.tiered:
        raise JobRefused(f"{where} has one tier: configure it with configure_job on a one-tier program")
    if len(cfg.leaves) != up.leaves or not 0 <= up.leaf < up.leaves:
        raise JobRefused(f"{where}: the uplink is leaf {up.leaf} of {up.leaves}, the job has "
                         f"{len(cfg.leaves)} leaves")
    width = cfg.partial_bits(up.leaf)
    if width != geometry.result_bits:
        raise JobRefused(f"{where}: leaf {up.leaf}'s partials need {width}-bit sums (g * n_l = "
                         f"{cfg.granularity} * {cfg.leaves[up.leaf]}); the program sends {geometry.result_bits}-bit "
                         f"partials (compile it with --result-bits {width}, or use more leaves)")


def spine_view(cfg: JobConfig, geometry: ProgramGeometry) -> JobConfig:
    """The one-tier job a spine program is configured with for the two-tier job ``cfg``: one sender per
    leaf (the job entry's workers are the leaves), the job's K, S, table and width. Raises JobRefused
    unless the program can serve it: the leaves' partials and the results at the program's width, and
    a worker count its 8-bit counters hold."""
    where = f"job {cfg.job}"
    if not cfg.tiered:
        raise JobRefused(f"{where} has one tier: configure it with configure_job on a one-tier program")
    widths = {cfg.partial_bits(leaf) for leaf in range(len(cfg.leaves))} | {cfg.result_bits}
    if widths != {geometry.result_bits}:
        raise JobRefused(f"{where}: partials and results need {sorted(widths)}-bit sums; the spine program adds "
                         f"{geometry.result_bits}-bit ones (compile it with --result-bits {max(widths)})")
    if cfg.workers > 255:
        raise JobRefused(f"{where}: {cfg.workers} workers; the BMv2 spine counts workers in 8 bits (at most 255)")
    return replace(cfg, workers=len(cfg.leaves), threshold=None, leaves=None)


def leaf_size_entries(cfg: JobConfig) -> tuple[LogicalEntry, ...]:
    """A spine program's ``thc_leaf_sizes`` entries of the two-tier job ``cfg``: each leaf's n_l."""
    return tuple(LogicalEntry("thc_leaf_sizes", (Match("hdr.thc.job", cfg.job), Match("hdr.thc.worker", leaf)),
                              "leaf_size", (("n", n),)) for leaf, n in enumerate(cfg.leaves))


def service_entry(ip: str, mac: str) -> LogicalEntry:
    """The ``thc_service`` entry that makes ``ip`` an aggregator address answering from ``mac``."""
    return LogicalEntry("thc_service", (Match("hdr.ipv4.dstAddr", int(ipaddress.IPv4Address(ip))),),
                        "thc_serve", (("switch_mac", mac_int(mac)),))


def route_entry(prefix: str, dst_mac: str, port: int) -> LogicalEntry:
    """The ``ipv4_lpm`` entry forwarding ``prefix`` out of ``port`` to next-hop ``dst_mac``."""
    net = ipaddress.IPv4Network(prefix, strict=False)
    return LogicalEntry("ipv4_lpm", (Match("hdr.ipv4.dstAddr", int(net.network_address), net.prefixlen),),
                        "ipv4_forward", (("dst_mac", mac_int(dst_mac)), ("port", int(port))))


def place_job(cfg: JobConfig, geometry: ProgramGeometry, installed: list[InstalledJob],
              generation: int) -> Placement:
    """Choose the job's row and slot range: its current ones if it is installed with the same slot
    count, else the lowest free row and the first free range of ``cfg.slots`` slots."""
    others = [j for j in installed if j.job != cfg.job]
    mine = next((j for j in installed if j.job == cfg.job), None)
    if mine is not None and mine.slots == cfg.slots:
        return Placement(mine.placement.job_index, mine.placement.slot_base, generation)
    used_rows = {j.placement.job_index for j in others}
    row = mine.placement.job_index if mine is not None else next(
        (r for r in range(geometry.jobs) if r not in used_rows), None)
    if row is None:
        raise JobRefused(f"job {cfg.job}: all {geometry.jobs} job rows of the program are in use")
    ranges = sorted((j.placement.slot_base, j.placement.slot_base + j.slots) for j in others)
    start = 0
    for lo, hi in ranges:
        if lo - start >= cfg.slots:
            break
        start = max(start, hi)
    if start + cfg.slots > geometry.slots:
        raise JobRefused(f"job {cfg.job}: no free range of {cfg.slots} slots among the program's {geometry.slots} "
                         f"(in use: {ranges})")
    return Placement(row, start, generation)


def new_generation(installed: list[InstalledJob], clock: Callable[[], int] = time.time_ns) -> int:
    """A 32-bit generation number: milliseconds of the clock, never 0 and never one in use."""
    used = {j.placement.generation for j in installed}
    gen = (clock() // 1_000_000) & 0xFFFFFFFF
    while gen == 0 or gen in used:
        gen = (gen + 1) & 0xFFFFFFFF
    return gen


def mac_int(mac: str) -> int:
    """``aa:bb:cc:dd:ee:ff`` -> 48-bit integer."""
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    try:
        return int("".join(f"{int(p, 16):02x}" for p in parts), 16)
    except ValueError:
        raise ValueError(f"not a MAC address: {mac!r}") from None
