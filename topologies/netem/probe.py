"""UDP probe for the emulated network: a sender and a receiver that measure goodput and loss.

    python -m topologies.netem.probe recv --bind 10.77.0.1:9000 --idle 1.0
    python -m topologies.netem.probe send --to 10.77.0.1:9000 --seconds 1 [--pps 2000]

The receiver prints one JSON line (packets, bytes, first-to-last seconds, Mbit/s) once nothing has
arrived for ``--idle`` seconds after the first packet (or after ``--wait`` seconds with none). The
sender prints how many datagrams it sent. Multicast: ``recv --group 239.7.7.7`` joins the group on
the ``--bind`` address.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time


def receive(bind: str, port: int, idle: float, wait: float, group: str | None = None) -> dict[str, float]:
    """Count datagrams until ``idle`` seconds pass without one (``wait`` before the first)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    if group:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((group, port))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(bind))
    else:
        s.bind((bind, port))
    print("ready", flush=True)
    packets = nbytes = 0
    first = last = 0.0
    limit = time.monotonic() + wait
    while True:
        timeout = (last + idle if packets else limit) - time.monotonic()
        ready, _, _ = select.select([s], [], [], max(timeout, 0.0))
        if not ready:
            if timeout <= 0:  # idle (a late wakeup still drains what is queued first)
                break
            continue
        data = s.recv(65536)
        last = time.monotonic()
        if not packets:
            first = last
        packets += 1
        nbytes += len(data)
    s.close()
    secs = max(last - first, 1e-9)
    mbit = nbytes * 8 / secs / 1e6 if packets > 1 else 0.0
    return {"packets": packets, "bytes": nbytes, "seconds": secs, "mbit_s": mbit}


def send(host: str, port: int, seconds: float, size: int, pps: float | None, count: int | None) -> int:
    """Send datagrams of ``size`` bytes for ``seconds`` (or ``count`` of them), paced at ``pps`` if given."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    payload = bytes(size)
    sent = 0
    t0 = time.monotonic()
    while True:
        now = time.monotonic()
        if (count is not None and sent >= count) or (count is None and now - t0 >= seconds):
            break
        if pps and sent > (now - t0) * pps:
            time.sleep(min(0.001, sent / pps - (now - t0)))
            continue
        try:
            s.sendto(payload, (host, port))
            sent += 1
        except (BlockingIOError, ConnectionRefusedError):
            pass
    s.close()
    return sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m topologies.netem.probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv", help="count datagrams, print JSON")
    r.add_argument("--bind", required=True, metavar="HOST:PORT")
    r.add_argument("--group", help="join this IPv4 multicast group on the --bind address")
    r.add_argument("--idle", type=float, default=1.0, help="stop after this long without a datagram")
    r.add_argument("--wait", type=float, default=20.0, help="give up after this long with no datagram at all")
    s = sub.add_parser("send", help="send datagrams")
    s.add_argument("--to", required=True, metavar="HOST:PORT")
    s.add_argument("--seconds", type=float, default=1.0)
    s.add_argument("--count", type=int, help="send exactly this many datagrams instead")
    s.add_argument("--size", type=int, default=1400, help="UDP payload bytes")
    s.add_argument("--pps", type=float, help="pace to this many datagrams per second")
    args = p.parse_args(argv)
    if args.cmd == "recv":
        host, _, port = args.bind.rpartition(":")
        print(json.dumps(receive(host, int(port), args.idle, args.wait, args.group)), flush=True)
    else:
        host, _, port = args.to.rpartition(":")
        print(json.dumps({"sent": send(host, int(port), args.seconds, args.size, args.pps, args.count)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
