"""One THC worker for the BMv2 topologies: the norm stage, then C chunks of seeded random indices
through the aggregator with the worker transport (worker_lib.transport), results as JSON.

Run inside a host's namespace (the switch answers the address it learns from the worker's packets)::

    python -m topologies.worker --job 'job=1,key=0x54484321,workers=4,elems=32,result_bits=8' \\
        --worker 0 --aggregator 10.0.0.100:9451 --bind 10.0.0.1 --chunks 64 --seed 7 --out w0.json

The indices are ``worker_indices(seed, worker, chunks, K, b)``, so whoever checks the sums can rebuild
every worker's packets without talking to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from pathlib import Path

import numpy as np

from worker_lib.cli.args import MAX_SEED, comma_list, float_in, host_port, int_in
from worker_lib.job import JobConfig, JobConfigError, parse_job_spec
from worker_lib.transport import AggregatorStateError, AggregatorUnreachable, Transport, TransportConfig
from worker_lib.wire.layout import THC_UDP_PORT

log = logging.getLogger(__name__)

#: Bound of the topologies' --chunks (shared by topologies.star and topologies.tree, whose workers get it;
#: their --seed takes worker_lib.cli.args.MAX_SEED): a run of a million chunks takes minutes through BMv2.
MAX_CHUNKS = 1 << 20


def worker_indices(seed: int, worker: int, chunks: int, elems: int, bits: int) -> np.ndarray:
    """The (chunks, K) uint8 indices worker ``worker`` sends (deterministic in seed and worker)."""
    rng = np.random.default_rng([seed, worker])
    return rng.integers(0, 1 << bits, size=(chunks, elems), dtype=np.uint8)


def worker_norm(seed: int, worker: int) -> float:
    """The norm worker ``worker`` publishes (a float32-exact positive value)."""
    return float(np.float32(1.0 + ((seed * 31 + worker * 7) % 64) / 8.0))


def check_results(cfg: JobConfig, seed: int, chunks: int, results: list[dict]) -> dict:
    """Whether every worker's JSON holds the sums of the table values of all the job's workers' indices (no
    chunk lost, every worker counted) and the largest norm; with the retransmissions and the slowest
    data stage. Shared by the topologies' checks."""
    values = cfg.values()
    want = sum(values[worker_indices(seed, w, chunks, cfg.elems, cfg.bits)].astype(np.int64)
               for w in range(cfg.workers))
    ok = all(np.array_equal(np.asarray(r["sums"]), want) and not any(r["lost"])
             and set(r["contributors"]) == {cfg.threshold} for r in results)
    norm_ok = all(r["norm"] == max(worker_norm(seed, w) for w in range(cfg.workers)) for r in results)
    return {"workers": cfg.workers, "chunks": chunks, "K": cfg.elems, "sums_exact": ok, "norm_exact": norm_ok,
            "retransmissions": sum(r["stats"]["retransmissions"] for r in results),
            "seconds": max(r["seconds_data"] for r in results)}


def collect(procs: list, outputs: list[Path], timeout: float = 300.0) -> list[dict]:
    """Wait for the worker processes (killing what is left on the way out) and read their JSON outputs;
    RuntimeError naming the first that failed."""
    try:
        for w, p in enumerate(procs):
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"worker {w} failed: {(err or '').strip()}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [json.loads(path.read_text()) for path in outputs]


def run_worker(cfg: JobConfig, worker: int, aggregator: tuple[str, int], bind: str, chunks: int, seed: int,
               timeout: float = 0.2, deadline: float = 20.0,
               more_aggregators: tuple[tuple[str, int], ...] = ()) -> dict:
    """Norm stage + ``chunks`` chunks; returns the max norm, sums, contributors, bitmaps, losses, timing.
    ``more_aggregators``: members 1.. where several aggregators share the job's slots."""
    tcfg = TransportConfig(cfg, worker=worker, aggregator=aggregator, more_aggregators=more_aggregators,
                           bind_host=bind, timeout=timeout, deadline=deadline)
    idx = worker_indices(seed, worker, chunks, cfg.elems, cfg.bits)
    with Transport(tcfg) as tr:
        t0 = time.perf_counter()
        norm, norm_contrib = tr.exchange_norm(worker_norm(seed, worker), tensor=1)
        t1 = time.perf_counter()
        res = tr.exchange_indices(idx, tensor=1)
        t2 = time.perf_counter()
        stats = tr.stats.as_dict()
    return {"worker": worker, "norm": norm, "norm_contributors": norm_contrib,
            "sums": res.sums.astype(int).tolist(), "contributors": res.contributors.astype(int).tolist(),
            "bitmap": res.bitmap.astype(int).tolist(), "lost": res.lost.astype(bool).tolist(),
            "seconds_norm": t1 - t0, "seconds_data": t2 - t1, "stats": stats}


def local_address(text: str) -> str:
    """An argparse type: an IPv4 address of this host (its namespace) the worker's socket can bind, or
    0.0.0.0; else one clear line, here rather than as the transport's bare socket error."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((text, 0))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"not an IPv4 address of this host: {text!r} "
                                         f"({exc.strerror or exc})") from None
    return text


def main(argv: list[str] | None = None) -> int:
    """CLI: run one worker and write its results as JSON (stdout or --out)."""
    ap = argparse.ArgumentParser(prog="python -m topologies.worker", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--job", required=True, help="job spec, key=value pairs as for thc-aggregator --job")
    ap.add_argument("--worker", type=int, required=True, help="this worker's id")
    ap.add_argument("--aggregator", default=[("10.0.0.100", THC_UDP_PORT)],
                    type=comma_list(host_port, "10.0.0.100:9451,10.0.0.101:9451"),
                    help="HOST:PORT of the aggregator; several, comma-separated, in member order (thc-aggregator "
                         "--member I/N on each)")
    ap.add_argument("--bind", type=local_address, default="0.0.0.0",
                    help="local address to send from, an IPv4 address of this host (default: any)")
    ap.add_argument("--chunks", type=int_in(1, MAX_CHUNKS), default=16,
                    help=f"chunks of K indices to aggregate, 1..{MAX_CHUNKS}")
    ap.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                    help=f"seed of the indices (see worker_indices), 0..{MAX_SEED}")
    ap.add_argument("--timeout", type=float_in(1e-4, 60), default=0.2,
                    help="retransmit timeout, s, 0.0001..60, until the round trip is measured "
                         "(then 3 round trips, at least min(2 ms, this)); zero-fill: always this")
    ap.add_argument("--deadline", type=float_in(0.01, 86400), default=20.0,
                    help="give up after this long without answers, s, 0.01..86400")
    ap.add_argument("--out", type=Path, help="write the JSON here instead of stdout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        cfg = parse_job_spec(args.job)
        out = run_worker(cfg, args.worker, args.aggregator[0], args.bind, args.chunks, args.seed, args.timeout,
                         args.deadline, more_aggregators=tuple(args.aggregator[1:]))
    except (JobConfigError, AggregatorUnreachable, AggregatorStateError, ValueError, OSError) as exc:
        sys.stderr.write(f"worker {args.worker}: {exc}\n")
        return 1
    text = json.dumps(out)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
