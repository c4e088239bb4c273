"""A Mininet switch node running BMv2 simple_switch_grpc, and the star network of topologies.star.

Imported only when Mininet is available (Debian's ``mininet`` package, a module of /usr/bin/python3).
The node starts simple_switch_grpc (topologies.bmv2.Bmv2Switch) with its log and per-port pcap files in
``workdir`` and its P4Runtime server on a TCP port of the root namespace (Mininet switches live there);
its start returns once that port accepts connections and the process is still running.
"""

from __future__ import annotations

import socket
from pathlib import Path

from mininet.net import Mininet
from mininet.node import Switch
from mininet.topo import Topo

from aggregator.p4rt import SwitchAddress
from topologies.bmv2 import Bmv2Config, Bmv2Switch
from topologies.nsstar import host_ip, host_mac


def free_tcp_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports of 127.0.0.1 that nothing uses right now (all bound at once, so that two
    picks cannot return the same port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Bmv2Node(Switch):
    """simple_switch_grpc as a Mininet switch: port i of the switch is its i-th Mininet interface.

    The process itself is a topologies.bmv2.Bmv2Switch (one command line, one start-up check for both
    kinds of topology); this class only maps Mininet's interfaces onto its ports. Its P4Runtime and
    Thrift ports are free ports picked at start (the root namespace is shared: 9559 and 9090 may belong to
    another switch, and a port picked when the network was built may be some connection's by then) unless
    given; ``address`` is known from then on."""

    def __init__(self, name: str, workdir: Path, grpc_port: int | None = None, thrift_port: int | None = None,
                 device_id: int = 0, **kw) -> None:
        super().__init__(name, **kw)
        self.workdir = Path(workdir)
        self.grpc_port, self.thrift_port = grpc_port, thrift_port
        self.device_id = device_id
        self.switch: Bmv2Switch | None = None

    @property
    def address(self) -> SwitchAddress:
        """The switch's P4Runtime address (once started, unless its port was given)."""
        if self.grpc_port is None:
            raise RuntimeError(f"switch {self.name} has no P4Runtime port before it starts")
        return SwitchAddress("127.0.0.1", self.grpc_port, device_id=self.device_id)

    def start(self, controllers) -> None:
        picked = iter(free_tcp_ports(2))
        self.grpc_port = self.grpc_port if self.grpc_port is not None else next(picked)
        self.thrift_port = self.thrift_port if self.thrift_port is not None else next(picked)
        interfaces = {port: intf.name for port, intf in self.intfs.items() if intf.name != "lo"}
        self.switch = Bmv2Switch(Bmv2Config(interfaces, self.workdir, device_id=self.device_id,
                                            grpc_port=self.grpc_port, thrift_port=self.thrift_port))
        self.switch.start()

    def stop(self, deleteIntfs: bool = True) -> None:
        if self.switch is not None:
            self.switch.stop()
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
