"""The package layering the README describes, checked on the source: every import statement (at module
level or inside a function) of each package names only the packages it may depend on."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: package (a folder under the repository root, or a module path) -> top-level names it must not import
FORBIDDEN = {
    "worker_lib": ("aggregator", "sim", "launchers", "topologies", "p4gen"),
    "p4gen": ("aggregator", "sim", "launchers", "topologies"),
    "aggregator": ("sim", "launchers", "topologies"),
    "sim": ("launchers", "topologies"),
}
#: control planes and P4 generators never import the aggregator's state machines or its server
ENGINE = ("aggregator.engine", "aggregator.state", "aggregator.server", "aggregator.dar")
CONTROL_PLANES = ("aggregator/p4rt", "aggregator/bfrt.py", "aggregator/switch", "p4gen")


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in a Python file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _files(where: str) -> list[Path]:
    """The Python files of a folder (recursively), or the one file named."""
    path = ROOT / where
    return sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []


@pytest.mark.parametrize("package", FORBIDDEN)
def test_dependencies_point_one_way(package: str) -> None:
    """worker_lib <- aggregator <- sim; p4gen needs only the protocol; launchers and topologies on top."""
    bad = [(str(f.relative_to(ROOT)), m) for f in _files(package) for m in imported_modules(f)
           if m.split(".")[0] in FORBIDDEN[package]]
    assert not bad, f"{package} imports what it must not: {bad}"


def test_control_planes_and_generators_do_not_import_the_engine() -> None:
    """The P4 generators and the switch control planes need the protocol core and the job, not the
    aggregator's state machines."""
    files = [f for folder in CONTROL_PLANES for f in _files(folder)]
    assert files, "no control-plane or generator sources found"
    bad = [(str(f.relative_to(ROOT)), m) for f in files for m in imported_modules(f)
           if any(m == e or m.startswith(e + ".") for e in ENGINE)]
    assert not bad, f"imports of the aggregator's engine: {bad}"


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    """A lazy import inside a function counts (the check would otherwise miss the commonest escape)."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from aggregator.engine import Aggregator\n    import sim.cli\n")
    assert {"aggregator.engine", "aggregator.engine.Aggregator", "sim.cli"} <= imported_modules(f)


def test_tofino_writer_and_neutral_entries_need_no_protobuf() -> None:
    """The bfrt script writer, the target-neutral entries and thc-switch's module load without grpc,
    protobuf or the P4Runtime stubs (a Tofino user needs none of them). (The bare ``google`` namespace is
    put in sys.modules at start-up by protobuf's .pth file, so ``google.protobuf`` is what counts.)"""
    code = ("import sys, aggregator.bfrt, aggregator.switch.entries, aggregator.switch.cli; "
            "print(sorted(m for m in sys.modules\n"
            "             if m.split('.')[0] in ('grpc', 'p4') or m.startswith('google.protobuf')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    assert out == "[]", f"loaded: {out}"
