"""Control plane of the THC BMv2 program (p4src/bmv2/thc.p4): one ``ThcSwitch`` per switch.

What it writes, all by name through the program's P4Info:

- ``ipv4_lpm``: routes for plain IPv4 forwarding (hosts can ping each other);
- ``thc_service``: the aggregator address(es) of the switch and the MAC its answers come from;
- per job: ``lookup_<e>`` entries (job index, index i) -> T[i] for every element e of the K and every
  index of the job's table (the values of ``JobConfig.values()``, i.e. ``worker_lib.thc.solve_table``
  or the job's explicit table: nothing is hard-coded in P4), a multicast group with one replica per
  worker (switch port, rid = job_index * 32 + worker) and last the ``thc_jobs`` entry (key, table id,
  n, threshold, slots, slot range, multicast group, generation), so that no packet of the job is
  accepted before its tables are in place.

A job is refused (``JobRefused``) before anything is written if the program cannot aggregate it: not a
THC job, K or b other than the compiled ones, a result width other than the compiled one, g * n that
does not fit the compiled result width, more workers than ports given, no free job row or slot range.

Target-neutral entries: ``job_entries``, ``service_entry`` and ``route_entry`` compute what a job or
address needs as logical entries (table, match, action, params by name; multicast groups as ports and
replication ids). The P4Runtime writer here and the Tofino bfrt_python writer (aggregator/p4rt/bfrt.py)
both translate those, so the two targets get the same entries from the same job description.

Registers: BMv2's P4Runtime server (PI) implements neither register reads nor writes; registers are
reset per job by its generation number (a new ``thc_jobs`` entry makes the job's old state read as
empty) and all together by loading the pipeline again. ``read_register`` sends the standard request
and says clearly when the target does not implement it.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from aggregator.p4rt.client import P4RuntimeClient, SwitchAddress
from aggregator.p4rt.errors import JobRefused, P4InfoError, SwitchRejected
from aggregator.p4rt.p4info import P4InfoIndex, ProgramGeometry, load_p4info
from worker_lib.job import JobConfig
from worker_lib.wire.layout import MAX_WORKERS
from worker_lib.wire.protocol import Counter

log = logging.getLogger(__name__)

INSERT = p4runtime_pb2.Update.INSERT
MODIFY = p4runtime_pb2.Update.MODIFY
DELETE = p4runtime_pb2.Update.DELETE

JOB_PARAMS = ("key", "table_id", "workers", "threshold", "slots", "slot_base", "job_index", "mcast_grp", "gen")


def encode(value: int, bitwidth: int) -> bytes:
    """A P4Runtime value: big-endian bytes without leading zero bytes (canonical form), at least one."""
    if value < 0 or value >= 1 << bitwidth:
        raise ValueError(f"value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    return int.from_bytes(data, "big")


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
                         f"(set elems={g.elems}, or regenerate with p4/gen_{target}.py --elems {cfg.elems})")
    if cfg.bits != g.bits:
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
                place: Placement, target: str = "bmv2") -> JobEntries:
    """The logical entries of a job at ``place`` (raises JobRefused if the program cannot aggregate it)."""
    check_job(cfg, geometry, ports, target)
    values = cfg.values().tolist()
    lookups = tuple(
        LogicalEntry(f"lookup_{e}", (Match("meta.job_index", place.job_index), Match(f"hdr.data.i{e}", i)),
                     f"value_{e}", (("v", int(v)),))
        for e in range(geometry.elems) for i, v in enumerate(values))
    group = MulticastGroup(place.mcast_grp,
                           tuple((int(port), replica_id(place.job_index, w)) for w, port in enumerate(ports)))
    vals = {"key": cfg.key, "table_id": cfg.table_id, "workers": cfg.workers, "threshold": cfg.threshold,
            "slots": cfg.slots, "slot_base": place.slot_base, "job_index": place.job_index,
            "mcast_grp": place.mcast_grp, "gen": place.generation}
    job = LogicalEntry("thc_jobs", (Match("hdr.thc.job", cfg.job),), "job_config",
                       tuple((name, int(vals[name])) for name in JOB_PARAMS))
    return JobEntries(lookups, group, job)


def service_entry(ip: str, mac: str) -> LogicalEntry:
    """The ``thc_service`` entry that makes ``ip`` an aggregator address answering from ``mac``."""
    return LogicalEntry("thc_service", (Match("hdr.ipv4.dstAddr", int(ipaddress.IPv4Address(ip))),),
                        "thc_serve", (("switch_mac", mac_int(mac)),))


def route_entry(prefix: str, dst_mac: str, port: int) -> LogicalEntry:
    """The ``ipv4_lpm`` entry forwarding ``prefix`` out of ``port`` to next-hop ``dst_mac``."""
    net = ipaddress.IPv4Network(prefix, strict=False)
    return LogicalEntry("ipv4_lpm", (Match("hdr.ipv4.dstAddr", int(net.network_address), net.prefixlen),),
                        "ipv4_forward", (("dst_mac", mac_int(dst_mac)), ("port", int(port))))


def table_update(idx: P4InfoIndex, entry: LogicalEntry, kind: int = INSERT) -> p4runtime_pb2.Update:
    """The P4Runtime update of a logical entry (ids and widths from the P4Info).

    Raises JobRefused if a value does not fit its field in the compiled program."""
    t = idx.table(entry.table)
    a = idx.action(entry.action)
    up = p4runtime_pb2.Update(type=kind)
    te = up.entity.table_entry
    te.table_id = t.id
    try:
        for m in entry.match:
            fid, width, _ = idx.match_field(t.name, m.field)
            fm = te.match.add(field_id=fid)
            if m.prefix_len is None:
                fm.exact.value = encode(m.value, width)
            else:
                fm.lpm.value = encode(m.value, width)
                fm.lpm.prefix_len = m.prefix_len
        te.action.action.action_id = a.id
        for name, value in entry.params:
            pid, width = idx.param(a.name, name)
            try:
                te.action.action.params.add(param_id=pid, value=encode(value, width))
            except ValueError:
                raise JobRefused(f"{entry.table}: {name} = {value} does not fit the program's {width}-bit "
                                 "field") from None
    except ValueError as exc:
        if isinstance(exc, JobRefused):
            raise
        raise JobRefused(f"{entry.table}: {exc}") from None
    return up


def group_update(group: MulticastGroup, kind: int = INSERT) -> p4runtime_pb2.Update:
    """The P4Runtime multicast group entry of a logical group."""
    up = p4runtime_pb2.Update(type=kind)
    grp = up.entity.packet_replication_engine_entry.multicast_group_entry
    grp.multicast_group_id = group.group
    for port, rid in group.replicas:
        grp.replicas.add(egress_port=port, instance=rid)
    return up


def job_updates(idx: P4InfoIndex, geometry: ProgramGeometry, cfg: JobConfig, ports: tuple[int, ...],
                place: Placement, kind: int = INSERT) -> list[p4runtime_pb2.Update]:
    """The updates that install (``INSERT``) or rewrite (``MODIFY``) a job, in the order to send them:
    lookup entries, multicast group, then the job entry (which makes the job's packets accepted)."""
    ent = job_entries(cfg, geometry, ports, place)
    out = [table_update(idx, e, kind) for e in ent.lookups]
    out.append(group_update(ent.group, kind))
    try:
        out.append(table_update(idx, ent.job, kind))
    except JobRefused as exc:
        raise JobRefused(f"job {cfg.job}: {str(exc).removeprefix('thc_jobs: ')}") from None
    return out


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


class ThcSwitch:
    """The THC control plane of one BMv2 switch (one object per switch; several may coexist).

    >>> sw = ThcSwitch(SwitchAddress("127.0.0.1", 9559))           # doctest: +SKIP
    >>> sw.load("build/thc.p4info.txtpb", "build/thc.json")        # doctest: +SKIP
    >>> sw.configure_job(JobConfig(workers=4, elems=32, result_bits=8), ports=(1, 2, 3, 4))  # doctest: +SKIP
    """

    def __init__(self, address: SwitchAddress, *, timeout: float = 10.0,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.address = address
        self.client = P4RuntimeClient(address, timeout=timeout)
        self.clock = clock
        self._index: P4InfoIndex | None = None
        self._geometry: ProgramGeometry | None = None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ThcSwitch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- program ---------------------------------------------------------------------------------
    def load(self, p4info: str | Path | p4info_pb2.P4Info, device_config: str | Path | bytes) -> ProgramGeometry:
        """Push the program (P4Info + BMv2 JSON); all tables, groups and registers start empty."""
        info = p4info if isinstance(p4info, p4info_pb2.P4Info) else load_p4info(p4info)
        if isinstance(device_config, bytes):
            blob = device_config
        else:
            try:
                blob = Path(device_config).read_bytes()
            except OSError as exc:
                raise P4InfoError(f"cannot read the BMv2 JSON {device_config}: {exc.strerror}") from None
        index = P4InfoIndex(info)
        geometry = ProgramGeometry.from_index(index)
        self._delete_multicast_groups()
        self.client.set_pipeline(info, blob)
        self._index, self._geometry = index, geometry
        log.info("%s: program loaded, %s", self.address.target, geometry)
        return geometry

    def _delete_multicast_groups(self) -> None:
        """Delete the multicast groups of the running program, if one runs.

        Why: BMv2 keeps its replication engine's groups across SetForwardingPipelineConfig while its
        P4Runtime server forgets them, so groups written after a reload would add to the old ones
        (every result arrives twice, then three times...). Deleting them first keeps both in step.
        """
        ent = p4runtime_pb2.Entity()
        ent.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0  # all groups
        try:
            groups = self.client.read([ent])
        except SwitchRejected:
            return  # no program loaded yet: nothing to delete
        ups = []
        for e in groups:
            g = e.packet_replication_engine_entry.multicast_group_entry
            if g.multicast_group_id:
                up = p4runtime_pb2.Update(type=DELETE)
                up.entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = \
                    g.multicast_group_id
                ups.append(up)
        if ups:
            self.client.write(ups)
            log.info("%s: deleted %d multicast groups before reloading", self.address.target, len(ups))

    @property
    def index(self) -> P4InfoIndex:
        """The P4Info index of the running program (fetched from the switch the first time)."""
        if self._index is None:
            self._index = P4InfoIndex(self.client.get_p4info())
        return self._index

    @property
    def geometry(self) -> ProgramGeometry:
        if self._geometry is None:
            self._geometry = ProgramGeometry.from_index(self.index)
        return self._geometry

    # -- forwarding ------------------------------------------------------------------------------
    def add_route(self, prefix: str, dst_mac: str, port: int) -> None:
        """Plain IPv4 forwarding: ``prefix`` (a.b.c.d/len) out of ``port`` to next-hop MAC ``dst_mac``."""
        self.client.write([table_update(self.index, route_entry(prefix, dst_mac, port))])

    def add_service(self, ip: str, mac: str) -> None:
        """Make ``ip`` an aggregator address of this switch; answers come from ``mac``."""
        self.client.write([table_update(self.index, service_entry(ip, mac))])

    # -- jobs ------------------------------------------------------------------------------------
    def jobs(self) -> list[InstalledJob]:
        """The jobs installed on the switch (read back from ``thc_jobs``)."""
        idx = self.index
        t = idx.table("thc_jobs")
        a = idx.action("job_config")
        names = {pid: name for name, (pid, _) in a.params.items()}
        ent = p4runtime_pb2.Entity()
        ent.table_entry.table_id = t.id
        out = []
        for e in self.client.read([ent]):
            te = e.table_entry
            if te.action.action.action_id != a.id:
                continue
            p = {names[x.param_id]: decode(x.value) for x in te.action.action.params}
            out.append(InstalledJob(decode(te.match[0].exact.value), p["key"], p["table_id"], p["workers"],
                                    p["threshold"], p["slots"],
                                    Placement(p["job_index"], p["slot_base"], p["gen"])))
        return out

    def configure_job(self, cfg: JobConfig, ports: tuple[int, ...] | list[int],
                      generation: int | None = None) -> Placement:
        """Install or replace a job: its lookup entries, multicast group and job entry.

        Replacing a job (same id) gives it a new generation, which resets its slots, banks and learnt
        addresses. Raises JobRefused (nothing written) if the program cannot aggregate the job.
        """
        ports = tuple(int(p) for p in ports)
        check_job(cfg, self.geometry, ports)
        installed = self.jobs()
        gen = generation if generation is not None else new_generation(installed, self.clock)
        place = place_job(cfg, self.geometry, installed, gen)
        old = next((j for j in installed if j.job == cfg.job), None)
        if old is not None and old.placement.job_index != place.job_index:
            self.remove_job(cfg.job)
            old = None
        kind = MODIFY if old is not None else INSERT
        self.client.write(job_updates(self.index, self.geometry, cfg, ports, place, kind))
        log.info("%s: job %d configured at %s", self.address.target, cfg.job, place)
        return place

    def remove_job(self, job: int) -> None:
        """Delete a job's entries (job entry first, so its packets are dropped as unknown at once)."""
        installed = {j.job: j for j in self.jobs()}
        if job not in installed:
            raise SwitchRejected(f"{self.address.target}: job {job} is not configured")
        j = installed[job]
        idx = self.index
        ups: list[p4runtime_pb2.Update] = []
        t = idx.table("thc_jobs")
        up = p4runtime_pb2.Update(type=DELETE)
        up.entity.table_entry.table_id = t.id
        f, w, _ = idx.match_field(t.name, "hdr.thc.job")
        up.entity.table_entry.match.add(field_id=f).exact.value = encode(job, w)
        ups.append(up)
        up = p4runtime_pb2.Update(type=DELETE)
        up.entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = j.placement.mcast_grp
        ups.append(up)
        n_values = 1 << self.geometry.bits
        for e in range(self.geometry.elems):
            t = idx.table(f"lookup_{e}")
            f_job, w_job, _ = idx.match_field(t.name, "meta.job_index")
            f_idx, w_idx, _ = idx.match_field(t.name, f"hdr.data.i{e}")
            for i in range(n_values):
                up = p4runtime_pb2.Update(type=DELETE)
                te = up.entity.table_entry
                te.table_id = t.id
                te.match.add(field_id=f_job).exact.value = encode(j.placement.job_index, w_job)
                te.match.add(field_id=f_idx).exact.value = encode(i, w_idx)
                ups.append(up)
        self.client.write(ups)

    # -- observation -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The aggregator counters (``worker_lib.wire.protocol.Counter`` names), read from ``thc_stats``.

        The program counts accepted DATA packets at ELEMENTS; this returns them times K, the
        Python aggregator's meaning (elements aggregated).
        """
        cid, _size = self.index.counter("thc_stats")
        ent = p4runtime_pb2.Entity()
        ent.counter_entry.counter_id = cid
        out = {c.name: 0 for c in Counter}
        for e in self.client.read([ent]):
            ce = e.counter_entry
            if ce.counter_id != cid:
                continue
            try:
                name = Counter(ce.index.index).name
            except ValueError:
                continue
            out[name] = int(ce.data.packet_count)
        out["ELEMENTS"] *= self.geometry.elems
        return out

    def read_register(self, name: str, index: int | None = None) -> dict[int, int]:
        """Values of a register array (all cells, or one): the standard P4Runtime RegisterEntry read.

        BMv2's P4Runtime server (PI) answers UNIMPLEMENTED; the error says so and how to read them
        instead (simple_switch_CLI ``register_read``).
        """
        rid, _size, _width = self.index.register(name)
        ent = p4runtime_pb2.Entity()
        ent.register_entry.register_id = rid
        if index is not None:
            ent.register_entry.index.index = index
        try:
            got = self.client.read([ent])
        except SwitchRejected as exc:
            if "UNIMPLEMENTED" in str(exc):
                raise SwitchRejected(f"{self.address.target}: this target's P4Runtime server does not implement "
                                     f"register reads (BMv2's PI does not); use simple_switch_CLI "
                                     f"`register_read {name}` on its Thrift port") from None
            raise
        return {e.register_entry.index.index: decode(e.register_entry.data.bitstring) for e in got}


def mac_int(mac: str) -> int:
    """``aa:bb:cc:dd:ee:ff`` -> 48-bit integer."""
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    try:
        return int("".join(f"{int(p, 16):02x}" for p in parts), 16)
    except ValueError:
        raise ValueError(f"not a MAC address: {mac!r}") from None
