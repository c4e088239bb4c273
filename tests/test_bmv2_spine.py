"""The BMv2 program as the spine of a two-tier job (compiled with -DTHC_SPINE), in lockstep with the Python
reference spine (aggregator.tiers.SpineAggregator): every partial in must make BMv2 send exactly the
packets the reference sends, byte for byte, on the right ports, and the counters must end equal.

Rig: tests/test_bmv2_dataplane.py's. Hosts h0..h2 play the job's three leaves (leaf l on port l), sending
PARTIAL / PARTIAL_NORM as a leaf does. Needs root, p4c-bm2-ss and simple_switch_grpc; skips naming what is
missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from aggregator.p4rt import JobRefused
from aggregator.tiers import SpineAggregator
from tests.p4_support import need_tools
from tests.scenarios import JOB
from tests.test_bmv2_dataplane import Rig, frame_from, running_rig, unwrap
from topologies.bmv2 import CompiledProgram, compile_program
from topologies.nsstar import SERVICE_IP, SWITCH_MAC
from worker_lib.job import JobConfig
from worker_lib.wire import Header, PacketType, float_bits
from worker_lib.wire.protocol import Counter

K, BITS = JOB["elems"], JOB["bits"]
LEAVES = (2, 3, 1)
CFG = JobConfig(job=7, key=0x5B14E001, leaves=LEAVES, workers=6, bits=BITS, granularity=30, elems=K, slots=4)
#: the same layout completing at 5 workers: leaves 0 and 1 suffice, leaf 2 is a latecomer
CFG5 = JobConfig(job=8, key=0x5B14E002, leaves=LEAVES, workers=6, threshold=5, bits=BITS, granularity=30,
                 elems=K, slots=4)


@pytest.fixture(scope="module")
def spine_program(tmp_path_factory) -> CompiledProgram:
    need_tools("p4c-bm2-ss")
    return compile_program(tmp_path_factory.mktemp("thc_spine"), elems=K, bits=BITS, result_bits=CFG.result_bits,
                           slots=16, jobs=4, spine=True)


@pytest.fixture(scope="module")
def spine_rig(spine_program: CompiledProgram, tmp_path_factory):
    with running_rig(spine_program, tmp_path_factory.mktemp("bmv2_spine"), "thcsp") as r:
        yield r


def reload(rig: Rig, *jobs: JobConfig) -> None:
    rig.ctl.load(rig.program.p4info, rig.program.json)
    rig.ctl.add_service(SERVICE_IP, SWITCH_MAC)
    for cfg in jobs:
        rig.ctl.configure_spine(cfg, tuple(range(len(cfg.leaves))))


def partial(cfg: JobConfig, leaf: int, slot: int, rnd: int, sums: list[int] | None = None,
            norm: float | None = None, **changes: int) -> bytes:
    """Leaf ``leaf``'s PARTIAL (``sums``) or PARTIAL_NORM (``norm``), as a leaf sends it."""
    n = cfg.leaves[leaf]
    typ = PacketType.PARTIAL_NORM if norm is not None else PacketType.PARTIAL
    hdr = Header(**cfg.request_fields(typ, slot=slot, round=rnd)).replace(
        **{"worker": leaf, "contributors": n, "bitmap": (1 << n) - 1, "width": 32 if norm is not None else 8,
           "elems": 1 if norm is not None else K, **changes})
    body = float_bits(norm).to_bytes(4, "big") if norm is not None else np.asarray(sums, ">u1").tobytes()
    return hdr.pack(body)


@dataclass
class Lockstep:
    """BMv2 and the reference spine fed the same partials; ``known``: leaves whose address was learnt."""

    rig: Rig
    jobs: tuple[JobConfig, ...]
    ref: SpineAggregator = field(init=False)
    known: dict[int, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ref = SpineAggregator(list(self.jobs))

    def send(self, leaf: int, pkt: bytes) -> list[tuple[bool, bytes]]:
        outs = self.ref.handle(pkt)
        if self.ref.last_valid is not None:
            self.known.setdefault(self.ref.last_valid.job, set()).add(self.ref.last_valid.worker)
        want = []
        for fanout, data in outs:
            job = int.from_bytes(data[2:4], "big")
            want += [(p, data) for p in sorted(self.known.get(job, ()))] if fanout else [(leaf, data)]
        hosts = self.rig.star.hosts
        self.rig.drain()
        self.rig.send(leaf, frame_from(hosts[leaf], pkt))
        got = [(p, unwrap(p, f, hosts[p])) for p, f in self.rig.collect(len(want))]
        assert sorted(got) == sorted(want), f"BMv2 sent {sorted(got)}, the reference {sorted(want)}"
        return outs


def sums(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 60, K).tolist()


def test_the_spine_program_sums_leaves_and_answers_them_all(spine_rig: Rig) -> None:
    reload(spine_rig, CFG, CFG5)
    ls = Lockstep(spine_rig, (CFG, CFG5))
    before = spine_rig.ctl.stats()
    # a full round: the third leaf completes it, the RESULT (its contributors: 3 leaves) goes to all three
    assert ls.send(0, partial(CFG, 0, 0, 0, sums(1))) == []
    assert ls.send(0, partial(CFG, 0, 0, 0, sums(1))) == []  # a duplicate adds nothing
    ls.send(1, partial(CFG, 1, 0, 0, sums(2)))
    [(fanout, res)] = ls.send(2, partial(CFG, 2, 0, 0, sums(3)))
    hdr, body = Header.parse(res)
    assert fanout and (hdr.contributors, hdr.bitmap) == (3, 0b111)
    assert np.frombuffer(body, ">u1").tolist() == (np.array(sums(1)) + sums(2) + sums(3)).tolist()
    [(fanout, again)] = ls.send(1, partial(CFG, 1, 0, 0, sums(2)))  # a lost RESULT: retained, unicast
    assert not fanout and Header.parse(again)[1] == body
    # a norm round
    for leaf, v in enumerate((1.5, 6.0, 2.5)):
        outs = ls.send(leaf, partial(CFG, leaf, 1, 0, norm=v))
    assert int.from_bytes(Header.parse(outs[0][1])[1], "big") == float_bits(6.0)
    # threshold 5 of 6: leaves 0 and 1 complete it; leaf 2 is a latecomer and gets the retained result
    ls.send(0, partial(CFG5, 0, 0, 0, sums(4)))
    [(fanout, res5)] = ls.send(1, partial(CFG5, 1, 0, 0, sums(5)))
    assert fanout and Header.parse(res5)[0].contributors == 2
    [(fanout, late)] = ls.send(2, partial(CFG5, 2, 0, 0, sums(6)))
    assert not fanout and Header.parse(late)[1] == Header.parse(res5)[1]
    # rounds 1 and 2 of slot 2 complete without leaf 2; its round 0 then finds bank 0 at round 2: a notice
    for rnd in (1, 2):
        ls.send(0, partial(CFG5, 0, 2, rnd, sums(7)))
        ls.send(1, partial(CFG5, 1, 2, rnd, sums(8)))
    [(fanout, notice)] = ls.send(2, partial(CFG5, 2, 2, 0, sums(9)))
    assert not fanout and Header.parse(notice)[0].type == PacketType.STRAGGLER
    # what a spine drops: a wrong worker count or bitmap, a fourth leaf, DATA, a negative norm
    ls.send(0, partial(CFG, 0, 3, 0, sums(1), contributors=3))
    ls.send(0, partial(CFG, 0, 3, 0, sums(1), bitmap=0b1))
    ls.send(0, partial(CFG, 0, 3, 0, sums(1), worker=3))
    ls.send(0, partial(CFG, 0, 3, 0, sums(1), type=PacketType.DATA))
    ls.send(2, partial(CFG, 2, 3, 1, norm=-1.0))
    after = spine_rig.ctl.stats()
    for c in Counter:
        assert after[c.name] - before[c.name] == ls.ref.counters[c], f"counter {c.label}"
    assert [ls.ref.counters[c] for c in (Counter.BAD_FORMAT, Counter.BAD_WORKER, Counter.BAD_TYPE, Counter.BAD_NORM,
                                         Counter.STRAGGLER)] == [2, 1, 1, 1, 1]


def test_random_partials_stay_in_lockstep(spine_rig: Rig) -> None:
    """Leaves that resend, fall behind and skip rounds on four slots."""
    reload(spine_rig, CFG5)
    ls = Lockstep(spine_rig, (CFG5,))
    rng = np.random.default_rng(3)
    rounds = [0, 0, 0, 0]
    for k in range(80):
        slot = int(rng.integers(0, 4))
        if rng.random() < 0.25:
            rounds[slot] += 1
        leaf = int(rng.integers(0, 3))
        rnd = max(0, rounds[slot] - int(rng.integers(0, 3)))
        ls.send(leaf, partial(CFG5, leaf, slot, rnd, sums(k)) if rng.random() < 0.8
                else partial(CFG5, leaf, slot, rnd, norm=float(k)))
    assert ls.ref.counters[Counter.COMPLETED] > 0 and ls.ref.counters[Counter.RETAINED] > 0


def test_configure_spine_refuses_what_the_program_cannot_serve(spine_rig: Rig) -> None:
    reload(spine_rig)
    wide = JobConfig(job=9, leaves=(9, 9), workers=18, bits=BITS, granularity=30, elems=K, slots=4)
    with pytest.raises(JobRefused, match="spine program adds 8-bit ones"):
        spine_rig.ctl.configure_spine(wide, (0, 1))
    with pytest.raises(JobRefused, match="has one tier"):
        spine_rig.ctl.configure_spine(JobConfig(job=9, workers=2, bits=BITS, elems=K, result_bits=8), (0, 1))


def test_thc_switch_configures_the_spine_from_the_command_line(spine_rig: Rig,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``thc-switch job --spine`` installs the spine's job and leaf sizes: two leaves' partials complete a
    round. (Last in this module: the command line's controller takes the primary role from the rig's.)"""
    from aggregator.switch.cli import main as thc_switch

    reload(spine_rig)
    assert thc_switch(["--switch", spine_rig.switch.address.target, "--election-id", "2", "job", "--job",
                       CFG5.spec(), "--ports", "0,1,2", "--spine"]) == 0
    assert '"role": "spine"' in capsys.readouterr().out
    ls = Lockstep(spine_rig, (CFG5,))
    ls.send(0, partial(CFG5, 0, 0, 0, sums(1)))
    [(fanout, _)] = ls.send(1, partial(CFG5, 1, 0, 0, sums(2)))
    assert fanout
