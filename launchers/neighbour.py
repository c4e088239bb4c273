"""A CPU-bound neighbour process for the length of a block: the benchmarks that measure beside one.

A user's machine is rarely quiet: training shares its cores with data loading, other jobs, a compiler.
``benchmarks/compression.py --contention`` and ``benchmarks.ddp_netem --busy-neighbour`` measure beside
one process that spins a Python loop at normal priority (one core's worth of demand), started before
the measurement and killed after it, also when the measurement fails; should the benchmark itself die,
the kernel signals the neighbour too (``die_with_parent``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from launchers.aggregator_process import die_with_parent

#: Seconds the neighbour gets to reach full speed before the block runs.
SETTLE_S = 0.2


@contextlib.contextmanager
def busy_neighbour(on: bool = True) -> Iterator[subprocess.Popen | None]:
    """Run one spinning process while the block runs (``on``); yields it, or None when not ``on``."""
    if not on:
        yield None
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent)
    try:
        time.sleep(SETTLE_S)
        yield hog
    finally:
        hog.kill()
        hog.wait()
