"""The aggregator's state table alone, numpy engine against compiled engine (no sockets; not a timed test).

``Aggregator.process`` on batches of 64 slots' DATA packets from each of n workers (4-bit indices, every
slot completing, rounds advancing batch after batch), for K = 256, 1024 and 8192, both engines
interleaved in one run on one core. Prints packets/s, aggregated elements/s and the compiled/numpy
ratio; the target is >= 1e9 elements/s per core at K = 8192 (issue 16).

``--slots S`` cycles the batches through a pool of S slots, as a worker's uses do, instead of reusing the
same 64: the banks (S x 2 x K registers) then stream through the cache as in a real job. With it the
compiled engine also runs with int32 banks (``narrow_banks=False``), to show what its narrow banks
(``aggregator.engine.bank_dtype``) save.

    python -m benchmarks.engine [--batches 120] [--workers 4] [--slots 64] [--elems 256,1024,8192] [--json]
    python -m benchmarks.engine --workers 2 --slots 2048 --elems 1440   # the DDP benchmark's job
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from aggregator.engine import DEFAULT_STRIDE, Aggregator
from worker_lib.cli.args import comma_list, int_in
from worker_lib.job import JobConfig
from worker_lib.wire import Header, PacketType, pack_bits
from worker_lib.wire.layout import field_offsets
from worker_lib.wire.protocol import Counter

SLOTS_PER_BATCH = 64


def batch(cfg: JobConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch: every worker's packet for 64 slots, round 0 (the caller sets the slot and round fields)."""
    rng = np.random.default_rng(seed)
    wires = [Header(**cfg.request_fields(PacketType.DATA, worker=w, slot=s, round=0))
             .pack(pack_bits(rng.integers(0, 16, cfg.elems).astype(np.uint8), 4).tobytes())
             for s in range(SLOTS_PER_BATCH) for w in range(cfg.workers)]
    buf = np.zeros((len(wires), DEFAULT_STRIDE), np.uint8)
    for i, w in enumerate(wires):
        buf[i, :len(w)] = np.frombuffer(w, np.uint8)
    return buf, np.array([len(w) for w in wires])


def rate(cfg: JobConfig, batches: int, **engine: bool) -> float:
    """Packets per second of one engine (``Aggregator`` options ``engine``) over ``batches`` batches (after
    one to warm up), batch r on slots 64 r .. 64 r + 63 of the pool (mod S) in round 64 r // S. Only
    ``process`` is timed, not the writing of each batch's slot and round fields."""
    buf, lens = batch(cfg, 0)
    agg = Aggregator([cfg], **engine)
    offsets = field_offsets()
    slot_at, round_at = offsets["slot"], offsets["round"]
    within = np.repeat(np.arange(SLOTS_PER_BATCH), cfg.workers)
    dt = 0.0
    for r in range(batches + 1):
        first = r * SLOTS_PER_BATCH
        slot, rnd = (first + within) % cfg.slots, ((first + within) // cfg.slots) & 0xFFFF
        buf[:, slot_at], buf[:, slot_at + 1] = slot >> 8, slot & 0xFF
        buf[:, round_at], buf[:, round_at + 1] = rnd >> 8, rnd & 0xFF
        t0 = time.perf_counter()
        agg.process(buf, lens)
        if r:
            dt += time.perf_counter() - t0
    if agg.counters[Counter.COMPLETED] != SLOTS_PER_BATCH * (batches + 1):
        raise SystemExit("the benchmark's batches did not all complete: a bug in the benchmark or the engine")
    return batches * len(lens) / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--batches", type=int_in(1, 1_000_000), default=120,
                    help="timed batches per engine and K, 1..1000000 (default 120)")
    ap.add_argument("--workers", type=int_in(1, 32), default=4, help="workers n, 1..32 (default 4)")
    ap.add_argument("--slots", type=int_in(SLOTS_PER_BATCH, 65536), default=SLOTS_PER_BATCH,
                    help=f"the job's slot pool S, {SLOTS_PER_BATCH}..65536, a multiple of {SLOTS_PER_BATCH} "
                         f"(default {SLOTS_PER_BATCH}: every batch on the same slots, banks in the cache)")
    ap.add_argument("--elems", type=comma_list(int_in(8, 8192), "256,1024,8192"), default=[256, 1024, 8192],
                    help="elements per packet K, multiples of 8 in 8..8192, comma-separated (default 256,1024,8192)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    if args.slots % SLOTS_PER_BATCH:
        ap.error(f"--slots must be a multiple of {SLOTS_PER_BATCH}, got {args.slots}")
    if any(k % 8 for k in args.elems):
        ap.error(f"--elems must be multiples of 8, got {args.elems}")
    pooled = args.slots > SLOTS_PER_BATCH
    rows = []
    for k in args.elems:
        cfg = JobConfig(job=1, key=7, workers=args.workers, slots=args.slots, elems=k, mtu=9000)
        numpy_rate, compiled_rate = rate(cfg, args.batches), rate(cfg, args.batches, compiled=True)
        row = {"elems": k, "numpy_packets_per_s": numpy_rate, "compiled_packets_per_s": compiled_rate,
               "compiled_elements_per_s": compiled_rate * k, "ratio": compiled_rate / numpy_rate}
        if pooled:
            row["int32_banks_packets_per_s"] = rate(cfg, args.batches, compiled=True, narrow_banks=False)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"state table alone, one core, n = {args.workers}, 4-bit indices, batches of "
          f"{args.workers * SLOTS_PER_BATCH}, a pool of {args.slots} slots")
    print(f"{'K':>6} {'numpy pkt/s':>12} {'compiled pkt/s':>15} {'compiled elem/s':>16} {'ratio':>6}"
          + (f" {'int32 banks pkt/s':>18} {'narrow/int32':>13}" if pooled else ""))
    for r in rows:
        print(f"{r['elems']:>6} {r['numpy_packets_per_s']:>12,.0f} {r['compiled_packets_per_s']:>15,.0f} "
              f"{r['compiled_elements_per_s']:>16.3e} {r['ratio']:>6.2f}"
              + (f" {r['int32_banks_packets_per_s']:>18,.0f} "
                 f"{r['compiled_packets_per_s'] / r['int32_banks_packets_per_s']:>13.2f}" if pooled else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
