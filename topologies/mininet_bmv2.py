"""A Mininet switch node running BMv2 simple_switch_grpc, and the star network of topologies.star.

Imported only when Mininet is available (Debian's ``mininet`` package, a module of /usr/bin/python3).
The node starts simple_switch_grpc with its log and per-port pcap files in ``workdir`` and its
P4Runtime server on a TCP port of the root namespace (Mininet switches live there), and the controller
waits for that port by polling (aggregator.p4rt.wait_for_port).
"""

from __future__ import annotations

import logging
import socket
import subprocess
from pathlib import Path

from mininet.net import Mininet
from mininet.node import Switch
from mininet.topo import Topo

from aggregator.p4rt import SwitchAddress, wait_for_port
from topologies.bmv2 import find_tool
from topologies.nsstar import host_ip, host_mac

log = logging.getLogger(__name__)


def free_tcp_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bmv2Node(Switch):
    """simple_switch_grpc as a Mininet switch: port i of the switch is its i-th Mininet interface."""

    def __init__(self, name: str, workdir: Path, grpc_port: int | None = None, thrift_port: int | None = None,
                 device_id: int = 0, **kw) -> None:
        super().__init__(name, **kw)
        self.workdir = Path(workdir)
        # Free ports by default: the root namespace is shared, 9559/9090 may belong to another switch.
        self.grpc_port = grpc_port if grpc_port is not None else free_tcp_port()
        self.thrift_port = thrift_port if thrift_port is not None else free_tcp_port()
        self.device_id = device_id
        self.address = SwitchAddress("127.0.0.1", self.grpc_port, device_id=device_id)
        self.proc: subprocess.Popen | None = None

    def start(self, controllers) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "pcap").mkdir(exist_ok=True)
        cmd = [find_tool("simple_switch_grpc"), "--no-p4", "--device-id", str(self.device_id),
               "--thrift-port", str(self.thrift_port), "--log-file", str(self.workdir / "simple_switch"),
               "--pcap", str(self.workdir / "pcap")]
        for port, intf in self.intfs.items():
            if intf.name != "lo":
                cmd += ["-i", f"{port}@{intf.name}"]
        cmd += ["--", "--grpc-server-addr", f"127.0.0.1:{self.grpc_port}"]
        self._out = open(self.workdir / "simple_switch.stdout", "wb")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        wait_for_port("127.0.0.1", self.grpc_port, timeout=30)

    def stop(self, deleteIntfs: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_out", None) is not None:
            self._out.close()
            self._out = None
        super().stop(deleteIntfs)


class StarTopo(Topo):
    """n hosts h1..hn (10.0.0.i/24) on ports 1..n of one BMv2 switch s1."""

    def build(self, n: int = 4, workdir: Path = Path("/tmp/thc-star")) -> None:
        sw = self.addSwitch("s1", cls=Bmv2Node, workdir=workdir)
        for i in range(n):
            h = self.addHost(f"h{i + 1}", ip=f"{host_ip(i)}/24", mac=host_mac(i))
            self.addLink(h, sw, port2=i + 1)


def build_star_net(n: int, workdir: Path) -> tuple[Mininet, Bmv2Node]:
    """The Mininet network of the star (not started) and its switch node."""
    net = Mininet(topo=StarTopo(n=n, workdir=workdir), controller=None, autoSetMacs=False)
    return net, net.get("s1")
