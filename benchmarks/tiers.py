"""The two-tier state machines alone against the one-tier engine (no sockets; not a timed test).

What ``thc-aggregator --role leaf`` and ``--role spine`` cost per packet. A leaf takes 4 workers' DATA
for 64 slots, forwards 64 PARTIALs and then takes the spine's 64 RESULTs (timed together): the leaf on
the compiled batch engine (``aggregator.leaf_engine.LeafEngine``, what ``--role leaf`` serves) and the
reference leaf (``aggregator.tiers.LeafAggregator``, ``--engine reference``). The reference spine
(``SpineAggregator``) takes 2 leaves' PARTIALs for the same slots. The compiled one-tier engine
(``aggregator.engine.Aggregator``, what a flat ``thc-aggregator`` serves) takes the same DATA packets,
rounds advancing batch after batch, in the same run on the same core. Prints DATA packets/s (a leaf's
time includes its parent's answers) and each role's rate as a ratio of the engine's.

    python -m benchmarks.tiers [--elems 1024] [--batches 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from aggregator.engine import Aggregator
from aggregator.leaf_engine import LeafEngine
from aggregator.tiers import Dest, LeafAggregator, SpineAggregator
from benchmarks.engine import SLOTS_PER_BATCH, batch
from worker_lib.cli.args import int_in
from worker_lib.job import JobConfig
from worker_lib.wire import Header
from worker_lib.wire.protocol import Counter
from worker_lib.wire.serializer import batch_of

LEAVES = 2
WORKERS = 4  #: per leaf


def _packets(buf: np.ndarray, lens: np.ndarray, rnd: int) -> list[bytes]:
    buf[:, 14], buf[:, 15] = (rnd >> 8) & 0xFF, rnd & 0xFF
    return [buf[i, :lens[i]].tobytes() for i in range(len(lens))]


def rates(elems: int, batches: int) -> dict[str, float]:
    """DATA packets per second of the leaf engine, the reference leaf and the compiled one-tier engine,
    PARTIALs per second of the reference spine."""
    tiered = JobConfig(leaves=(WORKERS,) * LEAVES, workers=WORKERS * LEAVES, elems=elems, slots=SLOTS_PER_BATCH,
                       mtu=9000)  # jumbo frames: K up to 8192 at 8-bit sums
    flat = tiered.leaf(0)
    buf, lens = batch(flat, 0)
    leaf, spine, engine = LeafAggregator(0, [tiered]), SpineAggregator([tiered]), Aggregator([flat], compiled=True)
    fast = LeafEngine(0, [tiered], compiled=True)
    local = np.zeros(len(lens), bool)
    leaf_s = fast_s = spine_s = engine_s = 0.0
    for r in range(batches + 1):
        packets = _packets(buf, lens, r)
        t0 = time.perf_counter()
        partials = [p for pkt in packets for d, p in leaf.handle(pkt) if d == Dest.PARENT]
        t1 = time.perf_counter()
        other = [Header.parse(p)[0].replace(worker=1).pack(p[32:]) for p in partials]
        t2 = time.perf_counter()
        results = [p for q in partials + other for fan, p in spine.handle(q) if fan]
        t3 = time.perf_counter()
        engine.process(buf, lens)
        t4 = time.perf_counter()
        for p in results:
            leaf.handle(p, from_parent=True)
        t5 = time.perf_counter()
        out = fast.process(buf, lens, local)
        t6 = time.perf_counter()
        if out.packets() != [(Dest.PARENT, p) for p in partials]:
            raise SystemExit("the leaf engine's partials are not the reference's: a bug")
        rows, rlens = batch_of(results, fast.engine.stride)
        t7 = time.perf_counter()
        fast.process(rows, rlens, np.ones(len(results), bool))
        t8 = time.perf_counter()
        if r:  # the first batch warms up (the engines compile)
            leaf_s += t1 - t0 + t5 - t4
            fast_s += t6 - t5 + t8 - t7
            spine_s += t3 - t2
            engine_s += t4 - t3
    done = SLOTS_PER_BATCH * (batches + 1)
    finished = (leaf.counters[Counter.COMPLETED], int(fast.counters[Counter.COMPLETED]),
                spine.counters[Counter.COMPLETED], engine.counters[Counter.COMPLETED])
    if finished != (done,) * 4:
        raise SystemExit("the benchmark's rounds did not all complete: a bug in the benchmark or the roles")
    n = batches * len(lens)  # DATA packets timed
    return {"elems": elems, "leaf_engine_pps": n / fast_s, "leaf_pps": n / leaf_s,
            "spine_pps": batches * LEAVES * SLOTS_PER_BATCH / spine_s, "engine_pps": n / engine_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tiers", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--elems", type=int_in(8, 8192), default=1024, help="K, indices per packet (default 1024)")
    ap.add_argument("--batches", type=int_in(1, 100_000), default=20, help="batches of 256 DATA packets (default 20)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.elems % 8:
        ap.error("--elems must be a multiple of 8")
    r = rates(args.elems, args.batches)
    r["leaf_engine_vs_engine"] = r["leaf_engine_pps"] / r["engine_pps"]
    r["leaf_vs_engine"] = r["leaf_pps"] / r["engine_pps"]
    r["spine_vs_engine"] = r["spine_pps"] / r["engine_pps"]
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"K = {r['elems']}: leaf engine {r['leaf_engine_pps']:,.0f} DATA/s, reference leaf {r['leaf_pps']:,.0f} "
          f"DATA/s (both with the spine's answers), reference spine {r['spine_pps']:,.0f} PARTIAL/s, compiled "
          f"one-tier engine {r['engine_pps']:,.0f} DATA/s")
    print(f"ratios (same run, same core): leaf engine/engine {r['leaf_engine_vs_engine']:.3f}, reference "
          f"leaf/engine {r['leaf_vs_engine']:.3f}, spine/engine {r['spine_vs_engine']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
