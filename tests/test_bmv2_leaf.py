"""The BMv2 program as the leaf of a two-tier job (compiled with -DTHC_LEAF), in lockstep with the Python
reference leaf (aggregator.tiers.LeafAggregator): every packet in, from a worker or from the parent,
must make BMv2 send exactly the packets the reference sends, byte for byte, on the right ports, and the
counters must end equal.

Rig: tests/test_bmv2_dataplane.py's (a switch namespace, four host namespaces, raw sockets). Hosts h0..h2
are leaf 0's three local workers; h3 plays the parent (the spine) at UDP port SPINE_PORT: what the
switch sends it is captured there, and the parent's answers are sent from there, built by the Python
spine (aggregator.tiers.SpineAggregator) from the partials. Needs root, p4c-bm2-ss and simple_switch_grpc;
skips naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import dpkt
import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from aggregator.p4rt import JobRefused, Uplink
from aggregator.tiers import Dest, LeafAggregator, SpineAggregator
from tests.p4_support import need_tools
from tests.scenarios import JOB, TIER_SCENARIOS, check_tier_answer, scenario_packet
from tests.test_bmv2_dataplane import Rig, frame_from, ipv4_checksum_ok, running_rig, unwrap
from topologies.bmv2 import CompiledProgram, compile_program
from topologies.nsstar import SERVICE_IP, SWITCH_MAC
from worker_lib.job import JobConfig, job_from_mapping
from worker_lib.wire import Header, PacketType, float_bits, pack_bits
from worker_lib.wire.layout import THC_UDP_PORT
from worker_lib.wire.protocol import Counter, TierCounter

K, BITS = JOB["elems"], JOB["bits"]
#: leaf 0 (three workers, this switch) and leaf 1 (two workers, played by the test) under one spine
CFG = JobConfig(job=3, key=0x1EAF0001, leaves=(3, 2), workers=5, bits=BITS, granularity=30, elems=K, slots=4)
SPINE_PORT = 9460
PARENT = 3  #: the host port of the parent
RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def leaf_program(tmp_path_factory) -> CompiledProgram:
    need_tools("p4c-bm2-ss")
    return compile_program(tmp_path_factory.mktemp("thc_leaf"), elems=K, bits=BITS, result_bits=CFG.result_bits,
                           slots=16, jobs=4, leaf=True)


@pytest.fixture(scope="module")
def leaf_rig(leaf_program: CompiledProgram, tmp_path_factory):
    with running_rig(leaf_program, tmp_path_factory.mktemp("bmv2_leaf"), "thclf") as r:
        yield r


def uplink(rig: Rig) -> Uplink:
    """Leaf 0 of two, its parent at host PARENT."""
    h = rig.star.hosts[PARENT]
    return Uplink(leaf=0, leaves=2, ip=h.ip, port=SPINE_PORT, mac=h.mac, out_port=PARENT)


def parent_frame(rig: Rig, payload: bytes) -> bytes:
    """Ethernet/IPv4/UDP from the parent (host PARENT, port SPINE_PORT) to the leaf's service address."""
    h = rig.star.hosts[PARENT]
    return bytes(Ether(src=h.mac, dst=SWITCH_MAC) / IP(src=h.ip, dst=SERVICE_IP)
                 / UDP(sport=SPINE_PORT, dport=THC_UDP_PORT) / Raw(payload))


def reload(rig: Rig, cfg: JobConfig = CFG) -> None:
    """Fresh leaf program, service address, routes, and ``cfg``'s leaf 0 with its workers on ports 0.."""
    rig.ctl.load(rig.program.p4info, rig.program.json)
    rig.ctl.add_service(SERVICE_IP, SWITCH_MAC)
    for prefix, mac, port in rig.star.routes():
        rig.ctl.add_route(prefix, mac, port)
    rig.ctl.configure_leaf(cfg, tuple(range(cfg.leaves[0])), uplink(rig))


def data(worker: int, slot: int, rnd: int, idx: np.ndarray | None = None) -> bytes:
    idx = RNG.integers(0, 1 << BITS, K) if idx is None else idx
    return Header(**CFG.leaf(0).request_fields(PacketType.DATA, worker=worker, slot=slot, round=rnd)).pack(
        pack_bits(idx[None], BITS).tobytes())


def norm(worker: int, slot: int, rnd: int, value: float) -> bytes:
    return Header(**CFG.leaf(0).request_fields(PacketType.NORM, worker=worker, slot=slot, round=rnd)).pack(
        float_bits(value).to_bytes(4, "big"))


def leaf1_partial(like: bytes) -> bytes:
    """Leaf 1's partial for the same use as leaf 0's ``like`` (random sums below g * 2)."""
    hdr = Header.parse(like)[0]
    body = (RNG.integers(0, 60, K).astype(">u1").tobytes() if hdr.type == PacketType.PARTIAL
            else float_bits(0.5).to_bytes(4, "big"))
    return hdr.replace(worker=1, contributors=2, bitmap=0b11).pack(body)


@dataclass
class Lockstep:
    """BMv2 and the reference leaf fed the same packets; ``known``: local workers whose address was learnt."""

    rig: Rig
    ref: LeafAggregator = field(default_factory=lambda: LeafAggregator(0, [CFG]))
    known: set[int] = field(default_factory=set)

    def worker(self, w: int, payload: bytes) -> list[tuple[Dest, bytes]]:
        host = self.rig.star.hosts[w]
        outs = self.ref.handle(payload)
        if self.ref.last_valid is not None:
            self.known.add(self.ref.last_valid.worker)
        self._check(frame_from(host, payload), w, outs, sender=w)
        return outs

    def parent(self, payload: bytes) -> list[tuple[Dest, bytes]]:
        outs = self.ref.handle(payload, from_parent=True)
        self._check(parent_frame(self.rig, payload), PARENT, outs, sender=None)
        return outs

    def _check(self, frame: bytes, port: int, outs: list[tuple[Dest, bytes]], sender: int | None) -> None:
        want: list[tuple[int, bytes]] = []
        for dest, pkt in outs:
            if dest == Dest.PARENT:
                want.append((PARENT, pkt))
            elif dest == Dest.SENDER:
                want.append((sender, pkt))
            else:
                want += [(w, pkt) for w in sorted(self.known)]
        self.rig.drain()
        self.rig.send(port, frame)
        got = [(p, self._unwrap(p, f)) for p, f in self.rig.collect(len(want))]
        assert sorted(got) == sorted(want), f"BMv2 sent {sorted(got)}, the reference {sorted(want)}"

    def _unwrap(self, port: int, frame: bytes) -> bytes:
        return unwrap_any(self.rig, port, frame)


def unwrap_any(rig: Rig, port: int, frame: bytes) -> bytes:
    """The THC bytes of a frame the leaf sent out of ``port``, its L2-L4 headers checked: to a worker's
    learnt address, or to the parent's configured one."""
    hosts = rig.star.hosts
    if port != PARENT:
        return unwrap(port, frame, hosts[port])
    eth = dpkt.ethernet.Ethernet(frame)
    ip, udp = eth.data, eth.data.data
    assert eth.dst == bytes.fromhex(hosts[PARENT].mac.replace(":", ""))
    assert eth.src == bytes.fromhex(SWITCH_MAC.replace(":", ""))
    assert dpkt.utils.inet_to_str(ip.src) == SERVICE_IP and dpkt.utils.inet_to_str(ip.dst) == hosts[PARENT].ip
    assert (udp.sport, udp.dport) == (THC_UDP_PORT, SPINE_PORT)
    assert ipv4_checksum_ok(bytes(frame[14:34])) and ip.len == 20 + udp.ulen
    return bytes(udp.data)


def test_the_leaf_program_forwards_partials_and_passes_the_spine_answers_down(leaf_rig: Rig) -> None:
    reload(leaf_rig)
    ls = Lockstep(leaf_rig)
    spine = SpineAggregator([CFG])
    before, tier_before = leaf_rig.ctl.stats(), leaf_rig.ctl.tier_stats()

    # a data round: the third worker completes it here, the partial goes up; a retransmission resends it
    assert ls.worker(0, data(0, 0, 0)) == []
    ls.worker(1, data(1, 0, 0))
    [(dest, partial)] = ls.worker(2, data(2, 0, 0))
    assert dest == Dest.PARENT and Header.parse(partial)[0].type == PacketType.PARTIAL
    assert ls.worker(1, data(1, 0, 0)) == [(Dest.PARENT, partial)]
    # the spine's result comes down to every local worker; a lost one is answered from the leaf's bank
    spine.handle(partial)
    [(_, result)] = spine.handle(leaf1_partial(partial))
    assert ls.parent(result) == [(Dest.ALL, result)]
    [(dest, retained)] = ls.worker(2, data(2, 0, 0))
    assert dest == Dest.SENDER and Header.parse(retained)[0].type == PacketType.RESULT
    assert ls.parent(result) == []  # a duplicate answer: nothing

    # a norm round
    for w, v in enumerate((1.5, 0.25, 3.0)):
        outs = ls.worker(w, norm(w, 1, 0, v))
    [(_, pnorm)] = outs
    assert Header.parse(pnorm)[0].type == PacketType.PARTIAL_NORM
    spine.handle(pnorm)
    [(_, nres)] = spine.handle(leaf1_partial(pnorm))
    assert ls.parent(nres) == [(Dest.ALL, nres)]

    # the spine's straggler notice, with a round of the other parity: down to the workers, then answers
    for w in range(3):
        outs = ls.worker(w, data(w, 2, 0))
    [(_, p2)] = outs
    refused = Header.parse(p2)[0]  # the spine names the refused partial's round in bitmap
    notice = refused.replace(type=PacketType.STRAGGLER, round=3, elems=0, width=0, contributors=0,
                             bitmap=refused.round)
    assert ls.parent(notice.pack()) == [(Dest.ALL, notice.replace(bitmap=0).pack())]
    [(_, again)] = ls.worker(0, data(0, 2, 0))
    assert Header.parse(again)[0].round == 3

    # what the parent may not send, and the parent's packets from elsewhere
    ls.worker(0, result)                                  # a RESULT from a worker's address: bad_type
    ls.parent(result[:-1])                                # truncated: bad_format
    ls.parent(Header.parse(result)[0].replace(worker=2).pack(Header.parse(result)[1]))  # leaf 2 of 2: bad_worker
    ls.parent(data(0, 0, 0))                              # DATA from the parent: bad_type
    ls.parent(Header.parse(result)[0].replace(round=1).pack(Header.parse(result)[1]))  # no such round: stale

    after, tier_after = leaf_rig.ctl.stats(), leaf_rig.ctl.tier_stats()
    for c in Counter:
        assert after[c.name] - before[c.name] == ls.ref.counters[c], f"counter {c.label}"
    for c in TierCounter:
        assert tier_after[c.name] - tier_before[c.name] == ls.ref.tier_counters[c], f"tier counter {c.label}"
    assert ls.ref.counters[Counter.BAD_TYPE] == 2 and ls.ref.counters[Counter.BAD_WORKER] == 1
    assert ls.ref.tier_counters[TierCounter.STALE_PARENT] == 2


@pytest.mark.parametrize("scenario", TIER_SCENARIOS, ids=[s["name"] for s in TIER_SCENARIOS])
def test_tier_scenario_on_the_bmv2_leaf(leaf_rig: Rig, scenario: dict) -> None:
    """The shared two-tier scenarios (tests/scenarios.py, hand-written answers), as tests/test_tiers.py
    runs them on the reference leaf: each packet in makes exactly the listed packets out, on the listed
    ports ("all": each local worker whose address was learnt, which the reference run beside it tells)."""
    cfg = job_from_mapping(dict(scenario["job"]))
    reload(leaf_rig, cfg)
    learner = LeafAggregator(0, [cfg])
    known: set[int] = set()
    before, tier_before = leaf_rig.ctl.stats(), leaf_rig.ctl.tier_stats()
    hosts = leaf_rig.star.hosts
    for n, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']} step {n}"
        send = step["send"]
        pkt = scenario_packet(send, {cfg.job: cfg})
        from_parent = send.get("from") == "parent"
        learner.handle(pkt, from_parent=from_parent)
        if learner.last_valid is not None:
            known.add(learner.last_valid.worker)
        port = PARENT if from_parent else send["worker"]
        expected = []
        for want in step["expect"]:
            ports = {"parent": [PARENT], "sender": [port], "all": sorted(known)}[want["to"]]
            expected += [(p, want) for p in ports]
        leaf_rig.drain()
        leaf_rig.send(port, parent_frame(leaf_rig, pkt) if from_parent else frame_from(hosts[port], pkt))
        got = sorted(leaf_rig.collect(len(expected)), key=lambda x: x[0])
        assert [p for p, _ in got] == sorted(p for p, _ in expected), f"{where}: ports {[p for p, _ in got]}"
        for (p, frame), (_, want) in zip(got, sorted(expected, key=lambda x: x[0]), strict=True):
            check_tier_answer(unwrap_any(leaf_rig, p, frame), want, f"{where} port {p}")
    after, tier_after = leaf_rig.ctl.stats(), leaf_rig.ctl.tier_stats()
    for name, value in scenario["counters"].items():
        assert after[name] - before[name] == value, f"{scenario['name']}: {name}"
    for name, value in scenario["tier_counters"].items():
        assert tier_after[name] - tier_before[name] == value, f"{scenario['name']}: {name}"
    assert after["RX"] - before["RX"] == len(scenario["steps"])


def test_random_traffic_from_workers_and_parent_stays_in_lockstep(leaf_rig: Rig) -> None:
    """Rounds of random length on four slots: workers send, resend and fall behind; the parent answers
    some partials (sometimes twice), drops others and sends stale answers."""
    reload(leaf_rig)
    ls = Lockstep(leaf_rig)
    spine = SpineAggregator([CFG])
    answers: list[bytes] = []
    rng = np.random.default_rng(5)
    rounds = [0, 0, 0, 0]
    for _ in range(60):
        slot = int(rng.integers(0, 4))
        if rng.random() < 0.25 and answers:
            ls.parent(answers[int(rng.integers(0, len(answers)))])
            continue
        if rng.random() < 0.2:
            rounds[slot] += 1
        w = int(rng.integers(0, 3))
        rnd = max(0, rounds[slot] - int(rng.integers(0, 2)))
        for dest, pkt in ls.worker(w, data(w, slot, rnd, np.full(K, w + 1))):
            if dest == Dest.PARENT and rng.random() < 0.8:
                spine.handle(pkt)
                answers += [p for _, p in spine.handle(leaf1_partial(pkt))]
    assert ls.ref.tier_counters[TierCounter.FORWARDED] > 0 and ls.ref.counters[Counter.COMPLETED] > 0


def test_the_one_tier_program_refuses_to_serve_a_leaf(leaf_rig: Rig, tmp_path) -> None:
    """configure_leaf needs the leaf program, and a job whose leaf width is the program's."""
    reload(leaf_rig)
    wide = JobConfig(job=4, leaves=(9, 2), workers=11, bits=BITS, granularity=30, elems=K, slots=4, result_bits=16)
    with pytest.raises(JobRefused, match="partials need 16-bit sums"):
        leaf_rig.ctl.configure_leaf(wide, tuple(range(9)), uplink(leaf_rig))
    flat = compile_program(tmp_path, elems=K, bits=BITS, result_bits=CFG.result_bits, slots=16, jobs=4)
    leaf_rig.ctl.load(flat.p4info, flat.json)
    with pytest.raises(JobRefused, match="not the leaf program"):
        leaf_rig.ctl.configure_leaf(CFG, (0, 1, 2), uplink(leaf_rig))


def test_thc_switch_configures_a_leaf_from_the_command_line(leaf_rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    """``thc-switch job --leaf 0 --upstream ...`` installs the leaf's job and uplink: the third worker's DATA
    then goes up to the parent as the reference's PARTIAL. (Last in this module: the command line's
    controller takes the primary role from the rig's.)"""
    from aggregator.switch.cli import main as thc_switch

    leaf_rig.ctl.load(leaf_rig.program.p4info, leaf_rig.program.json)
    leaf_rig.ctl.add_service(SERVICE_IP, SWITCH_MAC)
    h = leaf_rig.star.hosts[PARENT]
    base = ["--switch", leaf_rig.switch.address.target, "--election-id", "2", "job", "--job", CFG.spec(),
            "--ports", "0,1,2", "--leaf", "0"]
    assert thc_switch(base) == 1
    assert "--upstream, --upstream-mac, --upstream-port (one of its leaves)" in capsys.readouterr().err
    assert thc_switch([*base, "--upstream", f"{h.ip}:{SPINE_PORT}", "--upstream-mac", h.mac,
                       "--upstream-port", str(PARENT)]) == 0
    assert '"role": "leaf 0"' in capsys.readouterr().out
    ls = Lockstep(leaf_rig)
    ls.worker(0, data(0, 0, 0))
    ls.worker(1, data(1, 0, 0))
    [(dest, _)] = ls.worker(2, data(2, 0, 0))
    assert dest == Dest.PARENT
