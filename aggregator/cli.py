"""``thc-aggregator``: serve THC aggregation over UDP (see docs/aggregator.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aggregator.control import ControlAddress, ControlConfig, read_token
from aggregator.server import AggregatorServer, ServerConfig
from aggregator.tier_server import TierServer, TierServerConfig
from worker_lib.cli.args import float_in, host_port, int_in, ipv4_host, log_level, port_number
from worker_lib.job import DEFAULT_JOB_ID, DEFAULT_KEY, load_jobs, parse_job_spec, unique_jobs
from worker_lib.wire.layout import THC_UDP_PORT


def _control_address(text: str) -> ControlAddress:
    try:
        return ControlAddress.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _member(text: str) -> tuple[int, int]:
    """I/N: member I (0-based) of N aggregators, N in 1..64."""
    i, sep, n = text.partition("/")
    if not sep or not i.strip().isdigit() or not n.strip().isdigit() or not 0 <= int(i) < int(n) <= 64:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N <= 64 (member I of N), got {text!r}")
    return int(i), int(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="thc-aggregator",
        description="Userspace THC aggregator: table lookups and integer sums per slot, as a switch does "
                    "(protocol: docs/protocol.md). Without --config or --job it serves job "
                    f"{DEFAULT_JOB_ID} (key {DEFAULT_KEY:#x}, 4 workers, b=4, g=30, p=1/32).",
        epilog="Jobs: --job 'job=2,key=0x1234,workers=8,threshold=7,bits=4,granularity=30,p=1/32,"
               "result_bits=16,slots=128,elems=512' or a decompress-aggregate-recompress job 'job=3,kind=dar,"
               "codec=topk10,length=65536,max_message=65536,workers=4,slots=4' (repeatable) or a TOML file "
               "(--config, reloaded on SIGHUP). SIGINT/SIGTERM stop cleanly.")
    p.add_argument("--host", type=ipv4_host, default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=port_number, default=THC_UDP_PORT,
                   help=f"UDP port of shard 0 (shard i uses port+i); 0 picks a free range (default {THC_UDP_PORT})")
    p.add_argument("--shards", type=int_in(1, 64), default=1, help="processes; shard i owns slots s with s mod P == i")
    p.add_argument("--member", type=_member, default=(0, 1), metavar="I/N",
                   help="this aggregator is member I of N serving the same jobs (one per machine, each with the "
                        "same --shards P): its shard i owns slots s with s mod (N*P) == I*P + i; workers list "
                        "the N aggregators in member order (default 0/1: the only one)")
    p.add_argument("--role", choices=("flat", "leaf", "spine"), default="flat",
                   help="flat (default): the one-tier aggregator; leaf or spine: a tier of a two-tier job "
                        "(job option leaves=N0:N1:..., docs/protocol.md 'Two tiers'), with --host, --port, "
                        "--job/--config, --batch, --engine (a leaf) and --stats-interval only; a spine runs the "
                        "reference state machine")
    p.add_argument("--leaf", type=int_in(0, 31), metavar="L", help="--role leaf: this leaf's index in leaves=")
    p.add_argument("--upstream", type=host_port, metavar="HOST:PORT", help="--role leaf: the spine's address")
    p.add_argument("--parent-loss", type=float_in(0, 0.99), default=0.0, metavar="P",
                   help="--role leaf: drop this fraction of the packets to and from the spine (seeded by "
                        "--seed; to test recovery from loss on the leaf-spine link)")
    p.add_argument("--seed", type=int_in(0, (1 << 32) - 1), default=0, help="seed of --parent-loss")
    p.add_argument("--config", type=Path, help="TOML job file ([[job]] tables), reloaded on SIGHUP")
    p.add_argument("--job", action="append", default=[], metavar="SPEC", help="a job as key=value pairs")
    p.add_argument("--multicast", action="store_true",
                   help="send results once to each job's multicast group (job option multicast=GROUP:PORT)")
    p.add_argument("--batch", type=int_in(1, 4096), default=256, help="datagrams per recvmmsg/sendmmsg (default 256)")
    p.add_argument("--engine", choices=("compiled", "numpy", "reference"), default="compiled",
                   help="the state table as one compiled loop (numba; default) or as numpy batch operations; "
                        "--role leaf also takes reference (the reference leaf, one datagram at a time)")
    p.add_argument("--busy-poll", action="store_true", help="spin on the socket instead of sleeping in select")
    p.add_argument("--gro", action=argparse.BooleanOptionalAction, default=True,
                   help="read runs of datagrams that arrive whole as one message (UDP_GRO), where the kernel "
                        "has it (default: on; --no-gro reads datagram by datagram; docs/aggregator.md)")
    p.add_argument("--stats-interval", type=float_in(0, 86400), default=0.0, metavar="SECONDS",
                   help="print packets/s, elements/s, drops, stragglers and completions every SECONDS")
    p.add_argument("--metrics-port", type=port_number,
                   help="export the counters for Prometheus on this TCP port (on --metrics-host)")
    p.add_argument("--metrics-host", type=ipv4_host, default="127.0.0.1",
                   help="address of the Prometheus endpoint (default: loopback only)")
    p.add_argument("--control", metavar="PATH|HOST:PORT", type=_control_address,
                   help="accept the commands 'add SPEC', 'remove ID', 'list', 'stats' (thc-control) on a Unix "
                        "socket PATH (mode 0600) or a UDP HOST:PORT (port 0: any); an address off loopback "
                        "needs --control-token-file")
    p.add_argument("--control-token-file", type=Path, metavar="FILE",
                   help="a file (chmod 600) whose first line is a shared token of >= 16 bytes; every "
                        "command must then carry it (thc-control --token-file FILE)")
    p.add_argument("--pcap", type=Path, help="write every received and sent datagram to this pcap file")
    p.add_argument("--log-level", type=log_level, default="WARNING",
                   help="DEBUG, INFO, WARNING (default), ERROR or CRITICAL")
    return p


#: Options of the one-tier server that a tier does not take.
_FLAT_ONLY = ("shards", "member", "multicast", "busy_poll", "gro", "metrics_port", "control",
              "control_token_file", "pcap")


def _say(line: str) -> None:
    """Print a status line (listening, statistics, reloads, control changes) at once. Once stdout's reader is
    gone (``thc-aggregator | head``, a closed log pipe), the lines are dropped and the server keeps serving:
    a BrokenPipeError used to end it. stdout then points at /dev/null, so that the interpreter's flush at
    exit does not raise again (the ``signal``/``SIGPIPE`` note of Python's documentation)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _refused(exc: Exception) -> int:
    """One line on stderr; exit status 2 for a configuration out of range, 1 for an address or file it
    cannot use."""
    print(f"thc-aggregator: {exc}", file=sys.stderr)
    return 1 if isinstance(exc, OSError) else 2


def serve_tier(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--role leaf|spine``: serve a tier of two-tier jobs until a signal."""
    given = [f"--{'no-' if getattr(args, name) is False else ''}{name.replace('_', '-')}" for name in _FLAT_ONLY
             if getattr(args, name) != parser.get_default(name)]
    if args.role == "spine" and args.engine not in (parser.get_default("engine"), "reference"):
        given.append(f"--engine {args.engine} (a spine runs the reference state machine)")
    if given:
        print(f"thc-aggregator: --role {args.role} does not take {', '.join(given)}", file=sys.stderr)
        return 2
    try:
        jobs = unique_jobs([parse_job_spec(s) for s in args.job], "--job")
        jobs += load_jobs(args.config) if args.config else []
        server = TierServer(TierServerConfig(args.role, jobs, host=args.host, port=args.port, leaf=args.leaf,
                                             upstream=args.upstream, batch=args.batch,
                                             stats_interval=args.stats_interval, parent_loss=args.parent_loss,
                                             seed=args.seed, engine=args.engine),
                            out=_say)
    except (ValueError, OSError) as exc:  # JobConfigError is a ValueError
        return _refused(exc)
    server.install_signal_handlers()
    ids = ", ".join(f"{j.job} ({j.kind}, leaves={':'.join(map(str, j.leaves))}, threshold={j.threshold}, "
                    f"K={j.elems}, S={j.slots})" for j in server.jobs)
    where = f" leaf={args.leaf} upstream={args.upstream[0]}:{args.upstream[1]}" if args.role == "leaf" else ""
    _say(f"thc-aggregator listening on {args.host}:{server.port} role={args.role}{where} jobs: {ids}")
    server.serve()
    _say("thc-aggregator stopped: " + " ".join(f"{k}={v}" for k, v in server.totals().items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role != "flat":
        return serve_tier(args, parser)
    if args.leaf is not None or args.upstream is not None or args.parent_loss:
        print("thc-aggregator: --leaf, --upstream and --parent-loss are for --role leaf", file=sys.stderr)
        return 2
    try:
        jobs = unique_jobs([parse_job_spec(s) for s in args.job], "--job")
        control = None
        if args.control is not None:
            token = read_token(args.control_token_file) if args.control_token_file else None
            control = ControlConfig(args.control, token)
        elif args.control_token_file is not None:
            raise ValueError("--control-token-file needs --control")
        cfg = ServerConfig(host=args.host, port=args.port, shards=args.shards, member=args.member[0],
                           members=args.member[1], batch=args.batch,
                           multicast=args.multicast, busy_poll=args.busy_poll, gro=args.gro,
                           stats_interval=args.stats_interval, metrics_port=args.metrics_port,
                           metrics_host=args.metrics_host, config_path=args.config, jobs=jobs, pcap=args.pcap,
                           control=control, engine=args.engine)
        server = AggregatorServer(cfg, out=_say)
    except (ValueError, OSError) as exc:  # JobConfigError is a ValueError
        return _refused(exc)
    server.install_signal_handlers()
    ids = ", ".join(f"{j.job} ({j.kind}{'/' + j.codec if j.codec else ''}, n={j.workers}, "
                    f"threshold={j.threshold}, K={j.elems}, S={j.slots})"
                    for j in server.jobs)
    control = f" control={server.control.address}" if server.control is not None else ""
    member = f" member={args.member[0]}/{args.member[1]}" if args.member[1] > 1 else ""
    _say(f"thc-aggregator listening on {args.host}:{server.port} shards={args.shards}{member}{control} jobs: {ids}")
    server.serve()
    _say("thc-aggregator stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
