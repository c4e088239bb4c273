"""Helpers shared by the transport tests: a whole run's workers, each in its own thread."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from worker_lib.job import JobConfig
from worker_lib.transport import Transport, TransportConfig, UseResults


def opened_runs(cfg: JobConfig, aggregators: Sequence[tuple[str, int]], nonce: float,
                indices: Sequence[np.ndarray], shards: int = 1) -> list[UseResults | BaseException]:
    """Every worker w of ``cfg`` opens a run with ``nonce`` (``Transport.open_run``) on the aggregator
    ``aggregators[w]`` (of ``shards`` ports) and exchanges its ``indices[w]``, all at once; returns each
    worker's results, or the exception it raised (the tests check that every worker fails, not only the
    first)."""
    out: list[UseResults | BaseException] = [RuntimeError("the worker's thread did not finish")] * cfg.workers

    def go(w: int) -> None:
        try:
            with Transport(TransportConfig(cfg, worker=w, aggregator=aggregators[w], shards=shards, deadline=10)) as tr:
                tr.open_run(nonce)
                out[w] = tr.exchange_indices(indices[w])
        except BaseException as exc:  # handed to the caller
            out[w] = exc

    threads = [threading.Thread(target=go, args=(w,)) for w in range(cfg.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out
