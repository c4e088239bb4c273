"""Faults in the middle of a step (issue 15, item 5): SIGKILL of the aggregator (then restarted on the
same port) or of a worker. Every worker gets the exact sums or raises AggregatorUnreachable within its
deadline, never a silently different result; after an aggregator restart the next step is exact; a
dead worker leaves the others an error (threshold n) or the same partial aggregate (threshold < n)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from launchers.aggregator_process import stop_process
from worker_lib.job import JobConfig
from worker_lib.thc import lookup_sum
from worker_lib.transport import AggregatorUnreachable, Transport, TransportConfig, UseResults

# Deadlines of seconds, and a free port looked up before the aggregator binds it: alone.
pytestmark = pytest.mark.alone

D = 1 << 20
DEADLINE = 2.0


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_aggregator(port: int, cfg: JobConfig) -> subprocess.Popen:
    spec = f"job={cfg.job},key={cfg.key},workers={cfg.workers},threshold={cfg.threshold}"
    proc = subprocess.Popen([sys.executable, "-m", "aggregator.cli", "--port", str(port), "--job", spec],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line + proc.stderr.read()
    return proc


def run_workers(transports: list[Transport], idx: np.ndarray, tensor: int, while_running: Callable[[], None]
                ) -> list[UseResults | BaseException]:
    """Each transport exchanges its row of ``idx`` in a thread; ``while_running`` runs meanwhile."""
    out: list[UseResults | BaseException] = [RuntimeError("not run")] * len(transports)
    took = [0.0] * len(transports)

    def work(w: int) -> None:
        t0 = time.monotonic()
        try:
            out[w] = transports[w].exchange_indices(idx[w], tensor=tensor)
        except Exception as exc:  # collected and checked by the test
            out[w] = exc
        took[w] = time.monotonic() - t0

    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(transports))]
    for t in threads:
        t.start()
    while_running()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker hung past every deadline"
    assert max(took) < 4 * DEADLINE, took  # the deadline counts from the last answer: a few seconds at most
    return out


def wait_mid_step(transports: list[Transport], results: int = 20) -> None:
    """Until every transport has had some results of the running step (so a kill lands mid-step)."""
    t0 = time.monotonic()
    while min(t.stats.results for t in transports) < results:
        assert time.monotonic() - t0 < 10, "the step did not start"
        time.sleep(0.001)


@pytest.mark.parametrize("drop_down", [0.0, 0.03])
def test_aggregator_killed_and_restarted_mid_step(drop_down: float) -> None:
    cfg = JobConfig(job=3, key=0x33, workers=4)
    port = free_udp_port()
    rng = np.random.default_rng(5)
    steps = [rng.integers(0, 16, (4, D), dtype=np.uint8) for _ in range(2)]
    table = np.array(cfg.lookup.values)
    agg = start_aggregator(port, cfg)
    trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", port), deadline=DEADLINE,
                                     drop_down=drop_down, seed=w)) for w in range(4)]
    try:
        def kill_and_restart() -> None:
            nonlocal agg
            wait_mid_step(trs)
            agg.send_signal(signal.SIGKILL)
            agg.wait()
            time.sleep(0.1)
            agg = start_aggregator(port, cfg)

        got = run_workers(trs, steps[0], 0, kill_and_restart)
        want = lookup_sum(table, steps[0])
        for w, r in enumerate(got):
            if isinstance(r, BaseException):
                # the deadline's error, naming the aggregator: "no answer" from it, or (when the restarted
                # aggregator still answered resends with notices that finish nothing) "no use answered"
                assert isinstance(r, AggregatorUnreachable), repr(r)
                assert str(r).startswith(f"worker {w}: no ") and f"from the aggregator at 127.0.0.1:{port} " in str(r)
                assert f"for {DEADLINE:.1f} s" in str(r), str(r)
            else:
                assert not r.lost.any() and np.array_equal(r.sums.reshape(-1)[:D], want), f"worker {w} diverged"
        got = run_workers(trs, steps[1], 1, lambda: None)
        want = lookup_sum(table, steps[1])
        for r in got:
            assert not isinstance(r, BaseException), repr(r)
            assert not r.lost.any() and np.array_equal(r.sums.reshape(-1)[:D], want)
    finally:
        for t in trs:
            t.close()
        stop_process(agg, timeout=5)


WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from worker_lib.job import JobConfig
    from worker_lib.transport import Transport, TransportConfig
    port, threshold, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cfg = JobConfig(job=3, key=0x33, workers=4, threshold=threshold)
    idx = np.random.default_rng(5).integers(0, 16, (4, D), dtype=np.uint8)
    with Transport(TransportConfig(cfg, worker=3, aggregator=("127.0.0.1", port), deadline=30)) as tr:
        tr.exchange_indices(idx[3])
""")


@pytest.mark.parametrize("threshold", [4, 3])
def test_worker_killed_mid_step(threshold: int) -> None:
    """Worker 3 (a process) is killed mid-step. Threshold 4: the others raise AggregatorUnreachable
    within their deadline. Threshold 3: the others finish with the same partial aggregate, every
    chunk the exact sum of the workers its bitmap names."""
    cfg = JobConfig(job=3, key=0x33, workers=4, threshold=threshold)
    port = free_udp_port()
    idx = np.random.default_rng(5).integers(0, 16, (4, D), dtype=np.uint8)
    table = np.array(cfg.lookup.values)
    agg = start_aggregator(port, cfg)
    victim = subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(threshold), str(D)])
    trs = [Transport(TransportConfig(cfg, worker=w, aggregator=("127.0.0.1", port), deadline=DEADLINE))
           for w in range(3)]
    try:
        def kill_worker() -> None:
            wait_mid_step(trs)
            victim.send_signal(signal.SIGKILL)
            victim.wait()

        got = run_workers(trs, idx[:3], 0, kill_worker)
        if threshold == 4:
            assert all(isinstance(r, AggregatorUnreachable) for r in got), got
            return
        assert not any(isinstance(r, BaseException) for r in got), got
        first = got[0]
        for r in got[1:]:  # the same partial aggregate everywhere
            assert np.array_equal(r.sums, first.sums) and np.array_equal(r.bitmap, first.bitmap)
        assert not first.lost.any() and (first.contributors >= 3).all()
        assert (first.bitmap == 0b1111).any() or (first.contributors == 3).all()
        # the last chunk is padded with index 0, whose table value is 0 (K = 1440 does not divide D)
        chunks = first.sums.shape[0]
        assert table[0] == 0 and chunks == -(-D // cfg.elems)
        per_worker = np.zeros((4, chunks * cfg.elems), np.int64)
        per_worker[:, :D] = np.stack([table[idx[w].astype(np.int64)] for w in range(4)])
        per_worker = per_worker.reshape(4, chunks, cfg.elems)
        members = (first.bitmap[None, :] >> np.arange(4)[:, None]) & 1  # (4, chunks)
        expect = (per_worker * members[:, :, None]).sum(axis=0)
        assert np.array_equal(first.sums, expect)
        assert np.array_equal(first.contributors, members.sum(axis=0))
    finally:
        for t in trs:
            t.close()
        if victim.poll() is None:
            victim.kill()
        stop_process(agg, timeout=5)
