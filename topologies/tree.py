"""A two-level tree in Mininet: two BMv2 leaves with four worker hosts each under a spine, a host that runs
``thc-aggregator --role spine`` or a third BMv2 switch; one two-tier allreduce across it, checked bit for bit.

    python -m topologies.tree                        # 8 workers, 64 chunks each
    python -m topologies.tree --spine-loss 0.05      # drop 5 % of leaf 0's packets to and from the spine
    python -m topologies.tree --bmv2-spine           # all BMv2: the spine is a third switch

Layout: leaf l is switch s<l+1> (the BMv2 program compiled as a leaf, docs/protocol.md "Two tiers"), its
workers on ports 1..4 (10.0.<l+1>.1-4, service address 10.0.<l+1>.100) and its uplink on port 5 to the
spine host's interface 10.0.<l+1>.200. Each leaf is configured over P4Runtime with its one-tier job and
its uplink (aggregator.p4rt.ThcSwitch.configure_leaf). With ``--bmv2-spine`` the spine is switch s3 (the
program compiled as a spine, ThcSwitch.configure_spine) at 10.0.9.100, its port l+1 towards leaf l. Loss
on the leaf-spine link comes from nftables (this kernel has no tc netem): in the spine host's namespace,
or, between two switches, on the egress of the link's two switch ports (netdev family). A random
fraction of leaf 0's PARTIALs and of the spine's answers to it is dropped, and the workers'
retransmissions recover every one (docs/protocol.md, "Loss"). Every worker must receive the sums of the
table values of all eight workers' indices.
Needs root, Mininet (Debian's ``mininet``, see docs/bmv2.md), p4c-bm2-ss and simple_switch_grpc.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aggregator.p4rt import SwitchError, ThcSwitch, Uplink
from topologies.bmv2 import CONTROL_TIMEOUT, CompiledProgram, ToolMissing, compile_program, find_tool
from topologies.worker import MAX_CHUNKS, check_results, collect
from worker_lib.cli.args import MAX_SEED, int_in, log_level
from worker_lib.job import JobConfig, JobConfigError
from worker_lib.wire.layout import THC_UDP_PORT

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
LEAVES = 2
PER_LEAF = 4
UPLINK_PORT = PER_LEAF + 1
SPINE_PORT = 9460


def leaf_net(leaf: int) -> str:
    return f"10.0.{leaf + 1}"


def service_ip(leaf: int) -> str:
    return f"{leaf_net(leaf)}.100"


def switch_mac(leaf: int) -> str:
    return f"02:00:00:00:01:{leaf + 1:02x}"


def worker_ip(w: int) -> str:
    return f"{leaf_net(w // PER_LEAF)}.{w % PER_LEAF + 1}"


def worker_mac(w: int) -> str:
    return f"02:00:00:00:00:{w + 1:02x}"


def spine_ip(leaf: int) -> str:
    return f"{leaf_net(leaf)}.200"


def spine_mac(leaf: int) -> str:
    return f"02:00:00:00:02:{leaf + 1:02x}"


SWITCH_SPINE_IP = "10.0.9.100"
SWITCH_SPINE_MAC = "02:00:00:00:01:09"


@dataclass(frozen=True)
class TreeRun:
    """What to run: the job geometry, chunks, loss on leaf 0's uplink, where files go."""

    elems: int = 32
    bits: int = 4
    granularity: int = 30
    slots: int = 32
    chunks: int = 64
    seed: int = 1
    spine_loss: float = 0.0
    workdir: Path = Path(tempfile.gettempdir()) / "thc-tree"
    bmv2_spine: bool = False

    def job(self) -> JobConfig:
        return JobConfig(job=1, key=0x54484321, leaves=(PER_LEAF,) * LEAVES, workers=PER_LEAF * LEAVES,
                         bits=self.bits, granularity=self.granularity, p=1 / 32, elems=self.elems, slots=self.slots)


def build_tree_net(workdir: Path, bmv2_spine: bool = False):  # pragma: no cover - Mininet
    """The Mininet network of the tree (not started): its leaf switch nodes and the spine (a host, or with
    ``bmv2_spine`` a switch node)."""
    from mininet.net import Mininet
    from mininet.topo import Topo

    from topologies.mininet_bmv2 import Bmv2Node

    class TreeTopo(Topo):
        def build(self) -> None:
            spine = (self.addSwitch(f"s{LEAVES + 1}", cls=Bmv2Node, workdir=workdir / "spine") if bmv2_spine
                     else self.addHost("hs", ip=None))
            for leaf in range(LEAVES):
                sw = self.addSwitch(f"s{leaf + 1}", cls=Bmv2Node, workdir=workdir / f"s{leaf + 1}")
                for i in range(PER_LEAF):
                    w = leaf * PER_LEAF + i
                    h = self.addHost(f"h{w + 1}", ip=f"{worker_ip(w)}/24", mac=worker_mac(w))
                    self.addLink(h, sw, port2=i + 1)
                if bmv2_spine:
                    self.addLink(sw, spine, port1=UPLINK_PORT, port2=leaf + 1)
                else:
                    self.addLink(spine, sw, port2=UPLINK_PORT, intfName1=f"hs-eth{leaf}", addr1=spine_mac(leaf),
                                 params1={"ip": f"{spine_ip(leaf)}/24"})

    net = Mininet(topo=TreeTopo(), controller=None, autoSetMacs=False)
    return net, [net.get(f"s{leaf + 1}") for leaf in range(LEAVES)], net.get(f"s{LEAVES + 1}" if bmv2_spine else "hs")


def configure_leaf(ctl: ThcSwitch, prog: CompiledProgram, run: TreeRun, leaf: int) -> None:
    """Load the leaf program, its service address, routes to its workers and the spine, and the job."""
    ctl.load(prog.p4info, prog.json)
    ctl.add_service(service_ip(leaf), switch_mac(leaf))
    for i in range(PER_LEAF):
        w = leaf * PER_LEAF + i
        ctl.add_route(f"{worker_ip(w)}/32", worker_mac(w), i + 1)
    if run.bmv2_spine:  # the spine switch answers from the THC port of its service address
        up = Uplink(leaf=leaf, leaves=LEAVES, ip=SWITCH_SPINE_IP, port=THC_UDP_PORT, mac=SWITCH_SPINE_MAC,
                    out_port=UPLINK_PORT)
    else:
        ctl.add_route(f"{spine_ip(leaf)}/32", spine_mac(leaf), UPLINK_PORT)
        up = Uplink(leaf=leaf, leaves=LEAVES, ip=spine_ip(leaf), port=SPINE_PORT, mac=spine_mac(leaf),
                    out_port=UPLINK_PORT)
    ctl.configure_leaf(run.job(), tuple(range(1, PER_LEAF + 1)), up)


def configure_spine(ctl: ThcSwitch, prog: CompiledProgram, run: TreeRun) -> None:
    """Load the spine program, its service address and the job (leaf l on port l + 1)."""
    ctl.load(prog.p4info, prog.json)
    ctl.add_service(SWITCH_SPINE_IP, SWITCH_SPINE_MAC)
    ctl.configure_spine(run.job(), tuple(range(1, LEAVES + 1)))


def loss_rules(fraction: float, bmv2_spine: bool = False) -> str:
    """nftables rules (for ``nft -f -``) that drop ``fraction`` of leaf 0's packets to the spine and of the
    spine's packets to leaf 0, at random: in the spine host's namespace, or (``bmv2_spine``, in the root
    namespace) on the egress of both switch ports of that link, where the switches' raw sockets send."""
    pct = round(fraction * 100)
    if bmv2_spine:
        return "\n".join([
            "table netdev thc_tree_loss {",
            f"  chain up {{ type filter hook egress device \"s1-eth{UPLINK_PORT}\" priority 0; policy accept;",
            f"    numgen random mod 100 < {pct} drop; }}",
            f"  chain down {{ type filter hook egress device \"s{LEAVES + 1}-eth1\" priority 0; policy accept;",
            f"    numgen random mod 100 < {pct} drop; }}",
            "}", ""])
    return "\n".join([
        "table inet thc_tree_loss {",
        "  chain in { type filter hook input priority 0; policy accept;",
        f"    ip saddr {service_ip(0)} udp dport {SPINE_PORT} numgen random mod 100 < {pct} drop; }}",
        "  chain out { type filter hook output priority 0; policy accept;",
        f"    ip daddr {service_ip(0)} udp sport {SPINE_PORT} numgen random mod 100 < {pct} drop; }}",
        "}", ""])


def start_spine(host, run: TreeRun) -> subprocess.Popen:  # pragma: no cover - Mininet
    """``thc-aggregator --role spine`` on the spine host; returns once it listens."""
    proc = host.popen([sys.executable, "-m", "aggregator.cli", "--role", "spine", "--host", "0.0.0.0",
                       "--port", str(SPINE_PORT), "--job", run.job().spec()], cwd=str(ROOT),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"the spine did not start: {line.strip()} {proc.stderr.read().strip()}")
    return proc


def run_tree(run: TreeRun) -> dict:  # pragma: no cover - needs Mininet and root
    """Build the tree, configure both leaves, start the spine, run the eight workers, check, tear down."""
    prog = compile_program(run.workdir / "program", elems=run.elems, bits=run.bits,
                           result_bits=run.job().result_bits, leaf=True)
    spine_prog = compile_program(run.workdir / "program", elems=run.elems, bits=run.bits,
                                 result_bits=run.job().result_bits, spine=True) if run.bmv2_spine else None
    net, leaves, spine = build_tree_net(run.workdir, run.bmv2_spine)
    procs: list[subprocess.Popen] = []
    spine_proc = None
    nft_table = ""
    try:
        net.start()
        for w in range(run.job().workers):
            h = net.get(f"h{w + 1}")
            h.cmd(f"ip link set dev {h.defaultIntf()} gso_max_segs 1")
            h.cmd(f"ip neigh replace {service_ip(w // PER_LEAF)} lladdr {switch_mac(w // PER_LEAF)} "
                  f"dev {h.defaultIntf()} nud permanent")
        for leaf in range(LEAVES if not run.bmv2_spine else 0):
            spine.cmd(f"ip link set dev hs-eth{leaf} gso_max_segs 1")
            spine.cmd(f"ip neigh replace {service_ip(leaf)} lladdr {switch_mac(leaf)} dev hs-eth{leaf} nud permanent")
            spine.cmd(f"ip route replace {service_ip(leaf)}/32 dev hs-eth{leaf}")
        summary: dict = {}
        ctls = [ThcSwitch(node.address, timeout=CONTROL_TIMEOUT) for node in leaves]
        spine_ctl = ThcSwitch(spine.address, timeout=CONTROL_TIMEOUT) if run.bmv2_spine else None
        try:
            for leaf, ctl in enumerate(ctls):
                configure_leaf(ctl, prog, run, leaf)
            if spine_ctl is not None:
                configure_spine(spine_ctl, spine_prog, run)
            if run.spine_loss:
                if run.bmv2_spine:  # the switch ports are in the root namespace
                    out = subprocess.Popen(["nft", "-f", "-"], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)
                    nft_table = "netdev thc_tree_loss"
                else:
                    out = spine.popen(["nft", "-f", "-"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                _, err = out.communicate(loss_rules(run.spine_loss, run.bmv2_spine), timeout=30)
                if out.returncode != 0:
                    raise RuntimeError(f"nft could not install the loss rules: {err.strip()}")
            if spine_ctl is None:
                spine_proc = start_spine(spine, run)
            spec = run.job().spec()
            for w in range(run.job().workers):
                h = net.get(f"h{w + 1}")
                procs.append(h.popen([sys.executable, "-m", "topologies.worker", "--job", spec, "--worker", str(w),
                                      "--aggregator", f"{service_ip(w // PER_LEAF)}:{THC_UDP_PORT}", "--bind",
                                      worker_ip(w), "--chunks", str(run.chunks), "--seed", str(run.seed),
                                      "--out", str(run.workdir / f"w{w}.json")],
                                     cwd=str(ROOT), stderr=subprocess.PIPE, text=True))
            results = collect(procs, [run.workdir / f"w{w}.json" for w in range(len(procs))])
            summary = {"leaves": LEAVES, "spine_loss": run.spine_loss,
                       **check_results(run.job(), run.seed, run.chunks, results)}
            summary["leaf_counters"] = [ctl.stats() for ctl in ctls]
            summary["leaf_tier_counters"] = [ctl.tier_stats() for ctl in ctls]
            summary["spine"] = "bmv2" if spine_ctl is not None else "thc-aggregator --role spine"
            if spine_ctl is not None:
                summary["spine_counters"] = spine_ctl.stats()
        finally:
            for ctl in ctls:
                ctl.close()
            if spine_ctl is not None:
                spine_ctl.close()
        return summary
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if nft_table:
            subprocess.run(["nft", "delete", "table", *nft_table.split()], capture_output=True, check=False)
        if spine_proc is not None:
            spine_proc.terminate()
            try:
                spine_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                spine_proc.kill()
        net.stop()


def main(argv: list[str] | None = None) -> int:
    """CLI: bring the tree up, run one allreduce, print the check as JSON, tear down; rc 0 iff exact."""
    d = TreeRun()
    ap = argparse.ArgumentParser(prog="python -m topologies.tree", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--chunks", type=int_in(1, MAX_CHUNKS), default=d.chunks,
                    help=f"chunks per worker, 1..{MAX_CHUNKS} (default {d.chunks})")
    ap.add_argument("--elems", type=int, default=d.elems, help=f"K, indices per packet (default {d.elems})")
    ap.add_argument("--slots", type=int, default=d.slots, help=f"slots of the job (default {d.slots})")
    ap.add_argument("--seed", type=int_in(0, MAX_SEED), default=d.seed,
                    help=f"seed of the workers' indices, 0..{MAX_SEED} (default {d.seed})")
    ap.add_argument("--spine-loss", type=float, default=0.0, metavar="P",
                    help="drop this fraction (0..0.5) of leaf 0's packets to and from the spine (nftables)")
    ap.add_argument("--bmv2-spine", action="store_true",
                    help="the spine is a third BMv2 switch (the program compiled as a spine), not thc-aggregator")
    ap.add_argument("--workdir", type=Path, default=d.workdir, help=f"logs, pcaps, results (default {d.workdir})")
    ap.add_argument("--log-level", type=log_level, default="WARNING",
                    help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default WARNING)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not 0.0 <= args.spine_loss <= 0.5:
        ap.error(f"--spine-loss must be in 0..0.5, got {args.spine_loss}")
    if os.geteuid() != 0:
        sys.stderr.write("topologies.tree: needs root (Mininet)\n")
        return 1
    try:
        import mininet  # noqa: F401
    except ImportError:
        sys.stderr.write("topologies.tree: Mininet is not importable from this interpreter (see docs/bmv2.md)\n")
        return 1
    try:
        run = TreeRun(args.elems, 4, 30, args.slots, args.chunks, args.seed, args.spine_loss, args.workdir,
                      args.bmv2_spine)
        run.job()
        run.workdir.mkdir(parents=True, exist_ok=True)
        find_tool("simple_switch_grpc")
        try:
            summary = run_tree(run)
        except (SwitchError, RuntimeError):
            raise
        except Exception as exc:  # Mininet raises bare Exceptions (e.g. interfaces left by a killed run)
            sys.stderr.write(f"topologies.tree: Mininet: {exc} (interfaces left by an earlier run? `mn -c` "
                             "removes them)\n")
            return 1
    except (ToolMissing, SwitchError, JobConfigError, RuntimeError, OSError) as exc:
        sys.stderr.write(f"topologies.tree: {exc}\n")
        return 1
    print(json.dumps(summary, indent=1))
    ok = summary["sums_exact"] and summary["norm_exact"]
    print("RESULT CHECK:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
