"""launchers/neighbour.py: the busy neighbour the benchmarks measure beside spins while the block runs and is
gone after it, also when the block fails."""

from __future__ import annotations

import os
import time

import pytest

from launchers.neighbour import busy_neighbour


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_neighbour_spins_during_the_block_and_is_reaped_after() -> None:
    with busy_neighbour() as hog:
        assert hog is not None and hog.poll() is None
        before, t0 = cpu_seconds(hog.pid), time.monotonic()
        time.sleep(0.5)
        used = cpu_seconds(hog.pid) - before
        assert used > 0.2 * (time.monotonic() - t0), used  # busy, not sleeping (even on shared cores)
    assert hog.returncode is not None  # killed and waited for: no zombie left


def test_the_neighbour_is_killed_when_the_block_fails_and_absent_when_off() -> None:
    with pytest.raises(RuntimeError, match="measurement failed"), busy_neighbour() as hog:
        raise RuntimeError("measurement failed")
    assert hog is not None and hog.returncode is not None
    with busy_neighbour(False) as none:
        assert none is None
