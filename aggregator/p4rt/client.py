"""A small P4Runtime client over grpcio and the ``p4runtime`` package's stubs.

One ``P4RuntimeClient`` per switch (no module-level connection), so one process can drive several
switches. It opens the StreamChannel, becomes primary with its election id, and offers the RPCs the
THC control plane uses: set/get the forwarding pipeline, batched writes, reads. Every gRPC error is
turned into a ``SwitchError`` subclass with a readable message (including the per-update errors of a
rejected write), once, here.

Waiting for a switch polls its gRPC port (``wait_for_port``), never sleeps a fixed time.
"""

from __future__ import annotations

import argparse
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from aggregator.switch.errors import NotPrimary, SwitchError, SwitchRejected, SwitchUnreachable
from worker_lib.cli.args import host_port

log = logging.getLogger(__name__)


def wait_for_port(host: str, port: int, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Return once a TCP connection to ``host:port`` succeeds; raise SwitchUnreachable after ``timeout`` s.

    Polls with a short connect attempt every ``interval`` seconds (a switch is ready when its gRPC
    server listens; how long that takes varies by machine, so no fixed sleep is right).
    """
    _poll(lambda: socket.create_connection((host, port), timeout=min(1.0, timeout)), f"{host}:{port}",
          timeout, interval)


def wait_for_socket(path: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Like ``wait_for_port`` for a gRPC server on a Unix socket (a switch in another network namespace)."""
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return s
    _poll(connect, path, timeout, interval)


def wait_for_switch(address: SwitchAddress, timeout: float = 30.0) -> None:
    """Poll the switch's gRPC endpoint (TCP port or Unix socket) until it accepts connections."""
    if address.unix_socket:
        wait_for_socket(address.unix_socket, timeout)
    else:
        wait_for_port(address.host, address.port, timeout)


def _poll(connect: Callable[[], socket.socket], where: str, timeout: float, interval: float) -> None:
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            connect().close()
            return
        except OSError as exc:
            last = exc
            time.sleep(interval)
    raise SwitchUnreachable(f"nothing listens on {where} after {timeout:.1f} s"
                            f"{f' ({last.strerror})' if last and last.strerror else ''}; is the switch running?")


def _format_status(err: grpc.RpcError) -> tuple[str, list[str]]:
    """The message of a gRPC error and, for a rejected Write, each failed update's error."""
    code = err.code() if hasattr(err, "code") else None
    message = err.details() if hasattr(err, "details") else str(err)
    details: list[str] = []
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key != "grpc-status-details-bin":
            continue
        st = status_pb2.Status()
        st.ParseFromString(value)
        for i, any_msg in enumerate(st.details):
            e = p4runtime_pb2.Error()
            if any_msg.Unpack(e) and e.canonical_code != code_pb2.OK:
                details.append(f"update {i}: {code_pb2.Code.Name(e.canonical_code)}: {e.message}")
    name = code.name if code is not None else "ERROR"
    return f"{name}: {message}", details


@dataclass(frozen=True)
class SwitchAddress:
    """Where a P4Runtime switch listens (TCP host and port, or a Unix socket) and which device it is."""

    host: str = "127.0.0.1"
    port: int = 9559
    device_id: int = 0
    election_id: int = 1
    unix_socket: str | None = None  #: path of a Unix socket instead of host:port

    @property
    def target(self) -> str:
        """The gRPC target string."""
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str, device_id: int = 0, election_id: int = 1) -> SwitchAddress:
        """``host:port``, ``port`` or ``unix:/path`` -> SwitchAddress."""
        if text.startswith("unix:"):
            return cls(device_id=device_id, election_id=election_id, unix_socket=text[len("unix:"):])
        try:
            host, port = host_port(text if ":" in text else f":{text}")
        except argparse.ArgumentTypeError:
            raise SwitchError(f"switch address must be host:port with a port in 1..65535, got {text!r}") from None
        return cls(host, port, device_id, election_id)


class P4RuntimeClient:
    """A primary P4Runtime connection to one device. Use as a context manager, or call ``close``."""

    def __init__(self, address: SwitchAddress, *, timeout: float = 10.0) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address.target)
        self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
        self._requests: queue.Queue[p4runtime_pb2.StreamMessageRequest | None] = queue.Queue()
        self._arbitration: queue.Queue[p4runtime_pb2.StreamMessageResponse | Exception] = queue.Queue()
        self._stream: Iterator[p4runtime_pb2.StreamMessageResponse] | None = None
        self._reader: threading.Thread | None = None
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise SwitchUnreachable(f"no P4Runtime server answers at {address.target} "
                                    f"after {timeout:.0f} s") from None
        self._become_primary()

    # -- stream channel / arbitration ------------------------------------------------------------
    def _request_iter(self) -> Iterator[p4runtime_pb2.StreamMessageRequest]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _read_stream(self) -> None:
        try:
            for msg in self._stream:  # type: ignore[union-attr]
                if msg.HasField("arbitration"):
                    self._arbitration.put(msg)
                else:
                    log.debug("stream message ignored: %s", msg.WhichOneof("update"))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._arbitration.put(exc)

    def _become_primary(self) -> None:
        a = self.address
        self._stream = self.stub.StreamChannel(self._request_iter())
        self._reader = threading.Thread(target=self._read_stream, name=f"p4rt-stream-{a.target}", daemon=True)
        self._reader.start()
        req = p4runtime_pb2.StreamMessageRequest()
        req.arbitration.device_id = a.device_id
        req.arbitration.election_id.high = 0
        req.arbitration.election_id.low = a.election_id
        self._requests.put(req)
        try:
            reply = self._arbitration.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise SwitchUnreachable(f"{a.target}: no arbitration answer within {self.timeout:.0f} s") from None
        if isinstance(reply, Exception):
            self.close()
            msg, _ = _format_status(reply)
            raise SwitchUnreachable(f"{a.target}: stream channel failed: {msg}")
        if reply.arbitration.status.code != code_pb2.OK:
            self.close()
            raise NotPrimary(f"{a.target} device {a.device_id}: another controller is primary "
                             f"({reply.arbitration.status.message}); use a higher election id")
        log.info("primary for device %d at %s", a.device_id, a.target)

    def close(self) -> None:
        """End the stream channel and the gRPC channel (idempotent)."""
        self._requests.put(None)
        if self._stream is not None:
            self._stream.cancel()  # type: ignore[attr-defined]
        if self._reader is not None:
            self._reader.join(timeout=self.timeout)
            self._reader = None
        self.channel.close()

    def __enter__(self) -> P4RuntimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RPCs ------------------------------------------------------------------------------------
    def _call(self, what: str, fn, request):
        try:
            return fn(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            msg, details = _format_status(exc)
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise SwitchUnreachable(f"{self.address.target}: {what} failed: {msg}") from None
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise NotPrimary(f"{self.address.target}: {what} refused, not primary: {msg}") from None
            text = f"{self.address.target}: {what} rejected: {msg}"
            if details:
                text += "\n  " + "\n  ".join(details)
            raise SwitchRejected(text, details) from None

    def _election(self) -> p4runtime_pb2.Uint128:
        return p4runtime_pb2.Uint128(high=0, low=self.address.election_id)

    def set_pipeline(self, p4info: p4info_pb2.P4Info, device_config: bytes, cookie: int = 0) -> None:
        """Push a compiled program (P4Info + the target's config, the BMv2 JSON) and commit it."""
        req = p4runtime_pb2.SetForwardingPipelineConfigRequest(
            device_id=self.address.device_id, election_id=self._election(),
            action=p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT)
        req.config.p4info.CopyFrom(p4info)
        req.config.p4_device_config = device_config
        req.config.cookie.cookie = cookie
        self._call("SetForwardingPipelineConfig", self.stub.SetForwardingPipelineConfig, req)

    def get_p4info(self) -> p4info_pb2.P4Info:
        """The P4Info of the program the switch runs (SwitchRejected if none is loaded)."""
        req = p4runtime_pb2.GetForwardingPipelineConfigRequest(
            device_id=self.address.device_id,
            response_type=p4runtime_pb2.GetForwardingPipelineConfigRequest.P4INFO_AND_COOKIE)
        reply = self._call("GetForwardingPipelineConfig", self.stub.GetForwardingPipelineConfig, req)
        if not reply.config.HasField("p4info") or not reply.config.p4info.tables:
            raise SwitchRejected(f"{self.address.target}: no program loaded (run `thc-switch load` first)")
        return reply.config.p4info

    def write(self, updates: Iterable[p4runtime_pb2.Update], batch: int = 1000) -> int:
        """Send updates in Write batches of at most ``batch``; return how many were written."""
        ups = list(updates)
        for start in range(0, len(ups), batch):
            req = p4runtime_pb2.WriteRequest(device_id=self.address.device_id, election_id=self._election())
            req.updates.extend(ups[start:start + batch])
            self._call("Write", self.stub.Write, req)
        return len(ups)

    def read(self, entities: Iterable[p4runtime_pb2.Entity]) -> list[p4runtime_pb2.Entity]:
        """Read entities (wildcards allowed, as P4Runtime defines); return every entity answered."""
        req = p4runtime_pb2.ReadRequest(device_id=self.address.device_id)
        req.entities.extend(entities)
        try:
            out: list[p4runtime_pb2.Entity] = []
            for reply in self.stub.Read(req, timeout=self.timeout):
                out.extend(reply.entities)
            return out
        except grpc.RpcError as exc:
            msg, details = _format_status(exc)
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise SwitchUnreachable(f"{self.address.target}: Read failed: {msg}") from None
            raise SwitchRejected(f"{self.address.target}: Read rejected: {msg}", details) from None
