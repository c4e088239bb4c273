"""Benchmark of the userspace aggregator (not a timed test; medians of interleaved runs).

1. A load generator emulating n = 4 workers (one socket, worker ids 0..3) with K 4-bit indices per
   packet (``--elems``, default 256, 1024 and 8192), closed loop with a window of outstanding
   packets, against (a) a raw UDP reflector on the same batched I/O layer (worker_lib/batch_io.py) with no
   aggregation logic, (a') the same reflector in C (benchmarks/c_reflector.c, compiled here with
   ``cc``: the machine's I/O limit), and (b) ``thc-aggregator`` (compiled and numpy engines, 1 shard;
   compiled, 2 shards; compiled, busy polling instead of sleeping in select), interleaved in the same
   run. Reported: packets/s, aggregated elements/s (K per packet, SwitchML's metric) and the ratios b/a
   and b/a'. Targets (issue 16, K = 1024): >= 0.9 of the Python reflector, >= 0.7 of the C one.
2. The wall time of a 2^20-coordinate allreduce among 4 worker processes through the aggregator
   (``thc-allreduce``'s machinery) next to torch.distributed (gloo) all_reduce of the same float32
   tensor among 4 processes.
3. ``--cost``: the aggregator's CPU time per round of one d-coordinate tensor (the THC paper's
   Figure 2 point), measured in process in the same run, for THC (the state machine: table lookup
   and integer add of n workers' chunks, ``Aggregator.process``) and for the decompress-aggregate-
   recompress codecs (``DarAggregator.process`` on the n workers' fragments: reassembly, then
   decode + float sum + re-encode, whose share the ``cpu_ns`` counter gives), at n = 2, 4, 8, with
   the ratios DAR / THC. Torch runs on one thread, like the numpy THC path; no I/O is timed.
4. ``--lone``: what a datagram that arrives alone costs the aggregator's loop (``Shard.step`` in process on
   a loopback socket: the wait, the receive, the state table, the sends), by what it causes: nothing (a
   worker's first request of a round), a completion answered to both workers of a 2-worker job, an answer
   from the retained result (a resend after the completion). The last is what each recovered loss costs it,
   and the first two what a resend that reaches an open round, or completes it, costs: under loss they come
   one at a time, between the runs of first sends. Medians of ``--lone-rounds`` of each, interleaved.

    python benchmarks/aggregator.py [--seconds 3] [--elems 256,1024,8192] [--skip-allreduce] [--json]
    python benchmarks/aggregator.py --cost [--cost-dim 262144] [--cost-rounds 3] [--json]
    python benchmarks/aggregator.py --lone [--lone-rounds 3000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.engine import DEFAULT_STRIDE
from launchers.aggregator_process import listening_port
from worker_lib.batch_io import BatchSocket, sockaddr_in, udp_socket
from worker_lib.cli.args import comma_list, float_in, int_in
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire import PacketType, build_batch, fragment_count, pack_bits

WORKERS = 4


def reflector(port_q: mp.Queue, stop: mp.Event) -> None:
    """Raw reflector: every datagram goes straight back to its sender (batched, same I/O layer, with the
    offloads the aggregator has by default: segmented sends, coalesced receives)."""
    bs = BatchSocket(udp_socket("127.0.0.1", 0), batch=256, stride=DEFAULT_STRIDE, gso=True, gro=True)
    port_q.put(bs.sock.getsockname()[1])
    rows = np.arange(bs.batch)
    while not stop.is_set():
        if not bs.wait(0.05):
            continue
        n = bs.recv()
        if n:
            bs.send(bs.rx, rows[:n], bs.rx_len[:n], bs.rx_addr[:n])


def build_c_reflector(workdir: Path) -> Path | None:
    """benchmarks/c_reflector.c compiled with the machine's ``cc`` into ``workdir``; None (with one line on
    stderr) when there is no C compiler or it fails."""
    src = Path(__file__).with_name("c_reflector.c")
    exe = workdir / "c_reflector"
    try:
        proc = subprocess.run(["cc", "-O2", "-o", str(exe), str(src)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"C reflector skipped: cannot run cc ({exc})", file=sys.stderr)
        return None
    if proc.returncode != 0:
        print(f"C reflector skipped: cc failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return exe


def generator(port: int, shards: int, cfg: JobConfig, seconds: float, window: int, out: mp.Queue) -> None:
    """Closed-loop load: 4 emulated workers, slot u mod S and round u div S for use u."""
    rng = np.random.default_rng(0)
    pool = 64
    payload = pack_bits(rng.integers(0, 16, (pool, cfg.elems)).astype(np.uint8), cfg.bits)
    templates = build_batch(cfg.request_fields(PacketType.DATA, worker=0), payload)
    length = templates.shape[1]
    batch = 256
    bs = BatchSocket(udp_socket("127.0.0.1", 0), batch=batch, stride=DEFAULT_STRIDE, max_send=batch)
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


def measure(target: str, cfg: JobConfig, seconds: float, shards: int = 1, window: int = 1024,
            engine: str = "compiled", c_reflector: Path | None = None, busy_poll: bool = False) -> dict:
    """One target (``reflector``, ``c_reflector`` or ``aggregator``) under the generator's load."""
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
        elif target == "c_reflector":
            proc = subprocess.Popen([str(c_reflector)], stdout=subprocess.PIPE, text=True)
            port = listening_port(proc.stdout.readline())
        else:
            spec = ",".join(f"{k}={v}" for k, v in cfg.to_dict().items())
            proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", "--shards", str(shards),
                                     "--engine", engine, "--job", spec, *(["--busy-poll"] if busy_poll else [])],
                                    stdout=subprocess.PIPE, text=True)
            port = listening_port(proc.stdout.readline())
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
    from launchers.allreduce import build_parser, run

    args = build_parser().parse_args(["--workers", str(workers), "--dim", str(dim), "--steps", str(steps)])
    s = run(args)
    return {"seconds_per_step": s["seconds"] / steps, "exact": s["exact"], "nmse": s["nmse"],
            "retransmissions": s["retransmissions"]}


def _thc_round_cpu(d: int, workers: int, rounds: int, batch: int = 256) -> list[float]:
    """CPU seconds of ``Aggregator.process`` over every chunk packet of one round, per round."""
    from aggregator.engine import Aggregator
    from worker_lib.wire import header_view

    k = 1024
    chunks = -(-d // k)
    cfg = JobConfig(job=1, workers=workers, elems=k, slots=chunks)
    agg = Aggregator([cfg], max_batch=batch)
    rng = np.random.default_rng(1)
    payload = pack_bits(rng.integers(0, 1 << cfg.bits, (chunks * workers, k)).astype(np.uint8), cfg.bits)
    pkts = build_batch(cfg.request_fields(PacketType.DATA, worker=np.tile(np.arange(workers), chunks),
                                          slot=np.repeat(np.arange(chunks), workers)), payload)
    lens = np.full(len(pkts), pkts.shape[1])
    out = []
    for r in range(rounds):
        header_view(pkts)["round"] = r
        t0 = time.process_time()
        for i in range(0, len(pkts), batch):
            agg.process(pkts[i:i + batch], lens[i:i + batch])
        out.append(time.process_time() - t0)
    if agg.counters[3] != rounds * chunks:  # Counter.COMPLETED
        raise RuntimeError(f"THC rounds did not complete: {agg.counters}")
    return out


def _dar_messages(codec: str, d: int, workers: int) -> list:
    import torch

    from worker_lib.codecs import RoundContext, make_codec

    rng = np.random.default_rng(2)
    enc = make_codec(codec, seed=3)
    return [enc.encode(torch.from_numpy(rng.standard_normal(d).astype(np.float32)), RoundContext(length=d))
            for _ in range(workers)]


def _dar_round_cpu(codec: str, d: int, msgs: list, rounds: int, batch: int = 256) -> tuple[list[float], list[float]]:
    """(CPU seconds of ``DarAggregator.process`` over a round's fragments, of which decode + sum +
    re-encode) per round."""
    from aggregator.dar import FRAGMENT_OVERHEAD, DarAggregator
    from worker_lib.wire.protocol import DarCounter

    workers = len(msgs)
    biggest = max(m.nbytes for m in msgs)
    cfg = JobConfig(job=2, kind="dar", codec=codec, length=d, max_message=max(2 * biggest, 8 * d), workers=workers,
                    slots=1)
    agg = DarAggregator([cfg])
    per = cfg.elems
    rows, lens, index = [], [], []
    for w, m in enumerate(msgs):
        frags = fragment_count(m.nbytes, per)
        for k in range(frags):
            body = m.payload[k * per:(k + 1) * per]
            rows.append(build_batch(cfg.request_fields(PacketType.DAR_DATA, worker=w, chunk=k, elems=body.size),
                                    np.concatenate([np.array([m.bits, frags], ">u4").view(np.uint8), body,
                                                    np.zeros(per - body.size, np.uint8)])[None, :])[0])
            lens.append(FRAGMENT_OVERHEAD + body.size)
            index.append(k)
    order = np.argsort(np.asarray(index), kind="stable")  # fragments interleaved across workers, as they arrive
    pkts = np.ascontiguousarray(np.stack(rows)[order])
    lengths = np.asarray(lens)[order]
    from worker_lib.wire import header_view

    total, codec_part = [], []
    for r in range(rounds):
        header_view(pkts)["round"] = r
        before = int(agg.counters[DarCounter.CPU_NS])
        t0 = time.process_time()
        for i in range(0, len(pkts), batch):
            agg.process(pkts[i:i + batch], lengths[i:i + batch])
        total.append(time.process_time() - t0)
        codec_part.append((int(agg.counters[DarCounter.CPU_NS]) - before) / 1e9)
    if agg.counters[DarCounter.COMPLETED] != rounds:
        raise RuntimeError(f"{codec}: DAR rounds did not complete: {agg.counters}")
    return total, codec_part


def aggregator_cost(d: int, workers: tuple[int, ...] = (2, 4, 8),
                    codecs: tuple[str, ...] = ("topk10", "natural", "3lc", "dynquant"), rounds: int = 3) -> dict:
    """Aggregator CPU time per round: THC vs the DAR codecs at each n, medians over ``rounds``."""
    import torch

    torch.set_num_threads(1)
    res: dict = {"d": d, "rounds": rounds, "rows": []}
    msgs = {c: _dar_messages(c, d, max(workers)) for c in codecs}
    for n in workers:
        thc = statistics.median(_thc_round_cpu(d, n, rounds))
        res["rows"].append({"codec": "thc", "workers": n, "cpu_ms": thc * 1e3, "codec_ms": None, "ratio": 1.0})
        for c in codecs:
            total, part = _dar_round_cpu(c, d, msgs[c][:n], rounds)
            t, p = statistics.median(total), statistics.median(part)
            res["rows"].append({"codec": c, "workers": n, "cpu_ms": t * 1e3, "codec_ms": p * 1e3, "ratio": t / thc,
                                "message_bytes": int(msgs[c][0].nbytes)})
    return res


LONE_CASES = ("first request", "completion", "retained answer")


def lone_costs(rounds: int) -> dict[str, float]:
    """Microseconds of ``Shard.step`` per lone datagram, medians over ``rounds`` rounds of a 2-worker job (1,440
    4-bit indices per packet, the DDP benchmark's), by ``LONE_CASES``: worker 0's request, worker 1's (which
    completes the round), worker 0's again (answered from the retained result). Raises RuntimeError when the
    shard did not do what each case says (its counters, the answers that came back)."""
    from aggregator.server import AggregatorServer, ServerConfig
    from aggregator.shard import Shard
    from worker_lib.wire.protocol import Counter

    job = JobConfig(job=1, workers=2, bits=4, slots=512)
    cfg = ServerConfig(port=0, jobs=[job])
    server = AggregatorServer(cfg, out=lambda _line: None)  # its socket, with the compiled passes loaded
    shard = Shard(cfg, server.socks[0], 0, server.jobs, server.counters[0], server.dar_counters[0])
    workers = [udp_socket("127.0.0.1", 0) for _ in range(2)]
    here = ("127.0.0.1", server.port)
    use = np.arange(rounds)
    requests = [build_batch(job.request_fields(PacketType.DATA, worker=w, slot=use % job.slots, round=use // job.slots,
                                               tensor=0, chunk=use), np.zeros((rounds, job.data_bytes), np.uint8))
                for w in range(2)]
    took = np.zeros((len(LONE_CASES), rounds))
    answers = [0, 0]
    try:
        for r in range(rounds):
            for case, w in enumerate((0, 1, 0)):
                workers[w].sendto(requests[w][r], here)
                t0 = time.perf_counter()
                if not shard.step(2.0):  # loopback delivers at once: the wait only bounds a lost datagram
                    raise RuntimeError("lone datagrams: a request did not reach the aggregator within 2 s")
                took[case, r] = time.perf_counter() - t0
            for w, sock in enumerate(workers):
                with contextlib.suppress(BlockingIOError):
                    while sock.recv(65536):
                        answers[w] += 1
        done, again = (int(server.counters[0][c]) for c in (Counter.COMPLETED, Counter.RETAINED))
        if (done, again) != (rounds, rounds):
            raise RuntimeError(f"lone datagrams: {done} completions and {again} retained answers for {rounds} rounds")
        if answers != [2 * rounds, rounds]:  # worker 0: each completion and each retained answer
            raise RuntimeError(f"lone datagrams: the workers got {answers} answers for {rounds} rounds")
    finally:
        shard.close()
        for sock in workers:
            sock.close()
    warm = rounds // 10  # the first rounds warm the caches and the branch predictors
    return {name: float(np.median(took[k, warm:])) * 1e6 for k, name in enumerate(LONE_CASES)}


TARGETS = ("reflector", "c_reflector", "aggregator", "aggregator_busy_poll", "aggregator_numpy",
           "aggregator_2_shards")


def rates(cfg: JobConfig, args: argparse.Namespace, c_ref: Path | None) -> dict:
    """Every target's packet rate at the job's K, ``args.repeats`` interleaved runs (medians), and the
    aggregator's ratios to both reflectors."""
    runs: dict[str, list[dict]] = {t: [] for t in TARGETS if t != "c_reflector" or c_ref is not None}
    for _ in range(args.repeats):  # interleaved, so that background load hits every target alike
        runs["reflector"].append(measure("reflector", cfg, args.seconds))
        if c_ref is not None:
            runs["c_reflector"].append(measure("c_reflector", cfg, args.seconds, c_reflector=c_ref))
        runs["aggregator"].append(measure("aggregator", cfg, args.seconds))
        runs["aggregator_busy_poll"].append(measure("aggregator", cfg, args.seconds, busy_poll=True))
        runs["aggregator_numpy"].append(measure("aggregator", cfg, args.seconds, engine="numpy"))
        runs["aggregator_2_shards"].append(measure("aggregator", cfg, args.seconds, shards=2))
    res: dict = {}
    for name, rs in runs.items():
        res[name] = {"packets_per_s": statistics.median(r["packets_per_s"] for r in rs),
                     "elements_per_s": statistics.median(r["elements_per_s"] for r in rs),
                     "stalls": sum(r["stalls"] for r in rs),
                     "all_packets_per_s": [round(r["packets_per_s"]) for r in rs]}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x["packets_per_s"] / y["packets_per_s"] for x, y in zip(runs[a], runs[b], strict=True))

    res["ratio"] = ratio("aggregator", "reflector")
    res["ratios"] = [round(a["packets_per_s"] / r["packets_per_s"], 3)
                     for a, r in zip(runs["aggregator"], runs["reflector"], strict=True)]
    res["ratio_numpy"] = ratio("aggregator_numpy", "reflector")
    res["ratio_c"] = ratio("aggregator", "c_reflector") if c_ref is not None else None
    res["shards_speedup"] = ratio("aggregator_2_shards", "aggregator")
    res["busy_poll_speedup"] = ratio("aggregator_busy_poll", "aggregator")
    return res


def report_rates(k: int, res: dict, cpus: int | None) -> None:
    print(f"{cpus} CPUs, n = {WORKERS} emulated workers, K = {k} 4-bit indices per packet")
    for name in TARGETS:
        if name in res:
            r = res[name]
            print(f"  {name:22s} {r['packets_per_s']:12,.0f} pkt/s  {r['elements_per_s']:14,.0f} elements/s"
                  f"  (runs {r['all_packets_per_s']}, stalls {r['stalls']})")
    c = f"{res['ratio_c']:.2f}" if res["ratio_c"] is not None else "n/a (no C compiler)"
    print(f"  aggregator (compiled) / Python reflector {res['ratio']:.2f} (per run {res['ratios']}); / C reflector "
          f"{c}; numpy engine / Python reflector {res['ratio_numpy']:.2f}; 2 shards / 1 shard "
          f"{res['shards_speedup']:.2f}; busy polling / sleeping in select {res['busy_poll_speedup']:.2f}")


def rate_job(k: int) -> JobConfig:
    """The job of the packet-rate part at K = ``k`` (n = 4, 256 slots, 9000-byte MTU)."""
    return JobConfig(job=1, workers=WORKERS, elems=k, slots=256, mtu=9000)


def rate_k(text: str) -> int:
    """An argparse type: one K of the packet-rate part, a valid ``rate_job``."""
    k = int_in(8, 65528)(text)
    try:
        rate_job(k)
    except JobConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("job 1: ")) from None
    return k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float_in(0.1, 3600), default=3.0,
                    help="measurement time per target, 0.1..3600 (default 3)")
    ap.add_argument("--elems", type=comma_list(rate_k, "256,1024,8192"), default=[256, 1024, 8192],
                    help="indices per packet K, comma-separated, each a multiple of 8 in 8..8936 (its results "
                         "fit a 9000-byte MTU; default 256,1024,8192)")
    ap.add_argument("--repeats", type=int_in(1, 1000), default=3,
                    help="interleaved repetitions, 1..1000 (medians reported; default 3)")
    ap.add_argument("--dim", type=int_in(1, 1 << 28), default=1 << 20, help="allreduce length, 1..2^28 (default 2^20)")
    ap.add_argument("--skip-allreduce", action="store_true", help="only the packet-rate part")
    ap.add_argument("--cost", action="store_true",
                    help="only the aggregator CPU time per round: THC vs the DAR codecs at n = 2, 4, 8")
    ap.add_argument("--cost-dim", type=int_in(1, 1 << 23), default=1 << 18,
                    help="d of the --cost rounds, 1..2^23 (default 2^18)")
    ap.add_argument("--cost-rounds", type=int_in(1, 1000), default=3,
                    help="rounds per point of --cost, 1..1000 (medians; default 3)")
    ap.add_argument("--lone", action="store_true",
                    help="only the aggregator's time per datagram that arrives alone: a first request, a completion, "
                         "an answer from the retained result (a resend)")
    ap.add_argument("--lone-rounds", type=int_in(10, 1_000_000), default=3000,
                    help="rounds of each --lone case, 10..1000000 (medians; default 3000)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.lone:
        lone = lone_costs(args.lone_rounds)
        if args.json:
            print(json.dumps(lone))
            return 0
        print(f"aggregator loop per lone datagram, medians of {args.lone_rounds} rounds (2 workers, K = 1440):")
        for name, us in lone.items():
            print(f"  {name:16s} {us:6.1f} us")
        return 0
    if args.cost:
        res = aggregator_cost(args.cost_dim, rounds=args.cost_rounds)
        if args.json:
            print(json.dumps(res))
            return 0
        print(f"aggregator CPU time per round, d = {res['d']:,}, median of {res['rounds']} rounds, 1 thread")
        print(f"  {'codec':10s} {'n':>3s} {'cpu ms/round':>13s} {'decode+sum+reencode ms':>23s} {'x THC':>8s}")
        for r in res["rows"]:
            part = f"{r['codec_ms']:.2f}" if r["codec_ms"] is not None else "-"
            print(f"  {r['codec']:10s} {r['workers']:3d} {r['cpu_ms']:13.2f} {part:>23s} {r['ratio']:8.1f}")
        return 0
    res: dict = {"cpus": os.cpu_count(), "workers": WORKERS, "by_elems": {}}
    with tempfile.TemporaryDirectory(prefix="thc-bench-") as tmp:
        c_ref = build_c_reflector(Path(tmp))
        for k in args.elems:
            res["by_elems"][k] = rates(rate_job(k), args, c_ref)
    if not args.skip_allreduce:
        res["thc_allreduce"] = thc_allreduce(args.dim)
        res["gloo_allreduce_seconds"] = gloo_allreduce(args.dim)
    if args.json:
        print(json.dumps(res))
        return 0
    for k, r in res["by_elems"].items():
        report_rates(k, r, res["cpus"])
    if "thc_allreduce" in res:
        t = res["thc_allreduce"]
        print(f"  allreduce of {args.dim:,} floats among 4 processes: THC via aggregator "
              f"{t['seconds_per_step'] * 1e3:.1f} ms/step (exact {t['exact']}, NMSE {t['nmse']:.4f}); "
              f"gloo all_reduce {res['gloo_allreduce_seconds'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
