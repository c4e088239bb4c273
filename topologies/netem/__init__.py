"""An emulated network of Linux network namespaces: one per node, a bridge, shaped links, random loss.

Each node (the aggregator and every worker) gets its own namespace with an ``eth0`` veth whose
peer sits on a Linux bridge in a namespace of its own, so nothing is created in, or routed through,
the host's namespace. Every link is shaped in both directions (tc ``tbf`` or ``htb`` on the node's
``eth0`` for the uplink and on the bridge port for the downlink) and can drop packets at random
in each direction: with tc ``netem`` where the kernel has it, otherwise with nftables rules
``numgen random mod 100 < N drop`` on the node's bridge port, inside the bridge's namespace (the
development machines' kernel has no netem). Multicast floods on the bridge, so IP multicast results reach every node.
``set_loss`` changes the loss of a running topology (a benchmark alternates lossless and lossy phases
within one run with it: ``benchmarks/loss_phases.py``).

Everything is created by ``up()`` and removed by ``down()`` (the context manager calls both, and
``down`` also runs after a failed ``up``); the processes started with ``popen`` are killed first.
Inside the ``with`` block SIGTERM and SIGHUP end the program the way an error does (``Terminated``),
so a killed benchmark leaves no namespaces, processes or temporary folders behind either.
Needs root (CAP_NET_ADMIN); ``require_root()`` says why not when it is missing.

Usage::

    cfg = NetemConfig(workers=2, rate_mbit=1000, loss_percent={"w0": 1.0})
    with Topology(cfg) as net:
        agg = net.popen("agg", ["thc-aggregator", "--host", net.address("agg")])
        ...                                 # net.popen("w0", [...]), net.address("w1"), ...

CLI: ``python -m topologies.netem --help`` (``up``/``down`` for manual experiments, ``selftest``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

LossMethod = Literal["auto", "netem", "nftables"]
Qdisc = Literal["tbf", "htb"]


class NetemError(RuntimeError):
    """A command that builds or tears down the emulated network failed (the message has its stderr)."""


#: The signals that end a run holding a ``Topology`` the way an error does (``ExitOnSignals``): a
#: ``kill`` (SIGTERM) or a closed terminal or ssh session (SIGHUP). Their default action ends the
#: process at once, leaving namespaces, the processes inside them and temporary folders behind.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(SystemExit):
    """Raised in the main thread by one of ``EXIT_SIGNALS`` (see ``ExitOnSignals``): it unwinds like an
    error, so every ``with`` and ``finally`` on the way cleans up, and the process then exits with status
    128 + the signal's number (as if the signal had killed it) without a traceback."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class ExitOnSignals:
    """Within the block, the first of ``EXIT_SIGNALS`` raises ``Terminated`` in the main thread, and
    later ones are ignored while the cleanup that it set off runs; the previous handlers come back at
    the end. ``shield()`` covers a step that must not stop halfway (building or removing namespaces): a
    signal that arrives during it is held back and raised when it has finished. Off the main thread,
    where Python cannot set handlers, it does nothing."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._raised = False  #: Terminated was raised: the cleanup is under way, later signals are ignored
        self._shielded = False
        self._held: int | None = None  #: a signal that came during ``shield``

    def __enter__(self) -> ExitOnSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in EXIT_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self._raised or self._held is not None:
            return
        if self._shielded:
            self._held = signum
            return
        self._raised = True
        raise Terminated(signum)

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        """Run the block to its end whatever signal comes; then raise ``Terminated`` for one that came
        (unless one was raised already)."""
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False
        if self._held is not None and not self._raised:
            self._raised = True
            raise Terminated(self._held)


def require_root() -> str | None:
    """None when namespaces can be built here, else the reason why not (for pytest skips and CLIs)."""
    if os.geteuid() != 0:
        return "network namespaces, veth pairs, bridges, tc and nftables need root (CAP_NET_ADMIN)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2"
    if shutil.which("nft") is None:
        return "nft not found: install nftables (random loss where the kernel has no tc netem)"
    return None


def loss_problem(node: str, pct: float) -> str | None:
    """Why ``pct`` is not a loss rate ``node`` can be given (None if it can): a percentage in [0, 100)."""
    return None if 0 <= pct < 100 else f"loss of {node} must be a percentage in [0, 100), got {pct}"


@dataclass(frozen=True)
class NetemConfig:
    """The emulated network: nodes, addressing, link rate, loss and queueing."""

    workers: int = 2
    rate_mbit: float | None = 1000.0  #: every link, both directions; None: unshaped
    #: node -> % dropped per direction. A node listed with 0 gets the same loss machinery dropping nothing
    #: (the nftables rule or netem qdisc with 0 %), so that a lossless baseline pays what the lossy runs
    #: pay for it; a node not listed gets none of it. With any node listed, every node's link carries
    #: frames, not GSO runs (``gso_max_segs 1``).
    loss_percent: dict[str, float] = field(default_factory=dict)
    loss_method: LossMethod = "auto"  #: netem if the kernel has it, else nftables
    loss_udp_only: bool = False  #: drop only UDP (leaves the TCP of the rendezvous and gloo alone)
    qdisc: Qdisc = "tbf"
    queue_ms: float = 50.0  #: tbf latency / queue length in time at the link rate
    subnet: str = "10.77.0.0/24"
    mtu: int = 1500
    prefix: str = ""  #: namespace name prefix; default "thc<pid>" so concurrent runs do not collide
    aggregator: bool = True  #: a node "agg" for the aggregator

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 200:
            raise ValueError(f"workers must be in 1..200, got {self.workers}")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {self.rate_mbit}")
        for node, pct in self.loss_percent.items():
            if node not in self.nodes:
                raise ValueError(f"loss for unknown node {node!r}; nodes are {list(self.nodes)}")
            if (problem := loss_problem(node, pct)) is not None:
                raise ValueError(problem)
        if self.loss_method not in ("auto", "netem", "nftables"):
            raise ValueError(f"loss_method must be auto, netem or nftables, got {self.loss_method!r}")
        if self.qdisc not in ("tbf", "htb"):
            raise ValueError(f"qdisc must be tbf or htb, got {self.qdisc!r}")
        if len(self.prefix_name) > 10:
            raise ValueError(f"prefix {self.prefix_name!r} is too long (at most 10 characters)")
        net = ipaddress.ip_network(self.subnet)
        if net.num_addresses < len(self.nodes) + 3:
            raise ValueError(f"subnet {self.subnet} is too small for {len(self.nodes)} nodes")

    @property
    def prefix_name(self) -> str:
        return self.prefix or f"thc{os.getpid() % 100000}"

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names: "agg" (if any), then "w0", "w1", ..."""
        return (("agg",) if self.aggregator else ()) + tuple(f"w{i}" for i in range(self.workers))


class Topology:
    """The namespaces, links and rules of one ``NetemConfig`` (see the module docstring)."""

    def __init__(self, cfg: NetemConfig) -> None:
        self.cfg = cfg
        self.prefix = cfg.prefix_name
        self.bridge_ns = f"{self.prefix}-br"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        hosts = ipaddress.ip_network(cfg.subnet).hosts()
        self._addr = {node: str(next(hosts)) for node in cfg.nodes}
        self.loss_method: str | None = None
        self._netem_parents: dict[tuple[str, str, str], list[str]] = {}  #: (ns, dev, node) -> netem's parent

    # -- names ---------------------------------------------------------------------------------------
    def ns(self, node: str) -> str:
        """The namespace of ``node``."""
        if node not in self._addr:
            raise KeyError(f"no node {node!r}; nodes are {list(self._addr)}")
        return f"{self.prefix}-{node}"

    def address(self, node: str) -> str:
        """``node``'s IPv4 address on the emulated network."""
        self.ns(node)
        return self._addr[node]

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(self.ns(n) for n in self.cfg.nodes)]

    # -- building ------------------------------------------------------------------------------------
    def up(self) -> Topology:
        """Create namespaces, bridge, veths, addresses, routes, shaping and loss rules; wait until ready."""
        why = require_root()
        if why:
            raise NetemError(f"cannot build the emulated network: {why}")
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        cfg = self.cfg
        plen = ipaddress.ip_network(cfg.subnet).prefixlen
        existing = set(_run(["ip", "netns", "list"]).split())
        clash = [n for n in self.namespaces() if n in existing]
        if clash:
            raise NetemError(f"namespaces {clash} already exist: another run with prefix {self.prefix!r} "
                             f"(remove them with: python -m topologies.netem down --prefix {self.prefix})")
        self._netns_add(self.bridge_ns)
        self._bridge_without_netfilter()
        br = ["ip", "-n", self.bridge_ns]
        _run([*br, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])
        _run([*br, "link", "set", "br0", "up"])
        for i, node in enumerate(cfg.nodes):
            ns, port = self.ns(node), f"p{i}"
            self._netns_add(ns)
            _run(["ip", "link", "add", "eth0", "netns", ns, "mtu", str(cfg.mtu), "type", "veth", "peer", "name", port,
                  "netns", self.bridge_ns, "mtu", str(cfg.mtu)])
            _run([*br, "link", "set", port, "master", "br0"])
            _run([*br, "link", "set", port, "up"])
            n = ["ip", "-n", ns]
            _run([*n, "link", "set", "lo", "up"])
            _run([*n, "addr", "add", f"{self._addr[node]}/{plen}", "dev", "eth0"])
            _run([*n, "link", "set", "eth0", "up"])
            _run([*n, "route", "add", "224.0.0.0/4", "dev", "eth0"])
            loss = cfg.loss_percent.get(node)
            if cfg.loss_percent:
                # Loss is per frame, as on a wire: a GSO run (a worker's or the aggregator's UDP_SEGMENT
                # send, a TCP segment train) is cut into frames as it leaves any node, as a NIC would,
                # not dropped whole by a rule on the bridge.
                _run([*n, "link", "set", "dev", "eth0", "gso_max_segs", "1"])
            self._shape(ns, "eth0", loss, node)
            self._shape(self.bridge_ns, port, loss, node)
        if self.loss_method == "nftables":
            self._nft_loss()
        self._wait_ready()
        log.info("netem topology %s up: %s", self.prefix, self._addr)

    def _netns_add(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def _shape(self, ns: str, dev: str, loss: float | None, node: str) -> None:
        """Rate (tbf/htb) at the root, and netem loss under it when asked for (None: not) and available."""
        cfg = self.cfg
        tc = ["tc", "-n", ns, "qdisc"]
        parent: list[str] = ["root"]
        if cfg.rate_mbit is not None:
            rate = f"{cfg.rate_mbit}mbit"
            burst = max(64 * 1024, int(cfg.rate_mbit * 1e6 / 8 / 1000))  # 1 ms at the rate, at least 64 kB
            if cfg.qdisc == "tbf":
                _run([*tc, "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate, "burst", str(burst),
                      "latency", f"{cfg.queue_ms}ms"])
                parent = ["parent", "1:1"]
            else:
                _run([*tc, "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
                _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate",
                      rate, "ceil", rate, "burst", str(burst), "cburst", str(burst)])
                parent = ["parent", "1:10"]
        if loss is None:
            return
        if self.loss_method is None:
            self.loss_method = self._pick_loss_method(ns, dev, parent)
        if self.loss_method == "netem":
            _run([*tc, "add", "dev", dev, *parent, "handle", "10:", "netem", "loss", f"{loss}%", "limit", "100000"])
            self._netem_parents[ns, dev, node] = parent

    def _pick_loss_method(self, ns: str, dev: str, parent: list[str]) -> str:
        if self.cfg.loss_method != "auto":
            if self.cfg.loss_method == "nftables" and shutil.which("nft") is None:
                raise NetemError("nft not found: install nftables (apt-get install nftables)")
            return self.cfg.loss_method
        probe = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem",
                                "loss", "0%"], capture_output=True, text=True)
        if probe.returncode == 0:
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, *parent, "handle", "10:"])
            return "netem"
        if shutil.which("nft") is None:
            raise NetemError(f"this kernel has no tc netem ({probe.stderr.strip()}) and nft is not installed: "
                             "install nftables for random loss")
        log.info("no tc netem here (%s); random loss through nftables", probe.stderr.strip())
        return "nftables"

    def _nft_loss(self) -> None:
        """Drop each lossy node's ``loss`` % of frames in each direction on its bridge port (nftables numgen).

        The rules sit in the bridge's forward path, not in the node's output hook, so a dropped
        datagram is lost on the wire as with netem: the sender's ``sendto`` does not fail (an output
        hook drop would return EPERM to it).
        """
        lines = ["table bridge thcloss {", "  chain links {", "    type filter hook forward priority 0; policy accept;",
                 *(f"    {rule}" for rule in self._nft_rules(self.cfg.loss_percent)), "  }", "}", ""]
        _run(["ip", "netns", "exec", self.bridge_ns, "nft", "-f", "-"], stdin="\n".join(lines))

    def _nft_rules(self, loss_percent: dict[str, float]) -> list[str]:
        """The loss chain's rules for ``loss_percent`` (node -> % per direction; whole percent only)."""
        what = "ip protocol udp " if self.cfg.loss_udp_only else ""
        rules = []
        for i, node in enumerate(self.cfg.nodes):
            loss = loss_percent.get(node)
            if loss is None:
                continue
            pct = round(loss)
            if abs(pct - loss) > 1e-9:
                raise NetemError(f"nftables loss is in whole percent, got {loss} for {node}")
            rules += [f'iifname "p{i}" {what}numgen random mod 100 < {pct} counter drop comment "{node} up"',
                      f'oifname "p{i}" {what}numgen random mod 100 < {pct} counter drop comment "{node} down"']
        return rules

    def set_loss(self, loss_percent: dict[str, float]) -> None:
        """Change the loss of running links at once, e.g. to alternate lossless and lossy phases in one run.

        Only nodes the topology was built with loss for (``NetemConfig.loss_percent``, 0 included) can
        change, and each must be given: the nftables chain is replaced in one transaction (its drop
        counters start again from 0), netem's qdiscs are changed in place.
        """
        if set(loss_percent) != set(self.cfg.loss_percent):
            raise NetemError(f"set_loss needs exactly the nodes built with loss, {sorted(self.cfg.loss_percent)}; "
                             f"got {sorted(loss_percent)}")
        for node, pct in loss_percent.items():
            if (problem := loss_problem(node, pct)) is not None:
                raise NetemError(problem)
        if self.loss_method == "nftables":
            script = ["flush chain bridge thcloss links",
                      *(f"add rule bridge thcloss links {rule}" for rule in self._nft_rules(loss_percent)), ""]
            _run(["ip", "netns", "exec", self.bridge_ns, "nft", "-f", "-"], stdin="\n".join(script))
        elif self.loss_method == "netem":
            for (ns, dev, node), parent in self._netem_parents.items():
                _run(["tc", "-n", ns, "qdisc", "change", "dev", dev, *parent, "handle", "10:", "netem", "loss",
                      f"{loss_percent[node]}%", "limit", "100000"])

    def _bridge_without_netfilter(self) -> None:
        """Keep bridged frames out of br_netfilter's IPv4, IPv6 and ARP hooks in the bridge's namespace
        (per namespace since Linux 5.3; only where the module is loaded): the loss rules are nftables'
        bridge family, which needs none of them, and through them every frame crossing the bridge took an
        IP route lookup (perf during a lossy DDP run: ``br_nf_pre_routing``, ``ip_route_input_slow``,
        charged to whichever sender ran), CPU that a switch does not take from the hosts."""
        knobs = " ".join(f"/proc/sys/net/bridge/bridge-nf-call-{n}" for n in ("iptables", "ip6tables", "arptables"))
        script = f"for f in {knobs}; do [ -w $f ] && echo 0 > $f; done; true"
        _run(["ip", "netns", "exec", self.bridge_ns, "sh", "-c", script])

    def _wait_ready(self, timeout: float = 20.0) -> None:
        """Poll until every bridge port forwards and every eth0 is up (no fixed sleep)."""
        deadline = time.monotonic() + timeout
        ports = {f"p{i}" for i in range(len(self.cfg.nodes))}
        while True:
            links = json.loads(_run(["ip", "-n", self.bridge_ns, "-j", "link", "show", "master", "br0"]) or "[]")
            up = {ln["ifname"] for ln in links if "LOWER_UP" in ln.get("flags", [])}
            eth_up = all("LOWER_UP" in json.loads(_run(["ip", "-n", self.ns(n), "-j", "link", "show", "eth0"]))[0]
                         .get("flags", []) for n in self.cfg.nodes)
            if ports <= up and eth_up:
                return
            if time.monotonic() > deadline:
                raise NetemError(f"links not up after {timeout:.0f} s: bridge ports up {sorted(up)}")
            time.sleep(0.05)

    # -- running things inside ----------------------------------------------------------------------
    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def popen(self, node: str, argv: Sequence[str], **kw: object) -> subprocess.Popen:
        """Start ``argv`` in ``node``'s namespace (its own process group; killed by ``down``)."""
        proc = subprocess.Popen(self.command(node, argv), start_new_session=True, **kw)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """Kill the process group of a process started with ``popen``."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def counters(self) -> dict[str, int]:
        """Frames dropped so far by the nftables loss rules, by "<node> up" / "<node> down" (empty if none)."""
        if self.loss_method != "nftables":
            return {}
        doc = json.loads(_run(["ip", "netns", "exec", self.bridge_ns, "nft", "-j", "list", "table", "bridge",
                               "thcloss"]))
        out: dict[str, int] = {}
        for item in doc.get("nftables", []):
            rule = item.get("rule")
            if rule:
                for expr in rule["expr"]:
                    if "counter" in expr:
                        out[rule.get("comment", "?")] = int(expr["counter"]["packets"])
        return out

    # -- tearing down --------------------------------------------------------------------------------
    def down(self) -> None:
        """Kill what ``popen`` started, then delete every namespace this topology created."""
        for proc in self._procs:
            self.kill(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        errors = []
        for ns in reversed(self._created):
            # Stray processes of ours still inside (children that left the process group).
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"{ns}: {r.stderr.strip()}")
        self._created.clear()
        if errors:
            raise NetemError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> Topology:
        """``up()``; from here until ``__exit__`` has run ``down()``, SIGTERM and SIGHUP raise ``Terminated``
        (``ExitOnSignals``), so a killed run still removes everything."""
        self._signals = ExitOnSignals().__enter__()
        try:
            with self._signals.shield():  # a signal during up() is raised once it is complete ...
                self.up()
        except BaseException as exc:
            self._stopping(exc)
            try:
                self.down()  # ... and all of it removed (after a failed up(), nothing is left to remove)
            finally:
                self._signals.__exit__()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """``down()``, which a signal does not cut short (one that comes is raised once it is done)."""
        self._stopping(exc)
        try:
            with self._signals.shield():
                self.down()
        finally:
            self._signals.__exit__()

    def _stopping(self, exc: BaseException | None) -> None:
        """One line on stderr when a signal ends the run (``Terminated``): why the program stops."""
        if isinstance(exc, Terminated):
            print(f"topologies.netem: {signal.Signals(exc.signum).name}: stopping; removing the emulated network "
                  f"{self.prefix}-*", file=sys.stderr, flush=True)


def remove_prefix(prefix: str) -> list[str]:
    """Delete the namespaces ``<prefix>-*`` left by an interrupted run (exact prefix, ours only)."""
    names = [n for n in _run(["ip", "netns", "list"]).split() if n.startswith(f"{prefix}-")]
    for ns in names:
        _run(["ip", "netns", "del", ns])
    return names


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    r = subprocess.run(list(argv), input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetemError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout
