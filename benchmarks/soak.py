"""A bounded soak of thc-aggregator: hours of traffic compressed into minutes, under a hostile network.

Two jobs (THC, 2 workers; uncompressed int32, 2 workers) exchange without pause through a relay that
drops, duplicates and reorders datagrams in both directions, for ``--minutes``. Every step's sums are
checked against numpy; at the end the aggregator's counters are read over its control socket. The soak
passes when:

- every step of every worker was exact (reliable mode: nothing lost, whatever the network did);
- the aggregator's resident memory grew by less than ``--max-growth-mib`` after warm-up (flat);
- the counters add up: every datagram received is one outcome or one drop reason, and each job's
  completed rounds equal the uses its workers finished (each use completes exactly once).

``--netns MBIT`` (root) runs the same across network namespaces: ``thc-aggregator`` in its own
namespace, the workers and the relay in another, the link between them shaped by tc tbf to MBIT Mbit/s
with nftables dropping ``--link-loss`` % of the frames each way, under the relay's drops, duplicates
and reorderings. The aggregator's memory is read from /proc and its counters over its control socket
(a Unix socket in a shared folder) as on loopback.

    python -m benchmarks.soak --minutes 10
    python -m benchmarks.soak --minutes 0.15 --json      # the short version the test suite runs
    sudo .venv/bin/python -m benchmarks.soak --minutes 10 --netns 1000
"""

from __future__ import annotations

import argparse
import json
import random
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aggregator.control import ControlAddress, send_command  # noqa: E402
from launchers.aggregator_process import listening_port, stop_process  # noqa: E402
from topologies.netem import require_root  # noqa: E402
from worker_lib.cli.args import float_in, host_port, int_in  # noqa: E402
from worker_lib.job import JobConfig  # noqa: E402
from worker_lib.thc import lookup_sum  # noqa: E402
from worker_lib.transport import Transport, TransportConfig  # noqa: E402
from worker_lib.wire.protocol import DROP_COUNTERS, Counter  # noqa: E402

THC = JobConfig(job=21, key=0x2121, workers=2, slots=64)
INT = JobConfig(job=22, key=0x2222, workers=2, kind="uncompressed", slots=64)
OUTCOMES = (Counter.ACCEPTED, Counter.DUPLICATE, Counter.RETAINED, Counter.STRAGGLER, Counter.KIND_MISMATCH)


class Relay:
    """One UDP port per worker between it and the aggregator: each datagram, either way, is dropped with
    probability ``drop``, sent twice with ``dup``, or held back behind the next one with ``reorder``."""

    def __init__(self, upstream: tuple[str, int], workers: int, drop: float, dup: float, reorder: float,
                 seed: int) -> None:
        self.upstream, self.rng = upstream, random.Random(seed)
        self.drop, self.dup, self.reorder = drop, dup, reorder
        self.front = [self._sock() for _ in range(workers)]  # workers send here
        # and the aggregator sees these (any address: it may be across a link, not on loopback)
        self.back = [self._sock("127.0.0.1" if upstream[0].startswith("127.") else "0.0.0.0") for _ in range(workers)]
        self.peer: list[tuple[str, int] | None] = [None] * workers
        self.held: dict[int, tuple[socket.socket, bytes, object]] = {}
        self.counts = {"forwarded": 0, "dropped": 0, "duplicated": 0, "reordered": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-relay", daemon=True)
        self._thread.start()

    @staticmethod
    def _sock(host: str = "127.0.0.1") -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        s.bind((host, 0))
        return s

    def port(self, worker: int) -> int:
        return self.front[worker].getsockname()[1]

    def _forward(self, lane: int, out: socket.socket, data: bytes, dest: object) -> None:
        r = self.rng.random()
        if r < self.drop:
            self.counts["dropped"] += 1
            return
        if lane not in self.held and r < self.drop + self.reorder:
            self.held[lane] = (out, data, dest)  # released after the next datagram of this lane
            self.counts["reordered"] += 1
            return
        copies = 2 if r > 1 - self.dup else 1
        self.counts["duplicated"] += copies - 1
        for _ in range(copies):
            out.sendto(data, dest)
        self.counts["forwarded"] += 1
        if lane in self.held:
            s, d, to = self.held.pop(lane)
            s.sendto(d, to)

    def _run(self) -> None:
        socks = self.front + self.back
        while not self._stop.is_set():
            ready, _, _ = select.select(socks, [], [], 0.05)
            for s in ready:
                data, src = s.recvfrom(65536)
                if s in self.front:
                    w = self.front.index(s)
                    self.peer[w] = src
                    self._forward(2 * w, self.back[w], data, self.upstream)
                else:
                    w = self.back.index(s)
                    if self.peer[w] is not None:
                        self._forward(2 * w + 1, self.front[w], data, self.peer[w])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in self.front + self.back:
            s.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def soak(args: argparse.Namespace) -> dict:
    """Run the soak; its figures and verdicts."""
    attach = getattr(args, "attach", None)
    agg = None
    if attach is None:
        tmp = Path(tempfile.mkdtemp(prefix="thc-soak-"))
        ctl = ControlAddress(path=str(tmp / "ctl.sock"))
        agg = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", "0", "--control", ctl.path,
                                *job_args()], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:  # an aggregator started elsewhere (--netns): its address, control socket and pid
        ctl = ControlAddress(path=args.control)
    relays: list[Relay] = []
    try:
        upstream = ("127.0.0.1", listening_port(agg.stdout.readline())) if agg is not None else attach
        agg_pid = agg.pid if agg is not None else args.agg_pid
        relays = [Relay(upstream, 2, args.drop, args.dup, args.reorder, seed=j) for j in range(2)]
        end = time.monotonic() + args.minutes * 60
        warm = time.monotonic() + min(5.0, args.minutes * 60 / 4)
        state = {"rss_warm": 0, "steps": 0, "exact": True, "uses": {THC.job: 0, INT.job: 0}, "errors": []}
        lock = threading.Lock()

        go = {cfg.job: [True] for cfg in (THC, INT)}
        barriers = {cfg.job: threading.Barrier(2, action=lambda j=cfg.job: go[j].__setitem__(0, time.monotonic() < end))
                    for cfg in (THC, INT)}

        def worker(cfg: JobConfig, relay: Relay, w: int) -> None:
            try:
                run_steps(cfg, relay, w)
            except Exception as exc:  # reported in the result
                with lock:
                    state["errors"].append(f"job {cfg.job} worker {w}: {exc}")
                    state["exact"] = False
                barriers[cfg.job].abort()

        def run_steps(cfg: JobConfig, relay: Relay, w: int) -> None:
            rng = np.random.default_rng(1000 * cfg.job)  # both workers of a job draw the same steps
            with Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", relay.port(w)),
                                           deadline=30)) as tr:
                step = 0
                while True:
                    barriers[cfg.job].wait()  # both workers of the job take the same decision to go on
                    if not go[cfg.job][0]:
                        break
                    if cfg.kind == "thc":
                        data = rng.integers(0, 16, (2, args.dim), dtype=np.uint8)
                        res = tr.exchange_indices(data[w], tensor=step)
                        want = lookup_sum(np.array(cfg.lookup.values), data)
                    else:
                        data = rng.integers(-(1 << 29), 1 << 29, (2, args.dim), dtype=np.int64)
                        res = tr.exchange_int32(data[w], tensor=step)
                        want = data.sum(axis=0)
                    ok = not res.lost.any() and np.array_equal(res.sums.reshape(-1)[:args.dim], want)
                    with lock:
                        state["steps"] += 1
                        state["exact"] &= ok
                        if w == 0:
                            state["uses"][cfg.job] += len(res.lost)
                    step += 1

        threads = [threading.Thread(target=worker, args=(cfg, relays[j], w))
                   for j, cfg in enumerate((THC, INT)) for w in range(2)]
        for t in threads:
            t.start()
        while time.monotonic() < warm:
            time.sleep(0.05)
        state["rss_warm"] = rss_kib(agg_pid)
        for t in threads:
            t.join()
        rss_end = rss_kib(agg_pid)
        stats = json.loads(send_command(ctl, "stats"))
        outcomes = sum(stats[c.label] for c in OUTCOMES if c not in DROP_COUNTERS)
        drops = sum(stats[c.label] for c in DROP_COUNTERS)
        growth_mib = (rss_end - state["rss_warm"]) / 1024
        result = {
            "minutes": args.minutes, "steps": state["steps"], "exact": state["exact"],
            "rss_warm_mib": state["rss_warm"] / 1024, "rss_end_mib": rss_end / 1024, "growth_mib": growth_mib,
            "memory_flat": growth_mib < args.max_growth_mib,
            "aggregator": {k: stats[k] for k in ("rx", "accepted", "completed", "retained", "duplicate",
                                                  "straggler")},
            "dropped": drops, "uses_finished": sum(state["uses"].values()),
            "counters_add_up": stats["rx"] == outcomes + drops
                               and stats["completed"] == sum(state["uses"].values()),
            "relay": {k: sum(r.counts[k] for r in relays) for k in relays[0].counts},
        }
        result["errors"] = state["errors"]
        result["passed"] = result["exact"] and result["memory_flat"] and result["counters_add_up"]
        return result
    finally:
        for r in relays:
            r.close()
        if agg is not None:
            stop_process(agg, timeout=5)


def job_args() -> list[str]:
    """``thc-aggregator`` options serving the soak's two jobs."""
    return ["--job", f"job={THC.job},key={THC.key},workers=2,slots={THC.slots}",
            "--job", f"job={INT.job},key={INT.key},workers=2,kind=uncompressed,slots={INT.slots}"]


def soak_netns(args: argparse.Namespace) -> dict:
    """The soak across namespaces (see the module's text): this module again, attached, in ``w0``."""
    from topologies.netem import NetemConfig, Topology
    from topologies.netem.ddp import start_aggregator

    cfg = NetemConfig(workers=1, rate_mbit=args.netns, loss_method="nftables", prefix="thcsoak",
                      loss_percent={"w0": args.link_loss} if args.link_loss else {})
    with tempfile.TemporaryDirectory(prefix="thc-soak-") as tmp, Topology(cfg) as net:
        ctl = str(Path(tmp) / "ctl.sock")
        agg = start_aggregator(net, [THC, INT], extra=["--control", ctl])
        cmd = [sys.executable, "-m", "benchmarks.soak", "--attach", f"{net.address('agg')}:9451", "--control", ctl,
               "--agg-pid", str(agg.pid), "--minutes", str(args.minutes), "--dim", str(args.dim), "--drop",
               str(args.drop), "--dup", str(args.dup), "--reorder", str(args.reorder), "--max-growth-mib",
               str(args.max_growth_mib), "--json"]
        proc = net.popen("w0", cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        out, err = proc.communicate(timeout=args.minutes * 60 + 180)
        if not out.strip():
            raise SystemExit(f"soak: the attached run failed: {err.strip()[-400:]}")
        res = json.loads(out)
        res["link"] = {"mbit": args.netns, "loss_percent": args.link_loss,
                       "frames_dropped": sum(net.counters().values())}
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--minutes", type=float_in(0.01, 24 * 60), default=10.0,
                    help="how long the workers exchange, 0.01..1440 (default 10)")
    ap.add_argument("--dim", type=int_in(1, 1 << 24), default=1 << 16,
                    help="coordinates per step and worker, 1..2^24 (default 2^16)")
    ap.add_argument("--drop", type=float_in(0, 0.49), default=0.01,
                    help="drop share each way at the relay, 0..0.49 (default 0.01)")
    ap.add_argument("--dup", type=float_in(0, 0.49), default=0.01,
                    help="duplicate share each way, 0..0.49 (default 0.01)")
    ap.add_argument("--reorder", type=float_in(0, 0.49), default=0.02,
                    help="reorder share each way, 0..0.49 (default 0.02)")
    ap.add_argument("--max-growth-mib", type=float_in(0, 65536), default=16.0,
                    help="most resident-memory growth after warm-up called flat, 0..65536 (default 16 MiB)")
    ap.add_argument("--netns", type=float_in(1, 100_000), metavar="MBIT",
                    help="(root) across network namespaces, the link shaped to MBIT Mbit/s, 1..100000 (see above)")
    ap.add_argument("--link-loss", type=int_in(0, 49), default=1, help="with --netns: %% of frames nftables drops each "
                                                                      "way on the link (whole %%, 0..49, default 1)")
    ap.add_argument("--attach", type=host_port, metavar="HOST:PORT", help=argparse.SUPPRESS)  # --netns's inner run
    ap.add_argument("--control", help=argparse.SUPPRESS)
    ap.add_argument("--agg-pid", type=int_in(1, 1 << 22), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if args.attach and (not args.control or args.agg_pid is None):
        ap.error("--attach needs --control and --agg-pid")
    if args.netns is not None:
        why = require_root()
        if why:
            print(f"soak: --netns skipped: {why}", file=sys.stderr)
            return 2
    res = soak_netns(args) if args.netns is not None else soak(args)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        where = "loopback" if args.netns is None else \
            f"netns, {args.netns:g} Mbit/s tbf link dropping {args.link_loss} % each way, then a"
        print(f"soak {args.minutes:g} min, {where} relay (drop {args.drop:g}, dup {args.dup:g}, reorder "
              f"{args.reorder:g} each way), 2 jobs x 2 workers, {args.dim} coordinates per step")
        if "link" in res:
            print(f"link {res['link']}")
        print(f"steps {res['steps']}  exact {res['exact']}  uses finished {res['uses_finished']}")
        print(f"aggregator RSS {res['rss_warm_mib']:.1f} -> {res['rss_end_mib']:.1f} MiB (flat: {res['memory_flat']})")
        print(f"counters {res['aggregator']} dropped {res['dropped']}  add up: {res['counters_add_up']}")
        print(f"relay {res['relay']}")
        for e in res["errors"]:
            print(f"error: {e}")
        print("PASSED" if res["passed"] else "FAILED")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
