"""Helpers shared by the P4 / BMv2 / control-plane tests (a helper module, not a test file): where the
P4 sources are, finding the P4 toolchain, and compiling a program. Tests that need a tool skip with the
tool's name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from topologies.bmv2 import compile_p4
from worker_lib.wire.layout import THC_UDP_PORT

ROOT = Path(__file__).resolve().parent.parent
P4_DIR = ROOT / "p4src"
INCLUDE_DIR = P4_DIR / "include"
CHECKED_IN_P4INFO = P4_DIR / "bmv2" / "thc.p4info.txtpb"
ETH, IP4, UDP = 14, 20, 8  #: header bytes of the frames the programs parse (IPv4 without options)


def thc_destination(frame: bytes) -> int | None:
    """The IPv4 destination of an Ethernet frame the programs parse as a THC datagram (IPv4 without options
    or fragmentation, UDP to the THC port), or None: whether it is one also needs a ``thc_service`` entry
    for that address."""
    f = frame
    if len(f) < ETH + IP4 + UDP or f[12:14] != b"\x08\x00" or f[14] & 0x0F != 5 or \
            int.from_bytes(f[20:22], "big") & 0x1FFF or f[23] != 17 or int.from_bytes(f[36:38], "big") != THC_UDP_PORT:
        return None
    return int.from_bytes(f[30:34], "big")


def need_tools(*tools: str) -> dict[str, str]:
    """Paths of the given executables; skip the test naming the ones missing from PATH."""
    found = {t: shutil.which(t) for t in tools}
    missing = [t for t, p in found.items() if p is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH (P4 toolchain: see docs/bmv2.md or the Vagrantfile)")
    return {t: p for t, p in found.items() if p is not None}


def need_root(why: str) -> None:
    """Skip unless running as root (network namespaces, veth pairs)."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root for {why}")


def compile_bmv2(program: Path, outdir: Path, timeout: float = 240.0) -> tuple[Path, Path, str]:
    """``topologies.bmv2.compile_p4`` for a test: (BMv2 JSON, P4Info text, compiler output); skips without
    p4c-bm2-ss, fails the test on a compile error."""
    need_tools("p4c-bm2-ss")
    try:
        out = compile_p4(program, outdir, timeout=timeout)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return out.json, out.p4info, out.compiler_output


def preprocess(text: str, defined: set[str]) -> str:
    """The lines the C preprocessor keeps of ``text`` under #ifdef / #ifndef / #else / #endif, with the
    macros ``defined`` (and those the text #defines); the directives themselves are dropped."""
    keep: list[bool] = []
    defined = set(defined)
    out = []
    for line in text.splitlines():
        words = line.split()
        directive = words[0] if words and words[0].startswith("#") else ""
        if directive in ("#if", "#elif"):
            raise ValueError(f"preprocess() takes #ifdef and #ifndef only: {line}")
        if directive in ("#ifdef", "#ifndef"):
            keep.append((words[1] in defined) == (directive == "#ifdef"))
        elif directive == "#else":
            keep[-1] = not keep[-1]
        elif directive == "#endif":
            keep.pop()
        elif all(keep):
            if directive == "#define":
                defined.add(words[1])
            out.append(line)
    assert not keep, "unbalanced #ifdef"
    return "\n".join(out)
