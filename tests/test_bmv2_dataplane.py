"""Packet-level tests of the THC program on BMv2 simple_switch_grpc (PTF style), against the same
scenario table as the Python aggregator (tests/scenarios.py), plus ping, and a 4-worker allreduce whose
sums must equal the Python aggregator's bit for bit on the same packets (read back from BMv2's pcaps).

Rig: one switch namespace (ports s0..s3) and four host namespaces (h0..h3) made by topologies.nsstar;
simple_switch_grpc runs in the switch namespace with its P4Runtime server on a Unix socket; packets are
sent and captured on the host ends with AF_PACKET sockets opened inside the host namespaces. No packet
leaves namespaces created here. Each scenario loads the pipeline afresh (empty tables, registers and
counters), then configures its jobs through aggregator.p4rt.

Adapter: worker w of any job sits on port w. "to": "all" means one copy on the port of each worker of
the job whose address the switch has learnt (it answers the addresses it has seen, as the Python server
does); which packets taught an address is taken from the Python reference run in lockstep. Every THC
payload out of BMv2 must also be byte-identical to what the Python aggregator answers for that packet.
Needs root, p4c-bm2-ss and simple_switch_grpc; skips naming what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dpkt
import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from aggregator.engine import Aggregator
from aggregator.p4rt import SwitchRejected, ThcSwitch
from aggregator.state import ReferenceAggregator
from tests.p4_support import need_root, need_tools
from tests.scenarios import A_B, JOB, SCENARIOS, A, B, C, scenario_packet
from topologies.bmv2 import CONTROL_TIMEOUT, Bmv2Config, Bmv2Switch, CompiledProgram, compile_program
from topologies.netns import PACKET_OUTGOING
from topologies.nsstar import SERVICE_IP, SWITCH_MAC, Host, NsStar
from topologies.worker import worker_indices, worker_norm
from worker_lib.job import JobConfig, job_from_mapping
from worker_lib.wire import Header, PacketType, bits_float
from worker_lib.wire.layout import THC_UDP_PORT, field_offsets
from worker_lib.wire.protocol import Counter

ROOT = Path(__file__).resolve().parent.parent
PORTS = 4
BASE_SPORT = 40000
QUIET = 0.12  # seconds without a packet after which "nothing else comes" (PTF's negative timeout)


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> CompiledProgram:
    """The program compiled for the scenario table's geometry (K, b and result width of its jobs)."""
    need_tools("p4c-bm2-ss")
    return compile_program(tmp_path_factory.mktemp("thc_bmv2"), elems=JOB["elems"], bits=JOB["bits"],
                           result_bits=JOB["result_bits"], slots=16, jobs=4)


@dataclass
class Rig:
    """A running switch with four hosts, its controller and a raw socket per host port."""

    star: NsStar
    switch: Bmv2Switch
    ctl: ThcSwitch
    program: CompiledProgram
    socks: dict

    def reload(self, jobs: list[JobConfig]) -> None:
        """Fresh pipeline, service address, routes, then the jobs (worker w on port w)."""
        self.ctl.load(self.program.p4info, self.program.json)
        self.ctl.add_service(SERVICE_IP, SWITCH_MAC)
        for prefix, mac, port in self.star.routes():
            self.ctl.add_route(prefix, mac, port)
        for cfg in jobs:
            self.ctl.configure_job(cfg, tuple(range(cfg.workers)))

    def drain(self) -> None:
        for s in self.socks.values():
            while True:
                try:
                    s.recv(65536)
                except BlockingIOError:
                    break

    def send(self, port: int, frame: bytes) -> None:
        self.socks[port].send(frame)

    def collect(self, expected: int, timeout: float = 5.0, quiet: float = QUIET) -> list[tuple[int, bytes]]:
        """Frames arriving at the hosts: wait for ``expected`` of them, then ``quiet`` s more for extras."""
        got: list[tuple[int, bytes]] = []
        by_fd = {s.fileno(): (p, s) for p, s in self.socks.items()}
        t_end = time.monotonic() + timeout
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if len(got) >= expected and now - last >= quiet:
                return got
            if now >= t_end:
                return got
            wait = quiet - (now - last) if len(got) >= expected else min(quiet, t_end - now)
            ready, _, _ = select.select(list(by_fd), [], [], max(0.005, wait))
            for fd in ready:
                port, s = by_fd[fd]
                while True:
                    try:
                        data, addr = s.recvfrom(65536)
                    except BlockingIOError:
                        break
                    if addr[2] != PACKET_OUTGOING:
                        got.append((port, data))
                        last = time.monotonic()


@pytest.fixture(scope="module")
def rig(program, tmp_path_factory):
    """Namespaces, simple_switch_grpc and a controller, torn down after the module."""
    with running_rig(program, tmp_path_factory.mktemp("bmv2_run"), "thc8t") as r:
        yield r


@contextlib.contextmanager
def running_rig(program: CompiledProgram, work: Path, prefix: str) -> Iterator[Rig]:
    """The rig for ``program``: PORTS host namespaces around a switch namespace running simple_switch_grpc
    (files in ``work``, namespaces named from ``prefix``), its controller and a raw socket per host
    port; everything removed at exit. Skips without simple_switch_grpc or root."""
    need_tools("simple_switch_grpc")
    need_root("network namespaces and veth pairs")
    star = NsStar(PORTS, prefix=f"{prefix}{os.getpid() % 100000}").create()
    switch = Bmv2Switch(Bmv2Config(star.interfaces, work, netns=star.switch_ns))
    socks: dict = {}
    ctl = None
    try:
        switch.start()
        ctl = ThcSwitch(switch.address, timeout=CONTROL_TIMEOUT)
        for h in star.hosts:
            socks[h.port] = h.ns.raw_socket(h.ifname)
        yield Rig(star, switch, ctl, program, socks)
    finally:
        for s in socks.values():
            s.close()
        if ctl is not None:
            ctl.close()
        switch.stop()
        star.close()


# ---- the scenario adapter ---------------------------------------------------------------------------
def frame_from(host: Host, payload: bytes) -> bytes:
    """Ethernet/IPv4/UDP from the host to the aggregator address, carrying ``payload``."""
    return bytes(Ether(src=host.mac, dst=SWITCH_MAC) / IP(src=host.ip, dst=SERVICE_IP)
                 / UDP(sport=BASE_SPORT + host.port, dport=THC_UDP_PORT) / Raw(payload))


def ipv4_checksum_ok(header: bytes) -> bool:
    total = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, len(header), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF


def unwrap(port: int, frame: bytes, host: Host) -> bytes:
    """Check the L2-L4 headers of an answer arriving at ``host``; return its THC bytes."""
    eth = dpkt.ethernet.Ethernet(frame)
    assert isinstance(eth.data, dpkt.ip.IP), f"port {port}: not IPv4: {frame.hex()}"
    ip = eth.data
    assert isinstance(ip.data, dpkt.udp.UDP), f"port {port}: not UDP"
    udp = ip.data
    assert eth.dst == bytes.fromhex(host.mac.replace(":", "")), f"port {port}: dst MAC {eth.dst.hex()}"
    assert eth.src == bytes.fromhex(SWITCH_MAC.replace(":", ""))
    assert dpkt.utils.inet_to_str(ip.src) == SERVICE_IP and dpkt.utils.inet_to_str(ip.dst) == host.ip
    assert (udp.sport, udp.dport) == (THC_UDP_PORT, BASE_SPORT + host.port)
    raw = bytes(frame[14:])
    assert ipv4_checksum_ok(raw[:20]), "IPv4 header checksum"
    assert ip.len == 20 + udp.ulen and udp.ulen == 8 + len(udp.data), "IPv4/UDP lengths"
    return bytes(udp.data)


def check_thc(data: bytes, want: dict, cfg: JobConfig, where: str) -> None:
    """The answer's THC header and payload are what the scenario lists."""
    hdr, payload = Header.parse(data)
    assert hdr.type == PacketType[want["type"]], f"{where}: type {hdr.type}"
    for name, value in want.items():
        if name in ("to", "type", "sums", "norm", "ints"):
            continue
        assert getattr(hdr, name) == value, f"{where}: field {name} = {getattr(hdr, name)}, expected {value}"
    assert hdr.key == cfg.key
    if "sums" in want:
        assert hdr.width == cfg.result_bits and hdr.elems == len(want["sums"])
        assert np.frombuffer(payload, {8: ">u1", 16: ">u2"}[cfg.result_bits]).tolist() == want["sums"], \
            f"{where}: sums"
    if "norm" in want:
        assert len(payload) == 4 and bits_float(int.from_bytes(payload, "big")) == want["norm"], f"{where}: norm"
    if want["type"] == "STRAGGLER":
        assert payload == b"", f"{where}: straggler payload"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario(rig: Rig, scenario: dict) -> None:
    """Each packet in makes exactly the listed packets out, on the listed ports; counters end as listed."""
    jobs = {c.job: c for c in (job_from_mapping(dict(j)) for j in scenario["jobs"])}
    if any(c.kind != "thc" for c in jobs.values()):
        pytest.skip("the BMv2 program aggregates THC jobs only (uncompressed jobs: thc-aggregator); "
                    "thc-switch refuses them")
    rig.reload(list(jobs.values()))
    ref = Aggregator(jobs.values())
    known: set[tuple[int, int]] = set()
    before = rig.ctl.stats()
    hosts = {h.port: h for h in rig.star.hosts}
    for n, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']} step {n}"
        send = step["send"]
        payload = scenario_packet(send, jobs)
        port = send.get("worker", 0) if "raw" not in send and send.get("worker", 0) < PORTS else 0
        ref_out = ref.handle(payload)
        if ref.last_good.size:
            known.add((int(ref.last_job[0]), int(ref.last_worker[0])))
        pkt_job = send.get("job", 1) if "raw" not in send else None
        expected: list[tuple[int, dict]] = []
        for want in step["expect"]:
            job = want.get("job", pkt_job)
            if want["to"] == "all":
                expected += [(w, want) for (j, w) in sorted(known) if j == job]
            else:
                expected.append((port, want))
        rig.drain()
        rig.send(port, frame_from(hosts[port], payload))
        got = rig.collect(len(expected))
        assert sorted(p for p, _ in got) == sorted(p for p, _ in expected), \
            f"{where}: packets out on ports {sorted(p for p, _ in got)}, expected {sorted(p for p, _ in expected)}"
        ref_payloads = {data for _, data in ref_out}
        for (p, want), (gp, frame) in zip(sorted(expected, key=lambda x: x[0]), sorted(got, key=lambda x: x[0]),
                                          strict=True):
            assert p == gp
            data = unwrap(gp, frame, hosts[gp])
            check_thc(data, want, jobs[want.get("job", pkt_job)], f"{where} port {gp}")
            assert data in ref_payloads, f"{where}: BMv2 answer differs from the Python aggregator's"
    after = rig.ctl.stats()
    delta = {k: after[k] - before[k] for k in after}
    for name, value in scenario["counters"].items():
        assert delta[name] == value, f"{scenario['name']}: counter {name} = {delta[name]}, expected {value}"
    assert delta["RX"] == len(scenario["steps"])


def test_hosts_ping_each_other(rig: Rig) -> None:
    """Plain IPv4 is forwarded: every host pings the next one through the switch."""
    need_tools("ping")
    rig.reload([])
    for h in rig.star.hosts:
        other = rig.star.hosts[(h.port + 1) % PORTS]
        proc = subprocess.run(["ip", "netns", "exec", h.ns.name, "ping", "-c", "1", "-W", "2", other.ip],
                              capture_output=True, text=True, timeout=20, check=False)
        assert proc.returncode == 0, f"{h.ip} -> {other.ip}: {proc.stdout}{proc.stderr}"


# ---- 4 workers, real transport, bit-exact against the Python aggregator -----------------------------
def read_pcap(path: Path) -> list[tuple[float, bytes]]:
    if not path.exists():
        return []
    with path.open("rb") as f:
        return [(ts, bytes(buf)) for ts, buf in dpkt.pcap.Reader(f)]


def thc_of(frame: bytes) -> bytes | None:
    eth = dpkt.ethernet.Ethernet(frame)
    ip = eth.data
    if not isinstance(ip, dpkt.ip.IP) or not isinstance(ip.data, dpkt.udp.UDP):
        return None
    udp = ip.data
    if THC_UDP_PORT not in (udp.sport, udp.dport):
        return None
    return bytes(udp.data)


def mask_worker(data: bytes) -> bytes:
    """The THC packet with its ``worker`` byte zeroed."""
    off = field_offsets()["worker"]
    return data[:off] + b"\x00" + data[off + 1:]


def test_four_workers_allreduce_bit_exact(rig: Rig) -> None:
    """4 worker processes (worker_lib.transport) allreduce through BMv2: every worker gets the sums of
    the table values of everyone's indices; the RESULTs BMv2 sent equal, byte for byte, what the Python
    aggregator answers to the DATA/NORM packets BMv2 received (from its per-port pcaps)."""
    cfg = JobConfig(job=9, key=0x77665544, workers=4, bits=JOB["bits"], granularity=10, p=1 / 32,
                    elems=JOB["elems"], result_bits=JOB["result_bits"], slots=8)
    chunks, seed = 48, 5
    rig.reload([cfg])
    spec = (f"job={cfg.job},key={cfg.key},workers=4,bits={cfg.bits},granularity=10,p=1/32,elems={cfg.elems},"
            f"result_bits={cfg.result_bits},slots={cfg.slots}")
    out_dir = rig.switch.cfg.workdir / "allreduce"
    out_dir.mkdir(exist_ok=True)
    procs = []
    try:
        for h in rig.star.hosts:
            procs.append(h.ns.popen([sys.executable, "-m", "topologies.worker", "--job", spec, "--worker",
                                     str(h.port), "--aggregator", f"{SERVICE_IP}:{THC_UDP_PORT}", "--bind", h.ip,
                                     "--chunks", str(chunks), "--seed", str(seed), "--out",
                                     str(out_dir / f"w{h.port}.json")],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _out, err = p.communicate(timeout=120)
            assert p.returncode == 0, f"worker failed: {err}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    results = [json.loads((out_dir / f"w{i}.json").read_text()) for i in range(4)]
    values = cfg.values()
    want = sum(values[worker_indices(seed, w, chunks, cfg.elems, cfg.bits)].astype(np.int64) for w in range(4))
    for r in results:
        assert not any(r["lost"]) and r["contributors"] == [4] * chunks
        assert np.array_equal(np.asarray(r["sums"]), want), f"worker {r['worker']}: sums differ from the table sums"
        assert r["norm"] == max(worker_norm(seed, w) for w in range(4))
    # Replay what BMv2 received into the Python aggregator; compare answers byte for byte.
    pcap_dir = rig.switch.pcap_dir
    rx = sorted((ts, d) for i in range(PORTS) for ts, f in read_pcap(pcap_dir / f"s{i}_in.pcap")
                if (d := thc_of(f)) is not None and len(d) >= 4 and int.from_bytes(d[2:4], "big") == cfg.job)
    tx = [d for i in range(PORTS) for _, f in read_pcap(pcap_dir / f"s{i}_out.pcap")
          if (d := thc_of(f)) is not None and len(d) >= 4 and int.from_bytes(d[2:4], "big") == cfg.job]
    assert rx and tx, "no THC packets of the job in BMv2's pcaps"
    ref = ReferenceAggregator([cfg])
    ref_answers = set()
    for _, d in rx:
        ref_answers.update(data for _, data in ref.handle(d))
    bmv2_answers = set(tx)
    completions = {(h.slot, h.round, h.tensor, h.chunk, h.type)
                   for h, _ in map(Header.parse, bmv2_answers) if h.type == PacketType.RESULT}
    assert len(completions) == chunks
    # An answer echoes the worker id of the packet that caused it; which of the four packets completed a
    # round depends on arrival order across ports, which the per-port pcaps' timestamps do not fix. So the
    # worker byte is compared as "one of the contributors"; every other byte must be identical.
    for data in bmv2_answers:
        h, _ = Header.parse(data)
        assert h.bitmap >> h.worker & 1, "an answer echoes a worker that did not contribute"
    assert {mask_worker(d) for d in bmv2_answers} == {mask_worker(d) for d in ref_answers}
    st = rig.ctl.stats()
    assert st["COMPLETED"] == chunks + 1 == int(ref.counters[Counter.COMPLETED])
    assert st["ELEMENTS"] == int(ref.counters[Counter.ELEMENTS]) == 4 * chunks * cfg.elems


def test_reconfiguring_a_job_resets_its_slots(rig: Rig) -> None:
    """A job configured again (new generation) starts from empty slots: a half-done round is forgotten,
    so the next round 0 needs both workers again (no register write: BMv2's P4Runtime has none)."""
    cfg = job_from_mapping(dict(JOB))
    jobs = {cfg.job: cfg}
    rig.reload([cfg])
    hosts = {h.port: h for h in rig.star.hosts}

    def send(worker: int, indices: list[int]) -> list[tuple[int, bytes]]:
        rig.drain()
        payload = scenario_packet({"type": "DATA", "worker": worker, "slot": 0, "round": 0, "indices": indices}, jobs)
        rig.send(worker, frame_from(hosts[worker], payload))
        return rig.collect(0)

    assert send(0, C) == []                      # worker 0 half-fills round 0 of slot 0 ...
    rig.ctl.configure_job(cfg, (0, 1))           # ... then the job is configured again
    assert send(1, B) == []                      # round 0 is fresh: worker 1 alone does not complete it
    got = rig.collect(0) + send(0, A)
    assert sorted(p for p, _ in got) == [0, 1]
    for port, frame in got:
        hdr, payload = Header.parse(unwrap(port, frame, hosts[port]))
        assert hdr.contributors == 2 and np.frombuffer(payload, ">u1").tolist() == A_B


def test_register_reads_are_explained_on_bmv2(rig: Rig) -> None:
    """BMv2's P4Runtime server answers register reads with UNIMPLEMENTED; the error says what to use."""
    rig.reload([])
    with pytest.raises(SwitchRejected, match="does not implement register reads"):
        rig.ctl.read_register("bank_count", 0)
