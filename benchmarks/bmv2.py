"""BMv2 throughput of the THC pipeline next to plain IPv4 forwarding, same switch, same run.

    sudo python -m benchmarks.bmv2 --workers 4 --chunks 2000 --elems 32 --bits 4

(run it as a module from the repository root: benchmarks/aggregator.py would shadow the aggregator
package if the script ran as a file)

Topology: topologies.nsstar (n host namespaces around simple_switch_grpc, no Mininet). Two phases on
the same switch process and program, with frames of the same size (a THC DATA frame):

- THC: every worker sends DATA for chunk c on slot c mod S, round c div S; a window of S chunks
  (n*S packets) is sent, then the phase waits for the n*S RESULT copies before the next window (the
  worker protocol's flow control: a slot is reused only once its previous round completed).
  Reported: DATA packets the switch took in per second, RESULT packets out per second, aggregated
  elements per second (K per completed chunk).
- IPv4: the same number of frames of the same size, in windows of the same n*S frames, from host i to
  an address routed to host i+1 (not the host's own address, so its kernel drops the frame silently
  instead of answering); packets per second forwarded.

The ratio THC/IPv4 says what the per-element lookups and register updates cost on BMv2. Results are
those of this machine and this BMv2 build (a debug build with logging is much slower); the JSON line
records both so a run can be compared only with runs of the same build.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from aggregator.p4rt import ThcSwitch
from p4gen.bmv2 import Geometry
from topologies.bmv2 import CONTROL_TIMEOUT, Bmv2Config, Bmv2Switch, compile_program
from topologies.netns import PACKET_OUTGOING
from topologies.nsstar import SERVICE_IP, SWITCH_MAC, NsStar
from worker_lib.cli.args import int_in
from worker_lib.job import JobConfig
from worker_lib.wire import Header, PacketType, pack_bits
from worker_lib.wire.layout import THC_UDP_PORT

log = logging.getLogger("benchmarks.bmv2")


def _drain_count(socks: dict, want: int, timeout: float, match) -> int:
    """Receive on all sockets until ``want`` frames satisfying ``match`` arrived or ``timeout`` passed."""
    by_fd = {s.fileno(): s for s in socks.values()}
    got = 0
    end = time.monotonic() + timeout
    while got < want and time.monotonic() < end:
        ready, _, _ = select.select(list(by_fd), [], [], 0.05)
        for fd in ready:
            s = by_fd[fd]
            while True:
                try:
                    data, addr = s.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] != PACKET_OUTGOING and match(data):
                    got += 1
    return got


def job_config(workers: int, elems: int, bits: int, slots: int) -> JobConfig:
    """The benchmark's job (g = min(30, 255 // n), so that n 8-bit sums cannot overflow; p = 1/32)."""
    return JobConfig(job=1, key=0x54484321, workers=workers, bits=bits, granularity=min(30, 255 // workers),
                     p=1 / 32, elems=elems, result_bits=8, slots=slots)


def geometry(elems: int, bits: int, slots: int) -> Geometry:
    """The program's geometry for the job (at least 64 slots)."""
    return Geometry(elems=elems, bits=bits, result_bits=8, slots=max(64, slots))


def run(workers: int, chunks: int, elems: int, bits: int, slots: int, workdir: Path) -> dict:
    """Both phases on one switch; the measurements as a dict."""
    g = geometry(elems, bits, slots)
    prog = compile_program(workdir / "program", elems=g.elems, bits=g.bits, result_bits=g.result_bits, slots=g.slots)
    cfg = job_config(workers, elems, bits, slots)
    rng = np.random.default_rng(0)
    with NsStar(workers, prefix=f"thcbn{os.getpid() % 10000}") as star:
        sw = Bmv2Switch(Bmv2Config(star.interfaces, workdir / "switch", netns=star.switch_ns, pcap=False,
                                   log_level="off"))
        with sw, ThcSwitch(sw.address, timeout=CONTROL_TIMEOUT) as ctl:
            ctl.load(prog.p4info, prog.json)
            ctl.add_service(SERVICE_IP, SWITCH_MAC)
            for prefix, mac, port in star.routes():
                ctl.add_route(prefix, mac, port)
            for h in star.hosts:  # "foreign" addresses routed to each host, for the IPv4 phase
                ctl.add_route(f"10.0.1.{h.port + 1}/32", h.mac, h.port)
            ctl.configure_job(cfg, tuple(h.port for h in star.hosts))
            socks = {h.port: h.ns.raw_socket(h.ifname) for h in star.hosts}
            # UDP sockets on the workers' ports swallow results, so that no ICMP goes back to the switch.
            sinks = [h.ns.call_inside(lambda h=h: _udp_sink(h.ip, 40000 + h.port)) for h in star.hosts]
            try:
                thc_frames = []
                for c in range(chunks):
                    for h in star.hosts:
                        idx = rng.integers(0, 1 << bits, elems, dtype=np.uint8)
                        thc = Header(type=PacketType.DATA, job=cfg.job, key=cfg.key, table_id=cfg.table_id,
                                     worker=h.port, slot=c % slots, round=(c // slots) & 0xFFFF, chunk=c, elems=elems,
                                     width=bits).pack(pack_bits(idx, bits).tobytes())
                        thc_frames.append((h.port, bytes(
                            Ether(src=h.mac, dst=SWITCH_MAC) / IP(src=h.ip, dst=SERVICE_IP)
                            / UDP(sport=40000 + h.port, dport=THC_UDP_PORT) / Raw(thc))))
                size = len(thc_frames[0][1])
                ip_frames = []
                for _c in range(chunks):
                    for h in star.hosts:
                        dst = star.hosts[(h.port + 1) % workers]
                        pad = size - 14 - 20 - 8
                        ip_frames.append((h.port, bytes(
                            Ether(src=h.mac, dst=SWITCH_MAC) / IP(src=h.ip, dst=f"10.0.1.{dst.port + 1}")
                            / UDP(sport=5000, dport=5001) / Raw(bytes(pad)))))
                window = workers * slots

                def is_result(d: bytes) -> bool:
                    return len(d) > 42 + 2 and d[23] == 17 and int.from_bytes(d[34:36], "big") == THC_UDP_PORT

                def is_fwd(d: bytes) -> bool:
                    return len(d) > 36 and d[23] == 17 and int.from_bytes(d[36:38], "big") == 5001

                thc = _phase(socks, thc_frames, window, is_result)
                ipv4 = _phase(socks, ip_frames, window, is_fwd)
                stats = ctl.stats()
            finally:
                for s in [*socks.values(), *sinks]:
                    s.close()
    thc_pps = thc["sent"] / thc["seconds"]
    ip_pps = ipv4["sent"] / ipv4["seconds"]
    return {"workers": workers, "chunks": chunks, "K": elems, "b": bits, "frame_bytes": size, "window_packets": window,
            "thc_packets_in_per_s": thc_pps, "thc_results_out_per_s": thc["received"] / thc["seconds"],
            "thc_elements_per_s": stats["COMPLETED"] * elems / thc["seconds"],
            "ipv4_packets_per_s": ip_pps, "thc_over_ipv4": thc_pps / ip_pps,
            "thc_lost": thc["sent"] - thc["received"], "ipv4_lost": ipv4["sent"] - ipv4["received"],
            "switch_counters": {k: v for k, v in stats.items() if v}}


def _udp_sink(ip: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    return s


def _phase(socks: dict, frames: list[tuple[int, bytes]], window: int, match) -> dict:
    """Send ``frames`` in windows of ``window``; after each, wait for ``window`` matching receptions."""
    sent = received = 0
    t0 = time.perf_counter()
    for start in range(0, len(frames), window):
        batch = frames[start:start + window]
        for port, f in batch:
            socks[port].send(f)
        sent += len(batch)
        received += _drain_count(socks, len(batch), timeout=10.0, match=match)
    return {"sent": sent, "received": received, "seconds": time.perf_counter() - t0}


def work_dir(text: str) -> Path:
    """An argparse type: a folder to work in (made if missing; not a file, not empty)."""
    path = Path(text)
    if not text or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: run both phases and print one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workers", type=int_in(1, 32), default=4, help="worker hosts n, 1..32 (default 4)")
    ap.add_argument("--chunks", type=int_in(1, 100_000), default=1000,
                    help="chunks per worker, 1..100000 (default 1000)")
    ap.add_argument("--elems", type=int_in(8, 65528), default=32,
                    help="K, a multiple of 8 whose results fit a 1500-byte MTU (default 32)")
    ap.add_argument("--bits", type=int_in(1, 8), default=4,
                    help="b, 1..8 with 2^b - 1 <= min(30, 255 // n), the granularity (default 4)")
    ap.add_argument("--slots", type=int_in(1, 65536), default=16, help="slots S = chunks per window, 1..65536 "
                                                                       "(default 16)")
    ap.add_argument("--workdir", type=work_dir, default=Path(tempfile.gettempdir()) / "thc-bmv2-bench",
                    help="folder for the compiled program and the switch's files (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        job_config(args.workers, args.elems, args.bits, args.slots)
        geometry(args.elems, args.bits, args.slots)
    except ValueError as exc:  # JobConfigError included
        ap.error(f"--workers {args.workers} --elems {args.elems} --bits {args.bits} --slots {args.slots}: {exc}")
    logging.basicConfig(level=logging.WARNING)
    if os.geteuid() != 0:
        sys.stderr.write("benchmarks.bmv2: needs root (network namespaces)\n")
        return 1
    try:
        out = run(args.workers, args.chunks, args.elems, args.bits, args.slots, args.workdir)
    except (RuntimeError, OSError) as exc:
        sys.stderr.write(f"benchmarks.bmv2: {exc}\n")
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
