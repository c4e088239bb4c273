"""``thc-allreduce``: N worker processes allreduce random gradients through a THC aggregator.

Starts ``thc-aggregator`` on a free loopback port (unless ``--aggregator HOST:PORT`` names a running
one), runs the workers, then replays every worker's indices through the in-process reference state
machine and checks that the integer sums each worker received are bit for bit the reference's. It
prints a one-screen summary, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aggregator.engine import Aggregator
from launchers.aggregator_process import die_with_parent, local_aggregator, local_tiers
from worker_lib.cli.args import comma_list, float_in, fraction, host_port, int_in
from worker_lib.job import DEFAULT_JOB_ID, DEFAULT_KEY, JobConfig, JobConfigError, job_from_mapping
from worker_lib.pacing import TAIL_DUPLICATES
from worker_lib.wire.bits import pack_bits
from worker_lib.wire.layout import MAX_MTU, PacketType
from worker_lib.wire.serializer import build_batch, decode_sums, header_view


@dataclass
class RunSpec:
    """Everything a worker process needs."""

    job: JobConfig
    aggregators: list[tuple[str, int]]  #: the members serving the job, in member order
    shards: int
    dim: int
    steps: int
    seed: int
    loss_policy: str
    drop_up: float
    drop_down: float
    timeout: float
    deadline: float
    outdir: str
    nonce: float  #: the run's nonce (``Transport.open_run``): drawn once per run, the same for every worker
    multicast: str | None = None
    retries: int = 3
    pcap: Path | None = None  #: per-worker captures (FILE.worker<w>.pcap) when the aggregator is not ours
    leaf_addresses: list[tuple[str, int]] | None = None  #: two tiers: leaf l's address (the workers' aggregators)
    gro: bool = True  #: workers (and the aggregators started here) read runs of answers whole (UDP_GRO)
    tail_duplicates: int = TAIL_DUPLICATES  #: TransportConfig.tail_duplicates


WORKER_MODULES = ("torch", "worker_lib.allreduce", "worker_lib.thc", "worker_lib.transport")


def gradient(seed: int, worker: int, dim: int, step: int):  # -> torch.Tensor
    """The random gradient of a worker at a step (normal, with a per-worker scale)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + worker * 7919 + step)
    return torch.randn(dim, generator=g) * (1.0 + 0.25 * worker)


def _worker(spec: RunSpec, worker: int, barrier: mp.synchronize.Barrier) -> None:
    """Body of one worker process: allreduce, then save what it sent and received."""
    import torch

    from worker_lib.allreduce import THCAllreduce
    from worker_lib.thc import THCConfig
    from worker_lib.transport import Transport, TransportConfig

    die_with_parent()
    torch.set_num_threads(1)
    cfg = spec.job
    aggregators = [spec.leaf_addresses[cfg.tier_of(worker)[0]]] if spec.leaf_addresses else spec.aggregators
    tcfg = TransportConfig(cfg, worker=worker, aggregator=aggregators[0],
                           more_aggregators=tuple(aggregators[1:]), shards=spec.shards,
                           loss_policy=spec.loss_policy, timeout=spec.timeout, deadline=spec.deadline,
                           drop_up=spec.drop_up, drop_down=spec.drop_down, seed=spec.seed,
                           multicast=spec.multicast, retries=spec.retries, gro=spec.gro,
                           tail_duplicates=spec.tail_duplicates,
                           pcap=worker_pcap(spec.pcap, worker) if spec.pcap is not None else None)
    out = Path(spec.outdir)
    try:
        with Transport(tcfg) as tr:
            tr.open_run(spec.nonce)  # refuses a job that another run left on a running aggregator
            ar = THCAllreduce(tr, THCConfig(bits=cfg.bits, granularity=cfg.granularity, p=cfg.p),
                              seed=spec.seed * 31 + worker)
            grads = [gradient(spec.seed, worker, spec.dim, s) for s in range(spec.steps)]
            barrier.wait(timeout=60)
            t0 = time.perf_counter()
            results = [ar.allreduce(grads[s], tensor=0, step=s) for s in range(spec.steps)]
            seconds = time.perf_counter() - t0
        last = results[-1]
        np.savez(out / f"worker{worker}.npz", indices=np.stack([r.indices for r in results]),
                 sums=np.stack([r.sums for r in results]), contributors=np.stack([r.contributors for r in results]),
                 lost=np.stack([r.lost for r in results]), bitmap=np.stack([r.bitmap for r in results]),
                 average=last.average.numpy(), max_norm=last.max_norm,
                 seconds=seconds, stats=json.dumps(tr.stats.as_dict()))
    except Exception as exc:  # reported by the parent
        (out / f"worker{worker}.err").write_text(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from exc


def member_pcap(path: Path | None, member: int, members: int) -> Path | None:
    """Where started aggregator ``member`` writes its capture: ``path`` itself when it is the only one,
    else ``agg.pcap`` -> ``agg.member1.pcap``."""
    if path is None or members == 1:
        return path
    return path.with_suffix(f".member{member}{path.suffix}")


def worker_pcap(path: Path, worker: int) -> Path:
    """Where worker ``worker`` writes its capture: ``agg.pcap`` -> ``agg.worker2.pcap``."""
    return path.with_name(f"{path.stem}.worker{worker}{path.suffix or '.pcap'}")


def worker_bitmaps(cfg: JobConfig, bitmaps: np.ndarray) -> np.ndarray:
    """The workers summed in results with these ``bitmap`` fields: the bitmaps themselves in one tier; in
    two, whose results name leaves, the bits of the leaves' workers."""
    if not cfg.tiered:
        return bitmaps
    out = np.zeros_like(bitmaps)
    first = np.cumsum((0, *cfg.leaves))
    for leaf, n in enumerate(cfg.leaves):
        out |= ((bitmaps >> leaf) & 1) * (((1 << n) - 1) << int(first[leaf]))
    return out


def reference_sums(cfg: JobConfig, indices: list[np.ndarray], bitmaps: np.ndarray) -> np.ndarray:
    """Replay the workers' indices through the in-process state machine.

    Chunk c gets the packets of the workers in ``bitmaps[c]`` (the contributors the network
    reported), chunk c in slot c of a reference job. Returns (chunks, K) int64 sums; rows of chunks
    with an empty bitmap stay 0.
    """
    chunks = max(1, -(-indices[0].size // cfg.elems))
    padded = [np.concatenate([ix, np.zeros(chunks * cfg.elems - ix.size, np.uint8)]) for ix in indices]
    payload = [pack_bits(ix.reshape(chunks, cfg.elems), cfg.bits) for ix in padded]
    out = np.zeros((chunks, cfg.elems), np.int64)
    batch = 256
    if cfg.tiered:  # the sums of a two-tier job are the one-tier sums of the same workers
        bitmaps = worker_bitmaps(cfg, bitmaps)
        cfg = JobConfig(**{k: v for k, v in cfg.to_dict().items() if k != "leaves"})
    for bm in np.unique(bitmaps).tolist():
        members = [w for w in range(cfg.workers) if (int(bm) >> w) & 1]
        if not members:
            continue
        sel = np.flatnonzero(bitmaps == bm)
        ref = JobConfig(**{**cfg.to_dict(), "threshold": len(members), "slots": max(1, sel.size)})
        agg = Aggregator([ref], max_batch=batch)
        slot = np.repeat(np.arange(sel.size), len(members))
        worker = np.tile(np.array(members), sel.size)
        pay = np.stack([payload[w][c] for c in sel.tolist() for w in members])
        hdr = ref.request_fields(PacketType.DATA, worker=worker, slot=slot, round=0, tensor=0, chunk=sel[slot])
        pkts = build_batch(hdr, pay)
        seen = 0
        for start in range(0, len(pkts), batch):
            rows = pkts[start:start + batch]
            res = agg.process(rows, np.full(len(rows), pkts.shape[1]))
            hv = header_view(res.buf)
            for m in range(res.count):
                if not res.fanout[m]:
                    raise AssertionError("the reference state machine answered a fresh packet by unicast")
                c = int(sel[int(hv["slot"][m])])
                out[c] = decode_sums(res.buf[m, 32:32 + ref.result_bytes], ref.result_bits, ref.elems)
                seen += 1
        if seen != sel.size:
            raise AssertionError(f"the reference completed {seen} of {sel.size} chunks")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="thc-allreduce",
        description="Allreduce random gradients among N worker processes through a THC aggregator on "
                    "loopback, check the integer sums bit for bit against the in-process state machine, "
                    "and report time, packets, retransmissions, stragglers, NMSE and exactness.",
        epilog=f"With --aggregator, the job options must match a job the aggregator serves; by default "
               f"that is thc-aggregator's default job {DEFAULT_JOB_ID} (key {DEFAULT_KEY:#x}, 4 workers, "
               "b=4, g=30, p=1/32).")
    p.add_argument("--workers", type=int_in(1, 32),
                   help="worker processes (n, at most 32; default 4, or with --leaves the leaves' sum)")
    p.add_argument("--dim", type=int_in(1, 1 << 31), default=1 << 20, help="coordinates per gradient (default 2^20)")
    p.add_argument("--steps", type=int_in(1, 1 << 20), default=1, help="allreduce steps (error feedback carries over)")
    p.add_argument("--leaves", metavar="N0:N1:...",
                   help="two tiers: start a spine and one leaf per entry, leaf l serving N_l of the workers "
                        "(their sum is the workers; docs/protocol.md 'Two tiers')")
    p.add_argument("--parent-loss", type=float_in(0, 0.99), default=0.0, metavar="P",
                   help="with --leaves: each leaf drops this fraction of its packets to and from the spine")
    p.add_argument("--leaf-engine", choices=("compiled", "numpy", "reference"),
                   help="with --leaves: the leaves' state machine (thc-aggregator --engine; default compiled)")
    p.add_argument("--aggregator", type=comma_list(host_port, "10.0.0.1:9451,10.0.0.2:9451"), metavar="HOST:PORT",
                   help="use a running aggregator instead of starting one; several, comma-separated, in member "
                        "order: the job's slots spread over them (thc-aggregator --member I/N on each)")
    p.add_argument("--aggregators", type=int_in(1, 64), default=1,
                   help="without --aggregator: start this many on loopback, members 0..N-1 of N, the slots "
                        "spread over them")
    p.add_argument("--shards", type=int_in(1, 64), default=1,
                   help="shards of each aggregator (ports PORT..PORT+P-1)")
    p.add_argument("--loss-policy", choices=("reliable", "zero-fill"), default="reliable",
                   help="reliable: resend until every chunk's result comes (exact); zero-fill: give a chunk up "
                        "after --retries resends and take its coordinates as zero (docs/protocol.md)")
    p.add_argument("--drop-up", type=float_in(0, 0.99), default=0.0,
                   help="simulated loss of worker->aggregator packets")
    p.add_argument("--drop-down", type=float_in(0, 0.99), default=0.0,
                   help="simulated loss of aggregator->worker packets")
    p.add_argument("--timeout", type=float_in(1e-4, 60), default=0.05,
                   help="retransmit timeout, s, until the round trip is measured "
                        "(then 3 round trips, at least min(2 ms, this)); zero-fill: always this")
    p.add_argument("--retries", type=int_in(0, 1000),
                   help="zero-fill: retransmissions before a chunk is given up (0: the paper's no-retransmission; "
                        "default 3)")
    p.add_argument("--deadline", type=float_in(0.01, 86400), default=10.0,
                   help="seconds without answer before giving up")
    p.add_argument("--job", type=int_in(0, 65535), default=DEFAULT_JOB_ID,
                   help="the job's id, 0..65535 (with --aggregator: a job the aggregator serves)")
    p.add_argument("--key", type=int_in(0, (1 << 32) - 1), default=DEFAULT_KEY,
                   help="the job's 32-bit key, which every packet carries (decimal or 0x hex)")
    p.add_argument("--threshold", type=int_in(1, 32), help="completion threshold (default: all workers)")
    p.add_argument("--bits", type=int_in(1, 8), default=4, help="THC index width b, 1..8")
    p.add_argument("--granularity", type=int_in(1, 1 << 16), default=30,
                   help="THC granularity g: the grid's cells, at least 2^b - 1")
    p.add_argument("--p", type=fraction, default=1 / 32,
                   help="THC truncation fraction p, a decimal or a fraction like 1/32 (the table's tails)")
    p.add_argument("--slots", type=int_in(1, 65536), default=128,
                   help="aggregator slots S of the job: the most chunks a worker has in flight")
    p.add_argument("--elems", type=int_in(1, 65535),
                   help="indices per packet K (default: the largest whose results fit the MTU: 1440 at 1500 bytes)")
    p.add_argument("--mtu", type=int_in(68, MAX_MTU), default=1500,
                   help="path MTU the job's packets must fit (9000: jumbo frames)")
    p.add_argument("--seed", type=int_in(0, (1 << 32) - 1), default=0,
                   help="seed of the gradients, the quantization and the simulated loss")
    p.add_argument("--gro", action=argparse.BooleanOptionalAction, default=True,
                   help="workers (and the aggregators started here) read runs of answers that arrive whole as one "
                        "message (UDP_GRO, where the kernel has it; default: on)")
    p.add_argument("--multicast", metavar="GROUP:PORT",
                   help="results once to this IP multicast group (the started aggregator runs --multicast)")
    p.add_argument("--tail-duplicates", type=int_in(0, 65536), default=TAIL_DUPLICATES, metavar="N",
                   help="reliable: the last N uses of each exchange go out twice, so that a request lost at its end "
                        f"costs no recovery (docs/protocol.md; 0: off; default {TAIL_DUPLICATES})")
    p.add_argument("--pcap", type=Path, metavar="FILE",
                   help="write the traffic to pcap: the started aggregator's to FILE; with --aggregator, each "
                        "worker's own (what it sent and accepted) to FILE.worker<w>.pcap")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the summary (the transport's counters and times, such "
                        "as retransmissions or tail_s, are sums over the workers)")
    return p


def run(args: argparse.Namespace) -> dict:
    """Run the allreduce; returns the summary dict."""
    leaves = job_from_mapping({"leaves": args.leaves}, "--leaves").leaves if args.leaves else None
    if args.workers is None:  # --leaves 2:2 alone means 4 workers, as leaves=2:2 in a job spec does
        args.workers = sum(leaves) if leaves else 4
    job = JobConfig(job=args.job, key=args.key, workers=args.workers, threshold=args.threshold, bits=args.bits,
                    granularity=args.granularity, p=args.p, slots=args.slots, elems=args.elems,
                    multicast=args.multicast, mtu=args.mtu, leaves=leaves)
    # torch, the codec and the transport are imported once, in this process, while the aggregators start:
    # imported in each forked worker instead, they cost seconds of CPU per worker.
    preload = threading.Thread(target=lambda: [importlib.import_module(m) for m in WORKER_MODULES],
                               name="thc-preload", daemon=True)
    preload.start()
    # joined on every exit: a daemon thread still importing torch when the interpreter shuts down after an
    # early error prints "Exception in thread" under the one-line message
    with tempfile.TemporaryDirectory(prefix="thc-allreduce-") as tmp, contextlib.ExitStack() as stack:
        stack.callback(preload.join)
        leaf_addresses = None
        if (args.parent_loss or args.leaf_engine) and not job.tiered:
            raise ValueError("--parent-loss and --leaf-engine are for two tiers (--leaves)")
        if args.retries is not None and args.loss_policy != "zero-fill":
            raise ValueError("--retries counts the resends before zero-fill gives a chunk up: add --loss-policy "
                             "zero-fill (reliable resends until the result comes)")
        if job.tiered:
            if args.aggregator or args.aggregators > 1 or args.shards > 1 or args.pcap:
                raise ValueError("--leaves starts its own spine and leaves: drop --aggregator, --aggregators, "
                                 "--shards and --pcap")
            spine, leaf_addresses = stack.enter_context(local_tiers(
                job, parent_loss=args.parent_loss, seed=args.seed, leaf_engine=args.leaf_engine or "compiled"))
            members = [spine]
        elif args.aggregator:
            members = list(args.aggregator)
        else:
            members = [stack.enter_context(local_aggregator(
                [job], shards=args.shards, multicast=bool(job.multicast), member=(i, args.aggregators),
                pcap=member_pcap(args.pcap, i, args.aggregators), extra=[] if args.gro else ["--no-gro"]))
                for i in range(args.aggregators)]
        preload.join()  # no thread may run across the fork
        from worker_lib.transport import TransportConfig, run_nonce

        spec = RunSpec(job, members, args.shards, args.dim, args.steps, args.seed, args.loss_policy,
                       args.drop_up, args.drop_down, args.timeout, args.deadline, tmp, run_nonce(), args.multicast,
                       TransportConfig.retries if args.retries is None else args.retries,
                       args.pcap if args.aggregator else None, leaf_addresses, args.gro, args.tail_duplicates)
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(args.workers)
        procs = [ctx.Process(target=_worker, args=(spec, w, barrier), name=f"thc-worker{w}")
                 for w in range(args.workers)]
        t0 = time.perf_counter()
        for pr in procs:
            pr.start()
        limit = time.monotonic() + 120 + args.deadline * 4 + args.steps * 30
        for pr in procs:
            pr.join(timeout=max(0.1, limit - time.monotonic()))
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
                pr.join(5)
        wall = time.perf_counter() - t0
        errors = [(Path(tmp) / f"worker{w}.err") for w in range(args.workers)]
        msgs = [e.read_text() for e in errors if e.exists()]
        if msgs or any(pr.exitcode != 0 for pr in procs):
            raise RuntimeError("worker failed: " + ("; ".join(msgs) or "exit codes "
                                                     + str([pr.exitcode for pr in procs])))
        data = [np.load(Path(tmp) / f"worker{w}.npz") for w in range(args.workers)]
        where = ",".join(f"{h}:{p}" for h, p in members)
        if leaf_addresses:
            where = f"spine {where}, leaves " + ",".join(f"{h}:{p}" for h, p in leaf_addresses)
        return summarize(job, args, data, wall, where)


def summarize(job: JobConfig, args: argparse.Namespace, data: list, wall: float, where: str) -> dict:
    """Check sums against the reference, compute NMSE, gather counters."""
    import torch

    steps = args.steps
    exact = True
    lost_total = 0
    for s in range(steps):
        lost_any = np.zeros_like(data[0]["lost"][s])
        bitmaps = np.zeros(lost_any.shape, np.int64)
        for d in data:
            lost_any |= d["lost"][s]
        # Each chunk's contributors as reported by any worker that received it.
        for d in data:
            got = ~d["lost"][s]
            bitmaps[got] = d["bitmap"][s][got]
        ref = reference_sums(job, [d["indices"][s] for d in data], bitmaps)
        for d in data:
            got = ~d["lost"][s]
            exact &= bool(np.array_equal(d["sums"][s][got], ref[got]))
        lost_total += int(sum(d["lost"][s].sum() for d in data))
    true = sum(gradient(args.seed, w, args.dim, steps - 1) for w in range(args.workers)) / args.workers
    avg = torch.from_numpy(data[0]["average"])
    # The last step decoded in-process from the reference sums (when nothing was lost and every chunk
    # had the same contributors): the workers' average must be that, to float rounding.
    decoded_gap = None
    last_contrib = data[0]["contributors"][steps - 1]
    if not any(d["lost"][steps - 1].any() for d in data) and (last_contrib == last_contrib[0]).all():
        from worker_lib.thc import SignKey, THCCodec, THCConfig

        codec = THCCodec(THCConfig(bits=job.bits, granularity=job.granularity, p=job.p))
        padded = data[0]["indices"][steps - 1].size
        sums = torch.from_numpy(ref.reshape(-1)[:padded])
        est = codec.decode(sums, int(last_contrib[0]), codec.scale(float(data[0]["max_norm"]), padded), args.dim,
                           SignKey.derive(job.job, 0, steps - 1))
        decoded_gap = float((est - avg).abs().max())
    nmse = float(((avg - true) ** 2).sum() / (true ** 2).sum())
    consistent = all(np.array_equal(d["average"], data[0]["average"]) for d in data)
    stats = [json.loads(str(d["stats"])) for d in data]
    tot = {k: sum(st[k] for st in stats) for k in stats[0]}
    return {
        "exact": exact, "nmse": nmse, "seconds": max(float(d["seconds"]) for d in data), "wall_seconds": wall,
        "workers": args.workers, "dim": args.dim, "steps": steps, "loss_policy": args.loss_policy,
        "drop_up": args.drop_up, "drop_down": args.drop_down, "aggregator": where, "shards": args.shards,
        "consistent_average": consistent, "decoded_vs_reference_max_abs": decoded_gap, "lost_chunks": lost_total,
        "elems": job.elems, "threshold": job.threshold, "multicast": args.multicast, "gro": args.gro,
        **{k: v for k, v in tot.items() if k != "lost_chunks"},
    }


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.aggregator and args.aggregators > 1:
        ap.error("--aggregators N starts N aggregators; with --aggregator, list the running ones instead")
    try:
        summary = run(args)
    except (JobConfigError, ValueError, RuntimeError) as exc:
        print(f"thc-allreduce: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        s = summary
        print(f"thc-allreduce: {s['workers']} workers x {s['dim']:,} coordinates, {s['steps']} step(s), "
              f"aggregator {s['aggregator']} (shards {s['shards']}), K={s['elems']}, threshold {s['threshold']}")
        print(f"  time          {s['seconds']:.3f} s (wall with process start {s['wall_seconds']:.2f} s)")
        print(f"  packets sent  {s['packets_sent']:,}  results {s['results']:,}  "
              f"retransmissions {s['retransmissions']:,}")
        print(f"  loss          policy {s['loss_policy']}, simulated drops up {s['dropped_up']} / down "
              f"{s['dropped_down']}, chunks lost {s['lost_chunks']}")
        print(f"  stragglers    {s['stragglers']}")
        print(f"  NMSE          {s['nmse']:.5f}   averages identical on all workers: {s['consistent_average']}")
        print(f"  exact         {s['exact']} (integer sums vs the in-process state machine, bit for bit)")
    return 0 if summary["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
