"""tests/alone_lock.py: under pytest-xdist, a test marked ``alone`` overlaps no other test, while the
others run side by side. Runs two small files of sleeping tests (four shared, one alone each) in a pytest
subprocess with two workers, each test writing when it started and ended."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SLEEPERS = """
import os, time, pytest

def _sleep(kind):
    start = time.time()
    time.sleep(0.3)
    with open(os.environ["LOG"], "a") as f:
        f.write(f"{kind} {os.environ['PYTEST_XDIST_WORKER']} {start} {time.time()}\\n")

@pytest.mark.parametrize("i", range(4))
def test_shared(i):
    _sleep("shared")

@pytest.mark.alone
def test_alone():
    _sleep("alone")
"""


def test_alone_tests_overlap_nothing_and_the_others_overlap(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    shutil.copy(Path(__file__).with_name("alone_lock.py"), tmp_path / "alone_lock.py")
    for name in ("left", "right"):
        (tmp_path / f"test_{name}.py").write_text(SLEEPERS)
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k != "THC_TEST_LOCK"} | {"LOG": str(log)}
    locks_before = set(Path(tempfile.gettempdir()).glob("thc-pytest-*.lock"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "alone_lock", "-n", "2",
                        "--dist", "loadfile", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(Path(tempfile.gettempdir()).glob("thc-pytest-*.lock")) <= locks_before, "the lock file was left"
    runs = [(kind, worker, float(start), float(end))
            for kind, worker, start, end in (line.split() for line in log.read_text().splitlines())]
    alone = [r for r in runs if r[0] == "alone"]
    shared = [r for r in runs if r[0] == "shared"]
    assert len(alone) == 2 and len(shared) == 8 and len({r[1] for r in runs}) == 2

    def overlap(a: tuple, b: tuple) -> bool:
        return a is not b and a[2] < b[3] and b[2] < a[3]

    assert not any(overlap(a, b) for a in alone for b in runs)
    assert any(overlap(a, b) for a in shared for b in shared if a[1] != b[1])  # the workers ran side by side
