"""Scapy layer of the THC header, generated from ``layout.FIELDS`` and bound to the THC UDP port.

    >>> from worker_lib.wire.scapy_layer import THC
    >>> from scapy.all import IP, UDP, ls
    >>> pkt = IP(dst="127.0.0.1") / UDP(dport=9451) / THC(type=1, job=7, elems=8, width=4) / bytes(4)
"""

from __future__ import annotations

from scapy.fields import BitEnumField, BitField
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from worker_lib.wire.layout import FIELDS, THC_UDP_PORT, VERSION, PacketType

_TYPE_NAMES = {int(t): t.name for t in PacketType}


def _fields_desc() -> list:
    out = []
    for f in FIELDS:
        default = VERSION if f.name == "version" else 0
        if f.name == "type":
            out.append(BitEnumField(f.name, int(PacketType.DATA), f.bits, _TYPE_NAMES))
        else:
            out.append(BitField(f.name, default, f.bits))
    return out


class THC(Packet):
    """THC aggregation header (docs/protocol.md); the payload (indices, sums or a norm) follows as Raw."""

    name = "THC"
    fields_desc = _fields_desc()


bind_layers(UDP, THC, dport=THC_UDP_PORT)
bind_layers(UDP, THC, sport=THC_UDP_PORT)
