"""Network namespaces and veth pairs for BMv2 tests and benchmarks (iproute2, needs root).

Why: the BMv2 tests must not send a packet outside namespaces they create. ``Netns`` creates a named
namespace, veth pairs inside it (switch side ``sN``, host side ``hN``), disables IPv6 in it (no router
solicitations or neighbour discovery appear on the ports), and deletes it all on ``close`` (deleting
the namespace deletes its veths). ``Netns.socket_in`` opens a socket *inside* the namespace from this
process: the socket is created by a helper thread that has joined the namespace with setns(2), and
keeps belonging to it afterwards.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
T = TypeVar("T")


class NetnsError(RuntimeError):
    """An ip(8) command failed, or setns(2) did."""


def run_ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (inside ``netns`` if given); raise NetnsError with ip's message on failure."""
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


@dataclass
class Netns:
    """A network namespace. ``create`` makes it with loopback up and IPv6 off; ``close`` deletes it
    (and with it every interface inside). ``ports`` > 0 also creates veth pairs ``sN`` <-> ``hN`` in it."""

    name: str
    ports: int = 0
    mtu: int = 1500
    created: bool = field(default=False, init=False)

    def create(self) -> Netns:
        """Create the namespace (raise NetnsError, leaving nothing behind, on failure)."""
        run_ip("netns", "add", self.name)
        self.created = True
        try:
            self.exec(["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                       "net.ipv6.conf.default.disable_ipv6=1"])
            run_ip("link", "set", "lo", "up", netns=self.name)
            for i in range(self.ports):
                self.add_veth(f"s{i}", f"h{i}")
        except Exception:
            self.close()
            raise
        return self

    def add_veth(self, name: str, peer: str, peer_ns: Netns | None = None, peer_mac: str | None = None) -> None:
        """A veth pair ``name`` (here) <-> ``peer`` (in ``peer_ns``, default here), both up, this MTU.

        Both ends carry frames, as a wire does (``gso_max_segs 1``): a sender's segmentation-offload run
        (a worker's UDP_SEGMENT send) is cut into its datagrams as it enters the pair. Otherwise it would
        cross as one super-frame, and a BMv2 switch reading the port would see one packet where there
        are 64."""
        run_ip("link", "add", name, "mtu", str(self.mtu), "gso_max_segs", "1", "type", "veth", "peer", "name", peer,
               "mtu", str(self.mtu), "gso_max_segs", "1", netns=self.name)
        run_ip("link", "set", name, "up", netns=self.name)
        where = self
        if peer_ns is not None:
            run_ip("link", "set", peer, "netns", peer_ns.name, netns=self.name)
            where = peer_ns
        if peer_mac:
            run_ip("link", "set", peer, "address", peer_mac, netns=where.name)
        run_ip("link", "set", peer, "up", netns=where.name)

    def exec(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run a command inside the namespace and wait for it (bounded by ``timeout``, default 60 s)."""
        kw.setdefault("timeout", 60)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        proc = subprocess.run(["ip", "netns", "exec", self.name, *cmd], check=False, **kw)
        if proc.returncode != 0:
            raise NetnsError(f"in {self.name}: {' '.join(cmd)} failed: {proc.stderr.strip()}")
        return proc

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """Start a command inside the namespace (the caller stops it)."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], **kw)

    def call_inside(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a helper thread that has joined this namespace; return its result."""
        out: dict[str, object] = {}

        def body() -> None:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    out["error"] = NetnsError(f"setns({self.name}) failed: {os.strerror(ctypes.get_errno())}")
                    return
            finally:
                os.close(fd)
            try:
                out["value"] = fn()
            except Exception as exc:
                out["error"] = exc

        th = threading.Thread(target=body, name=f"setns-{self.name}")
        th.start()
        th.join()
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        return out["value"]  # type: ignore[return-value]

    def raw_socket(self, ifname: str) -> socket.socket:
        """An AF_PACKET socket bound to ``ifname`` inside the namespace (sees every frame on it)."""
        def make() -> socket.socket:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((ifname, 0))
            s.setblocking(False)
            return s
        return self.call_inside(make)

    def close(self) -> None:
        """Delete the namespace (and with it the veths); idempotent."""
        if self.created:
            proc = run_ip("netns", "del", self.name, check=False)
            if proc.returncode != 0:
                log.warning("ip netns del %s: %s", self.name, proc.stderr.strip())
            self.created = False

    def __enter__(self) -> Netns:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
