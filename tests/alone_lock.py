"""A pytest plugin (loaded by tests/conftest.py) that lets timing-sensitive tests run alone under pytest-xdist.

The suite runs in parallel (pyproject.toml: ``-n auto --dist loadfile``, each file on one worker, so a
file's module fixtures are built once). Most tests wait on processes and sockets more than they compute,
but a few measure time (a rate, a gap between answers, a deadline) or need a reader to keep up with a
burst: those carry ``@pytest.mark.alone`` and run while no other test runs. (Mininet's interface names
in the root namespace need no lock: every Mininet test is in tests/test_topologies.py, on one worker.)
Every other test holds a shared lock on one file for its whole run (setup to teardown), an ``alone``
test an exclusive one (flock(2)). The controller makes the file and names it to its workers in
``THC_TEST_LOCK``; in one process nothing is locked.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

LOCK_ENV = "THC_TEST_LOCK"
_OWN_LOCK = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs while no other test of a parallel run (pytest-xdist) runs")
    if getattr(config, "workerinput", None) is None and LOCK_ENV not in os.environ:
        # The controller, or a run in one process: the workers it starts inherit the file's name.
        fd, path = tempfile.mkstemp(prefix="thc-pytest-", suffix=".lock")
        os.close(fd)
        os.environ[LOCK_ENV] = path
        config.stash[_OWN_LOCK] = Path(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_OWN_LOCK, None)
    if path is not None:
        path.unlink(missing_ok=True)
        del os.environ[LOCK_ENV]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = os.environ.get(LOCK_ENV)
    if getattr(item.config, "workerinput", None) is None or path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
