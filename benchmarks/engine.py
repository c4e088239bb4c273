"""The aggregator's state table alone, numpy engine against compiled engine (no sockets; not a timed test).

``Aggregator.process`` on batches of 256 DATA packets (64 slots x n = 4 workers, 4-bit indices, every
slot completing, rounds advancing batch after batch), for K = 256, 1024 and 8192, both engines
interleaved in one run on one core. Prints packets/s, aggregated elements/s and the compiled/numpy
ratio; the target is >= 1e9 elements/s per core at K = 8192 (issue 16).

    python -m benchmarks.engine [--batches 120] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from aggregator.engine import DEFAULT_STRIDE, Aggregator
from worker_lib.cli.args import int_in
from worker_lib.job import JobConfig
from worker_lib.wire import Header, PacketType, pack_bits
from worker_lib.wire.protocol import Counter

WORKERS, SLOTS_PER_BATCH = 4, 64


def batch(cfg: JobConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch: every worker's packet for 64 slots, round 0 (the caller advances the round field)."""
    rng = np.random.default_rng(seed)
    wires = [Header(**cfg.request_fields(PacketType.DATA, worker=w, slot=s, round=0))
             .pack(pack_bits(rng.integers(0, 16, cfg.elems).astype(np.uint8), 4).tobytes())
             for s in range(SLOTS_PER_BATCH) for w in range(WORKERS)]
    buf = np.zeros((len(wires), DEFAULT_STRIDE), np.uint8)
    for i, w in enumerate(wires):
        buf[i, :len(w)] = np.frombuffer(w, np.uint8)
    return buf, np.array([len(w) for w in wires])


def rate(cfg: JobConfig, compiled: bool, batches: int) -> float:
    """Packets per second of one engine over ``batches`` batches (after one to warm up)."""
    buf, lens = batch(cfg, 0)
    agg = Aggregator([cfg], compiled=compiled)
    t0 = 0.0
    for r in range(batches + 1):
        if r == 1:
            t0 = time.perf_counter()
        buf[:, 14], buf[:, 15] = (r >> 8) & 0xFF, r & 0xFF
        agg.process(buf, lens)
    dt = time.perf_counter() - t0
    if agg.counters[Counter.COMPLETED] != SLOTS_PER_BATCH * (batches + 1):
        raise SystemExit("the benchmark's batches did not all complete: a bug in the benchmark or the engine")
    return batches * len(lens) / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--batches", type=int_in(1, 1_000_000), default=120,
                    help="timed batches per engine and K, 1..1000000 (default 120)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows = []
    for k in (256, 1024, 8192):
        cfg = JobConfig(job=1, key=7, workers=WORKERS, slots=256, elems=k, mtu=9000)
        numpy_rate, compiled_rate = rate(cfg, False, args.batches), rate(cfg, True, args.batches)
        rows.append({"elems": k, "numpy_packets_per_s": numpy_rate, "compiled_packets_per_s": compiled_rate,
                     "compiled_elements_per_s": compiled_rate * k, "ratio": compiled_rate / numpy_rate})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"state table alone, one core, n = {WORKERS}, 4-bit indices, batches of {WORKERS * SLOTS_PER_BATCH}")
    print(f"{'K':>6} {'numpy pkt/s':>12} {'compiled pkt/s':>15} {'compiled elem/s':>16} {'ratio':>6}")
    for r in rows:
        print(f"{r['elems']:>6} {r['numpy_packets_per_s']:>12,.0f} {r['compiled_packets_per_s']:>15,.0f} "
              f"{r['compiled_elements_per_s']:>16.3e} {r['ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
