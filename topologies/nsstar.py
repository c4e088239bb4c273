"""A star of n hosts around one BMv2 switch, built from plain network namespaces (no Mininet).

Why next to the Mininet star: Mininet is a module of Debian's /usr/bin/python3 and not always
installed; the BMv2 tests and benchmarks need only namespaces and veth pairs, which iproute2 gives as
root. Layout (``prefix`` keeps names unique per run)::

    <prefix>sw  : s0 .. s{n-1}               (simple_switch_grpc runs here; port i = s{i})
    <prefix>h{i}: h{i}, 10.0.0.{i+1}/24, MAC 02:00:00:00:00:{i+1:02x}
                  static neighbours: every other host, and the aggregator address 10.0.0.100 ->
                  the switch's MAC 02:00:00:00:01:00 (THC packets to it are aggregated by the switch)

``routes()`` are the ipv4_lpm entries that let hosts ping each other through the switch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from topologies.netns import Netns

log = logging.getLogger(__name__)

SERVICE_IP = "10.0.0.100"
SWITCH_MAC = "02:00:00:00:01:00"


@dataclass(frozen=True)
class Host:
    """One worker host: its namespace, interface, addresses and the switch port it hangs off."""

    ns: Netns
    ifname: str
    mac: str
    ip: str
    port: int


def host_mac(i: int) -> str:
    return f"02:00:00:00:00:{i + 1:02x}"


def host_ip(i: int) -> str:
    return f"10.0.0.{i + 1}"


@dataclass
class NsStar:
    """n host namespaces, each linked by a veth pair to port i of the switch namespace."""

    hosts_n: int
    prefix: str
    switch_ns: Netns = field(init=False)
    hosts: list[Host] = field(default_factory=list, init=False)
    _made: list[Netns] = field(default_factory=list, init=False)

    def create(self) -> NsStar:
        """Create every namespace, link and address; on failure remove what was made and re-raise."""
        try:
            self.switch_ns = Netns(f"{self.prefix}sw").create()
            self._made.append(self.switch_ns)
            for i in range(self.hosts_n):
                ns = Netns(f"{self.prefix}h{i}").create()
                self._made.append(ns)
                self.switch_ns.add_veth(f"s{i}", f"h{i}", peer_ns=ns, peer_mac=host_mac(i))
                ns.exec(["ip", "addr", "add", f"{host_ip(i)}/24", "dev", f"h{i}"])
                ns.exec(["ip", "neigh", "replace", SERVICE_IP, "lladdr", SWITCH_MAC, "dev", f"h{i}", "nud",
                         "permanent"])
                self.hosts.append(Host(ns, f"h{i}", host_mac(i), host_ip(i), i))
            for h in self.hosts:
                for other in self.hosts:
                    if other is not h:
                        h.ns.exec(["ip", "neigh", "replace", other.ip, "lladdr", other.mac, "dev", h.ifname, "nud",
                                   "permanent"])
        except Exception:
            self.close()
            raise
        return self

    @property
    def interfaces(self) -> dict[int, str]:
        """Switch port -> interface name in the switch namespace."""
        return {h.port: f"s{h.port}" for h in self.hosts}

    def routes(self) -> list[tuple[str, str, int]]:
        """(prefix, next-hop MAC, port) of every host, for ``ThcSwitch.add_route``."""
        return [(f"{h.ip}/32", h.mac, h.port) for h in self.hosts]

    def close(self) -> None:
        """Delete every namespace made (hosts first); idempotent."""
        for ns in reversed(self._made):
            ns.close()
        self._made.clear()

    def __enter__(self) -> NsStar:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
