"""THC allreduce over the transport: norm stage, compression, chunked exchange, decoding.

Kept apart from ``worker_lib.transport`` so that the low-level transport needs numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker_lib.thc import THCConfig, THCWorker
from worker_lib.transport import Transport, TransportStats, UseResults


@dataclass
class AllreduceResult:
    """One allreduce: the decoded average and what the network gave back."""

    average: torch.Tensor
    max_norm: float
    sums: np.ndarray  #: (chunks, K) int64 integer sums per chunk (0 rows where lost)
    contributors: np.ndarray  #: (chunks,) contributors per chunk (0 where lost)
    bitmap: np.ndarray  #: (chunks,) contributor bitmap per chunk
    lost: np.ndarray  #: (chunks,) bool, chunks taken as zero
    indices: np.ndarray  #: this worker's indices over the padded transformed length (uint8)
    stats: TransportStats


class THCAllreduce:
    """``allreduce(tensor)`` for one worker of a THC job (error feedback kept per tensor id)."""

    def __init__(self, transport: Transport, config: THCConfig | None = None, *, seed: int | None = None) -> None:
        self.transport = transport
        p = transport.cfg.params
        self.config = config or THCConfig(bits=p.bits, granularity=p.granularity)
        if (self.config.bits, self.config.granularity) != (p.bits, p.granularity):
            raise ValueError("the THC config does not match the job's bits and granularity")
        self.worker = THCWorker(self.config, job=p.job, worker=transport.cfg.worker, seed=seed)
        table_id = self.worker.codec.table.table_id()
        if p.kind == "thc" and table_id != p.table_id:
            raise ValueError(f"this worker's table id {table_id:#06x} is not the job's {p.table_id:#06x}: "
                             "the aggregator would refuse every packet")

    def allreduce(self, grad: torch.Tensor, *, tensor: int = 0, step: int = 0) -> AllreduceResult:
        """Average ``grad`` over the job's workers through the aggregator."""
        tr = self.transport
        p = tr.cfg.params
        norm = self.worker.begin(grad, tensor, step)
        max_norm, _ = tr.exchange_norm(norm, tensor=tensor)
        enc = self.worker.compress(tensor, max_norm)  # the same scale on every worker
        idx = enc.indices.cpu().numpy().astype(np.uint8)
        res: UseResults = tr.exchange_indices(idx, tensor=tensor)
        d = idx.size
        flat_sums = torch.from_numpy(res.sums.reshape(-1)[:d])
        counts = res.contributors
        if not res.lost.any() and (counts == counts[0]).all():
            avg = self.worker.finish(tensor, flat_sums, int(counts[0]))
        else:
            # Per-chunk contributor counts; lost chunks are zero in the transformed domain.
            per_coord = torch.from_numpy(np.repeat(counts, p.elems)[:d])
            lost = torch.from_numpy(np.repeat(res.lost, p.elems)[:d])
            avg = self.worker.finish(tensor, flat_sums, per_coord, lost=lost)
        return AllreduceResult(avg, max_norm, res.sums, res.contributors, res.bitmap, res.lost, idx, tr.stats)


def chunks_for(d: int, elems: int) -> int:
    """Chunks of K elements that a tensor of d coordinates (padded to a power of two) takes."""
    padded = 1 << max(0, math.ceil(math.log2(max(d, 1))))
    return max(1, math.ceil(padded / elems))
