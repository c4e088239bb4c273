"""``python -m topologies.netem``: build, inspect, check and remove an emulated THC network.

    python -m topologies.netem selftest --workers 2 --rate-mbit 100 --loss w1=10
    python -m topologies.netem up --prefix thcx --workers 4 --rate-mbit 1000     # stays up; prints names
    ip netns exec thcx-w0 ...                                                     # your experiment
    python -m topologies.netem down --prefix thcx
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from topologies.netem import NetemConfig, NetemError, Topology, remove_prefix, require_root


def parse_loss(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        node, sep, pct = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--loss wants NODE=PERCENT, got {item!r}")
        out[node] = float(pct)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m topologies.netem", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Nodes are 'agg' and 'w0'..'w<n-1>', each in namespace <prefix>-<node>, on "
                                       "10.77.0.0/24 through a bridge in <prefix>-br. Needs root.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text in (("up", "build the network and leave it up"),
                       ("selftest", "build it, measure shaping, loss and multicast with UDP probes, remove it")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--prefix", default="", help="namespace prefix (default thc<pid>; at most 10 characters)")
        s.add_argument("--workers", type=int, default=2)
        s.add_argument("--rate-mbit", type=float, default=1000.0, help="every link, both directions (0: unshaped)")
        s.add_argument("--qdisc", choices=("tbf", "htb"), default="tbf")
        s.add_argument("--loss", action="append", default=[], metavar="NODE=PERCENT",
                       help="random loss per direction at NODE's link (repeatable)")
        s.add_argument("--loss-method", choices=("auto", "netem", "nftables"), default="auto")
        s.add_argument("--subnet", default="10.77.0.0/24")
    d = sub.add_parser("down", help="delete the namespaces <prefix>-* of a network left up")
    d.add_argument("--prefix", required=True)
    return p


def config(args: argparse.Namespace) -> NetemConfig:
    return NetemConfig(workers=args.workers, rate_mbit=args.rate_mbit or None, loss_percent=parse_loss(args.loss),
                       loss_method=args.loss_method, qdisc=args.qdisc, subnet=args.subnet, prefix=args.prefix)


def selftest(net: Topology) -> dict:
    """UDP goodput w0 -> agg for 1 s, loss of 2000 paced datagrams from each lossy worker, multicast agg -> w*."""
    probe = [sys.executable, "-m", "topologies.netem.probe"]
    agg = net.address("agg")
    out: dict = {"addresses": {n: net.address(n) for n in net.cfg.nodes}, "loss_method": net.loss_method}

    def measure(receivers: list[tuple[str, list[str]]], sender: str, send_args: list[str]) -> list[dict]:
        rx = [net.popen(node, [*probe, "recv", *a, "--idle", "0.5"], stdout=subprocess.PIPE, text=True)
              for node, a in receivers]
        for r in rx:
            r.stdout.readline()  # "ready"
        subprocess.run(net.command(sender, [*probe, "send", *send_args]), check=True, capture_output=True, timeout=60)
        return [json.loads(r.communicate(timeout=60)[0]) for r in rx]

    out["goodput_w0_to_agg"] = measure([("agg", ["--bind", f"{agg}:9000"])], "w0",
                                       ["--to", f"{agg}:9000", "--seconds", "1"])[0]
    for node, pct in net.cfg.loss_percent.items():
        if node.startswith("w"):
            got = measure([("agg", ["--bind", f"{agg}:9001"])], node,
                          ["--to", f"{agg}:9001", "--count", "2000", "--pps", "2000"])[0]
            out[f"delivered_from_{node}"] = {"sent": 2000, "received": got["packets"], "loss_percent": pct}
    group = "239.7.7.7"
    workers = [n for n in net.cfg.nodes if n != "agg"]
    got = measure([(w, ["--bind", f"{net.address(w)}:9500", "--group", group]) for w in workers], "agg",
                  ["--to", f"{group}:9500", "--count", "200", "--pps", "1000"])
    out["multicast_received"] = {w: g["packets"] for w, g in zip(workers, got, strict=True)}
    out["nft_drops"] = net.counters()
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    why = require_root()
    if why:
        print(f"topologies.netem: {why}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "down":
            print(json.dumps({"removed": remove_prefix(args.prefix)}))
            return 0
        net = Topology(config(args))
        if args.cmd == "up":
            net.up()
            print(json.dumps({"prefix": net.prefix, "namespaces": net.namespaces(), "loss_method": net.loss_method,
                              "addresses": {n: net.address(n) for n in net.cfg.nodes}}))
            return 0
        with net:
            print(json.dumps(selftest(net), indent=1))
        return 0
    except (NetemError, ValueError, subprocess.SubprocessError) as exc:
        print(f"topologies.netem: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
