"""The P4Runtime control plane against a fake P4Runtime server on port 0 in the test process.

The fake server checks every write against the P4Info of the program (table, field, action and
parameter ids and widths; duplicate inserts; modifies/deletes of missing entries), stores the entries,
answers reads and arbitration, and records every request; the tests assert the exact entries and
multicast groups written for a job description. The P4Info is the one p4c-bm2-ss writes for
p4src/bmv2/thc.p4, checked in as p4src/bmv2/thc.p4info.txtpb (tests/test_p4_program.py checks it is current
where p4c exists).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import text_format
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from aggregator.p4rt import (
    JobRefused,
    NotPrimary,
    P4InfoIndex,
    SwitchAddress,
    SwitchRejected,
    SwitchUnreachable,
    ThcSwitch,
    program_geometry,
    wait_for_port,
)
from tests.p4_support import CHECKED_IN_P4INFO
from worker_lib.job import JobConfig
from worker_lib.thc import solve_table
from worker_lib.wire.protocol import Counter

if not CHECKED_IN_P4INFO.exists():
    pytest.skip(f"{CHECKED_IN_P4INFO} is missing (compile p4src/bmv2/thc.p4 with p4c-bm2-ss)", allow_module_level=True)

P4INFO = text_format.Parse(CHECKED_IN_P4INFO.read_text(), p4info_pb2.P4Info())


class FakeP4Runtime(p4runtime_pb2_grpc.P4RuntimeServicer):
    """A P4Runtime server that validates writes against a P4Info and keeps what it is told."""

    def __init__(self, p4info: p4info_pb2.P4Info | None = None) -> None:
        self.p4info = p4info
        self.writes: list[p4runtime_pb2.WriteRequest] = []
        self.pipelines: list[p4runtime_pb2.SetForwardingPipelineConfigRequest] = []
        self.tables: dict[tuple[int, bytes], p4runtime_pb2.TableEntry] = {}
        self.groups: dict[int, p4runtime_pb2.MulticastGroupEntry] = {}
        self.counters: dict[int, int] = {}
        self.primary_election: int | None = None
        self.stale_groups: dict[int, p4runtime_pb2.MulticastGroupEntry] = {}
        self.lock = threading.Lock()

    # -- validation --------------------------------------------------------------------------------
    def _check_table_entry(self, te: p4runtime_pb2.TableEntry, with_action: bool) -> str | None:
        tables = {t.preamble.id: t for t in self.p4info.tables}
        if te.table_id not in tables:
            return f"unknown table id {te.table_id}"
        t = tables[te.table_id]
        fields = {m.id: m for m in t.match_fields}
        for m in te.match:
            if m.field_id not in fields:
                return f"table {t.preamble.name}: unknown field id {m.field_id}"
            f = fields[m.field_id]
            kind = m.WhichOneof("field_match_type")
            value = getattr(m, kind).value
            if value[:1] == b"\x00" and len(value) > 1:
                return f"{f.name}: value not canonical"
            if int.from_bytes(value, "big") >= 1 << f.bitwidth:
                return f"{f.name}: value does not fit {f.bitwidth} bits"
        if not with_action:
            return None
        if te.action.action.action_id not in {a.id for a in t.action_refs}:
            return f"table {t.preamble.name}: action {te.action.action.action_id} not allowed"
        action = next(a for a in self.p4info.actions if a.preamble.id == te.action.action.action_id)
        params = {p.id: p for p in action.params}
        if sorted(p.param_id for p in te.action.action.params) != sorted(params):
            return f"action {action.preamble.name}: wrong parameter set"
        for p in te.action.action.params:
            if int.from_bytes(p.value, "big") >= 1 << params[p.param_id].bitwidth:
                return f"{action.preamble.name}.{params[p.param_id].name}: does not fit"
        return None

    def _apply(self, up: p4runtime_pb2.Update) -> str | None:
        ent = up.entity
        which = ent.WhichOneof("entity")
        if which == "table_entry":
            te = ent.table_entry
            err = self._check_table_entry(te, up.type != p4runtime_pb2.Update.DELETE)
            if err:
                return err
            k = (te.table_id, b"".join(m.SerializeToString() for m in te.match))
            if up.type == p4runtime_pb2.Update.INSERT:
                if k in self.tables:
                    return "ALREADY_EXISTS"
                self.tables[k] = te
            elif k not in self.tables:
                return "NOT_FOUND"
            elif up.type == p4runtime_pb2.Update.MODIFY:
                self.tables[k] = te
            else:
                del self.tables[k]
            return None
        if which == "packet_replication_engine_entry":
            g = ent.packet_replication_engine_entry.multicast_group_entry
            present = g.multicast_group_id in self.groups
            if up.type == p4runtime_pb2.Update.INSERT and present:
                return "ALREADY_EXISTS"
            if up.type != p4runtime_pb2.Update.INSERT and not present:
                return "NOT_FOUND"
            if up.type == p4runtime_pb2.Update.DELETE:
                del self.groups[g.multicast_group_id]
            else:
                self.groups[g.multicast_group_id] = g
            return None
        return f"unsupported entity {which}"

    # -- RPCs --------------------------------------------------------------------------------------
    def Write(self, request, context):
        with self.lock:
            self.writes.append(request)
            errors = [self._apply(u) for u in request.updates]
        if any(errors):
            st = status_pb2.Status(code=code_pb2.UNKNOWN, message="Write failure.")
            for e in errors:
                err = p4runtime_pb2.Error(canonical_code=code_pb2.INVALID_ARGUMENT if e else code_pb2.OK,
                                          message=e or "")
                st.details.add().Pack(err)
            context.set_trailing_metadata((("grpc-status-details-bin", st.SerializeToString()),))
            context.abort(grpc.StatusCode.UNKNOWN, "Write failure.")
        return p4runtime_pb2.WriteResponse()

    def Read(self, request, context):
        reply = p4runtime_pb2.ReadResponse()
        for ent in request.entities:
            which = ent.WhichOneof("entity")
            if which == "table_entry":
                for (tid, _), te in sorted(self.tables.items()):
                    if tid == ent.table_entry.table_id:
                        reply.entities.add().table_entry.CopyFrom(te)
            elif which == "counter_entry":
                for i, v in sorted(self.counters.items()):
                    ce = reply.entities.add().counter_entry
                    ce.counter_id = ent.counter_entry.counter_id
                    ce.index.index = i
                    ce.data.packet_count = v
            elif which == "packet_replication_engine_entry":
                if self.p4info is None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "No forwarding pipeline config set")
                for _gid, g in sorted(self.groups.items()):
                    reply.entities.add().packet_replication_engine_entry.multicast_group_entry.CopyFrom(g)
            elif which == "register_entry":
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "Register reads are not supported yet")
        yield reply

    def SetForwardingPipelineConfig(self, request, context):
        self.pipelines.append(request)
        self.p4info = request.config.p4info
        self.tables.clear()
        # Like BMv2: the replication engine keeps its groups across a reload (see ThcSwitch.load).
        self.stale_groups = dict(self.groups)
        self.groups.clear()
        return p4runtime_pb2.SetForwardingPipelineConfigResponse()

    def GetForwardingPipelineConfig(self, request, context):
        reply = p4runtime_pb2.GetForwardingPipelineConfigResponse()
        if self.p4info is not None:
            reply.config.p4info.CopyFrom(self.p4info)
        return reply

    def StreamChannel(self, request_iterator, context):
        for req in request_iterator:
            if req.HasField("arbitration"):
                e = req.arbitration.election_id.low
                resp = p4runtime_pb2.StreamMessageResponse()
                resp.arbitration.CopyFrom(req.arbitration)
                if self.primary_election is None or e >= self.primary_election:
                    self.primary_election = e
                    resp.arbitration.status.code = code_pb2.OK
                else:
                    resp.arbitration.status.code = code_pb2.ALREADY_EXISTS
                    resp.arbitration.status.message = "a controller with a higher election id is primary"
                yield resp

    def Capabilities(self, request, context):
        return p4runtime_pb2.CapabilitiesResponse(p4runtime_api_version="1.3.0")


@pytest.fixture
def fake_switch():
    """A fake P4Runtime server on 127.0.0.1:<free port>, already running the THC program's P4Info."""
    servers = []

    def start(p4info: p4info_pb2.P4Info | None = P4INFO) -> tuple[FakeP4Runtime, SwitchAddress]:
        fake = FakeP4Runtime(p4info)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        p4runtime_pb2_grpc.add_P4RuntimeServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return fake, SwitchAddress("127.0.0.1", port)

    yield start
    for s in servers:
        s.stop(grace=None)


IDX = P4InfoIndex(P4INFO)
GEOM = program_geometry(IDX)


def _job(**kw) -> JobConfig:
    base = dict(job=5, key=0xCAFE0001, workers=4, bits=GEOM.bits, granularity=30, p=1 / 32,
                elems=GEOM.elems, result_bits=GEOM.result_bits, slots=16)
    base.update(kw)
    return JobConfig(**base)


def _p4id(kind: str, name: str) -> int:
    """Id of a table/action from the P4Info protobuf directly (not through the code under test): by its
    full name or its last component."""
    for obj in getattr(P4INFO, kind):
        if name in (obj.preamble.name, obj.preamble.name.split(".")[-1]):
            return obj.preamble.id
    raise KeyError(name)


def _params(te: p4runtime_pb2.TableEntry) -> dict[str, int]:
    action = next(a for a in P4INFO.actions if a.preamble.id == te.action.action.action_id)
    names = {p.id: p.name for p in action.params}
    return {names[p.param_id]: int.from_bytes(p.value, "big") for p in te.action.action.params}


def test_geometry_is_read_from_the_p4info() -> None:
    """K, b and the result width come from the P4Info (the checked-in program's defaults)."""
    lookups = [t for t in P4INFO.tables if re.fullmatch(r"ThcIngress\.elem_\d+\.lookup", t.preamble.name)]
    assert GEOM.elems == len(lookups) == 32
    assert GEOM.bits == 4 and GEOM.result_bits == 8


def test_job_writes_exact_entries(fake_switch) -> None:
    """A 4-worker job: K x 2^b lookup entries with the solver's values, one multicast group with a replica
    per worker port, and last the job entry with the configured n, threshold, key and table id."""
    fake, addr = fake_switch()
    cfg = _job(threshold=3)
    table = solve_table(4, 30, 1 / 32).as_array().tolist()
    with ThcSwitch(addr) as sw:
        place = sw.configure_job(cfg, ports=(7, 3, 9, 1), generation=0x1234)
    ups = [u for w in fake.writes for u in w.updates]
    assert all(u.type == p4runtime_pb2.Update.INSERT for u in ups)
    assert len(ups) == GEOM.elems * 16 + 2
    # Lookup entries: for each element e, index i -> T[i] under the job's row.
    seen = {}
    for u in ups[:-2]:
        te = u.entity.table_entry
        name = next(t.preamble.name for t in P4INFO.tables if t.preamble.id == te.table_id)
        e = int(re.fullmatch(r"ThcIngress\.elem_(\d+)\.lookup", name).group(1))
        job_row, index = (int.from_bytes(m.exact.value, "big") for m in te.match)
        assert te.action.action.action_id == _p4id("actions", f"ThcIngress.elem_{e}.value")
        seen[(e, index)] = (job_row, _params(te)["v"])
    assert seen == {(e, i): (place.job_index, table[i]) for e in range(GEOM.elems) for i in range(16)}
    grp = ups[-2].entity.packet_replication_engine_entry.multicast_group_entry
    assert grp.multicast_group_id == place.job_index + 1
    assert [(r.egress_port, r.instance) for r in grp.replicas] == \
        [(7, place.job_index * 32), (3, place.job_index * 32 + 1), (9, place.job_index * 32 + 2),
         (1, place.job_index * 32 + 3)]
    te = ups[-1].entity.table_entry
    assert te.table_id == _p4id("tables", "thc_jobs")
    assert int.from_bytes(te.match[0].exact.value, "big") == 5
    assert _params(te) == {"key": 0xCAFE0001, "table_id": cfg.table_id, "workers": 4, "threshold": 3, "slots": 16,
                           "slot_base": 0, "job_index": 0, "mcast_grp": 1, "gen": 0x1234}


def test_second_job_gets_next_row_and_slot_range_and_reconfigure_modifies(fake_switch) -> None:
    """Jobs do not share rows or slots; configuring a job again rewrites it with a new generation."""
    fake, addr = fake_switch()
    with ThcSwitch(addr) as sw:
        a = sw.configure_job(_job(job=1, slots=16), (1, 2, 3, 4), generation=10)
        b = sw.configure_job(_job(job=2, slots=8, workers=2), (5, 6), generation=11)
        assert (a.job_index, a.slot_base) == (0, 0)
        assert (b.job_index, b.slot_base) == (1, 16)
        n_before = len(fake.writes)
        c = sw.configure_job(_job(job=1, slots=16, threshold=2), (1, 2, 3, 4), generation=12)
        assert (c.job_index, c.slot_base, c.generation) == (0, 0, 12)
        ups = [u for w in fake.writes[n_before:] for u in w.updates]
        assert ups and all(u.type == p4runtime_pb2.Update.MODIFY for u in ups)
        jobs = {j.job: j for j in sw.jobs()}
        assert jobs[1].threshold == 2 and jobs[1].placement.generation == 12
        assert jobs[2].placement.slot_base == 16


def test_remove_job_deletes_everything_it_wrote(fake_switch) -> None:
    """After remove_job the fake holds no entry or group of the job (deletes matched every insert)."""
    fake, addr = fake_switch()
    with ThcSwitch(addr) as sw:
        sw.configure_job(_job(job=1), (1, 2, 3, 4), generation=1)
        assert fake.tables and fake.groups
        sw.remove_job(1)
        assert not fake.tables and not fake.groups
        with pytest.raises(SwitchRejected, match="job 1 is not configured"):
            sw.remove_job(1)


@pytest.mark.parametrize(("kw", "ports", "match"), [
    (dict(workers=9, result_bits=16), tuple(range(9)), r"g \* n = 30 \* 9 = 270 does not fit the program's 8-bit"),
    (dict(elems=64), (1, 2, 3, 4), "compiled for K = 32"),
    (dict(bits=2, granularity=10, p=None, table=(0, 2, 7, 10)), (1, 2, 3, 4), "compiled for b = 4"),
    (dict(kind="uncompressed", result_bits=32), (1, 2, 3, 4), "THC jobs only"),
    (dict(), (1, 2, 3), "4 workers but 3 switch ports"),
    (dict(slots=5000), (1, 2, 3, 4), "slots"),
])
def test_refused_jobs_write_nothing(fake_switch, kw: dict, ports: tuple, match: str) -> None:
    """A job the program cannot aggregate is refused with a clear reason before any write."""
    fake, addr = fake_switch()
    base = dict(job=5, key=1, workers=4, bits=4, granularity=30, p=1 / 32, elems=32, result_bits=8, slots=16)
    base.update(kw)
    if base.get("kind") == "uncompressed":
        for k in ("bits", "granularity", "p"):
            base.pop(k)
    if base.get("table"):
        base.pop("p")
    cfg = JobConfig(**base)
    with ThcSwitch(addr) as sw, pytest.raises(JobRefused, match=match):
        sw.configure_job(cfg, ports)
    assert not fake.writes


def test_slots_exhausted_is_refused(fake_switch) -> None:
    """When no free slot range is left, the job is refused and nothing is written for it."""
    fake, addr = fake_switch()
    with ThcSwitch(addr) as sw:
        sw.configure_job(_job(job=1, slots=GEOM.slots - 4), (1, 2, 3, 4), generation=1)
        n = len(fake.writes)
        with pytest.raises(JobRefused, match="no free range of 8 slots"):
            sw.configure_job(_job(job=2, slots=8), (1, 2, 3, 4), generation=2)
        assert len(fake.writes) == n


def test_load_pushes_p4info_and_json_and_routes(fake_switch, tmp_path) -> None:
    """load() sends the P4Info and the BMv2 JSON bytes unchanged; routes and services are LPM/exact entries."""
    fake, addr = fake_switch(p4info=None)
    blob = tmp_path / "thc.json"
    blob.write_bytes(b'{"program": "thc"}')
    with ThcSwitch(addr) as sw:
        geom = sw.load(CHECKED_IN_P4INFO, blob)
        sw.add_route("10.0.0.0/24", "00:00:00:00:00:0a", 3)
        sw.add_service("10.0.0.100", "02:00:00:00:01:00")
    assert geom == GEOM
    (req,) = fake.pipelines
    assert req.config.p4_device_config == b'{"program": "thc"}'
    assert req.config.p4info == P4INFO
    assert req.action == p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT
    route = fake.writes[0].updates[0].entity.table_entry
    assert route.table_id == _p4id("tables", "ipv4_lpm")
    assert (route.match[0].lpm.value, route.match[0].lpm.prefix_len) == (bytes([10, 0, 0, 0]), 24)
    assert _params(route) == {"dst_mac": 0x0A, "port": 3}
    svc = fake.writes[1].updates[0].entity.table_entry
    assert svc.match[0].exact.value == bytes([10, 0, 0, 100])
    assert _params(svc) == {"switch_mac": 0x020000000100}


def test_default_route_omits_its_lpm_field(fake_switch, tmp_path) -> None:
    """A /0 route matches everything: P4Runtime wants its LPM field left out (simple_switch_grpc refuses a
    prefix length of 0), the entry otherwise the same."""
    fake, addr = fake_switch(p4info=None)
    blob = tmp_path / "thc.json"
    blob.write_bytes(b"{}")
    with ThcSwitch(addr) as sw:
        sw.load(CHECKED_IN_P4INFO, blob)
        sw.add_route("0.0.0.0/0", "00:00:00:00:00:0b", 2)
    route = fake.writes[0].updates[0].entity.table_entry
    assert route.table_id == _p4id("tables", "ipv4_lpm") and len(route.match) == 0
    assert _params(route) == {"dst_mac": 0x0B, "port": 2}


def test_stats_names_counters_and_scales_elements(fake_switch) -> None:
    """Counters come back under the Python aggregator's names; ELEMENTS is packets times K."""
    fake, addr = fake_switch()
    fake.counters = {int(Counter.RX): 9, int(Counter.ELEMENTS): 3, int(Counter.BAD_KEY): 2}
    with ThcSwitch(addr) as sw:
        st = sw.stats()
    assert st["RX"] == 9 and st["BAD_KEY"] == 2 and st["ELEMENTS"] == 3 * GEOM.elems
    assert st["COMPLETED"] == 0 and set(st) == {c.name for c in Counter}


def test_rejected_write_reports_each_failed_update(fake_switch) -> None:
    """A write the switch refuses raises SwitchRejected listing the failed updates, not a gRPC trace."""
    _fake, addr = fake_switch()
    with ThcSwitch(addr) as sw:
        sw.add_service("10.0.0.100", "02:00:00:00:01:00")
        with pytest.raises(SwitchRejected) as info:
            sw.add_service("10.0.0.100", "02:00:00:00:01:00")
    assert "update 0: INVALID_ARGUMENT: ALREADY_EXISTS" in str(info.value)
    assert info.value.details == ["update 0: INVALID_ARGUMENT: ALREADY_EXISTS"]


def test_register_read_unimplemented_is_explained(fake_switch) -> None:
    """BMv2's P4Runtime has no register reads; the error says so and names the alternative."""
    _fake, addr = fake_switch()
    with ThcSwitch(addr) as sw, pytest.raises(SwitchRejected, match="does not implement register reads"):
        sw.read_register("bank_count", 0)


def test_two_switches_in_one_process(fake_switch) -> None:
    """Two ThcSwitch objects drive two switches independently (no shared connection state)."""
    fa, aa = fake_switch()
    fb, ab = fake_switch()
    with ThcSwitch(aa) as a, ThcSwitch(ab) as b:
        a.add_service("10.0.0.1", "02:00:00:00:00:01")
        b.add_service("10.0.0.2", "02:00:00:00:00:02")
    assert [w.updates[0].entity.table_entry.match[0].exact.value for w in fa.writes] == [bytes([10, 0, 0, 1])]
    assert [w.updates[0].entity.table_entry.match[0].exact.value for w in fb.writes] == [bytes([10, 0, 0, 2])]


def test_lower_election_id_is_not_primary(fake_switch) -> None:
    """A second controller with a lower election id is told another controller is primary."""
    _fake, addr = fake_switch()
    with ThcSwitch(SwitchAddress(addr.host, addr.port, election_id=5)):
        with pytest.raises(NotPrimary, match="another controller is primary"):
            ThcSwitch(SwitchAddress(addr.host, addr.port, election_id=2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_switch_is_a_clear_error() -> None:
    """Nothing listening: SwitchUnreachable naming the address, within the timeout."""
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(SwitchUnreachable, match=f"127.0.0.1:{port}"):
        ThcSwitch(SwitchAddress("127.0.0.1", port), timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_wait_for_port_polls_until_listening() -> None:
    """wait_for_port returns as soon as the port listens (started later by a thread) and fails otherwise."""
    port = _free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    th = threading.Thread(target=listen_later)
    th.start()
    try:
        wait_for_port("127.0.0.1", port, timeout=10)
    finally:
        th.join()
        srv.close()
    with pytest.raises(SwitchUnreachable, match="nothing listens"):
        wait_for_port("127.0.0.1", _free_port(), timeout=0.3)


def test_cli_job_and_errors(fake_switch, capsys) -> None:
    """thc-switch job installs a job and prints its placement; a refused job is one stderr line, rc 1."""
    from aggregator.switch.cli import main

    fake, addr = fake_switch()
    spec = "job=3,key=0x10,workers=2,bits=4,granularity=30,elems=32,result_bits=8,slots=4"
    assert main(["--switch", addr.target, "job", "--job", spec, "--ports", "1,2"]) == 0
    out = capsys.readouterr().out
    assert '"job": 3' in out and '"mcast_grp": 1' in out
    assert any(u.entity.table_entry.table_id == _p4id("tables", "thc_jobs") for w in fake.writes for u in w.updates)
    n = len(fake.writes)
    bad = spec.replace("workers=2", "workers=9").replace("result_bits=8", "result_bits=16")
    assert main(["--switch", addr.target, "job", "--job", bad, "--ports", "1,2,3,4,5,6,7,8,9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("thc-switch: job 3: g * n = 30 * 9 = 270 does not fit") and err.count("\n") == 1
    assert len(fake.writes) == n


def test_cli_unreachable_switch_is_one_line_no_traceback() -> None:
    """The installed console entry point reports an unreachable switch as one line on stderr, rc 1."""
    bad = subprocess.run([sys.executable, "-m", "aggregator.switch.cli", "--switch", f"127.0.0.1:{_free_port()}",
                          "--timeout", "0.5", "stats"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1
    assert bad.stderr.startswith("thc-switch: ") and "Traceback" not in bad.stderr
    assert "no P4Runtime server answers" in bad.stderr


@pytest.mark.parametrize("module", ["aggregator.switch.cli", "topologies.star"])
def test_switch_tools_refuse_an_unknown_log_level_in_one_line(module: str) -> None:
    """thc-switch and the BMv2 star take a logging level by name, and refuse another in one line."""
    bad = subprocess.run([sys.executable, "-m", module, "--log-level", "loud", "stats"], capture_output=True,
                         text=True, timeout=60, check=False)
    lines = [ln for ln in bad.stderr.splitlines() if not ln.startswith(("usage:", "  "))]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(lines) == 1, bad.stderr
    assert "--log-level: expected one of DEBUG" in lines[0]


def test_generation_is_never_zero_nor_in_use() -> None:
    """A new generation skips 0 and the generations of installed jobs (so no stale state reads as current)."""
    from aggregator.switch.entries import InstalledJob, Placement, new_generation

    def job(gen: int) -> InstalledJob:
        return InstalledJob(1, 1, 1, 2, 2, 4, Placement(0, 0, gen))

    assert new_generation([], clock=lambda: 0) == 1
    assert new_generation([job(1), job(2)], clock=lambda: 0) == 3
    assert new_generation([], clock=lambda: (1 << 32) * 1_000_000 + 5_000_000) == 5


def test_reload_deletes_multicast_groups_first(fake_switch, tmp_path) -> None:
    """Loading the program again first deletes the running program's multicast groups (BMv2 would keep
    them in its replication engine and every result would then be replicated twice)."""
    fake, addr = fake_switch()
    blob = tmp_path / "thc.json"
    blob.write_bytes(b"{}")
    with ThcSwitch(addr) as sw:
        sw.configure_job(_job(job=1), (1, 2, 3, 4), generation=1)
        sw.configure_job(_job(job=2, slots=8), (1, 2, 3, 4), generation=2)
        assert sorted(fake.groups) == [1, 2]
        sw.load(CHECKED_IN_P4INFO, blob)
    deletes = [u for w in fake.writes for u in w.updates if u.type == p4runtime_pb2.Update.DELETE]
    assert sorted(u.entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id
                  for u in deletes) == [1, 2]
    assert fake.stale_groups == {}
