"""The control plane of ``thc-aggregator``: text commands, one per datagram, answered to the sender
(docs/aggregator.md, "Control").

Commands: ``add SPEC`` (a ``--job`` spec; replaces a job with the same id), ``remove ID``, ``list``
(JSON, job keys left out) and ``stats`` (JSON counter totals).

Who may drive it: the control socket is a Unix datagram socket (mode 0600: its owner only) or a UDP
address. A UDP address off loopback is refused unless a shared token is configured; with a token,
every datagram must start with ``auth=TOKEN`` (compared in constant time), on any kind of socket.
A refused datagram gets a reply no longer than itself (no amplification towards a forged source),
and at most ``REFUSALS_PER_S`` of those per second.

Control never stalls data: a thread reads the socket and does the expensive part of a command (parsing
a spec solves the job's table: seconds for a large granularity, in numpy calls short enough to let the
packet loop run between them), then hands the ready change to the serving loop, which applies it
between two batches and answers. The codecs a dar job needs (torch) are loaded at startup.
``prepare_command`` and ``commit`` are the protocol, pure; ``apply_command`` is both in one step.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker_lib.job import JobConfig, parse_job_spec

log = logging.getLogger(__name__)

USAGE = "error: unknown command; use: add SPEC | remove ID | list | stats"
REFUSED = "error: bad or missing token"
AUTH_PREFIX = "auth="
MIN_TOKEN_BYTES = 16
REFUSALS_PER_S = 100
MAX_DATAGRAM = 8192

Totals = Callable[[], dict[str, int]]
#: How a serving loop puts a job list (possibly empty) into its shards: (jobs, the ids to configure anew
#: even where their settings did not change: those a control ``add`` named).
Install = Callable[[list[JobConfig], frozenset[int]], None]


class ControlConfigError(ValueError):
    """A control-plane setting that thc-aggregator refuses to start with."""


@dataclass(frozen=True)
class ControlAddress:
    """Where commands are accepted: a Unix datagram socket ``path``, or UDP ``host``:``port``."""

    path: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> ControlAddress:
        """``/run/thc.sock`` or ``./ctl.sock`` (a path: has a slash) or ``HOST:PORT`` (UDP; port 0: any)."""
        if "/" in text:
            return cls(path=text)
        host, sep, port = text.rpartition(":")
        try:
            ipaddress.IPv4Address(host)
            num = int(port)
        except ValueError:
            num = -1
        if not sep or not 0 <= num < 1 << 16:
            raise ControlConfigError(f"control address {text!r}: expected a socket path (with a '/') or "
                                     "IPV4:PORT with a port in 0..65535")
        return cls(host=host, port=num)

    @property
    def is_local(self) -> bool:
        """True when only this machine can reach it (a Unix socket, or a loopback address)."""
        return self.path is not None or ipaddress.IPv4Address(self.host).is_loopback

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.path is not None else f"{self.host}:{self.port}"


def read_token(path: Path) -> bytes:
    """The shared token: the file's first line. Refused if short or readable by group or others."""
    try:
        mode = path.stat().st_mode
        token = path.read_bytes().split(b"\n", 1)[0].strip()
    except OSError as exc:
        raise ControlConfigError(f"control token file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ControlConfigError(f"control token file {path} is readable by other users: chmod 600 {path}")
    if len(token) < MIN_TOKEN_BYTES or b" " in token:
        raise ControlConfigError(f"control token in {path} must be at least {MIN_TOKEN_BYTES} bytes without "
                                 "spaces (e.g. the output of: python -c 'import secrets; "
                                 "print(secrets.token_hex(16))')")
    return token


@dataclass(frozen=True)
class ControlConfig:
    """The control socket's address and the token every command must carry (None: no token)."""

    address: ControlAddress
    token: bytes | None = None

    def __post_init__(self) -> None:
        if not self.address.is_local and self.token is None:
            raise ControlConfigError(
                f"control on {self.address} can be reached from other hosts: give --control-token-file FILE "
                "(a shared secret every command must carry), or use 127.0.0.1:PORT or a Unix socket path")


def authenticate(data: bytes, token: bytes | None) -> str | None:
    """The command text of a datagram, or None when it lacks the configured token."""
    if token is None:
        return data.decode("utf-8", "replace")
    head, _, rest = data.partition(b" ")
    given = head[len(AUTH_PREFIX):] if head.startswith(AUTH_PREFIX.encode()) else b""
    return rest.decode("utf-8", "replace") if hmac.compare_digest(given, token) else None


@dataclass(frozen=True)
class Prepared:
    """A parsed command: ``verb`` and its ``arg`` (a JobConfig for add, an id for remove), or the
    final ``reply`` of a command that failed to parse."""

    verb: str
    arg: JobConfig | int | None = None
    reply: str | None = None

    @property
    def changes_jobs(self) -> bool:
        return self.reply is None and self.verb in ("add", "remove")


def prepare_command(text: str) -> Prepared:
    """Parse one command, doing its expensive part (an add's spec solves the job's table)."""
    verb, _, arg = text.strip().partition(" ")
    try:
        if verb == "add":
            if "job" not in (part.partition("=")[0].strip() for part in arg.split(",")):
                return Prepared(verb, reply="error: add needs the job's id in its spec: add job=ID,key=...,workers=N")
            cfg = parse_job_spec(arg)
            cfg.check_one_tier()
            return Prepared(verb, cfg)
        if verb == "remove":
            try:
                return Prepared(verb, int(arg.strip(), 0))
            except ValueError:
                return Prepared(verb, reply=f"error: remove takes one job id (remove ID), got {arg.strip()!r}")
        if verb in ("list", "stats"):
            return Prepared(verb)
        return Prepared(verb, reply=USAGE)
    except ValueError as exc:
        return Prepared(verb, reply=f"error: {exc}")


def public_view(cfg: JobConfig) -> dict[str, object]:
    """A job as ``list`` shows it: every setting but its key."""
    return {k: v for k, v in cfg.to_dict().items() if k != "key"}


def commit(cmd: Prepared, jobs: dict[int, JobConfig], totals: Totals) -> tuple[str, dict[int, JobConfig] | None]:
    """The reply to a prepared command and the job table it leaves (None: unchanged; the caller's
    table is never mutated). Bad input gets a one-line ``error: ...`` reply and changes nothing."""
    if cmd.reply is not None:
        return cmd.reply, None
    if cmd.verb == "add":
        cfg = cmd.arg
        return f"ok: job {cfg.job} configured", {**jobs, cfg.job: cfg}
    if cmd.verb == "remove":
        if cmd.arg not in jobs:
            return f"error: no job {cmd.arg}", None
        return f"ok: job {cmd.arg} removed", {j: c for j, c in jobs.items() if j != cmd.arg}
    if cmd.verb == "list":
        return json.dumps([public_view(j) for j in jobs.values()]), None
    return json.dumps(totals()), None


def apply_command(text: str, jobs: dict[int, JobConfig], totals: Totals) -> tuple[str, dict[int, JobConfig] | None]:
    """``commit(prepare_command(text), ...)``: one command's reply and the job table it leaves."""
    return commit(prepare_command(text), jobs, totals)


def _bind(address: ControlAddress) -> socket.socket:
    """The control socket; a Unix one is created with mode 0600, replacing a stale socket file."""
    if address.path is None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((address.host, address.port))
        except OSError as exc:
            s.close()
            raise OSError(f"cannot bind the control socket {address}: {exc.strerror or exc}") from None
        return s
    path = Path(address.path)
    if path.is_socket():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(str(path))
            raise OSError(f"control socket {path} is in use by a running process")
        except ConnectionRefusedError:
            path.unlink()  # left by a process that died
        finally:
            probe.close()
    elif path.exists():
        raise OSError(f"control path {path} exists and is not a socket")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    old = os.umask(0o177)  # the file is born 0600: no window in which others could connect
    try:
        s.bind(str(path))
    except OSError as exc:
        s.close()
        raise OSError(f"cannot bind the control socket {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    return s


class ControlChannel:
    """The control socket, read by a thread from ``start()`` on. ``jobs()`` and ``totals()`` are read by
    that thread for ``list`` and ``stats``; job changes wait for the serving loop's ``apply`` (between
    batches)."""

    def __init__(self, cfg: ControlConfig, jobs: Callable[[], list[JobConfig]], totals: Totals) -> None:
        self.cfg, self._jobs, self._totals = cfg, jobs, totals
        self.sock = _bind(cfg.address)
        self.sock.settimeout(0.2)
        name = self.sock.getsockname()
        self.address = cfg.address if cfg.address.path is not None else ControlAddress(host=name[0], port=name[1])
        self.counts = {"control_commands": 0, "control_refused": 0}
        self._pending: queue.SimpleQueue[tuple[Prepared, object]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._budget, self._budget_t = float(REFUSALS_PER_S), time.monotonic()
        self._thread = threading.Thread(target=self._run, name="thc-control", daemon=True)

    def start(self) -> None:
        """Start reading commands (after any fork: the serving loop's processes must not inherit a thread)."""
        self._thread.start()

    def _reply(self, text: str, peer: object, limit: int | None = None) -> None:
        data = text.encode()[:limit]
        if peer:  # an unbound Unix client has no address to answer to
            with contextlib.suppress(OSError):
                self.sock.sendto(data, peer)

    def _refuse(self, size: int, peer: object) -> None:
        """Answer a refused datagram with at most its own size, within the refusal budget."""
        self.counts["control_refused"] += 1
        now = time.monotonic()
        self._budget = min(float(REFUSALS_PER_S), self._budget + (now - self._budget_t) * REFUSALS_PER_S)
        self._budget_t = now
        if self._budget >= 1:
            self._budget -= 1
            self._reply(REFUSED, peer, limit=size)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(MAX_DATAGRAM)
            except (TimeoutError, InterruptedError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            text = authenticate(data, self.cfg.token)
            if text is None:
                self._refuse(len(data), peer)
                continue
            self.counts["control_commands"] += 1
            cmd = prepare_command(text)
            if cmd.changes_jobs:
                self._pending.put((cmd, peer))
                continue
            reply, _ = commit(cmd, {j.job: j for j in self._jobs()}, self._totals)
            self._reply(reply, peer)

    def apply(self, jobs: list[JobConfig], install: Install) -> None:
        """Apply the waiting job changes in order: ``install`` the job list they leave (if any changed) with
        the ids of the jobs an ``add`` named, which start fresh even where their settings did not change
        (docs/protocol.md, "A new run needs a fresh job"), then answer them, so that a reply is never seen
        before its change."""
        table = {j.job: j for j in jobs}
        changed, fresh, replies = False, set(), []
        while True:
            try:
                cmd, peer = self._pending.get_nowait()
            except queue.Empty:
                break
            reply, new = commit(cmd, table, self._totals)
            if new is not None:
                table, changed = new, True
                if cmd.verb == "add":
                    fresh.add(cmd.arg.job)
            replies.append((reply, peer))
        if changed:
            install(list(table.values()), frozenset(fresh & table.keys()))
        for reply, peer in replies:
            self._reply(reply, peer)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)
        self.sock.close()
        if self.cfg.address.path is not None:
            with contextlib.suppress(OSError):
                Path(self.cfg.address.path).unlink()


def send_command(address: ControlAddress, command: str, *, token: bytes | None = None,
                 timeout: float = 3.0) -> str:
    """Send one command and return the reply (``thc-control``, tests). Raises TimeoutError.

    Over a Unix socket the reply comes to a socket in a private temporary folder, not to an abstract
    (autobound) address: abstract addresses belong to a network namespace, and an aggregator in another
    one (a Mininet host, ``topologies.netem``) could not answer them."""
    data = (f"{AUTH_PREFIX}{token.decode()} " if token else "") + command
    with contextlib.ExitStack() as stack:
        if address.path is not None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="thc-control-"))
            s = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
            s.bind(str(Path(folder) / "reply"))
            dest: object = address.path
        else:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            dest = (address.host, address.port)
        s.settimeout(timeout)
        s.sendto(data.encode(), dest)
        return s.recv(1 << 20).decode("utf-8", "replace")
