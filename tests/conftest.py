"""Shared test configuration, and the lock that lets timing-sensitive tests run alone under pytest-xdist.

The suite runs in parallel (pyproject.toml: ``-n auto --dist loadfile``, each file on one worker, so a
file's module fixtures are built once). Most tests wait on processes and sockets more than they compute,
but a few measure time (a rate, a gap between answers, a deadline) or use names in the root network
namespace (Mininet's interfaces): those carry ``@pytest.mark.alone`` and run while no other test runs.
Every other test holds a shared lock on one file for its whole run (setup to teardown), an ``alone``
test an exclusive one (flock(2)); outside xdist nothing is locked.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Several test processes share two cores in CI; one intra-op thread each avoids OpenMP thrashing.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs while no other test of a parallel run (pytest-xdist) runs")


def _lock_path(config: pytest.Config) -> Path | None:
    """The run's lock file, the same for every xdist worker of one run; None outside xdist."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    return Path(tempfile.gettempdir()) / f"thc-pytest-{workerinput['testrunuid']}.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = _lock_path(item.config)
    if path is None:
        yield
        return
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
