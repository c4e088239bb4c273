"""Start a ``thc-aggregator`` process for the duration of a block (launchers, examples, benchmarks).

Used by ``thc-allreduce`` and ``examples/train_ddp.py``: a job description becomes ``--job`` options,
the process binds a free port and reports it on its first line, and it is stopped (and, should the
launcher die, signalled by the kernel) when the block ends, so no aggregator is left orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from worker_lib.job import JobConfig

log = logging.getLogger(__name__)


def die_with_parent() -> None:
    """In the child between fork and exec: receive SIGTERM when the parent dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def listening_port(line: str) -> int:
    """The data port announced by thc-aggregator's first line ("thc-aggregator listening on HOST:PORT ...")."""
    if "listening on " not in line:
        raise ValueError(f"not thc-aggregator's start line: {line!r}")
    return int(line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)[1])


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate ``proc`` and wait for it; kill it if it does not exit within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


@contextlib.contextmanager
def local_aggregator(jobs: Sequence[JobConfig], *, host: str = "127.0.0.1", shards: int = 1,
                     multicast: bool = False, pcap: Path | None = None, member: tuple[int, int] = (0, 1),
                     timeout: float = 60.0, extra: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """Run ``thc-aggregator`` serving ``jobs`` on ``host`` (a free port), as ``member`` (I, N) of the
    aggregators serving them, with the options ``extra`` too (``--control PATH``); yields (host, port)."""
    cmd = [sys.executable, "-m", "aggregator.cli", "--host", host, "--port", "0", "--shards", str(shards),
           "--member", f"{member[0]}/{member[1]}"]
    for cfg in jobs:
        cmd += ["--job", cfg.spec()]
    if pcap is not None:
        cmd += ["--pcap", str(pcap)]
    if multicast:
        cmd.append("--multicast")
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready and proc.stdout else ""
        if "listening on" not in line:
            with contextlib.suppress(subprocess.TimeoutExpired):  # its output ended: it is exiting
                proc.wait(timeout=2 if ready and not line else 0)
            exited = proc.poll()
            proc.kill()
            err = " ".join(f"{line.strip()} {proc.stderr.read() if proc.stderr else ''}".split())
            raise RuntimeError(f"thc-aggregator did not start within {timeout:.0f} s: {err}" if exited is None else
                               f"thc-aggregator exited at start (exit code {exited}): {err}")
        port = listening_port(line)
        log.info("started thc-aggregator on %s:%d (pid %d)", host, port, proc.pid)
        yield host, port
    finally:
        stop_process(proc)


@contextlib.contextmanager
def local_tiers(job: JobConfig, *, host: str = "127.0.0.1", parent_loss: float = 0.0, seed: int = 0,
                leaf_engine: str = "compiled") -> Iterator[tuple[tuple[str, int], list[tuple[str, int]]]]:
    """Run a two-tier job's aggregators on ``host``: ``thc-aggregator --role spine`` and one ``--role leaf``
    per leaf (its ``--engine leaf_engine``; each dropping ``parent_loss`` of its packets to and from the
    spine, seeded from ``seed``); yields the spine's (host, port) and the leaves', in leaf order."""
    with contextlib.ExitStack() as stack:
        spine = stack.enter_context(local_aggregator([job], host=host, extra=["--role", "spine"]))
        leaves = [stack.enter_context(local_aggregator(
            [job], host=host, extra=["--role", "leaf", "--leaf", str(leaf), "--upstream", f"{spine[0]}:{spine[1]}",
                                     "--parent-loss", str(parent_loss), "--seed", str(seed * 64 + leaf),
                                     "--engine", leaf_engine]))
            for leaf in range(len(job.leaves))]
        yield spine, leaves
