"""Run ``examples/train_ddp.py`` across the namespaces of a ``Topology``: one torchrun node per worker.

Each worker namespace runs ``torchrun --nnodes N --node-rank i --nproc-per-node 1`` with the
rendezvous at w0's address, exactly as on separate machines; the aggregator (when used) runs in
the ``agg`` namespace. Used by ``benchmarks/ddp_netem.py`` and ``tests/test_netem.py``.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launchers.checkout import checkout_env
from topologies.netem import NetemError, Topology
from worker_lib.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"


@dataclass
class NodeResult:
    """What one torchrun node did."""

    node: str
    returncode: int | None  #: None: killed (the deadline passed, or another node failed)
    output: str


def start_aggregator(net: Topology, jobs: Sequence[JobConfig], *, multicast: bool = False, port: int = 9451,
                     timeout: float = 60.0, extra: Sequence[str] = (), node: str = "agg") -> subprocess.Popen:
    """``thc-aggregator`` in ``node``'s namespace (the ``agg`` node's by default) on its address (with the
    options ``extra`` too); returns once it listens (polled, no sleep)."""
    cmd = [sys.executable, "-m", "aggregator.cli", "--host", net.address(node), "--port", str(port), *extra]
    for job in jobs:
        cmd += ["--job", job.spec()]
    if multicast:
        cmd.append("--multicast")
    proc = net.popen(node, cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready and proc.stdout else ""
    if "listening on" not in line:
        raise NetemError(f"thc-aggregator did not start in the {node} namespace: {line.strip()!r}")
    return proc


def run_training(net: Topology, script_args: Sequence[str], *, timeout: float = 300.0,
                 master_port: int = 29500) -> list[NodeResult]:
    """Run the example on every worker node (one rank each); waits at most ``timeout`` seconds in all.

    When a node fails, the others are killed at once (a torchrun agent would otherwise wait minutes at
    its exit barrier for the node that is gone).
    """
    workers = [n for n in net.cfg.nodes if n != "agg"]
    # the ranks run this checkout's code, not the one installed in editable mode (launchers/checkout.py)
    env = {**checkout_env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="netem-ddp-") as tmp:
        logs = [Path(tmp) / f"{node}.log" for node in workers]
        procs = []
        for rank, (node, log_path) in enumerate(zip(workers, logs, strict=True)):
            # torchrun's agent polls its worker every --monitor-interval (0.1 s by default); each poll allocates
            # enough that the agent, which holds torch's whole import, ran full garbage collections for about
            # 2.7 % of a core each (perf, 1 Gbit/s DDP run), on the cores the workers and the aggregator
            # share. A crashed worker is still noticed within a second.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "1", "--nnodes",
                   str(len(workers)), "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr",
                   net.address(workers[0]), "--master-port", str(master_port), str(EXAMPLE), *script_args]
            with log_path.open("w") as out:
                procs.append(net.popen(node, cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env))
        deadline = time.monotonic() + timeout
        killed: set[int] = set()
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        net.kill(p)
                        killed.add(i)
            alive = [p for p in procs if p.poll() is None]
            if alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    alive[0].wait(timeout=0.2)
        return [NodeResult(node, None if i in killed else p.returncode, log.read_text())
                for i, (node, p, log) in enumerate(zip(workers, procs, logs, strict=True))]
