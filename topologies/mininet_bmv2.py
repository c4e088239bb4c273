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


def free_tcp_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bmv2Node(Switch):
    """simple_switch_grpc as a Mininet switch: port i of the switch is its i-th Mininet interface.

    The process itself is a topologies.bmv2.Bmv2Switch (one command line, one start-up check for both
    kinds of topology); this class only maps Mininet's interfaces onto its ports."""

    def __init__(self, name: str, workdir: Path, grpc_port: int | None = None, thrift_port: int | None = None,
                 device_id: int = 0, **kw) -> None:
        super().__init__(name, **kw)
        self.workdir = Path(workdir)
        # Free ports by default: the root namespace is shared, 9559/9090 may belong to another switch.
        self.grpc_port = grpc_port if grpc_port is not None else free_tcp_port()
        self.thrift_port = thrift_port if thrift_port is not None else free_tcp_port()
        self.device_id = device_id
        self.address = SwitchAddress("127.0.0.1", self.grpc_port, device_id=device_id)
        self.switch: Bmv2Switch | None = None

    def start(self, controllers) -> None:
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
