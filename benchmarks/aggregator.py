"""Benchmark of the userspace aggregator (not a timed test; medians of interleaved runs).

1. A load generator emulating n = 4 workers (one socket, worker ids 0..3) with K = 1024 4-bit
   indices per packet, closed loop with a window of outstanding packets, against
   (a) a raw UDP reflector on the same batched I/O layer (aggregator/io.py) with no aggregation
       logic, and (b) ``thc-aggregator`` (1 shard, then 2 shards), in the same run.
   Reported: packets/s, aggregated elements/s (K per packet, SwitchML's metric) and the ratio b/a.
2. The wall time of a 2^20-coordinate allreduce among 4 worker processes through the aggregator
   (``thc-allreduce``'s machinery) next to torch.distributed (gloo) all_reduce of the same float32
   tensor among 4 processes.

    python benchmarks/aggregator.py [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.io import BatchSocket, sockaddr_in, udp_socket
from aggregator.jobs import JobConfig
from worker_lib.wire import build_batch, pack_indices_np

WORKERS = 4


def reflector(port_q: mp.Queue, stop: mp.Event) -> None:
    """Raw reflector: every datagram goes straight back to its sender (batched, same I/O layer)."""
    bs = BatchSocket(udp_socket("127.0.0.1", 0), batch=256, stride=4224)
    port_q.put(bs.sock.getsockname()[1])
    rows = np.arange(256)
    while not stop.is_set():
        if not bs.wait(0.05):
            continue
        n = bs.recv()
        if n:
            bs.send(bs.rx, rows[:n], bs.rx_len[:n], bs.rx_addr[:n])


def generator(port: int, shards: int, cfg: JobConfig, seconds: float, window: int, out: mp.Queue) -> None:
    """Closed-loop load: 4 emulated workers, slot u mod S and round u div S for use u."""
    rng = np.random.default_rng(0)
    pool = 64
    payload = pack_indices_np(rng.integers(0, 16, (pool, cfg.elems)).astype(np.uint8), cfg.bits)
    templates = build_batch({"type": 1, "job": cfg.job, "key": cfg.key, "table_id": cfg.table_id,
                             "worker": 0, "elems": cfg.elems, "width": cfg.bits}, payload)
    length = templates.shape[1]
    batch = 256
    bs = BatchSocket(udp_socket("127.0.0.1", 0), batch=batch, stride=4224, max_send=batch)
    ring = np.zeros((batch, length), np.uint8)
    dests = np.stack([np.frombuffer(sockaddr_in("127.0.0.1", port + i), np.uint8) for i in range(shards)])
    lengths = np.full(batch, length)
    rows = np.arange(batch)
    sent = recvd = 0
    p = 0
    t0 = time.perf_counter()
    warm_end = t0 + 0.5
    end = warm_end + seconds
    base_sent = base_recvd = None
    last_reply = time.perf_counter()
    stalls = 0
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if base_sent is None and now >= warm_end:
            base_sent, base_recvd, t_meas = sent, recvd, now
        room = window - (sent - recvd)
        if room >= batch // 2:
            k = min(room, batch)
            g = p + np.arange(k)
            use = g // WORKERS
            slot = use % cfg.slots
            rnd = (use // cfg.slots) & 0xFFFF
            ring[:k] = templates[g % pool]
            ring[:k, 10] = g % WORKERS
            ring[:k, 12] = slot >> 8
            ring[:k, 13] = slot & 0xFF
            ring[:k, 14] = rnd >> 8
            ring[:k, 15] = rnd & 0xFF
            bs.send(ring, rows[:k], lengths[:k], dests[slot % shards])
            sent += k
            p += k
        if bs.wait(0 if room >= batch // 2 else 0.002):
            while True:
                n = bs.recv()
                if not n:
                    break
                recvd += n
                last_reply = now
        elif now - last_reply > 0.05 and sent > recvd:
            stalls += 1  # lost packets: forget them so the window reopens
            recvd = sent
            last_reply = now
    t1 = time.perf_counter()
    out.put({"packets_per_s": (recvd - base_recvd) / (t1 - t_meas), "sent_per_s": (sent - base_sent) / (t1 - t_meas),
             "stalls": stalls})


def measure(target: str, cfg: JobConfig, seconds: float, shards: int = 1, window: int = 1024) -> dict:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    stop = ctx.Event()
    proc = None
    srv = None
    try:
        if target == "reflector":
            q = ctx.Queue()
            srv = ctx.Process(target=reflector, args=(q, stop), daemon=True)
            srv.start()
            port = q.get(timeout=10)
        else:
            spec = ",".join(f"{k}={v}" for k, v in cfg.to_dict().items())
            proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", "--shards", str(shards),
                                     "--job", spec], stdout=subprocess.PIPE, text=True)
            port = int(proc.stdout.readline().split()[3].rsplit(":", 1)[1])
        gen = ctx.Process(target=generator, args=(port, shards, cfg, seconds, window, out))
        gen.start()
        res = out.get(timeout=seconds + 30)
        gen.join(10)
    finally:
        stop.set()
        if srv is not None:
            srv.join(5)
            if srv.is_alive():
                srv.terminate()
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    res["elements_per_s"] = res["packets_per_s"] * cfg.elems
    return res


def _gloo_rank(rank: int, world: int, port: int, dim: int, reps: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.randn(dim, generator=torch.Generator().manual_seed(rank))
    times = []
    for i in range(reps + 2):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def gloo_allreduce(dim: int, world: int = 4, reps: int = 5) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, dim, reps, out)) for r in range(world)]
    for p in procs:
        p.start()
    times = out.get(timeout=300)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.terminate()
    return statistics.median(times)


def thc_allreduce(dim: int, workers: int = 4, steps: int = 3) -> dict:
    from aggregator.allreduce_cli import build_parser, run

    args = build_parser().parse_args(["--workers", str(workers), "--dim", str(dim), "--steps", str(steps)])
    s = run(args)
    return {"seconds_per_step": s["seconds"] / steps, "exact": s["exact"], "nmse": s["nmse"],
            "retransmissions": s["retransmissions"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement time per target")
    ap.add_argument("--elems", type=int, default=1024, help="indices per packet K")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians reported)")
    ap.add_argument("--dim", type=int, default=1 << 20, help="allreduce length")
    ap.add_argument("--skip-allreduce", action="store_true", help="only the packet-rate part")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = JobConfig(job=1, workers=WORKERS, elems=args.elems, slots=256)
    res: dict = {"cpus": os.cpu_count(), "elems": cfg.elems, "workers": WORKERS}
    runs: dict[str, list[dict]] = {"reflector": [], "aggregator": [], "aggregator_2_shards": []}
    for _ in range(args.repeats):  # interleaved, so that background load hits every target alike
        runs["reflector"].append(measure("reflector", cfg, args.seconds))
        runs["aggregator"].append(measure("aggregator", cfg, args.seconds))
        runs["aggregator_2_shards"].append(measure("aggregator", cfg, args.seconds, shards=2))
    for name, rs in runs.items():
        res[name] = {"packets_per_s": statistics.median(r["packets_per_s"] for r in rs),
                     "elements_per_s": statistics.median(r["elements_per_s"] for r in rs),
                     "stalls": sum(r["stalls"] for r in rs),
                     "all_packets_per_s": [round(r["packets_per_s"]) for r in rs]}
    ratios = [a["packets_per_s"] / r["packets_per_s"] for a, r in zip(runs["aggregator"], runs["reflector"],
                                                                          strict=True)]
    speedups = [b["packets_per_s"] / a["packets_per_s"] for a, b in zip(runs["aggregator"],
                                                                          runs["aggregator_2_shards"], strict=True)]
    res["ratio"] = statistics.median(ratios)
    res["shards_speedup"] = statistics.median(speedups)
    res["ratios"] = [round(x, 3) for x in ratios]
    if not args.skip_allreduce:
        res["thc_allreduce"] = thc_allreduce(args.dim)
        res["gloo_allreduce_seconds"] = gloo_allreduce(args.dim)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['cpus']} CPUs, n = {WORKERS} emulated workers, K = {cfg.elems} 4-bit indices per packet")
    for name in ("reflector", "aggregator", "aggregator_2_shards"):
        r = res[name]
        print(f"  {name:22s} {r['packets_per_s']:12,.0f} pkt/s  {r['elements_per_s']:14,.0f} elements/s"
              f"  (runs {r['all_packets_per_s']}, stalls {r['stalls']})")
    print(f"  aggregator / reflector {res['ratio']:.2f} (per run {res['ratios']})   "
          f"2 shards / 1 shard {res['shards_speedup']:.2f}")
    if "thc_allreduce" in res:
        t = res["thc_allreduce"]
        print(f"  allreduce of {args.dim:,} floats among 4 processes: THC via aggregator "
              f"{t['seconds_per_step'] * 1e3:.1f} ms/step (exact {t['exact']}, NMSE {t['nmse']:.4f}); "
              f"gloo all_reduce {res['gloo_allreduce_seconds'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
