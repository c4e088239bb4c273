"""What one exchange of a tensor's indices costs the worker and the aggregator, on loopback (no torch).

Starts ``thc-aggregator`` and ``--workers`` worker processes on 127.0.0.1; each runs
``Transport.exchange_indices`` of ``--dim`` random b-bit indices ``--warmup`` times, then ``--repeats``
times timed, all workers together. Prints per worker the median wall time and thread CPU of an exchange,
its resends and receive batches, and the aggregator's CPU per exchange over the timed part. The cost of
the transport alone (building the packets, sending, receiving, the answers' bookkeeping), which a DDP
step pays beside the codec: compare two versions of the code by running it in each, alternately (the
machine's speed drifts between minutes).

    python -m benchmarks.exchange                     # 2 workers, 4,191,951 4-bit indices, 30 exchanges
    python -m benchmarks.exchange --workers 4 --dim 1048576 --json
    python -m benchmarks.exchange --no-gro            # without coalesced receives (UDP_GRO)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import subprocess
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import numpy as np

from benchmarks.ddp_netem import cpu_seconds
from launchers.aggregator_process import die_with_parent, listening_port, stop_process
from worker_lib.cli.args import float_in, int_in
from worker_lib.job import JobConfig
from worker_lib.transport import Transport, TransportConfig

ROOT = Path(__file__).resolve().parents[1]


def worker(w: int, address: tuple[str, int], job: JobConfig, args: argparse.Namespace, go: Event,
           out: Queue) -> None:
    """One worker: warm up, say so, wait for ``go``, then time ``args.repeats`` exchanges."""
    with Transport(TransportConfig(job, worker=w, aggregator=address, seed=w + 1, drop_up=args.loss,
                                   drop_down=args.loss, gro=args.gro)) as tr:
        idx = np.random.default_rng(w).integers(0, 1 << job.bits, args.dim, dtype=np.uint8)
        for _ in range(args.warmup):
            tr.exchange_indices(idx)
        out.put(("ready", w, None))
        go.wait()
        rows = []
        for _ in range(args.repeats):
            before = tr.stats.as_dict()
            t0, c0 = time.perf_counter(), time.thread_time()
            tr.exchange_indices(idx)
            after = tr.stats.as_dict()
            rows.append({"wall_s": time.perf_counter() - t0, "cpu_s": time.thread_time() - c0,
                         **{k: after[k] - before[k] for k in ("retransmissions", "receive_batches", "tail_probes")}})
        out.put(("done", w, rows))


def _next(out: Queue, procs: list[mp.Process], timeout: float) -> tuple:
    """The next message of a worker; a worker that died or a wait past ``timeout`` ends the benchmark with
    one line (a dead worker's traceback is above it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a worker failed (its error is above)") from None
    raise SystemExit(f"the workers did not finish within --timeout {timeout} s")


def measure(args: argparse.Namespace) -> dict:
    """Run the exchanges; per worker the medians of its rows, and the aggregator's CPU per exchange."""
    job = JobConfig(job=1, workers=args.workers, bits=args.bits, slots=args.slots)
    agg = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--host", "127.0.0.1", "--port", "0",
                            "--job", job.spec(), "--gro" if args.gro else "--no-gro"], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    procs: list[mp.Process] = []
    try:
        line = agg.stdout.readline() if agg.stdout else ""
        if "listening on" not in line:
            raise SystemExit(f"thc-aggregator did not start (exit code {agg.poll()}): {line.strip()}")
        address = ("127.0.0.1", listening_port(line))
        go, out = mp.Event(), mp.Queue()
        procs = [mp.Process(target=worker, args=(w, address, job, args, go, out)) for w in range(args.workers)]
        for p in procs:
            p.start()
        for _ in procs:
            _next(out, procs, args.timeout)  # every worker warm
        cpu0 = cpu_seconds(agg.pid)
        go.set()
        results = {}
        for _ in procs:
            _, w, rows = _next(out, procs, args.timeout)
            results[w] = rows
        agg_cpu = cpu_seconds(agg.pid) - cpu0
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        stop_process(agg)
    per_worker = [{k: statistics.median(r[k] for r in results[w]) for k in results[w][0]}
                  for w in sorted(results)]
    return {"workers": args.workers, "dim": args.dim, "bits": args.bits, "elems": job.elems, "loss": args.loss,
            "gro": args.gro,
            "repeats": args.repeats, "per_worker": per_worker, "aggregator_cpu_s": agg_cpu / args.repeats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.exchange", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workers", type=int_in(1, 32), default=2, help="worker processes, 1..32 (default 2)")
    ap.add_argument("--dim", type=int_in(1, 1 << 28), default=4191951,
                    help="indices per exchange, 1..268435456 (default 4,191,951: the DDP benchmark's bucket)")
    ap.add_argument("--bits", type=int_in(1, 8), default=4, help="bits per index, 1..8 (default 4)")
    ap.add_argument("--slots", type=int_in(1, 65536), default=512, help="the job's slots, 1..65536 (default 512)")
    ap.add_argument("--repeats", type=int_in(1, 10000), default=30, help="timed exchanges, 1..10000 (default 30)")
    ap.add_argument("--warmup", type=int_in(0, 1000), default=2, help="exchanges before timing, 0..1000 (default 2)")
    ap.add_argument("--timeout", type=int_in(1, 86400), default=600,
                    help="seconds to wait for the workers, 1..86400 (default 600)")
    ap.add_argument("--loss", type=float_in(0, 0.5), default=0.0,
                    help="share of the datagrams each worker drops in each direction (the transport's simulated "
                         "loss), 0..0.5 (default 0): what recovering from loss costs the worker's CPU")
    ap.add_argument("--gro", action=argparse.BooleanOptionalAction, default=True,
                    help="the aggregator and the workers read runs of datagrams as one message each (UDP_GRO; "
                         "default: on, as thc-aggregator and the transport; --no-gro: datagram by datagram)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    res = measure(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{res['workers']} workers, {res['dim']:,} {res['bits']}-bit indices per exchange, K = {res['elems']}, "
          f"{res['loss']:.1%} loss each way, median of {res['repeats']} exchanges"
          f"{'' if res['gro'] else ', without UDP_GRO'}")
    print(f"{'worker':>6} {'wall ms':>8} {'cpu ms':>7} {'resent':>7} {'probes':>7} {'rx batches':>10}")
    for w, r in enumerate(res["per_worker"]):
        print(f"{w:>6} {r['wall_s'] * 1e3:8.1f} {r['cpu_s'] * 1e3:7.1f} {r['retransmissions']:7.0f} "
              f"{r['tail_probes']:7.0f} {r['receive_batches']:10.0f}")
    print(f"aggregator CPU per exchange: {res['aggregator_cpu_s'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
