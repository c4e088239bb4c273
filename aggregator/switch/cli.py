"""``thc-switch``: load the THC program onto a switch and configure it: BMv2 over P4Runtime, Tofino
through bfrt_python scripts.

    thc-switch --switch 127.0.0.1:9559 load --p4info build/thc.p4info.txtpb --json build/thc.json \\
        --service 10.0.0.100,02:00:00:00:01:00 --route 10.0.0.1/32,00:00:00:00:00:01,1
    thc-switch --switch 127.0.0.1:9559 job --job 'job=1,key=0x54484321,workers=4,elems=32,result_bits=8' \\
        --ports 1,2,3,4
    thc-switch --switch 127.0.0.1:9559 stats
    thc-switch --switch 127.0.0.1:9559 job --job 'job=1,leaves=4:4,elems=32' --ports 1,2,3,4 \
        --leaf 0 --upstream 10.0.1.200:9460 --upstream-mac 02:00:00:00:02:01 --upstream-port 5
    thc-switch --switch 127.0.0.1:9560 job --job 'job=1,leaves=4:4,elems=32' --ports 1,2 --spine

Tofino (p4src/tofino/thc.p4; docs/tofino.md): ``load --target tofino`` writes a bfrt_python script that
configures ports, resets the registers and installs services, routes and jobs (lookup entries, PRE nodes
and group, job entry), and runs it in bfshell where the SDE is installed ($SDE/run_bfshell.sh):

    thc-switch load --target tofino --job 'job=1,workers=4,elems=32,result_bits=8' --ports 1,2,3,4 \\
        --service 10.0.0.100,02:00:00:00:01:00 --output thc_load.py
    thc-switch stats --target tofino

A Tofino leaf of two-tier jobs runs the program ``python -m p4gen.tofino --leaf`` renders; its load script
takes the same --leaf and --upstream options as ``job`` does on BMv2:

    thc-switch load --target tofino --geometry 32,4,8,4096,8 --job 'job=1,leaves=4:4,elems=32' \\
        --ports 1,2,3,4 --leaf 0 --upstream 10.0.1.200:9451 --upstream-mac 02:00:00:00:02:01 --upstream-port 5
    thc-switch stats --target tofino --leaf
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from aggregator.bfrt import (
    BfrtUnavailable,
    TofinoJob,
    TofinoPlan,
    TofinoProgram,
    bfrt_load_script,
    bfrt_stats_script,
    bfshell,
    parse_stats_output,
    run_bfrt_script,
    tofino_geometry,
)
from aggregator.control import ControlAddress, ControlConfigError, read_token
from aggregator.placement import Fallback, JobPlacer
from aggregator.switch.entries import Uplink, mac_int, route_entry, service_entry
from aggregator.switch.errors import SwitchError
from p4gen.tofino import TofinoGeometry
from worker_lib.cli.args import comma_list, float_in, host_port, int_in, log_level
from worker_lib.job import JobConfig, JobConfigError, load_jobs, parse_job_spec, unique_jobs

if TYPE_CHECKING:
    from p4.config.v1.p4info_pb2 import P4Info

TARGETS = ("bmv2", "tofino", "tofino2")
log = logging.getLogger(__name__)

#: A switch's device port: 9 bits on every target (BMv2's v1model ports and the programs' ``bit<9>``
#: port parameters; Tofino's and Tofino 2's ``PortId_t`` is ``bit<9>``), so 0..511.
device_port = int_in(0, 511)
#: The ports of a job's workers (or leaves), in order; one port twice would send one of them every result twice.
port_list = comma_list(device_port, "1,2,3,4")
#: Job ids are 16 bits on the wire (worker_lib.job.JobConfig).
job_id = int_in(0, 0xFFFF)
#: P4Runtime's device id is a uint64, and so is the low half of the election id this client sends.
uint64 = int_in(0, (1 << 64) - 1)
#: Seconds: a day bounds the waits; a P4Runtime call needs some time (a timeout of 0 would fail every call).
wait_seconds = float_in(0.0, 86400.0)
call_seconds = float_in(0.001, 86400.0)


def switch_address(text: str) -> str:
    """An argparse type: ``unix:/path``, ``HOST:PORT`` or ``PORT`` with a port in 1..65535, returned as
    given: SwitchAddress.parse reads it when a BMv2 command connects (importing grpc only then)."""
    if text.startswith("unix:"):
        if text == "unix:":
            raise argparse.ArgumentTypeError("expected unix:/path, got 'unix:' (no path)")
        return text
    host_port(text if ":" in text else f":{text}")
    return text


def service(text: str) -> tuple[str, str]:
    """An argparse type: ``IP,MAC``, an aggregator address of the switch and the MAC its answers come from."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected IP,MAC, got {text!r}")
    try:
        service_entry(*parts)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parts[0], parts[1]


def route(text: str) -> tuple[str, str, int]:
    """An argparse type: ``PREFIX,MAC,PORT``, an IPv4 route (prefix, next-hop MAC, egress device port)."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected PREFIX,MAC,PORT, got {text!r}")
    port = device_port(parts[2])
    try:
        route_entry(parts[0], parts[1], port)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parts[0], parts[1], port


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``thc-switch`` (sub-commands load, job, remove, jobs, stats)."""
    p = argparse.ArgumentParser(prog="thc-switch", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", type=switch_address, default="127.0.0.1:9559",
                   help="P4Runtime address host:port or unix:/path (default %(default)s)")
    p.add_argument("--device-id", type=uint64, default=0, help="P4Runtime device id (default 0)")
    p.add_argument("--election-id", type=uint64, default=1, help="election id of this controller (default 1)")
    p.add_argument("--wait", type=wait_seconds, default=0.0, metavar="SECONDS",
                   help="poll the switch's gRPC port up to SECONDS before connecting (default: do not wait)")
    p.add_argument("--timeout", type=call_seconds, default=10.0, help="seconds per P4Runtime call (default 10)")
    p.add_argument("--log-level", type=log_level, default="WARNING",
                    help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    ld = sub.add_parser("load", help="push the program (P4Info + BMv2 JSON), then services and routes; "
                        "--target tofino: write (and run where the SDE is) the bfrt_python script")
    ld.add_argument("--target", choices=TARGETS, default="bmv2",
                    help="switch kind: bmv2, tofino (Tofino 1) or tofino2 (Tofino 2) (default bmv2)")
    ld.add_argument("--p4info", type=Path, help="bmv2: P4Info file written by p4c (text format)")
    ld.add_argument("--json", type=Path, help="bmv2: BMv2 JSON written by p4c-bm2-ss")
    ld.add_argument("--job", action="append", default=[], metavar="SPEC",
                    help="tofino: a job to install, key=value pairs as for thc-aggregator --job (repeatable)")
    ld.add_argument("--config", type=Path, help="tofino: TOML job file (all its jobs are installed)")
    ld.add_argument("--ports", type=port_list, action="append", default=[], metavar="P1,P2,...",
                    help="tofino: device port of each worker of a job, one --ports per job in order")
    ld.add_argument("--output", type=Path, help="tofino: where to write the script (default: print it)")
    ld.add_argument("--no-run", action="store_true", help="tofino: only write the script, even where the SDE is")
    ld.add_argument("--sde", help="tofino: the SDE directory (default $SDE)")
    ld.add_argument("--geometry", metavar="K,B,RESULT_BITS,SLOTS,JOBS",
                    help="tofino: the geometry p4gen/tofino.py rendered the program with (default: its defaults "
                         "for the target)")
    ld.add_argument("--service", type=service, action="append", default=[], metavar="IP,MAC",
                    help="an aggregator address of the switch and the MAC its answers come from (repeatable)")
    ld.add_argument("--route", type=route, action="append", default=[], metavar="PREFIX,MAC,PORT",
                    help="an IPv4 route: prefix, next-hop MAC, egress port (repeatable)")
    _uplink_arguments(ld, "tofino: two-tier jobs (leaves=...): the switch, running the leaf program "
                          "(python -m p4gen.tofino --leaf), is leaf L; --ports are its local workers' ports")

    jb = sub.add_parser("job", help="install or replace a job (lookup entries, multicast group, job entry)")
    src = jb.add_mutually_exclusive_group(required=True)
    src.add_argument("--job", metavar="SPEC", help="key=value pairs as for thc-aggregator --job")
    src.add_argument("--config", type=Path, help="TOML job file; with several jobs, --job-id picks one")
    jb.add_argument("--job-id", type=job_id, help="the job of --config to install")
    jb.add_argument("--ports", type=port_list, required=True,
                    help="switch port of each worker, in worker order: 1,2,3,4")
    jb.add_argument("--fallback-control", metavar="ADDRESS",
                    help="where the switch refuses the job (no free row or slots, another K, b or width, not a THC "
                         "job), install it on the thc-aggregator with this --control (a Unix socket PATH or "
                         "HOST:PORT) instead, and print where the workers must send")
    jb.add_argument("--fallback", metavar="HOST:PORT", help="that thc-aggregator's data address (for the workers)")
    jb.add_argument("--fallback-token-file", type=Path, help="its --control-token-file, if it has one")
    _uplink_arguments(jb, "a two-tier job (leaves=...): this switch, running the leaf program (-DTHC_LEAF), is "
                          "leaf L; --ports are its local workers' ports, in local order")
    jb.add_argument("--spine", action="store_true",
                    help="a two-tier job: this switch, running the spine program (-DTHC_SPINE), is its spine; "
                         "--ports are the leaves' ports, in leaf order")
    jb.add_argument("--service-address", metavar="HOST:PORT", default="switch",
                    help="the switch's aggregator address as the workers reach it (printed for jobs it takes)")

    rm = sub.add_parser("remove", help="remove a job")
    rm.add_argument("job", type=job_id, help="job id")
    sub.add_parser("jobs", help="list the installed jobs (JSON)")
    st = sub.add_parser("stats", help="print the aggregator counters (JSON, Counter names of worker_lib.wire.protocol)")
    st.add_argument("--target", choices=TARGETS, default="bmv2",
                    help="switch kind: bmv2, tofino (Tofino 1) or tofino2 (Tofino 2) (default bmv2)")
    st.add_argument("--elems", type=int_in(1, 65528),
                    help="tofino: K of the compiled program, for the ELEMENTS counter (default: the generator's for "
                         "the target)")
    st.add_argument("--output", type=Path, help="tofino: also write the bfrt_python script here")
    st.add_argument("--sde", help="tofino: the SDE directory (default $SDE)")
    st.add_argument("--leaf", action="store_true",
                    help="tofino: the switch runs the leaf program (p4gen.tofino --leaf): its tier counters too")
    return p


def _uplink_arguments(p: argparse.ArgumentParser, leaf_help: str) -> None:
    """A leaf's options: its index and its parent (the spine)."""
    p.add_argument("--leaf", type=int, metavar="L", help=leaf_help)
    p.add_argument("--upstream", type=host_port, metavar="IP:PORT",
                   help="with --leaf: the spine's address and UDP port")
    p.add_argument("--upstream-mac", metavar="MAC", help="with --leaf: the next hop's MAC towards the spine")
    p.add_argument("--upstream-port", type=device_port, metavar="PORT",
                   help="with --leaf: the switch port towards the spine")


def _pair(text: str, n: int, what: str) -> list[str]:
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != n:
        raise SwitchError(f"{what} must have {n} comma-separated parts, got {text!r}")
    return parts


def _check_forwarding(args: argparse.Namespace) -> None:
    """Refuse a --service address or a --route prefix given twice: the second entry would be refused by
    the switch after the program and the first one were written."""
    ips = [ipaddress.IPv4Address(ip) for ip, _ in args.service]
    nets = [ipaddress.IPv4Network(prefix, strict=False) for prefix, _, _ in args.route]
    for option, values in (("--service", ips), ("--route", nets)):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            raise SwitchError(f"{option}: {', '.join(twice)} given twice")


def _check_uplink_options(args: argparse.Namespace) -> None:
    """Refuse the uplink's options without --leaf (they would be ignored)."""
    if args.leaf is None and (args.upstream or args.upstream_mac or args.upstream_port is not None):
        raise SwitchError("--upstream, --upstream-mac and --upstream-port are for a leaf: give --leaf L too")


def _tofino_plan(args: argparse.Namespace) -> TofinoPlan:
    """The jobs, services and routes of ``load --target tofino`` (ports, services and routes are checked
    as argparse parses them; a job id given twice would install only one of the two)."""
    cfgs = [parse_job_spec(spec) for spec in args.job]
    if args.config:
        cfgs += load_jobs(args.config)
    cfgs = unique_jobs(cfgs, "--job and --config")
    if len(args.ports) != len(cfgs):
        raise SwitchError(f"{len(cfgs)} jobs but {len(args.ports)} --ports: give one --ports per job, in order")
    jobs = tuple(TofinoJob(cfg, tuple(ports)) for cfg, ports in zip(cfgs, args.ports, strict=True))
    services = tuple(args.service)
    routes = tuple(args.route)
    _check_forwarding(args)
    _check_uplink_options(args)
    uplink = _uplink(cfgs[0], args) if args.leaf is not None and cfgs else None
    program = TofinoProgram(geometry=tofino_geometry(TofinoGeometry(target=args.target)), leaf=uplink is not None)
    if args.geometry:
        try:
            k, b, rbits, slots, njobs = (int(x) for x in _pair(args.geometry, 5, "--geometry"))
        except ValueError:
            raise SwitchError(f"--geometry must be five integers K,B,RESULT_BITS,SLOTS,JOBS, got {args.geometry!r}") \
                from None
        try:
            geometry = TofinoGeometry(k, b, rbits, slots, njobs, target=args.target)
        except ValueError as exc:
            raise SwitchError(f"--geometry: {exc}") from None
        program = TofinoProgram(geometry=tofino_geometry(geometry), leaf=uplink is not None)
    return TofinoPlan(jobs=jobs, services=services, routes=routes, program=program, uplink=uplink)


def run_tofino(args: argparse.Namespace) -> int:
    """``load`` and ``stats`` for --target tofino/tofino2: write the bfrt_python script, run it where the SDE is."""
    if args.command == "load":
        script = bfrt_load_script(_tofino_plan(args))
        if args.output:
            args.output.write_text(script)
        if args.no_run:
            if not args.output:
                print(script, end="")
            return 0
        try:
            shell = bfshell(args.sde)
        except BfrtUnavailable as exc:
            if not args.output:
                print(script, end="")
            sys.stderr.write(f"thc-switch: script not run: {exc}\n")
            return 0
        log.info("running the load script with %s", shell)
        _run_script(script, args.output, args.sde)
        print(json.dumps({"loaded": str(args.output or "thc load script")}))
        return 0
    if args.command == "stats":
        script = bfrt_stats_script(TofinoProgram(leaf=args.leaf))
        if args.output:
            args.output.write_text(script)
        bfshell(args.sde)  # raises BfrtUnavailable, saying why, where the SDE is not installed
        out = _run_script(script, args.output, args.sde)
        elems = args.elems if args.elems is not None else TofinoGeometry(target=args.target).elems
        print(json.dumps(parse_stats_output(out, elems)))
        return 0
    raise SwitchError(f"--target {args.target} supports load and stats, not {args.command}")


def _run_script(text: str, path: Path | None, sde: str | None) -> str:
    """Run a bfrt_python script in bfshell: the written file if any, else a temporary one (removed after)."""
    if path is not None:
        return run_bfrt_script(path, sde)
    with tempfile.TemporaryDirectory(prefix="thc_bfrt_") as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(text)
        return run_bfrt_script(script, sde)


def run(args: argparse.Namespace) -> int:
    """Execute one parsed command; raises SwitchError/JobConfigError/ValueError on failure.

    For BMv2, everything the command reads (files, job, options) is read and checked before connecting:
    bad input is refused without touching the switch, and never leaves it half configured."""
    if getattr(args, "target", "bmv2") != "bmv2":
        return run_tofino(args)
    # P4Runtime (grpc, protobuf) only for BMv2: a Tofino user needs neither.
    from aggregator.p4rt.client import SwitchAddress, wait_for_switch
    from aggregator.p4rt.thc import ThcSwitch

    program = _bmv2_program(args) if args.command == "load" else None
    job = _bmv2_job(args) if args.command == "job" else None
    addr = SwitchAddress.parse(args.switch, args.device_id, args.election_id)
    if args.wait > 0:
        wait_for_switch(addr, timeout=args.wait)
    with ThcSwitch(addr, timeout=args.timeout) as sw:
        if program is not None:
            geom = sw.load(*program)
            for ip, mac in args.service:
                sw.add_service(ip, mac)
            for prefix, mac, port in args.route:
                sw.add_route(prefix, mac, port)
            print(json.dumps({"loaded": str(args.json), "geometry": geom.__dict__}))
        elif job is not None:
            cfg, ports, uplink, fallback = job
            if args.spine or uplink is not None:
                place = sw.configure_spine(cfg, ports) if args.spine else sw.configure_leaf(cfg, ports, uplink)
                print(json.dumps({"job": cfg.job, "role": "spine" if args.spine else f"leaf {args.leaf}",
                                  "job_index": place.job_index, "slot_base": place.slot_base,
                                  "mcast_grp": place.mcast_grp, "generation": place.generation}))
                return 0
            if fallback is not None:
                placer = JobPlacer(sw, args.service_address, fallback)  # type: ignore[arg-type]
                print(json.dumps(placer.place(cfg, ports).to_dict()))
                return 0
            place = sw.configure_job(cfg, ports)
            print(json.dumps({"job": cfg.job, "job_index": place.job_index, "slot_base": place.slot_base,
                              "mcast_grp": place.mcast_grp, "generation": place.generation}))
        elif args.command == "remove":
            sw.remove_job(args.job)
        elif args.command == "jobs":
            print(json.dumps([{"job": j.job, "workers": j.workers, "threshold": j.threshold, "slots": j.slots,
                               "job_index": j.placement.job_index, "slot_base": j.placement.slot_base,
                               "generation": j.placement.generation} for j in sw.jobs()]))
        elif args.command == "stats":
            print(json.dumps({**sw.stats(), **(sw.tier_stats() if sw.is_leaf else {})}))
    return 0


def _bmv2_program(args: argparse.Namespace) -> tuple[P4Info, bytes]:
    """``load``'s program, read before connecting: the P4Info (checked to be a THC program's) and the BMv2
    JSON; the services and routes were checked as argparse parsed them."""
    from aggregator.p4rt.p4info import P4InfoIndex, load_p4info, program_geometry

    if args.p4info is None or args.json is None:
        raise SwitchError("load --target bmv2 needs --p4info and --json")
    info = load_p4info(args.p4info)
    program_geometry(P4InfoIndex(info))
    try:
        blob = args.json.read_bytes()
    except OSError as exc:
        raise SwitchError(f"cannot read the BMv2 JSON {args.json}: {exc.strerror}") from None
    _check_forwarding(args)
    return info, blob


def _bmv2_job(args: argparse.Namespace) -> tuple[JobConfig, tuple[int, ...], Uplink | None, Fallback | None]:
    """``job``'s job (from --job or --config), its ports, and its uplink (a leaf) or fallback
    (--fallback-control), all read and checked before connecting."""
    if args.job:
        cfg = parse_job_spec(args.job)
    else:
        jobs = load_jobs(args.config)
        pick = [j for j in jobs if args.job_id is None or j.job == args.job_id]
        if len(pick) != 1:
            raise SwitchError(f"{args.config}: {len(pick)} jobs match; pick one with --job-id")
        cfg = pick[0]
    if args.spine and (args.leaf is not None or not cfg.tiered):
        raise SwitchError("--spine is for a two-tier job (leaves=...), and not with --leaf")
    _check_uplink_options(args)
    uplink = _uplink(cfg, args) if not args.spine and (cfg.tiered or args.leaf is not None) else None
    fallback = _fallback(args) if args.fallback_control and not args.spine and uplink is None else None
    return cfg, tuple(args.ports), uplink, fallback


def _uplink(cfg: JobConfig, args: argparse.Namespace) -> Uplink:
    """The leaf's uplink from ``job --leaf L --upstream IP:PORT --upstream-mac MAC --upstream-port PORT``."""
    if not cfg.tiered:
        raise SwitchError(f"--leaf is for a two-tier job (leaves=N0:N1:...); job {cfg.job} has one tier")
    missing = [f"--{n.replace('_', '-')}" for n in ("leaf", "upstream", "upstream_mac", "upstream_port")
               if getattr(args, n) is None]
    if missing:
        raise SwitchError(f"job {cfg.job} has two tiers: give --spine (this switch is its spine), or "
                          f"{', '.join(missing)} (one of its leaves)")
    if getattr(args, "fallback_control", None):
        raise SwitchError("--fallback-control places one-tier jobs; a leaf's job has no software fallback here")
    if not 0 <= args.leaf < len(cfg.leaves):
        raise SwitchError(f"--leaf {args.leaf}: job {cfg.job} has {len(cfg.leaves)} leaves, 0..{len(cfg.leaves) - 1}")
    ip, port = args.upstream
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        raise SwitchError(f"--upstream must be an IPv4 address and a port, got {ip}:{port}") from None
    try:
        mac_int(args.upstream_mac)
    except ValueError as exc:
        raise SwitchError(f"--upstream-mac: {exc}") from None
    return Uplink(leaf=args.leaf, leaves=len(cfg.leaves), ip=ip, port=port, mac=args.upstream_mac,
                  out_port=args.upstream_port)


def _fallback(args: argparse.Namespace) -> Fallback:
    """The thc-aggregator that takes the jobs the switch refuses (``job --fallback-control``)."""
    if not args.fallback:
        raise SwitchError("--fallback-control needs --fallback HOST:PORT (the aggregator's data address, for the "
                          "workers)")
    try:
        control = ControlAddress.parse(args.fallback_control)
        token = read_token(args.fallback_token_file) if args.fallback_token_file else None
    except ControlConfigError as exc:
        raise SwitchError(f"--fallback-control: {exc}") from None
    return Fallback(control, args.fallback, token)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: errors become one line on stderr and exit status 1, never a traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (SwitchError, JobConfigError, ValueError, OSError) as exc:
        sys.stderr.write(f"thc-switch: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
