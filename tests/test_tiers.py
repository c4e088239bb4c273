"""Two tiers (docs/protocol.md, "Two tiers"): the job layout, the leaf's and the spine's state tables row
by row, exactness under loss at every hop, and a two-tier allreduce over loopback UDP.

Expected sums are the table values of the workers' indices added with numpy here, never what the code
under test computes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from aggregator.cli import main as cli_main
from aggregator.engine import Aggregator
from aggregator.leaf_engine import LeafEngine
from aggregator.state import ReferenceAggregator
from aggregator.tiers import Dest, LeafAggregator, SpineAggregator
from launchers.aggregator_process import local_tiers
from tests.cli_support import call_main
from tests.scenarios import TIER_SCENARIOS, check_tier_answer, scenario_packet
from tests.transport_support import opened_runs
from worker_lib.job import JobConfig, JobConfigError, job_from_mapping, parse_job_spec
from worker_lib.transport import AggregatorStateError, UseResults
from worker_lib.wire import Header, PacketType, float_bits, pack_bits
from worker_lib.wire.protocol import Counter, TierCounter

K = 16
JOB = JobConfig(leaves=(3, 5), workers=8, elems=K, slots=4)  # b = 4, g = 30: leaves 8-bit, spine 8-bit
RNG = np.random.default_rng(7)
IDX = RNG.integers(0, 16, (8, K))


def data(cfg: JobConfig, worker: int, slot: int = 1, rnd: int = 0, idx: np.ndarray | None = None) -> bytes:
    """Global worker ``worker``'s DATA as it sends it to its leaf (its local id in the header)."""
    local = cfg.tier_of(worker)[1]
    payload = pack_bits((IDX[worker] if idx is None else idx)[None], cfg.bits).tobytes()
    return Header(**cfg.request_fields(PacketType.DATA, worker=local, slot=slot, round=rnd)).pack(payload)


def norm(cfg: JobConfig, worker: int, value: float, slot: int = 0, rnd: int = 0) -> bytes:
    local = cfg.tier_of(worker)[1]
    return Header(**cfg.request_fields(PacketType.NORM, worker=local, slot=slot, round=rnd)).pack(
        float_bits(value).to_bytes(4, "big"))


def table_sums(cfg: JobConfig, workers: list[int]) -> list[int]:
    return cfg.values()[IDX[workers]].sum(axis=0).tolist()


def sums_of(packet: bytes) -> list[int]:
    hdr, payload = Header.parse(packet)
    return np.frombuffer(payload, {8: ">u1", 16: ">u2", 32: ">u4"}[hdr.width]).astype(int).tolist()


# -- the job layout -------------------------------------------------------------------------------------
def test_layout_numbers_workers_leaf_by_leaf_and_sizes_each_tier() -> None:
    cfg = parse_job_spec("leaves=4:4:8,granularity=30")
    assert cfg.workers == 16
    assert [cfg.tier_of(w) for w in (0, 3, 4, 8, 15)] == [(0, 0), (0, 3), (1, 0), (2, 0), (2, 7)]
    assert cfg.result_bits == 16  # 30 * 16 = 480 > 255
    assert [cfg.partial_bits(leaf) for leaf in range(3)] == [8, 8, 8]  # 30 * 8 = 240 < 256
    assert parse_job_spec("leaves=9:1,granularity=30").partial_bits(0) == 16  # 270
    assert parse_job_spec("leaves=2:2,kind=uncompressed").partial_bits(0) == 32
    leaf = cfg.leaf(2)
    assert (leaf.workers, leaf.threshold, leaf.result_bits, leaf.elems, leaf.tiered) == (8, 8, 16, cfg.elems, False)
    assert leaf.table_id == cfg.table_id
    # results count leaves; workers are the leaves' sizes: {0, 2} = 4 + 8, {1} = 4
    assert cfg.result_counts(np.array([2, 1]), np.array([0b101, 0b010])).tolist() == [12, 4]
    assert parse_job_spec("workers=4").result_counts(np.array([3]), np.array([7])).tolist() == [3]
    big = parse_job_spec("leaves=" + ":".join(["32"] * 32))
    assert (big.workers, big.result_bits) == (1024, 16)


@pytest.mark.parametrize(("spec", "message"), [
    ("leaves=4:4,workers=9", "set workers=8"),
    ("leaves=0:3", "leaves must list"),
    ("leaves=" + ":".join(["1"] * 33), "leaves must list"),
    ("leaves=33", "leaves must list"),
    ("leaves=a:b", r"leaves must be integers \(N:N:\.\.\. in a spec"),
    ("leaves=4:4,multicast=239.1.1.1:5000", "unicast"),
    ("leaves=16:16,granularity=30,result_bits=8", "does not fit 8-bit results"),
])
def test_bad_layouts_are_refused_with_what_to_change(spec: str, message: str) -> None:
    with pytest.raises(JobConfigError, match=message):
        parse_job_spec(spec)


def test_one_tier_aggregators_refuse_a_two_tier_job() -> None:
    for make in (ReferenceAggregator, Aggregator):
        with pytest.raises(JobConfigError, match="--role leaf"):
            make([JOB])
    with pytest.raises(JobConfigError, match="not a two-tier job"):
        SpineAggregator([JobConfig(workers=4)])
    with pytest.raises(JobConfigError, match=r"leaf 2 is not in 0\.\.1"):
        LeafAggregator(2, [JOB])


# -- the leaf -------------------------------------------------------------------------------------------
def test_leaf_forwards_a_full_partial_once_and_again_on_a_retransmission() -> None:
    leaf = LeafAggregator(1, [JOB])
    for w in (3, 4, 5, 6):
        assert leaf.handle(data(JOB, w)) == []
    [(dest, partial)] = leaf.handle(data(JOB, 7))
    assert dest == Dest.PARENT
    hdr = Header.parse(partial)[0]
    assert (hdr.type, hdr.worker, hdr.contributors, hdr.bitmap, hdr.width, hdr.elems) == \
        (PacketType.PARTIAL, 1, 5, 0b11111, 8, K)
    assert (hdr.slot, hdr.round, hdr.job, hdr.key, hdr.table_id) == (1, 0, JOB.job, JOB.key, JOB.table_id)
    assert sums_of(partial) == table_sums(JOB, [3, 4, 5, 6, 7])
    assert leaf.tier_counters[TierCounter.FORWARDED] == 1
    # a worker's retransmission while the spine has not answered: the same partial again
    assert leaf.handle(data(JOB, 5)) == [(Dest.PARENT, partial)]
    assert leaf.tier_counters[TierCounter.FORWARDED_AGAIN] == 1
    assert leaf.counters[Counter.DUPLICATE] == 0


def test_leaf_passes_the_spine_result_down_and_keeps_it_for_retransmissions() -> None:
    leaf, spine = LeafAggregator(0, [JOB]), SpineAggregator([JOB])
    [(_, partial)] = [o for w in (0, 1, 2) for o in leaf.handle(data(JOB, w))]
    assert spine.handle(partial) == []  # leaf 1 has not reported
    other = Header.parse(partial)[0].replace(worker=1, contributors=5, bitmap=0b11111)
    [(fanout, result)] = spine.handle(other.pack(bytes(K)))  # leaf 1's partial: all zeros
    assert fanout is True
    hdr = Header.parse(result)[0]
    assert (hdr.type, hdr.contributors, hdr.bitmap, hdr.worker, hdr.width) == (PacketType.RESULT, 2, 0b11, 1, 8)
    assert sums_of(result) == table_sums(JOB, [0, 1, 2])
    assert leaf.handle(result, from_parent=True) == [(Dest.ALL, result)]
    assert leaf.counters[Counter.COMPLETED] == 1
    # a lost RESULT: the worker's retransmission gets the retained (spine's) result, in its own header
    [(dest, retained)] = leaf.handle(data(JOB, 2))
    rh = Header.parse(retained)[0]
    assert dest == Dest.SENDER and sums_of(retained) == sums_of(result)
    assert (rh.type, rh.worker, rh.contributors, rh.bitmap) == (PacketType.RESULT, 2, 2, 0b11)
    # the spine's answer again (a retransmitted partial's retained result): nothing to do
    assert leaf.handle(result, from_parent=True) == []
    assert leaf.tier_counters[TierCounter.STALE_PARENT] == 1


def test_leaf_checks_what_comes_from_the_parent_and_from_elsewhere() -> None:
    leaf = LeafAggregator(0, [JOB])
    for w in (0, 1, 2):
        leaf.handle(data(JOB, w))
    good = Header(**JOB.request_fields(PacketType.RESULT, slot=1, round=0)).replace(
        elems=K, width=8, contributors=2, bitmap=3).pack(bytes(K))
    assert leaf.handle(good) == []  # a RESULT from a worker's address
    assert leaf.counters[Counter.BAD_TYPE] == 1
    assert leaf.handle(good[:-1], from_parent=True) == []
    assert leaf.counters[Counter.BAD_FORMAT] == 1
    assert leaf.handle(Header.parse(good)[0].replace(key=1).pack(bytes(K)), from_parent=True) == []
    assert leaf.counters[Counter.BAD_KEY] == 1
    assert leaf.handle(data(JOB, 0), from_parent=True) == []  # DATA from the parent
    assert leaf.counters[Counter.BAD_TYPE] == 2
    assert leaf.handle(good, from_parent=True) == [(Dest.ALL, good)]  # the state survived all that


@pytest.mark.parametrize("spine_round", [2, 3])  # the notice's round need not share the bank's parity
def test_leaf_passes_a_spine_straggler_notice_down_and_answers_later_packets_with_it(spine_round: int) -> None:
    leaf = LeafAggregator(0, [JOB])
    [(_, partial)] = [o for w in (0, 1, 2) for o in leaf.handle(data(JOB, w))]
    # the spine's notice: its round, and in bitmap the round of the partial it refuses (0)
    notice = Header.parse(partial)[0].replace(type=PacketType.STRAGGLER, round=spine_round, elems=0, width=0,
                                              contributors=0, bitmap=0).pack()
    [(dest, down)] = leaf.handle(notice, from_parent=True)
    assert dest == Dest.ALL and down == notice  # bitmap 0 already: the one-tier notice
    [(dest, again)] = leaf.handle(data(JOB, 1))
    hdr = Header.parse(again)[0]
    assert dest == Dest.SENDER and (hdr.type, hdr.round, hdr.worker) == (PacketType.STRAGGLER, spine_round, 1)
    assert leaf.counters[Counter.STRAGGLER] == 2
    assert leaf.handle(notice, from_parent=True) == []  # the same notice again: nothing waits for it
    assert leaf.tier_counters[TierCounter.STALE_PARENT] == 1


def test_a_spine_notice_is_for_the_bank_of_the_round_it_names() -> None:
    """The notice names the refused partial's round in ``bitmap``: a notice naming another round (here the
    other bank's, which is not FORWARDED) changes nothing; the workers get the notice with bitmap 0."""
    leaf = LeafAggregator(0, [JOB])
    [(_, p1)] = [o for w in (0, 1, 2) for o in leaf.handle(data(JOB, w, rnd=1))]
    base = Header.parse(p1)[0].replace(type=PacketType.STRAGGLER, round=5, elems=0, width=0, contributors=0)
    assert leaf.handle(base.replace(bitmap=0).pack(), from_parent=True) == []  # round 0 was never forwarded
    assert leaf.handle(base.replace(bitmap=3).pack(), from_parent=True) == []  # round 3: same bank, not its round
    assert leaf.tier_counters[TierCounter.STALE_PARENT] == 2
    assert leaf.handle(base.replace(bitmap=1 << 16 | 1).pack(), from_parent=True) == []  # not a round
    assert leaf.counters[Counter.BAD_FORMAT] == 1
    [(dest, down)] = leaf.handle(base.replace(bitmap=1).pack(), from_parent=True)
    assert dest == Dest.ALL and Header.parse(down)[0] == base.replace(bitmap=0)


def test_the_spine_names_the_refused_partial_round_in_its_notice() -> None:
    spine = SpineAggregator([JOB])
    leaf = LeafAggregator(0, [JOB])
    partials = [o for w in (0, 1, 2) for _, o in leaf.handle(data(JOB, w, rnd=1))]
    newer = Header.parse(partials[0])[0].replace(round=3, worker=1, contributors=5, bitmap=0b11111)
    spine.handle(newer.pack(bytes(JOB.elems * JOB.partial_bits(1) // 8)))  # leaf 1 moved the slot on to round 3
    [(fanout, notice)] = spine.handle(partials[0])
    hdr = Header.parse(notice)[0]
    assert not fanout and (hdr.type, hdr.round, hdr.bitmap, hdr.worker) == (PacketType.STRAGGLER, 3, 1, 0)


@pytest.mark.parametrize("scenario", TIER_SCENARIOS, ids=[s["name"] for s in TIER_SCENARIOS])
@pytest.mark.parametrize("machine", [LeafAggregator, LeafEngine], ids=["reference", "engine"])
def test_tier_scenario_on_the_software_leaves(scenario: dict, machine: type) -> None:
    """The shared two-tier scenarios (tests/scenarios.py, hand-written answers) on the reference leaf and
    the leaf engine; tests/test_bmv2_leaf.py runs the same table on the BMv2 leaf program."""
    cfg = job_from_mapping(dict(scenario["job"]))
    leaf = machine(0, [cfg])
    for n, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']} step {n}"
        send = step["send"]
        outs = leaf.handle(scenario_packet(send, {cfg.job: cfg}), from_parent=send.get("from") == "parent")
        assert len(outs) == len(step["expect"]), f"{where}: {len(outs)} packets out"
        for (dest, data), want in zip(outs, step["expect"], strict=True):
            assert dest.name.lower() == want["to"], f"{where}: to {dest.name}"
            check_tier_answer(data, want, where)
    for name, value in scenario["counters"].items():
        assert leaf.counters[Counter[name]] == value, f"{scenario['name']}: {name}"
    for name, value in scenario["tier_counters"].items():
        assert leaf.tier_counters[TierCounter[name]] == value, f"{scenario['name']}: {name}"
    assert leaf.counters[Counter.RX] == len(scenario["steps"])


# -- the spine ------------------------------------------------------------------------------------------
def partial(cfg: JobConfig, leaf: int, sums: list[int], slot: int = 1, rnd: int = 0, **changes: int) -> bytes:
    n, width = cfg.leaves[leaf], cfg.partial_bits(leaf)
    hdr = Header(**cfg.request_fields(PacketType.PARTIAL, slot=slot, round=rnd)).replace(
        **{"worker": leaf, "contributors": n, "bitmap": (1 << n) - 1, "width": width, **changes})
    dt = {8: ">u1", 16: ">u2", 32: ">i4"}[width]
    return hdr.pack(np.asarray(sums, dt).tobytes())


@pytest.mark.parametrize(("changes", "counter"), [
    ({"worker": 2}, Counter.BAD_WORKER),
    ({"contributors": 4}, Counter.BAD_FORMAT),
    ({"bitmap": 0b11}, Counter.BAD_FORMAT),
    ({"width": 16}, Counter.BAD_FORMAT),
    ({"type": PacketType.DATA}, Counter.BAD_TYPE),
    ({"key": 5}, Counter.BAD_KEY),
    ({"slot": 4}, Counter.BAD_SLOT),
])
def test_spine_drops_partials_that_do_not_match_the_layout(changes: dict, counter: Counter) -> None:
    spine = SpineAggregator([JOB])
    assert spine.handle(partial(JOB, 0, [1] * K, **changes)) == []
    assert spine.counters[counter] == 1 and spine.counters[Counter.ACCEPTED] == 0


def test_spine_sums_leaves_counts_workers_and_answers_duplicates_latecomers_and_stale_rounds() -> None:
    cfg = JobConfig(leaves=(3, 5), workers=8, threshold=3, elems=K, slots=4)
    spine = SpineAggregator([cfg])
    [(fanout, res)] = spine.handle(partial(cfg, 0, list(range(K))))  # 3 workers reach the threshold
    hdr = Header.parse(res)[0]
    assert fanout and (hdr.contributors, hdr.bitmap) == (1, 0b01) and sums_of(res) == list(range(K))
    [(fanout, late)] = spine.handle(partial(cfg, 1, [7] * K))  # the latecomer gets the retained result
    assert not fanout and sums_of(late) == list(range(K)) and spine.counters[Counter.RETAINED] == 1
    spine.handle(partial(cfg, 0, [1] * K, rnd=1, slot=1))
    spine.handle(partial(cfg, 0, [1] * K, rnd=2, slot=1))
    [(fanout, notice)] = spine.handle(partial(cfg, 1, [1] * K, rnd=0, slot=1))  # bank 0 holds round 2
    nh = Header.parse(notice)[0]
    assert not fanout and (nh.type, nh.round, nh.worker) == (PacketType.STRAGGLER, 2, 1)
    full = SpineAggregator([JOB])
    assert full.handle(partial(JOB, 1, [2] * K)) == []
    assert full.handle(partial(JOB, 1, [2] * K)) == []
    assert full.counters[Counter.DUPLICATE] == 1
    [(_, both)] = full.handle(partial(JOB, 0, [3] * K))
    assert sums_of(both) == [5] * K


def test_norms_and_uncompressed_sums_cross_both_tiers() -> None:
    leaves, spine = [LeafAggregator(0, [JOB]), LeafAggregator(1, [JOB])], SpineAggregator([JOB])
    values = [0.5, 3.25, 1.0, 2.0, 7.5, 0.25, 6.0, 1.5]
    results = []
    for w, v in enumerate(values):
        leaf = JOB.tier_of(w)[0]
        for _, p in leaves[leaf].handle(norm(JOB, w, v)):
            results += spine.handle(p)
    [(_, res)] = results
    assert Header.parse(res)[0].type == PacketType.NORM_RESULT
    assert int.from_bytes(Header.parse(res)[1], "big") == float_bits(7.5)
    assert spine.handle(partial(JOB, 0, [0] * 0, slot=2)[:32] + float_bits(-1.0).to_bytes(4, "big")) == []
    cfg = JobConfig(leaves=(2, 1), workers=3, kind="uncompressed", elems=8, slots=2)
    ints = np.array([[-5, 2**31 - 1, 3, 0, 0, 0, 0, 1], [-7, 1, -3, 0, 0, 0, 0, 1], [4, 0, 0, 0, 0, 0, 0, -2]])
    tl, ts = [LeafAggregator(0, [cfg]), LeafAggregator(1, [cfg])], SpineAggregator([cfg])
    out = []
    for w in range(3):
        leaf, local = cfg.tier_of(w)
        pkt = Header(**cfg.request_fields(PacketType.DATA, worker=local, slot=0, round=0)).pack(
            ints[w].astype(">i4").tobytes())
        for _, p in tl[leaf].handle(pkt):
            out += ts.handle(p)
    [(_, res)] = out
    want = ints.sum(axis=0).astype(np.int64).astype(np.int32)  # int32, wrapping as a switch adds
    assert np.frombuffer(Header.parse(res)[1], ">i4").tolist() == want.tolist()


# -- loss at every hop -------------------------------------------------------------------------------------
def run_lossy(cfg: JobConfig, loss: float, seed: int, uses: int) -> tuple[dict, list[LeafAggregator]]:
    """Every worker sends its DATA for ``uses`` consecutive uses and resends until it has each result;
    every packet on every hop (worker-leaf, leaf-spine, both ways) is lost with probability ``loss``.
    Returns {(worker, use): (sums, contributors, bitmap)} and the leaves."""
    rng = np.random.default_rng(seed)
    leaves = [LeafAggregator(leaf, [cfg]) for leaf in range(len(cfg.leaves))]
    spine = SpineAggregator([cfg])
    got: dict = {}
    idx = np.random.default_rng(seed + 1).integers(0, 1 << cfg.bits, (uses, cfg.workers, cfg.elems))

    def lost() -> bool:
        return bool(rng.random() < loss)

    def to_workers(leaf: int, outs: list, sender: int) -> None:
        first = sum(cfg.leaves[:leaf])
        for dest, pkt in outs:
            if dest == Dest.PARENT:
                if lost():
                    continue
                for fanout, answer in spine.handle(pkt):
                    for target in (range(len(leaves)) if fanout else [leaf]):
                        if not lost():
                            to_workers(target, leaves[target].handle(answer, from_parent=True), -1)
                continue
            for local in (range(cfg.leaves[leaf]) if dest == Dest.ALL else [sender]):
                h = Header.parse(pkt)[0]
                w = first + local
                use = h.slot + cfg.slots * h.round  # uses are fresh per slot round here
                if h.type == PacketType.RESULT and not lost():
                    got.setdefault((w, use), (sums_of(pkt), h.contributors, h.bitmap))

    for use in range(uses):
        slot, rnd = use % cfg.slots, use // cfg.slots
        for _ in range(200):  # rounds of retransmission
            missing = [w for w in range(cfg.workers) if (w, use) not in got]
            if not missing:
                break
            for w in missing:
                leaf, local = cfg.tier_of(w)
                if not lost():
                    to_workers(leaf, leaves[leaf].handle(data(cfg, w, slot, rnd, idx[use, w])), local)
        assert not [w for w in range(cfg.workers) if (w, use) not in got], "no recovery after 200 rounds"
    for use in range(uses):
        want = cfg.values()[idx[use]].sum(axis=0).tolist()
        for w in range(cfg.workers):
            assert got[(w, use)] == (want, len(cfg.leaves), (1 << len(cfg.leaves)) - 1), (w, use)
    return got, leaves


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reliable_recovery_is_exact_whatever_hop_loses_packets(seed: int) -> None:
    cfg = JobConfig(leaves=(3, 5, 2), workers=10, elems=K, slots=2)
    _, leaves = run_lossy(cfg, 0.3, seed, uses=6)  # uses 0..5 reuse each slot 3 times
    assert sum(leaf.tier_counters[TierCounter.FORWARDED_AGAIN] for leaf in leaves) > 0  # lost partials resent


# -- over UDP -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("leaf_engine", ["compiled", "reference"])
def test_thc_allreduce_over_two_tiers_is_exact_with_loss_on_every_link(leaf_engine: str) -> None:
    out = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--workers", "6", "--leaves", "2:4",
                          "--dim", "20000", "--steps", "2", "--drop-up", "0.05", "--drop-down", "0.05",
                          "--parent-loss", "0.1", "--leaf-engine", leaf_engine, "--json"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["exact"] is True and s["lost_chunks"] == 0 and s["consistent_average"] is True
    assert s["retransmissions"] > 0 and s["nmse"] < 0.2
    assert s["aggregator"].startswith("spine ") and len(s["aggregator"].split("leaves ")[1].split(",")) == 2


def test_thc_allreduce_takes_the_workers_from_the_leaves() -> None:
    """--leaves 1:2 alone means three workers, as leaves=1:2 in a job spec does (the default of 4 used to be
    refused with 'workers=4 but the leaves hold 3', for a --workers never given)."""
    out = subprocess.run([sys.executable, "-m", "launchers.allreduce", "--leaves", "1:2", "--dim", "3000", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["workers"] == 3 and s["exact"] is True


def test_a_new_run_on_a_two_tier_job_another_run_used_is_refused() -> None:
    """A second run on a two-tier job that a first run used, each opened with its own nonce: where the first
    run left slot 0 two rounds on, the opening draws a straggler notice (before, it was given up and the
    run went on with notices, and retained results of the first run, as its sums); where it left the slot
    one round on, the opening gets the first run's nonce back. Both raise AggregatorStateError at every
    worker. The first run is exact."""
    cfg = JobConfig(leaves=(1, 2), workers=3, slots=8, elems=K)
    idx = np.random.default_rng(5).integers(0, 1 << cfg.bits, (cfg.workers, 20 * K)).astype(np.uint8)

    want = cfg.values()[idx].sum(axis=0)
    for chunks, why in ((20, r"slot 0: a straggler notice for round 0 \(the slot is at round 2\)"),
                        (4, r"slot 0: the run's first use came back with 3\.0, not this run's nonce 2\.5")):
        with local_tiers(cfg) as (_spine, leaves):
            leaf_of = [leaves[cfg.tier_of(w)[0]] for w in range(cfg.workers)]
            for r in opened_runs(cfg, leaf_of, 3.0, idx[:, :chunks * K]):
                assert isinstance(r, UseResults) and not r.lost.any()
                assert np.array_equal(r.sums.reshape(-1), want[:chunks * K]) and (r.contributors == 3).all()
            for r in opened_runs(cfg, leaf_of, 2.5, idx[:, :chunks * K]):
                assert isinstance(r, AggregatorStateError) and re.search(why, str(r)), r


@pytest.mark.parametrize(("args", "message"), [
    (["--role", "leaf", "--job", "leaves=2:2"], "needs --leaf L"),
    (["--role", "spine", "--job", "workers=4"], "has one tier"),
    (["--role", "spine", "--job", "leaves=2:2", "--shards", "2"], "does not take --shards"),
    (["--role", "spine", "--job", "leaves=2:2", "--no-gro"], "does not take --no-gro"),
    (["--role", "spine", "--job", "leaves=2:2", "--leaf", "0"], "are for --role leaf"),
    (["--job", "leaves=2:2"], "--role leaf / --role spine"),
    (["--upstream", "127.0.0.1:9"], "are for --role leaf"),
    (["--role", "spine", "--job", "leaves=2:2", "--engine", "numpy"], "a spine runs the reference"),
    (["--job", "workers=2", "--engine", "reference"], "engine must be compiled or numpy"),
])
def test_thc_aggregator_roles_refuse_what_they_cannot_serve_in_one_line(args: list[str], message: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """thc-aggregator's main in this process (tests/test_aggregator.py runs the command itself)."""
    code, err = call_main(cli_main, ["--port", "0", *args], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
