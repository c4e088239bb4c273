"""UDP segmentation offload (udp(7), Linux 4.18+): one send of many equal-size datagrams.

A ``sendmsg``/``sendmmsg`` message with a ``UDP_SEGMENT`` control message carries up to
``GSO_SEGMENTS`` datagrams of the cmsg's size back to back (``GSO_BYTES`` in all); the kernel passes
the run through the socket and IP layers once and cuts it into the datagrams as late as it can (in the
NIC where it segments UDP). Workers send their windows this way (``worker_lib.transport``) and the
aggregator its answers (``worker_lib.batch_io``); both fall back to one datagram per message where the kernel
lacks it or refuses a run. On the receive side, a socket with UDP_GRO gets a run that reached it whole
(over veth and bridges, or loopback) as one message, which ``worker_lib.batch_io`` cuts back into its
datagrams.
"""

from __future__ import annotations

import socket

#: The socket level and option (and cmsg type) of UDP segmentation offload, and of its receive side
#: (UDP_GRO: a run that arrives whole is read as one message, its segment size in a cmsg).
SOL_UDP, UDP_SEGMENT, UDP_GRO = socket.IPPROTO_UDP, 103, 104
#: Most datagrams per message (UDP_MAX_SEGMENTS) and bytes of payload in all (one UDP datagram's limit).
GSO_SEGMENTS, GSO_BYTES = 64, 65507


def gso_available(sock: socket.socket) -> bool:
    """Whether the kernel knows UDP_SEGMENT (reading the option does not set it)."""
    try:
        sock.getsockopt(SOL_UDP, UDP_SEGMENT)
    except OSError:
        return False
    return True


def enable_gro(sock: socket.socket) -> bool:
    """Ask for coalesced receives (UDP_GRO, Linux 5.0+); False where the kernel refuses it."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True
