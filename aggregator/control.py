"""The control protocol of ``thc-aggregator``: text commands on a UDP socket, one per datagram,
answered to the sender (docs/aggregator.md, "Options": ``--control-port``).

``add SPEC`` (a ``--job`` spec; replaces a job with the same id), ``remove ID``, ``list`` (JSON) and
``stats`` (JSON counter totals). ``apply_command`` is the protocol (pure: job table in, reply and new
job table out); ``ControlChannel`` reads the socket without blocking and answers.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable

from aggregator.io import udp_socket
from worker_lib.job import JobConfig, parse_job_spec

USAGE = "error: unknown command; use: add SPEC | remove ID | list | stats"


def apply_command(text: str, jobs: dict[int, JobConfig],
                  totals: Callable[[], dict[str, int]]) -> tuple[str, dict[int, JobConfig] | None]:
    """The reply to one command and the job table it leaves (None: unchanged). Bad input gets a
    one-line ``error: ...`` reply and changes nothing."""
    cmd, _, arg = text.strip().partition(" ")
    try:
        if cmd == "add":
            cfg = parse_job_spec(arg)
            return f"ok: job {cfg.job} configured", {**jobs, cfg.job: cfg}
        if cmd == "remove":
            jid = int(arg, 0)
            if jid not in jobs:
                raise ValueError(f"no job {jid}")
            return f"ok: job {jid} removed", {j: c for j, c in jobs.items() if j != jid}
        if cmd == "list":
            return json.dumps([j.to_dict() for j in jobs.values()]), None
        if cmd == "stats":
            return json.dumps(totals()), None
        return USAGE, None
    except ValueError as exc:
        return f"error: {exc}", None


class ControlChannel:
    """The control socket: ``poll`` answers every waiting command and returns the new job list, if any."""

    def __init__(self, host: str, port: int) -> None:
        self.sock: socket.socket = udp_socket(host, port, rcvbuf=1 << 16, sndbuf=1 << 16)
        self.port: int = self.sock.getsockname()[1]

    def poll(self, jobs: list[JobConfig], totals: Callable[[], dict[str, int]]) -> list[JobConfig] | None:
        """Answer the waiting commands in order; the job list they leave, or None if none changed it."""
        table = {j.job: j for j in jobs}
        changed = False
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except (BlockingIOError, InterruptedError):
                break
            reply, new = apply_command(data.decode("utf-8", "replace"), table, totals)
            if new is not None:
                table, changed = new, True
            with contextlib.suppress(OSError):
                self.sock.sendto(reply.encode(), peer)
        return list(table.values()) if changed else None

    def close(self) -> None:
        self.sock.close()
