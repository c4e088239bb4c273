"""Control plane of the THC Tofino program (p4src/tofino/thc.p4): bfrt_python scripts.

The Tofino SDE's runtime (BF Runtime) is driven here through ``bfrt_python`` scripts, the SDE's own
scripting front end (``$SDE/run_bfshell.sh -b script.py``): this module *writes* the script, and runs it
only where the SDE is installed (``$SDE/run_bfshell.sh`` exists). Why scripts and not a gRPC client: the
BF Runtime gRPC client ships with the SDE only (it is not on PyPI), and a script is something a user can
read, keep and rerun on the switch. It imports neither grpc nor protobuf.

The entries come from the same code as the BMv2 ones: ``aggregator.switch.entries.job_entries``,
``service_entry`` and ``route_entry`` give target-neutral logical entries; ``bfrt_load_script`` spells
them in bfrt_python. A load script, in order: port configuration (one port per worker, plus the ones
of the routes), register reset (every register of the program, so jobs start FRESH), services and
routes, per job its lookup entries, its PRE nodes (one per worker: rid = job_index * 32 + worker) and
multicast group, and last its ``thc_jobs`` entry, then ``bfrt.complete_operations()``.

A plan with an ``uplink`` is for the leaf program of two-tier jobs (``python -m p4gen.tofino --leaf``):
each job is installed as its leaf's one-tier job (``JobConfig.leaf``) with the same checks as BMv2's
``configure_leaf``, and the script also sets ``thc_uplink``'s default action and resets the leaf's
register.

Nothing here was run against a Tofino switch or the SDE's model (neither is available where this was
written); docs/tofino.md says what a real switch must still confirm.

    >>> plan = TofinoPlan(jobs=(TofinoJob(JobConfig(workers=2, elems=32, result_bits=8), (1, 2)),))  # doctest: +SKIP
    >>> print(bfrt_load_script(plan))                                                               # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from aggregator.switch.entries import (
    InstalledJob,
    JobEntries,
    JobRefused,
    LogicalEntry,
    MulticastGroup,
    Placement,
    ProgramGeometry,
    Uplink,
    check_leaf_job,
    job_entries,
    new_generation,
    place_job,
    route_entry,
    service_entry,
    uplink_entry,
)
from aggregator.switch.errors import SwitchError
from p4gen.tofino import TofinoGeometry
from worker_lib.job import JobConfig
from worker_lib.wire.protocol import Counter, TierCounter


def tofino_geometry(g: TofinoGeometry) -> ProgramGeometry:
    """What the control plane needs of a Tofino program rendered by p4gen/tofino.py for ``g``: its
    constants and the shape of its lookups (``lookup_<m>``, keyed on ``indices``: adjacent indices)."""
    return ProgramGeometry(g.elems, g.bits, g.result_bits, g.slots, g.jobs, lookup_indices=g.lookup_indices,
                           lookup_control="lookup", lookup_key="indices")


# The geometry p4gen/tofino.py renders p4src/tofino/thc.p4 with by default.
DEFAULT_TOFINO_GEOMETRY = tofino_geometry(TofinoGeometry())

# Registers of the program and their data fields (bfrt names: a plain register's single field is f1), so
# the load script can reset them.
INGRESS_REGISTERS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "slot_state": ("f1",), "bank_tag": ("f1",), "bank_seen": ("f1",), "bank_count": ("f1",),
    "bank_norm": ("f1",), "bank_result_bitmap": ("f1",),
})
LEAF_INGRESS_REGISTERS: Mapping[str, tuple[str, ...]] = MappingProxyType({"bank_upstream": ("f1",)})
EGRESS_REGISTERS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "worker_ip": ("f1",), "worker_port_mac_hi": ("f1",), "worker_mac_lo": ("f1",),
})
# Tables that match ternary on Tofino: the lookups (``lookup_<m>.lookup``) live in TCAM (an
# exact-match table needs a hash unit of its own, and a stage has 8), so their entries carry masks (all
# ones: an exact match) and a priority.
TERNARY_TABLE_SUFFIX = ".lookup"
STATS_MARK = "THC_STATS "


class BfrtUnavailable(SwitchError):
    """The Tofino SDE (bfshell with bfrt_python) is not installed where a script should run."""


@dataclass(frozen=True)
class TofinoProgram:
    """Names and geometry of the compiled Tofino program as bfrt_python sees it.

    name: the P4 program name under ``bfrt`` (bf-p4c names it after the source file: ``thc``);
    pipe, ingress, egress: the Pipeline and control instance names; geometry: its compile-time constants
    (those of p4gen/tofino.py)."""

    name: str = "thc"
    pipe: str = "pipe"
    ingress: str = "ThcIngress"
    egress: str = "ThcEgress"
    geometry: ProgramGeometry = DEFAULT_TOFINO_GEOMETRY
    leaf: bool = False  #: the leaf program of two-tier jobs (p4gen.tofino --leaf)


@dataclass(frozen=True)
class PortConfig:
    """How the load script brings up a port (bfrt ``port.port`` table): speed and FEC as the SDE names them."""

    speed: str = "BF_SPEED_100G"
    fec: str = "BF_FEC_TYP_RS"
    autoneg: str = "PM_AN_DEFAULT"


@dataclass(frozen=True)
class TofinoJob:
    """A job to install and the device port of each worker, in worker order."""

    config: JobConfig
    ports: tuple[int, ...]


@dataclass(frozen=True)
class TofinoPlan:
    """What one load script installs: jobs, aggregator addresses (ip, mac), routes (prefix, mac, port);
    for the leaf program, the uplink to the parent (then every job is a two-tier job and its ports are
    this leaf's workers', in local order)."""

    jobs: tuple[TofinoJob, ...] = ()
    services: tuple[tuple[str, str], ...] = ()
    routes: tuple[tuple[str, str, int], ...] = ()
    program: TofinoProgram = field(default_factory=TofinoProgram)
    port_config: PortConfig = field(default_factory=PortConfig)
    uplink: Uplink | None = None

    def served(self, cfg: JobConfig) -> JobConfig:
        """The one-tier job the program runs for ``cfg``: itself, or at a leaf its leaf's job. Raises
        JobRefused where the program cannot serve it."""
        if self.uplink is None:
            if self.program.leaf or cfg.tiered:
                raise JobRefused(f"job {cfg.job}: the leaf program serves two-tier jobs with an uplink "
                                 "(--leaf, --upstream, --upstream-mac, --upstream-port), and only it")
            return cfg
        if not self.program.leaf:
            raise JobRefused(f"job {cfg.job}: an uplink needs the leaf program (python -m p4gen.tofino --leaf)")
        check_leaf_job(cfg, self.program.geometry, self.uplink)
        return cfg.leaf(self.uplink.leaf)


def place_jobs(plan: TofinoPlan, generation: int | None = None) -> list[tuple[TofinoJob, Placement]]:
    """Rows and slot ranges of the plan's jobs, in order, on an empty switch (the load script resets it).

    Raises JobRefused (from ``place_job``) if they do not fit the program's rows or slots."""
    installed: list[InstalledJob] = []
    out = []
    gen = generation if generation is not None else new_generation([])
    for tj in plan.jobs:
        cfg = plan.served(tj.config)
        place = place_job(cfg, plan.program.geometry, installed, gen)
        installed.append(InstalledJob(cfg.job, cfg.key, cfg.table_id, cfg.workers, cfg.threshold, cfg.slots,
                                      place))
        out.append((tj, place))
    return out


def _short(name: str) -> str:
    """bfrt_python's keyword for a key field: the last component of its P4 name (``hdr.data.i3`` -> ``i3``)."""
    return name.rsplit(".", 1)[-1]


def _key_bits(prog: TofinoProgram, name: str) -> int:
    """Width of a lookup table's key field: the job row (16 bits) or its adjacent b-bit indices."""
    g = prog.geometry
    return 16 if name == "job_index" else g.bits * g.lookup_indices


def bfrt_table_call(prog: TofinoProgram, entry: LogicalEntry) -> str:
    """One ``add_with_<action>`` call of bfrt_python for a logical entry of the ingress (the table by its
    path below the ingress, ``lookup_3.lookup``; the action by its own name, ``value``); a keyless table's
    entry is its default action (``set_default_with_<action>``)."""
    if not entry.match:
        params = ", ".join(f"{name}={value:#x}" for name, value in entry.params)
        return f"ing.{entry.table}.set_default_with_{entry.action.rsplit('.', 1)[-1]}({params})"
    args = []
    ternary = entry.table.endswith(TERNARY_TABLE_SUFFIX)
    for m in entry.match:
        name = _short(m.field)
        args.append(f"{name}={m.value:#x}")
        if ternary:
            args.append(f"{name}_mask={(1 << _key_bits(prog, name)) - 1:#x}")
        if m.prefix_len is not None:
            args.append(f"{name}_p_length={m.prefix_len}")
    if ternary:
        args.append("MATCH_PRIORITY=0")  # the entries of a lookup table never overlap
    args += [f"{name}={value:#x}" for name, value in entry.params]
    return f"ing.{entry.table}.add_with_{entry.action.rsplit('.', 1)[-1]}({', '.join(args)})"


def bfrt_group_calls(group: MulticastGroup, node_base: int) -> list[str]:
    """PRE calls for a group: one node per replica (its rid and port), then the group (mgid) of those nodes.

    Node ids are ``node_base + i``; the load script gives each job its own range."""
    out = []
    nodes = []
    for i, (port, rid) in enumerate(group.replicas):
        node = node_base + i
        nodes.append(node)
        out.append(f"bfrt.pre.node.entry(MULTICAST_NODE_ID={node}, MULTICAST_RID={rid}, "
                   f"MULTICAST_LAG_ID=[], DEV_PORT=[{port}]).push()")
    n = len(nodes)
    out.append(f"bfrt.pre.mgid.entry(MGID={group.group}, MULTICAST_NODE_ID={nodes}, "
               f"MULTICAST_NODE_L1_XID_VALID={[False] * n}, MULTICAST_NODE_L1_XID={[0] * n}).push()")
    return out


def _register_reset(prog: TofinoProgram) -> list[str]:
    out = []
    ingress = {**INGRESS_REGISTERS, **(LEAF_INGRESS_REGISTERS if prog.leaf else {})}
    for ctl, regs in (("ing", ingress), ("egr", EGRESS_REGISTERS)):
        for name in regs:
            out.append(f"{ctl}.{name}.clear()")
    return out


def plan_entries(plan: TofinoPlan, generation: int | None = None) -> list[tuple[TofinoJob, Placement, JobEntries]]:
    """The logical entries of every job of the plan (the same function as BMv2's ``job_updates`` uses)."""
    return [(tj, place, job_entries(plan.served(tj.config), plan.program.geometry, tuple(tj.ports), place, "tofino"))
            for tj, place in place_jobs(plan, generation)]


def bfrt_load_script(plan: TofinoPlan, generation: int | None = None) -> str:
    """The bfrt_python script that configures a switch running the Tofino program for ``plan``.

    Raises JobRefused (nothing is written) if the program cannot aggregate one of the jobs."""
    prog = plan.program
    jobs = plan_entries(plan, generation)
    services = [service_entry(ip, mac) for ip, mac in plan.services]
    routes = [route_entry(prefix, mac, int(port)) for prefix, mac, port in plan.routes]
    ports = sorted({p for tj, _, _ in jobs for p in tj.ports} | {int(r[2]) for r in plan.routes}
                   | ({plan.uplink.out_port} if plan.uplink else set()))
    pc = plan.port_config
    lines = [
        "# bfrt_python script written by thc-switch (aggregator/bfrt.py). Run on the switch with",
        "#   $SDE/run_bfshell.sh -b <this file>",
        "# after starting bf_switchd with the compiled "
        + ("leaf program (python -m p4gen.tofino --leaf)." if prog.leaf else "p4src/tofino/thc.p4.")
        + " Do not edit: regenerate it.",
        f"p4 = bfrt.{prog.name}.{prog.pipe}",
        f"ing = p4.{prog.ingress}",
        f"egr = p4.{prog.egress}",
        "",
        "# ports (device port numbers)",
        *[f"bfrt.port.port.add(DEV_PORT={p}, SPEED='{pc.speed}', FEC='{pc.fec}', AUTO_NEGOTIATION='{pc.autoneg}', "
          "PORT_ENABLE=True)" for p in ports],
        "",
        "# registers: every slot, bank and learnt address starts empty",
        *_register_reset(prog),
        "",
        "# aggregator addresses and routes",
        *[bfrt_table_call(prog, e) for e in services + routes],
    ]
    if plan.uplink is not None:
        up = plan.uplink
        lines += ["", f"# the parent of leaf {up.leaf} of {up.leaves}: {up.ip}:{up.port} via port {up.out_port}",
                  bfrt_table_call(prog, uplink_entry(up))]
    for tj, place, ent in jobs:
        lines += ["", f"# job {tj.config.job}: row {place.job_index}, slots {place.slot_base}.."
                  f"{place.slot_base + tj.config.slots - 1}, group {place.mcast_grp}, ports {list(tj.ports)}"]
        lines += [bfrt_table_call(prog, e) for e in ent.lookups]
        lines += bfrt_group_calls(ent.group, node_base=place.job_index * 32 + 1)
        lines.append(bfrt_table_call(prog, ent.job))
    lines += ["", "bfrt.complete_operations()", ""]
    return "\n".join(lines)


def bfrt_stats_script(prog: TofinoProgram | None = None) -> str:
    """A bfrt_python script that prints the program's counters as one line ``THC_STATS {json}`` (a
    leaf's, ``prog.leaf``, with its tier counters)."""
    prog = prog or TofinoProgram()
    tier = [f"raw['thc_tier_stats'] = _cells(ing.thc_tier_stats, {len(TierCounter)})",
            "raw['thc_forwarded'] = _cells(ing.thc_forwarded, 1)"] if prog.leaf else []
    return "\n".join([
        "# bfrt_python script written by thc-switch: read the THC counters.",
        "import json",
        f"ing = bfrt.{prog.name}.{prog.pipe}.{prog.ingress}",
        "def _cells(counter, n):",
        "    out = []",
        "    for i in range(n):",
        "        e = counter.get(COUNTER_INDEX=i, from_hw=True, print_ents=False)",
        "        out.append(int(e.data[b'$COUNTER_SPEC_PKTS']))",
        "    return out",
        f"raw = {{'thc_stats': _cells(ing.thc_stats, {len(Counter)}), 'thc_rx': _cells(ing.thc_rx, 1),",
        "       'thc_accepted': _cells(ing.thc_accepted, 2), 'thc_completed': _cells(ing.thc_completed, 1)}",
        *tier,
        f"print('{STATS_MARK}' + json.dumps(raw))",
        "",
    ])


def stats_from_raw(raw: dict[str, list[int]], elems: int) -> dict[str, int]:
    """The aggregator counters (``worker_lib.wire.protocol.Counter`` names) from the Tofino program's counters.

    Why a mapping: a Tofino counter is counted at most once per pass, so RX, ACCEPTED (thc_accepted: [0]
    NORM, [1] DATA), ELEMENTS (DATA packets accepted times K) and COMPLETED have their own counters and
    thc_stats holds the other outcomes at Counter's indices. A leaf's read-back adds its TierCounter names:
    FORWARDED (thc_forwarded, pass 2) and the others at thc_tier_stats' indices."""
    try:
        stats = list(raw["thc_stats"])
        out = {c.name: int(stats[c.value]) if c.value < len(stats) else 0 for c in Counter}
        out["RX"] = int(raw["thc_rx"][0])
        out["ACCEPTED"] = int(raw["thc_accepted"][0]) + int(raw["thc_accepted"][1])
        out["ELEMENTS"] = int(raw["thc_accepted"][1]) * elems
        out["COMPLETED"] = int(raw["thc_completed"][0])
        if "thc_tier_stats" in raw:
            tier = list(raw["thc_tier_stats"])
            out |= {c.name: int(tier[c.value]) for c in TierCounter}
            out["FORWARDED"] = int(raw["thc_forwarded"][0])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise SwitchError(f"unexpected counter read-back from the switch: {exc!r}") from None
    return out


def parse_stats_output(text: str, elems: int) -> dict[str, int]:
    """The counters from the output of the stats script (its ``THC_STATS`` line)."""
    for line in text.splitlines():
        if line.startswith(STATS_MARK):
            try:
                raw = json.loads(line[len(STATS_MARK):])
            except json.JSONDecodeError as exc:
                raise SwitchError(f"cannot parse the counters printed by bfshell: {exc}") from None
            return stats_from_raw(raw, elems)
    raise SwitchError("bfshell printed no THC_STATS line (is the THC program running on the switch?)")


def bfshell(sde: str | None = None) -> Path:
    """``$SDE/run_bfshell.sh``; raises BfrtUnavailable, saying why, where the SDE is not installed."""
    root = sde if sde is not None else os.environ.get("SDE")
    if not root:
        raise BfrtUnavailable("the Tofino SDE is not installed here ($SDE is not set): write the script with "
                              "--output and run it on the switch with $SDE/run_bfshell.sh -b <script>")
    path = Path(root) / "run_bfshell.sh"
    if not path.is_file():
        raise BfrtUnavailable(f"{path} does not exist: is $SDE={root} a built Tofino SDE?")
    return path


def run_bfrt_script(script: Path, sde: str | None = None, timeout: float = 600.0) -> str:
    """Run a bfrt_python script in bfshell (the switch's bf_switchd must be running); its output."""
    shell = bfshell(sde)
    try:
        proc = subprocess.run([str(shell), "-b", str(script)], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise SwitchError(f"bfshell did not finish {script} within {timeout:.0f} s") from None
    # bfshell exits 0 even when a bfrt_python call raises; the traceback's "Error" is how it shows.
    if proc.returncode != 0 or "Error" in proc.stdout:
        raise SwitchError(f"bfshell failed on {script} (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                          f"{proc.stderr[-2000:]}")
    return proc.stdout
