"""Helpers shared by the P4 / BMv2 / control-plane tests: locating the generator scripts (p4/ is not a
Python package: a ``p4`` package would shadow the ``p4runtime`` stubs' ``p4`` namespace), finding the
P4 toolchain, and compiling a program. Tests that need a tool skip with the tool's name."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
P4_DIR = ROOT / "p4src"
INCLUDE_DIR = P4_DIR / "include"
CHECKED_IN_P4INFO = P4_DIR / "bmv2" / "thc.p4info.txtpb"


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
    """Compile with p4c-bm2-ss: (BMv2 JSON, P4Info text, compiler stderr). Fails the test on error."""
    tools = need_tools("p4c-bm2-ss")
    outdir.mkdir(parents=True, exist_ok=True)
    json_out = outdir / (program.stem + ".json")
    p4info = outdir / (program.stem + ".p4info.txtpb")
    cmd = [tools["p4c-bm2-ss"], "--std", "p4-16", "-I", str(INCLUDE_DIR), "-o", str(json_out),
           "--p4runtime-files", str(p4info), str(program)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"p4c-bm2-ss failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}"
    return json_out, p4info, proc.stderr + proc.stdout


def test_need_tools_names_what_is_missing() -> None:
    """A missing tool skips the test with its name in the reason (the helpers above are shared)."""
    with pytest.raises(pytest.skip.Exception, match="thc-no-such-tool-xyz"):
        need_tools("sh", "thc-no-such-tool-xyz")
    assert "sh" in need_tools("sh")
