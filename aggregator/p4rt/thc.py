"""Control plane of the THC BMv2 program (p4src/bmv2/thc.p4): one ``ThcSwitch`` per switch.

What it writes, all by name through the program's P4Info:

- ``ipv4_lpm``: routes for plain IPv4 forwarding (hosts can ping each other);
- ``thc_service``: the aggregator address(es) of the switch and the MAC its answers come from;
- per job: ``elem_<e>.lookup`` entries (job index, index i) -> T[i] for every element e of the K and every
  index of the job's table (the values of ``JobConfig.values()``, i.e. ``worker_lib.thc.solve_table``
  or the job's explicit table: nothing is hard-coded in P4), a multicast group with one replica per
  worker (switch port, rid = job_index * 32 + worker) and last the ``thc_jobs`` entry (key, table id,
  n, threshold, slots, slot range, multicast group, generation), so that no packet of the job is
  accepted before its tables are in place.

The entries themselves are target-neutral data from ``aggregator.switch.entries`` (which also says
when a job is refused); this module is the P4Runtime writer that spells them with the P4Info's ids,
as ``aggregator.bfrt`` spells the same entries for Tofino.

Registers: BMv2's P4Runtime server (PI) implements neither register reads nor writes; registers are
reset per job by its generation number (a new ``thc_jobs`` entry makes the job's old state read as
empty) and all together by loading the pipeline again. ``read_register`` sends the standard request
and says clearly when the target does not implement it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from aggregator.p4rt.client import P4RuntimeClient, SwitchAddress
from aggregator.p4rt.p4info import P4InfoIndex, load_p4info, program_geometry
from aggregator.switch.entries import (
    InstalledJob,
    LogicalEntry,
    MulticastGroup,
    Placement,
    ProgramGeometry,
    Uplink,
    check_job,
    check_leaf_job,
    job_entries,
    leaf_size_entries,
    lookup_table,
    new_generation,
    place_job,
    route_entry,
    service_entry,
    spine_view,
    uplink_entry,
)
from aggregator.switch.errors import JobRefused, P4InfoError, SwitchRejected
from worker_lib.job import JobConfig
from worker_lib.wire.protocol import Counter, TierCounter

log = logging.getLogger(__name__)

INSERT = p4runtime_pb2.Update.INSERT
MODIFY = p4runtime_pb2.Update.MODIFY
DELETE = p4runtime_pb2.Update.DELETE

def encode(value: int, bitwidth: int) -> bytes:
    """A P4Runtime value: big-endian bytes without leading zero bytes (canonical form), at least one."""
    if value < 0 or value >= 1 << bitwidth:
        raise ValueError(f"value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    return int.from_bytes(data, "big")


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
            if m.prefix_len == 0:  # P4Runtime: a don't-care LPM field is omitted, not given /0 (a default route)
                continue
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
                place: Placement, kind: int = INSERT, threshold: int | None = None) -> list[p4runtime_pb2.Update]:
    """The updates that install (``INSERT``) or rewrite (``MODIFY``) a job, in the order to send them:
    lookup entries, multicast group, then the job entry (which makes the job's packets accepted);
    ``threshold`` as for ``job_entries``."""
    ent = job_entries(cfg, geometry, ports, place, threshold=threshold)
    out = [table_update(idx, e, kind) for e in ent.lookups]
    out.append(group_update(ent.group, kind))
    try:
        out.append(table_update(idx, ent.job, kind))
    except JobRefused as exc:
        raise JobRefused(f"job {cfg.job}: {str(exc).removeprefix('thc_jobs: ')}") from None
    return out


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
        self._uplink: Uplink | None = None

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
        geometry = program_geometry(index)
        self._delete_multicast_groups()
        self.client.set_pipeline(info, blob)
        self._index, self._geometry, self._uplink = index, geometry, None
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
            self._geometry = program_geometry(self.index)
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
                      generation: int | None = None, *, threshold: int | None = None) -> Placement:
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
        self.client.write(job_updates(self.index, self.geometry, cfg, ports, place, kind, threshold))
        log.info("%s: job %d configured at %s", self.address.target, cfg.job, place)
        return place

    @property
    def is_leaf(self) -> bool:
        """Whether the running program is the leaf program (compiled with -DTHC_LEAF: it has thc_uplink)."""
        return any(name.endswith("thc_uplink") for name in self.index.tables)

    @property
    def is_spine(self) -> bool:
        """Whether the running program is the spine program (-DTHC_SPINE: it has thc_leaf_sizes)."""
        return any(name.endswith("thc_leaf_sizes") for name in self.index.tables)

    def configure_leaf(self, cfg: JobConfig, ports: tuple[int, ...] | list[int], uplink: Uplink,
                       generation: int | None = None) -> Placement:
        """Serve leaf ``uplink.leaf`` of the two-tier job ``cfg`` (docs/protocol.md, "Two tiers"): its
        one-tier job ``cfg.leaf(l)`` (local workers on ``ports``) and the uplink to the parent. One uplink
        per switch: every two-tier job it serves has the same leaf index and leaf count. Raises JobRefused
        (nothing written) if the program is not the leaf program or cannot serve the job."""
        if not self.is_leaf:
            raise JobRefused(f"job {cfg.job}: the running program is not the leaf program (compile it with "
                             f"-DTHC_LEAF: topologies.bmv2.compile_program(leaf=True))")
        check_leaf_job(cfg, self.geometry, uplink)
        if self._uplink is not None and (self._uplink.leaf, self._uplink.leaves) != (uplink.leaf, uplink.leaves):
            raise JobRefused(f"job {cfg.job}: this switch is leaf {self._uplink.leaf} of {self._uplink.leaves}; "
                             f"one uplink serves every job")
        up = table_update(self.index, uplink_entry(uplink), MODIFY)
        up.entity.table_entry.is_default_action = True
        place = self.configure_job(cfg.leaf(uplink.leaf), ports, generation)
        self.client.write([up])
        self._uplink = uplink
        return place

    def configure_spine(self, cfg: JobConfig, ports: tuple[int, ...] | list[int],
                        generation: int | None = None) -> Placement:
        """Serve the spine of the two-tier job ``cfg`` (docs/protocol.md, "Two tiers"): leaf l on switch
        port ``ports[l]``, each leaf's worker count, and the job's threshold in workers. Raises JobRefused
        (nothing written) if the program is not the spine program or cannot serve the job. Until the
        leaf sizes follow the job entry, the job's partials are dropped as bad_format (the leaves resend)."""
        if not self.is_spine:
            raise JobRefused(f"job {cfg.job}: the running program is not the spine program (compile it with "
                             f"-DTHC_SPINE: topologies.bmv2.compile_program(spine=True))")
        view = spine_view(cfg, self.geometry)
        sizes = [table_update(self.index, e) for e in leaf_size_entries(cfg)]
        place = self.configure_job(view, ports, generation, threshold=cfg.threshold)
        for up in sizes:  # a reconfigured job's leaves: what an earlier configuration wrote goes first
            try:
                self.client.write([p4runtime_pb2.Update(type=DELETE, entity=up.entity)])
            except SwitchRejected:
                pass
        self.client.write(sizes)
        return place

    def tier_stats(self) -> dict[str, int]:
        """A leaf program's ``thc_tier_stats`` (``worker_lib.wire.protocol.TierCounter`` names)."""
        return self._read_counter("thc_tier_stats", TierCounter)

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
        g = self.geometry
        keys = range(1 << (g.bits * g.lookup_indices))  # every key a job's entries have (lookup_rows)
        for m in range(g.lookups):
            t = idx.table(lookup_table(m, g.lookup_control))
            f_job, w_job, _ = idx.match_field(t.name, "job_index")
            f_idx, w_idx, _ = idx.match_field(t.name, g.lookup_key)
            for i in keys:
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
        out = self._read_counter("thc_stats", Counter)
        out["ELEMENTS"] *= self.geometry.elems
        return out

    def _read_counter(self, name: str, names: type[Counter] | type[TierCounter]) -> dict[str, int]:
        """A packet counter array by the names of its enum."""
        cid, _size = self.index.counter(name)
        ent = p4runtime_pb2.Entity()
        ent.counter_entry.counter_id = cid
        out = {c.name: 0 for c in names}
        for e in self.client.read([ent]):
            ce = e.counter_entry
            if ce.counter_id != cid:
                continue
            try:
                out[names(ce.index.index).name] = int(ce.data.packet_count)
            except ValueError:
                continue
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
