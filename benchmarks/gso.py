"""What UDP segmentation offload saves a worker: the CPU time of sending its datagrams (not a timed test).

A worker's ``Transport`` sends the first copies of a window of uses either datagram by datagram
(``sendto`` per datagram, ``gso=False``) or as runs of up to 64 datagrams per system call with
UDP_SEGMENT (the default where the kernel has it). Both modes send the same datagrams (1500-byte MTU
packets of a 4-bit THC job) to a loopback socket that nobody reads (the kernel drops what overflows it,
after the sender's work is done), in interleaved rounds, and the sender's CPU time per datagram is
reported with their ratio. CPU time, not wall time: a worker shares its cores with training and the
aggregator, and what the send path costs is what it takes from them.

    python -m benchmarks.gso [--datagrams 20000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import numpy as np

from worker_lib.cli.args import int_in
from worker_lib.job import JobConfig
from worker_lib.transport import Transport, TransportConfig
from worker_lib.udp_offload import gso_available
from worker_lib.wire.layout import HEADER_BYTES

#: The most --datagrams: the rows to send are built up front, one DATA request of about 750 bytes each.
MAX_DATAGRAMS = 1_000_000


def cpu_per_datagram(tr: Transport, rows: np.ndarray, gso: bool) -> float:
    """Seconds of this process's CPU per datagram to send ``rows`` in runs of one window (64 uses)."""
    tr.gso = gso
    t0 = time.process_time()
    for start in range(0, rows.shape[0], 64):
        run = rows[start:start + 64]
        if gso:
            tr._send_run(run)
        else:
            for row in run:
                tr._send(row, 0)
    return (time.process_time() - t0) / rows.shape[0]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gso", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--datagrams", type=int_in(64, MAX_DATAGRAMS), default=20000,
                    help=f"datagrams per mode per round, 64 (one run of 64) to {MAX_DATAGRAMS:,} (all held in "
                         "memory, about 750 bytes each) (default 20000)")
    ap.add_argument("--rounds", type=int_in(1, 1000), default=5,
                    help="interleaved rounds, 1..1000; medians reported (default 5)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    if not gso_available(sink):
        print("this kernel has no UDP_SEGMENT: nothing to compare", file=sys.stderr)
        return 1
    cfg = JobConfig(workers=4, mtu=1500)
    length = HEADER_BYTES + cfg.data_bytes  # one DATA request
    rows = np.random.default_rng(0).integers(0, 256, (args.datagrams, length), dtype=np.uint8)
    per: dict[str, list[float]] = {"sendto": [], "gso": []}
    with sink, Transport(TransportConfig(cfg, worker=0, aggregator=sink.getsockname())) as tr:
        for _ in range(args.rounds):
            per["sendto"].append(cpu_per_datagram(tr, rows, gso=False))
            per["gso"].append(cpu_per_datagram(tr, rows, gso=True))
    med = {k: statistics.median(v) for k, v in per.items()}
    out = {"datagram_bytes": length, "us_per_datagram_sendto": med["sendto"] * 1e6,
           "us_per_datagram_gso": med["gso"] * 1e6, "sendto_over_gso": med["sendto"] / med["gso"]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{length}-byte datagrams, runs of 64, CPU per datagram (median of {args.rounds}): "
              f"sendto {out['us_per_datagram_sendto']:.2f} us, GSO {out['us_per_datagram_gso']:.2f} us, "
              f"{out['sendto_over_gso']:.2f}x less with GSO")
    return 0


if __name__ == "__main__":
    sys.exit(main())
