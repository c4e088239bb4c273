"""Compile the THC program and run BMv2 simple_switch_grpc as a child process.

``compile_program`` renders p4src/bmv2/thc.p4 for a geometry (p4gen/bmv2.py) and compiles it with
p4c-bm2-ss into a BMv2 JSON and a P4Info. ``Bmv2Switch`` starts simple_switch_grpc (optionally inside a
network namespace, with its gRPC server on a Unix socket so that the controller outside can reach it),
waits until its gRPC endpoint accepts connections (polling, never a fixed sleep), and stops it with a
bounded wait. Its log and per-port pcap files go to ``workdir``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import p4gen.bmv2 as gen
from aggregator.p4rt.client import SwitchAddress, wait_for_switch
from topologies.netns import Netns

log = logging.getLogger(__name__)



class ToolMissing(RuntimeError):
    """A P4 tool (p4c-bm2-ss, simple_switch_grpc) is not on PATH."""


def find_tool(name: str) -> str:
    """Absolute path of a tool on PATH, or ToolMissing naming it."""
    path = shutil.which(name)
    if path is None:
        raise ToolMissing(f"{name} is not on PATH; install the P4 toolchain (see docs/bmv2.md or the Vagrantfile)")
    return path


@dataclass(frozen=True)
class CompiledProgram:
    """Outputs of p4c-bm2-ss for one geometry."""

    source: Path
    json: Path
    p4info: Path
    compiler_output: str


def compile_p4(src: Path, outdir: Path, *, timeout: float = 300.0, defines: tuple[str, ...] = (),
               stem: str | None = None) -> CompiledProgram:
    """Compile a THC program with p4c-bm2-ss into ``outdir`` (``<stem>.json``, ``<stem>.p4info.txtpb``;
    ``stem`` defaults to the source's) with the preprocessor ``defines``; raise ToolMissing without the
    compiler, RuntimeError on a compile error."""
    outdir.mkdir(parents=True, exist_ok=True)
    stem = stem or src.stem
    out_json, out_info = outdir / f"{stem}.json", outdir / f"{stem}.p4info.txtpb"
    cmd = [find_tool("p4c-bm2-ss"), "--std", "p4-16", "-I", str(gen.INCLUDE_DIR), *(f"-D{d}" for d in defines),
           "-o", str(out_json), "--p4runtime-files", str(out_info), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"p4c-bm2-ss failed on {src}:\n{proc.stderr}{proc.stdout}")
    return CompiledProgram(src, out_json, out_info, proc.stderr + proc.stdout)


def compile_program(outdir: Path, *, elems: int = 32, bits: int = 4, result_bits: int = 8, slots: int = 1024,
                    jobs: int = 8, timeout: float = 300.0, leaf: bool = False,
                    spine: bool = False) -> CompiledProgram:
    """Render the program for the geometry into ``outdir``/thc.p4 and compile it (``compile_p4``); with
    ``leaf`` (``spine``), as the leaf (spine) of two-tier jobs: -DTHC_LEAF (-DTHC_SPINE), outputs
    thc_leaf.* (thc_spine.*)."""
    if leaf and spine:
        raise ValueError("a program is a leaf or a spine, not both")
    outdir.mkdir(parents=True, exist_ok=True)
    src = outdir / "thc.p4"
    src.write_text(gen.render(gen.Geometry(elems, bits, result_bits, slots, jobs)))
    if leaf or spine:
        role = "leaf" if leaf else "spine"
        return compile_p4(src, outdir, timeout=timeout, defines=(f"THC_{role.upper()}",), stem=f"thc_{role}")
    return compile_p4(src, outdir, timeout=timeout)


#: Seconds a controller of a switch started here waits for its P4Runtime server and for each call: a
#: switch that starts while the test suite keeps both cores busy can take more than the library's 10 s.
CONTROL_TIMEOUT = 30.0


@dataclass
class Bmv2Config:
    """How to start one simple_switch_grpc: ports (port number -> interface), where its gRPC server
    listens, where its log and pcaps go, and the namespace it runs in (None: this one)."""

    interfaces: dict[int, str]
    workdir: Path
    netns: Netns | None = None
    device_id: int = 0
    grpc_port: int | None = None  #: TCP port of the P4Runtime server; None: a Unix socket in workdir
    thrift_port: int = 9090
    pcap: bool = True
    log_level: str = "warn"
    extra_args: list[str] = field(default_factory=list)


class Bmv2Switch:
    """One simple_switch_grpc process. ``start`` returns once its P4Runtime endpoint accepts connections."""

    def __init__(self, cfg: Bmv2Config) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None
        self.cfg.workdir.mkdir(parents=True, exist_ok=True)
        if cfg.grpc_port is None:
            self.address = SwitchAddress(device_id=cfg.device_id, unix_socket=str(cfg.workdir / "p4rt.sock"))
        else:
            self.address = SwitchAddress("127.0.0.1", cfg.grpc_port, device_id=cfg.device_id)
        self.log_path = cfg.workdir / "simple_switch.log"
        self.pcap_dir = cfg.workdir / "pcap"

    def command(self) -> list[str]:
        """The simple_switch_grpc command line."""
        cfg = self.cfg
        cmd = [find_tool("simple_switch_grpc"), "--no-p4", "--device-id", str(cfg.device_id),
               "--thrift-port", str(cfg.thrift_port), "--log-level", cfg.log_level,
               "--log-file", str(cfg.workdir / "simple_switch")]
        for port, ifname in sorted(cfg.interfaces.items()):
            cmd += ["-i", f"{port}@{ifname}"]
        if cfg.pcap:
            self.pcap_dir.mkdir(exist_ok=True)
            cmd += ["--pcap", str(self.pcap_dir)]
        cmd += [*cfg.extra_args, "--", "--grpc-server-addr",
                self.address.target if self.address.unix_socket else f"127.0.0.1:{cfg.grpc_port}"]
        return cmd

    def start(self, timeout: float = 30.0) -> SwitchAddress:
        """Start the switch and wait for its gRPC endpoint; raise RuntimeError with its log if it dies."""
        if self.address.unix_socket:
            Path(self.address.unix_socket).unlink(missing_ok=True)
        cmd = self.command()
        out = open(self.cfg.workdir / "simple_switch.stdout", "wb")  # closed in stop()
        self._out = out
        if self.cfg.netns is not None:
            self.proc = self.cfg.netns.popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        else:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        log.info("started simple_switch_grpc (pid %d): %s", self.proc.pid, " ".join(cmd))
        try:
            wait_for_switch(self.address, timeout)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"simple_switch_grpc did not come up: {exc}\n{self.output_tail()}") from None
        if self.proc.poll() is not None:
            raise RuntimeError(f"simple_switch_grpc exited with {self.proc.returncode}\n{self.output_tail()}")
        return self.address

    def output_tail(self, lines: int = 30) -> str:
        """The last lines of the switch's stdout/stderr and log (for error messages)."""
        text = []
        for p in (self.cfg.workdir / "simple_switch.stdout", self.log_path):
            if p.exists():
                text += p.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the switch (SIGTERM, then SIGKILL after ``timeout`` s); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self.proc = None
        if getattr(self, "_out", None) is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> Bmv2Switch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
