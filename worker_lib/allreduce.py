"""The one THC allreduce path: norm stage, rotation and quantization, index exchange, decoding.

``thc_allreduce`` writes THC's steps once (the paper's Algorithm 3) for a *group* of local workers
and takes the exchange as a parameter:

1. each worker adds its error feedback and rotates (``THCWorker.begin``), giving its norm;
2. ``exchange.exchange_norms``: the norm stage; every worker learns the job's max norm;
3. each worker quantizes its rotated vector with that max norm (the same scale on every worker);
4. ``exchange.exchange_indices``: the chunks of indices go to the aggregator; the integer sums,
   contributor counts and losses come back, one ``UseResults`` per worker;
5. each worker decodes its average; a lost chunk is zero in the rotated domain and chunks with
   different contributor counts are scaled each by its own count.

The exchanges are

- ``TransportExchange``: one worker's UDP ``Transport`` (``thc-allreduce``, ``THCAllreduce``, the DDP
  hook in ``worker_lib.ddp``);
- ``sim.network.StepExchange``: all n workers of a simulation, in step, through the in-process
  reference aggregator.

Error feedback is either the ``THCWorker``'s own (per tensor id, ``THCConfig.error_feedback``) or
kept by the caller (``errors``: the DDP hook keeps one per parameter, so that it survives DDP's
bucket rebuilds); the decoded numbers do not depend on the exchange.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker_lib.job import JobConfig
from worker_lib.thc import THCConfig, THCWorker
from worker_lib.transport import IndexFill, Transport, UseResults


class Exchange(Protocol):
    """Carries the norm and index uses of a group of local workers to the aggregator and back."""

    def exchange_norms(self, norms: np.ndarray, *, tensor: int) -> np.ndarray:
        """The norm stage: (workers,) norms in, (workers,) job max norms as each worker learned it."""
        ...

    def exchange_indices(self, indices: np.ndarray, *, tensor: int) -> list[UseResults]:
        """(workers, L) uint8 indices in, each worker's (chunks, K) sums and per-chunk outcome back."""
        ...


#: ``exchange_streamed(indices, fill, *, tensor)`` of an exchange of one worker that sends its indices as
#: ``fill`` computes them (``Transport.exchange_indices``' ``fill``): that worker's results.
StreamedExchange = Callable[..., list[UseResults]]


@dataclass
class AllreduceResult:
    """One worker's allreduce: the decoded average and what the network gave back."""

    average: torch.Tensor
    max_norm: float
    sums: np.ndarray  #: (chunks, K) integer sums per chunk (0 rows where lost)
    contributors: np.ndarray  #: (chunks,) contributors per chunk (0 where lost)
    bitmap: np.ndarray  #: (chunks,) contributor bitmap per chunk
    lost: np.ndarray  #: (chunks,) bool, chunks taken as zero
    indices: np.ndarray  #: this worker's indices over the padded transformed length (uint8)
    #: seconds in error feedback, rotation and quantization (the group's; a worker of its own quantizes
    #: beside its index exchange, which counts it in ``network_s``)
    encode_s: float = 0.0
    network_s: float = 0.0  #: seconds in the two exchanges, waiting for peers included (and, with
    #: caller-kept error feedback, the new error's computation, which runs beside the index exchange)


def thc_allreduce(workers: Sequence[THCWorker], exchange: Exchange, grads: Sequence[torch.Tensor], *,
                  tensor: int = 0, step: int = 0,
                  errors: Sequence[torch.Tensor] | None = None,
                  outs: Sequence[torch.Tensor] | None = None) -> list[AllreduceResult]:
    """Average ``grads`` (one per local worker) over the job's workers through ``exchange``.

    ``errors``: caller-kept error feedback, one flat float32 tensor per worker, added to the gradient
    before the rotation and overwritten with x - RHT^-1(X_i) after quantization (the workers' own
    error feedback should then be off); with ``THCConfig.rotation = "fixed"``, rotated and of the padded
    length, overwritten by the quantization's own pass. ``outs``: where each worker's average goes (float32 of the
    gradient's length, decoded in place; may be the gradient itself), instead of new tensors.
    """
    t0 = time.perf_counter()
    errs = [None] * len(workers) if errors is None else errors
    norms = np.array([w.begin(g, tensor, step, error=e) for w, g, e in zip(workers, grads, errs, strict=True)])
    t1 = time.perf_counter()
    max_norms = exchange.exchange_norms(norms, tensor=tensor)
    t2 = time.perf_counter()

    def new_errors() -> None:  # x - RHT^-1(X_i) with this step's rotation (Algorithm 3)
        for w, e in zip(workers, errs, strict=True):
            w.residual(tensor, out=e)

    # the job's max norm: the same scale on every worker
    stream = getattr(exchange, "exchange_streamed", None) if len(workers) == 1 else None
    if stream is not None:
        results, stacked = _streamed(workers[0], stream, float(max_norms[0]), tensor,
                                     None if errors is None else new_errors)
        t3, t4 = t2, time.perf_counter()  # quantized beside the exchange: it counts in the network phase
    else:
        # np.stack copies (the codec reuses its buffer)
        stacked = np.stack([np.asarray(w.compress(tensor, float(m)).indices.cpu().numpy(), np.uint8)
                            for w, m in zip(workers, max_norms, strict=True)])
        t3 = time.perf_counter()
        if errors is not None and all(w.fixed for w in workers):
            new_errors()  # written by compress already (a copy at most): nothing to run beside the exchange
            errors = None
        with _Beside(None if errors is None else new_errors):
            results = exchange.exchange_indices(stacked, tensor=tensor)
        t4 = time.perf_counter()
    encode_s, network_s = (t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3)
    dests = [None] * len(workers) if outs is None else outs
    return [AllreduceResult(decode(w, tensor, r, idx.size, out=o), float(m), r.sums, r.contributors, r.bitmap,
                            r.lost, idx, encode_s, network_s)
            for w, r, idx, m, o in zip(workers, results, stacked, max_norms, dests, strict=True)]


#: Coordinates quantized before a worker's first chunks go out, and in each later piece (multiples of
#: ``fused.BLOCK``): the first piece small, so that the network starts at once; the later ones large enough
#: that waking the exchange for each costs little (a 4.19 M-coordinate bucket: 17 pieces).
FIRST_PIECE = 1 << 16
PIECE = 1 << 18


def _streamed(worker: THCWorker, stream: StreamedExchange, max_norm: float, tensor: int,
              after: Callable[[], object] | None) -> tuple[list[UseResults], np.ndarray]:
    """One worker's quantization and index exchange overlapped: the compiled pass quantizes piece by piece
    on the exchange's helper thread while the chunks already quantized are on their way
    (``Transport.exchange_indices``' ``fill``); ``after`` (the new error feedback) runs there once the last
    piece is done. Returns the results and a copy of the indices."""
    enc, quantize = worker.compress_in_pieces(tensor, max_norm)
    host = enc.indices.cpu().numpy()  # the codec's own buffer on a CPU (written in place by ``quantize``)
    kept = np.empty_like(host)

    def fill(done: Callable[[int], None]) -> None:
        n, start = host.size, 0
        for stop in [*range(FIRST_PIECE, n, PIECE), n]:
            quantize(start, stop)
            done(stop)
            start = stop
        np.copyto(kept, host)  # the codec reuses its buffer next step
        if after is not None:
            after()

    return stream(host, fill, tensor=tensor), kept[None, :]


class _Beside:
    """Runs ``work`` on a helper thread for the duration of a ``with`` block and re-raises its exception
    at the end. The new error feedback, x - RHT^-1(X_i) (Algorithm 3), needs the indices but not the
    answers, and its compiled passes and fht-cpu release the GIL: computed while the exchange waits on
    the network, it leaves the critical path (10 ms of a 4.19 M-coordinate step on this machine). The
    exchange does not touch the codec's buffers, and decoding starts only after the block."""

    def __init__(self, work: Callable[[], object] | None) -> None:
        self._work, self._error = work, None
        self._thread = None if work is None else threading.Thread(target=self._run, name="thc-beside", daemon=True)

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as e:  # handed to the caller's thread
            self._error = e

    def __enter__(self) -> _Beside:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._thread.join()
            if self._error is not None and exc[0] is None:
                raise self._error


def decode(worker: THCWorker, tensor: int, res: UseResults, length: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The average from one worker's sums over ``length`` padded coordinates (``res.sums`` is (chunks, K)).

    When every chunk came back with the same contributor count, one count scales them all; otherwise
    each coordinate gets its chunk's count and lost chunks are zero in the rotated domain.
    """
    sums = torch.from_numpy(res.sums.reshape(-1)[:length])
    counts = res.contributors
    if not res.lost.any() and (counts == counts[0]).all():
        return worker.finish(tensor, sums, int(counts[0]), out=out)
    k = res.sums.shape[1]
    per_coord = torch.from_numpy(np.repeat(counts, k)[:length])
    lost = torch.from_numpy(np.repeat(res.lost, k)[:length])
    return worker.finish(tensor, sums, per_coord, out=out, lost=lost)


def check_table(worker: THCWorker, job: JobConfig) -> None:
    """Refuse a worker whose THC table is not the job's: the aggregator would drop every packet."""
    table_id = worker.codec.table.table_id()
    if job.kind == "thc" and table_id != job.table_id:
        raise ValueError(f"this worker's table id {table_id:#06x} is not the job's {job.table_id:#06x}: "
                         "the aggregator would refuse every packet")


class TransportExchange:
    """One worker's UDP ``Transport`` as the exchange of a group of one."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def exchange_norms(self, norms: np.ndarray, *, tensor: int) -> np.ndarray:
        (norm,) = norms
        return np.array([self.transport.exchange_norm(float(norm), tensor=tensor)[0]])

    def exchange_indices(self, indices: np.ndarray, *, tensor: int) -> list[UseResults]:
        (own,) = indices
        return [self.transport.exchange_indices(own, tensor=tensor)]

    def exchange_streamed(self, indices: np.ndarray, fill: IndexFill, *, tensor: int) -> list[UseResults]:
        """The worker's indices sent while ``fill`` computes them (``Transport.exchange_indices``)."""
        return [self.transport.exchange_indices(indices, tensor=tensor, fill=fill)]


class THCAllreduce:
    """``allreduce(tensor)`` for one worker of a THC job over UDP (error feedback kept per tensor id)."""

    def __init__(self, transport: Transport, config: THCConfig | None = None, *, seed: int | None = None) -> None:
        self.transport = transport
        self.exchange = TransportExchange(transport)
        p = transport.cfg.params
        self.config = config or THCConfig(bits=p.bits, granularity=p.granularity)
        if (self.config.bits, self.config.granularity) != (p.bits, p.granularity):
            raise ValueError("the THC config does not match the job's bits and granularity")
        self.worker = THCWorker(self.config, job=p.job, worker=transport.cfg.worker, seed=seed)
        check_table(self.worker, p)

    def allreduce(self, grad: torch.Tensor, *, tensor: int = 0, step: int = 0) -> AllreduceResult:
        """Average ``grad`` over the job's workers through the aggregator."""
        return thc_allreduce([self.worker], self.exchange, [grad], tensor=tensor, step=step)[0]
