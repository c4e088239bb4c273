"""A star: n worker hosts around one BMv2 switch running the THC program; one allreduce; result check.

    python -m topologies.star --workers 4              # Mininet (Debian's python3 + the project)
    python -m topologies.star --workers 4 --netns      # the same on plain network namespaces

Steps: compile p4src/bmv2/thc.p4 for the job's K and b (or use --program-dir), build the topology,
start simple_switch_grpc (log and per-port pcaps in --workdir), load the program and the job over
P4Runtime (aggregator.p4rt.ThcSwitch), run one worker process per host (topologies.worker: norm stage,
then --chunks chunks through worker_lib.transport), check every worker received the sums of the table
values of all workers' indices, print the check, and tear everything down (also on errors/Ctrl-C).
Needs root; Mininet mode needs Mininet (Debian package ``mininet``, a module of /usr/bin/python3; see
docs/bmv2.md for an environment that sees both Mininet and this project).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aggregator.p4rt import SwitchError, ThcSwitch
from topologies.bmv2 import (
    CONTROL_TIMEOUT,
    Bmv2Config,
    Bmv2Switch,
    CompiledProgram,
    ToolMissing,
    compile_program,
    find_tool,
)
from topologies.nsstar import SERVICE_IP, SWITCH_MAC, NsStar, host_ip, host_mac
from topologies.worker import MAX_CHUNKS, collect
from topologies.worker import check_results as check_sums
from worker_lib.cli.args import MAX_SEED, int_in, log_level
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.layout import THC_UDP_PORT

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class StarRun:
    """What to run: workers, the job geometry, how many chunks, where files go."""

    workers: int = 4
    elems: int = 32
    bits: int = 4
    granularity: int = 30
    result_bits: int = 8
    slots: int = 32
    chunks: int = 64
    seed: int = 1
    workdir: Path = Path(tempfile.gettempdir()) / "thc-star"
    program_dir: Path | None = None

    def job(self) -> JobConfig:
        return JobConfig(job=1, key=0x54484321, workers=self.workers, bits=self.bits, granularity=self.granularity,
                         p=1 / 32, elems=self.elems, result_bits=self.result_bits, slots=self.slots)



def program_for(run: StarRun) -> CompiledProgram:
    """The compiled program: --program-dir's files if given, else compiled for the run's K, b, width."""
    if run.program_dir is not None:
        d = run.program_dir
        return CompiledProgram(d / "thc.p4", d / "thc.json", d / "thc.p4info.txtpb", "")
    return compile_program(run.workdir / "program", elems=run.elems, bits=run.bits, result_bits=run.result_bits)


def configure(ctl: ThcSwitch, prog: CompiledProgram, run: StarRun, routes: list[tuple[str, str, int]]) -> None:
    """Load the program, the service address, the routes and the job."""
    ctl.load(prog.p4info, prog.json)
    ctl.add_service(SERVICE_IP, SWITCH_MAC)
    for prefix, mac, port in routes:
        ctl.add_route(prefix, mac, port)
    ctl.configure_job(run.job(), tuple(port for _, _, port in routes))


def worker_command(run: StarRun, w: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "topologies.worker", "--job", run.job().spec(), "--worker", str(w),
            "--aggregator", f"{SERVICE_IP}:{THC_UDP_PORT}", "--bind", host_ip(w), "--chunks", str(run.chunks),
            "--seed", str(run.seed), "--out", str(out)]


def check_results(run: StarRun, results: list[dict]) -> dict:
    """Compare every worker's sums with the table sums of all workers' indices; a summary dict."""
    out = check_sums(run.job(), run.seed, run.chunks, results)
    out["elements_per_s"] = run.chunks * run.elems / out["seconds"] if out["seconds"] else 0.0
    return out


def run_netns(run: StarRun) -> dict:
    """The star on plain namespaces (topologies.nsstar)."""
    prog = program_for(run)
    with NsStar(run.workers, prefix=f"thcst{os.getpid() % 10000}") as star:
        sw = Bmv2Switch(Bmv2Config(star.interfaces, run.workdir / "switch", netns=star.switch_ns))
        with sw, ThcSwitch(sw.address, timeout=CONTROL_TIMEOUT) as ctl:
            configure(ctl, prog, run, star.routes())
            procs = [h.ns.popen(worker_command(run, h.port, run.workdir / f"w{h.port}.json"), cwd=ROOT,
                                stderr=subprocess.PIPE, text=True) for h in star.hosts]
            results = _collect(procs, run)
            summary = check_results(run, results)
            summary["switch_counters"] = ctl.stats()
    summary["pcaps"] = str(sw.pcap_dir)
    return summary


def _collect(procs: list[subprocess.Popen], run: StarRun, timeout: float = 300.0) -> list[dict]:
    return collect(procs, [run.workdir / f"w{w}.json" for w in range(len(procs))], timeout)


def run_mininet(run: StarRun) -> dict:  # pragma: no cover - needs Mininet and root
    """The star in Mininet: hosts h1..hn, one BMv2 switch node (topologies.mininet_bmv2)."""
    from topologies.mininet_bmv2 import build_star_net

    prog = program_for(run)
    net, sw_node = build_star_net(run.workers, run.workdir / "switch")
    try:
        net.start()
        for i, h in enumerate(net.hosts):
            # frames on the host's link, not segmentation-offload runs (topologies.netns.Netns.add_veth)
            h.cmd(f"ip link set dev {h.defaultIntf()} gso_max_segs 1")
            h.cmd(f"arp -s {SERVICE_IP} {SWITCH_MAC}")
            for j in range(run.workers):
                if j != i:
                    h.cmd(f"arp -s {host_ip(j)} {host_mac(j)}")
        with ThcSwitch(sw_node.address, timeout=CONTROL_TIMEOUT) as ctl:
            routes = [(f"{host_ip(i)}/32", host_mac(i), i + 1) for i in range(run.workers)]
            configure(ctl, prog, run, routes)
            procs = [h.popen(worker_command(run, i, run.workdir / f"w{i}.json"), cwd=str(ROOT),
                             stderr=subprocess.PIPE, text=True) for i, h in enumerate(net.hosts)]
            results = _collect(procs, run)
            summary = check_results(run, results)
            summary["switch_counters"] = ctl.stats()
            summary["ping_loss_percent"] = net.pingAll(timeout="1")
    finally:
        net.stop()
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: bring the star up, run one allreduce, print the check as JSON, tear down; rc 0 iff exact."""
    d = StarRun()
    ap = argparse.ArgumentParser(prog="python -m topologies.star", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workers", type=int, default=d.workers, help=f"worker hosts (default {d.workers})")
    ap.add_argument("--chunks", type=int_in(1, MAX_CHUNKS), default=d.chunks,
                    help=f"chunks per worker, 1..{MAX_CHUNKS} (default {d.chunks})")
    ap.add_argument("--elems", type=int, default=d.elems, help=f"K, indices per packet (default {d.elems})")
    ap.add_argument("--bits", type=int, default=d.bits, help=f"b, bits per index (default {d.bits})")
    ap.add_argument("--granularity", type=int, default=d.granularity, help=f"g (default {d.granularity})")
    ap.add_argument("--result-bits", type=int, default=d.result_bits, choices=(8, 16), help="sum width")
    ap.add_argument("--slots", type=int, default=d.slots, help=f"slots of the job (default {d.slots})")
    ap.add_argument("--seed", type=int_in(0, MAX_SEED), default=d.seed,
                    help=f"seed of the workers' indices, 0..{MAX_SEED} (default {d.seed})")
    ap.add_argument("--workdir", type=Path, default=d.workdir, help=f"logs, pcaps, results (default {d.workdir})")
    ap.add_argument("--program-dir", type=Path, help="use thc.json/thc.p4info.txtpb from here (no compile)")
    ap.add_argument("--netns", action="store_true", help="plain network namespaces instead of Mininet")
    ap.add_argument("--log-level", type=log_level, default="WARNING",
                    help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default WARNING)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        sys.stderr.write("topologies.star: needs root (network namespaces)\n")
        return 1
    try:
        run = StarRun(args.workers, args.elems, args.bits, args.granularity, args.result_bits, args.slots,
                      args.chunks, args.seed, args.workdir, args.program_dir)
        run.job()
        run.workdir.mkdir(parents=True, exist_ok=True)
        find_tool("simple_switch_grpc")
        if args.netns:
            summary = run_netns(run)
        else:
            try:
                import mininet  # noqa: F401
            except ImportError:
                sys.stderr.write("topologies.star: Mininet is not importable from this interpreter (see "
                                 "docs/bmv2.md), or use --netns\n")
                return 1
            try:
                summary = run_mininet(run)
            except Exception as exc:  # Mininet raises bare Exceptions (e.g. interfaces left by a killed run)
                sys.stderr.write(f"topologies.star: Mininet: {exc} (interfaces left by an earlier run? "
                                 "`sudo mn -c` removes them)\n")
                return 1
    except (ToolMissing, SwitchError, JobConfigError, RuntimeError, OSError) as exc:
        sys.stderr.write(f"topologies.star: {exc}\n")
        return 1
    print(json.dumps(summary, indent=1))
    print("RESULT CHECK:", "PASS" if summary["sums_exact"] and summary["norm_exact"] else "FAIL")
    return 0 if summary["sums_exact"] and summary["norm_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
