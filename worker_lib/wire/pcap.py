"""Write and read THC traffic as pcap files (dpkt), for Wireshark/tshark and for tests.

UDP payloads seen by a userspace program are wrapped in synthesized Ethernet/IPv4/UDP headers so
that the capture opens like one taken on the wire (the generated Lua dissector decodes it).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import dpkt


@dataclass(frozen=True)
class Captured:
    """One UDP datagram of a capture."""

    ts: float
    src: tuple[str, int]
    dst: tuple[str, int]
    payload: bytes


def frame(src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    """Ethernet/IPv4/UDP frame around a UDP payload (checksums filled by dpkt)."""
    udp = dpkt.udp.UDP(sport=src[1], dport=dst[1], data=payload)
    udp.ulen = len(udp)
    ip = dpkt.ip.IP(src=socket.inet_aton(src[0]), dst=socket.inet_aton(dst[0]), p=dpkt.ip.IP_PROTO_UDP,
                    data=udp, ttl=64)
    ip.len = len(ip)
    eth = dpkt.ethernet.Ethernet(src=b"\x02\x00\x00\x00\x00\x01", dst=b"\x02\x00\x00\x00\x00\x02",
                                 type=dpkt.ethernet.ETH_TYPE_IP, data=ip)
    return bytes(eth)


class PcapWriter:
    """Append UDP datagrams to a pcap file (Ethernet link type)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: BinaryIO = open(self.path, "wb")
        self._writer = dpkt.pcap.Writer(self._fh, linktype=dpkt.pcap.DLT_EN10MB)
        self.count = 0

    def write(self, src: tuple[str, int], dst: tuple[str, int], payload: bytes, ts: float | None = None) -> None:
        self._writer.writepkt(frame(src, dst, payload), ts=time.time() if ts is None else ts)
        self.count += 1

    def close(self) -> None:
        """Flush and close; the file is closed even where the flush fails (a full disk), which then raises."""
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> PcapWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def read_pcap(path: str | Path) -> list[Captured]:
    """All UDP/IPv4 datagrams of a pcap file (other frames are skipped)."""
    out = []
    with open(path, "rb") as fh:
        for ts, buf in dpkt.pcap.Reader(fh):
            eth = dpkt.ethernet.Ethernet(buf)
            ip = eth.data
            if not isinstance(ip, dpkt.ip.IP) or not isinstance(ip.data, dpkt.udp.UDP):
                continue
            udp = ip.data
            out.append(Captured(ts, (socket.inet_ntoa(ip.src), udp.sport), (socket.inet_ntoa(ip.dst), udp.dport),
                                bytes(udp.data)))
    return out
