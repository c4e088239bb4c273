"""PyTorch DistributedDataParallel communication hook that averages gradients through a THC aggregator.

DDP hands a communication hook one *bucket* of gradients at a time (a flat tensor holding the
gradients of a few parameters) and expects a ``torch.futures.Future`` of the averaged bucket. This
hook compresses the bucket with THC on the tensor's own device, runs the norm stage and the index
exchange through a ``thc-aggregator`` (or a switch speaking the same protocol) with the worker
``Transport``, decodes the average and writes it back into the bucket. The process group (gloo,
or NCCL on GPUs) still serves DDP's own needs (the initial broadcast, buffers); gradients travel
only through the aggregator.

Why it is built this way:

- **One transport per process, uses in bucket order.** DDP calls the hook for buckets in index
  order on every rank, so all ranks issue the same sequence of aggregator uses (docs/protocol.md)
  without talking to each other. The exchange runs on one background thread per process, in
  submission order, so communication overlaps the rest of the backward pass as with NCCL/gloo.
- **Error feedback keyed by parameter.** DDP rebuilds its buckets after the first iteration (and
  may again); the error of each parameter's coordinates is kept in a per-parameter view, so a
  bucket whose parameter set changes starts from the errors its parameters carried before. With
  ``rotation="fixed"`` (the default with error feedback: docs/ddp.md says why) a bucket's error is kept
  rotated (no inverse transform per step, see ``worker_lib.thc.THCWorker``) and is rotated back into its
  parameters only when a rebuild moves them.
- **Bit-identical replicas.** Every rank decodes the same integer sums with the same max norm and
  the same rotation, so the averages (and thus the parameters) agree bit for bit. With the
  ``zero-fill`` loss policy a chunk may be lost for one rank and not for another; replicas can then
  drift apart, which is why ``reliable`` is the default.
- **No hang.** A silent aggregator raises ``AggregatorUnreachable`` after ``deadline`` seconds; the
  exception completes the bucket's future, so ``loss.backward()`` raises it.

Usage::

    job = JobConfig(job=1, workers=4)                               # the job thc-aggregator serves
    cfg = DDPHookConfig(job, aggregator=("10.0.0.1", 9451))
    model = DistributedDataParallel(net)
    state = register_thc_hook(model, cfg)                           # rank/world from torch.distributed
    ...train as usual...
    state.close()

The ``uncompressed`` kind sends int32 fixed-point values (a SwitchML-style job of the aggregator,
scaled by the job's max |value| so that n workers' sums cannot overflow) over the same transport:
the baseline THC is measured against.

(No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects.)
"""

import concurrent.futures
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist

from worker_lib.allreduce import TransportExchange, check_table, thc_allreduce
from worker_lib.cli.args import DDP_ROTATION
from worker_lib.job import JobConfig
from worker_lib.pacing import TAIL_DUPLICATES
from worker_lib.thc import THCConfig, THCWorker
from worker_lib.thc.codec import Rotation, warm_up
from worker_lib.transport import (
    AggregatorStateError,
    AggregatorUnreachable,
    LossPolicy,
    Transport,
    TransportConfig,
    data_sums_type,
    run_nonce,
)
from worker_lib.values import is_integer

log = logging.getLogger(__name__)

__all__ = ["AggregatorStateError", "AggregatorUnreachable", "DDPHookConfig", "HookStats", "THCHookState",
           "register_thc_hook", "settings_disagree", "thc_hook"]

_INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class DDPHookConfig:
    """Settings of the DDP hook: the job, where its aggregator is, the loss policy and timeouts.

    ``job`` is the job exactly as the aggregator serves it (kind ``thc`` or ``uncompressed``; its
    ``workers`` must be the world size, its ``multicast`` group, if any, is where results are
    received); THC's knobs are the job's.
    """

    job: JobConfig = field(default_factory=JobConfig)
    aggregator: tuple[str, int] = ("127.0.0.1", 9451)  #: the aggregator (member 0 where several serve the job)
    #: members 1..N-1 of the aggregators serving the job (thc-aggregator --member I/N), in member order
    more_aggregators: tuple[tuple[str, int], ...] = ()
    shards: int = 1  #: shards of each aggregator (ports PORT..PORT+shards-1)
    loss_policy: LossPolicy = "reliable"
    timeout: float = 0.05  #: seconds before a use is retransmitted
    retries: int = 3  #: zero-fill: retransmissions before a chunk is given up
    deadline: float = 10.0  #: seconds without any answer before AggregatorUnreachable
    window: int | None = None  #: uses in flight (default: all slots)
    bind_host: str = "127.0.0.1"  #: local address of the worker's socket (its interface towards the aggregator)
    error_feedback: bool = True
    overlap: bool = True  #: exchange on a background thread (overlaps backward); False: inside the hook
    seed: int = 0  #: seeds the stochastic quantization (mixed with the rank)
    gro: bool = True  #: read answers that arrive as one run as one message (UDP_GRO; TransportConfig.gro)
    #: the last this many uses of each bucket's index exchange go out twice (TransportConfig.tail_duplicates)
    tail_duplicates: int = TAIL_DUPLICATES
    #: one rotation per bucket, with error feedback kept rotated, or new signs every step (the paper's;
    #: THCConfig.rotation). None: fixed with error feedback, per-step without (docs/ddp.md says why)
    rotation: Rotation | None = None

    def __post_init__(self) -> None:
        if self.rotation is None:  # frozen: the chosen default is the setting the ranks compare
            object.__setattr__(self, "rotation", DDP_ROTATION if self.error_feedback else "per-step")
        if not isinstance(self.job, JobConfig):  # a spec string is a likely slip: parse_job_spec makes one
            raise ValueError(f"job must be a JobConfig (worker_lib.job.parse_job_spec reads a spec), got {self.job!r}")
        if self.job.kind not in ("thc", "uncompressed"):
            raise ValueError(f"the job's kind must be 'thc' or 'uncompressed' for the DDP hook, got {self.job.kind!r}")
        if self.loss_policy not in ("reliable", "zero-fill"):
            raise ValueError(f"loss_policy must be 'reliable' or 'zero-fill', got {self.loss_policy!r}")
        for member in (self.aggregator, *self.more_aggregators):
            if not (isinstance(member, (tuple, list)) and len(member) == 2 and isinstance(member[0], str) and member[0]
                    and is_integer(member[1]) and 0 < member[1] < 65536):
                raise ValueError(f"an aggregator must be (host, port) with a port in 1..65535, got {member!r}")
        longest = TransportConfig.max_timeout
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout <= longest):
            raise ValueError(f"timeout must be in (0, {longest}] seconds (the transport's longest), "
                             f"got {self.timeout!r}")
        if self.job.kind == "thc":
            self.thc_config()  # validates p and the rotation with THC's own messages
        if not (is_integer(self.seed) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        self.transport_config(0, self.job.workers)  # the rest (deadline, retries, window, ...) as the transport does

    def shared_settings(self) -> dict[str, object]:
        """What every rank of a job must set alike (``register_thc_hook`` compares them across the ranks): a
        rank with another rotation, error feedback, loss policy or job would decode or give up chunks
        differently, and the replicas would part ways without an error. The job's key is compared as a
        digest, never sent or shown as it is."""
        job = {f.name: getattr(self.job, f.name) for f in fields(self.job) if f.compare and f.name != "key"}
        job["key"] = hashlib.sha256(str(self.job.key).encode()).hexdigest()[:16]
        return {"job": job, "loss_policy": self.loss_policy,
                "retries": self.retries if self.loss_policy == "zero-fill" else None,  # zero-fill's alone
                "error_feedback": self.error_feedback, "rotation": self.rotation}

    def thc_config(self) -> THCConfig:
        """THC's codec settings, the job's (error feedback is done by the hook, per parameter)."""
        j = self.job
        return THCConfig(bits=j.bits, granularity=j.granularity, p=j.p, error_feedback=False, rotation=self.rotation)

    def transport_config(self, rank: int, world_size: int) -> TransportConfig:
        """The transport of ``rank``; refuses a job whose worker count is not the world size."""
        if self.job.workers != world_size:
            raise ValueError(f"job {self.job.job} has {self.job.workers} workers but the world size is "
                             f"{world_size}: the aggregator would wait for workers that never send "
                             f"(or refuse ranks beyond the job's)")
        return TransportConfig(self.job, worker=rank, aggregator=(self.aggregator[0], int(self.aggregator[1])),
                               more_aggregators=tuple((h, int(p)) for h, p in self.more_aggregators),
                               shards=self.shards, loss_policy=self.loss_policy, timeout=self.timeout,
                               retries=self.retries, deadline=self.deadline, window=self.window, seed=self.seed,
                               bind_host=self.bind_host, multicast=self.job.multicast, gro=self.gro,
                               tail_duplicates=self.tail_duplicates)


def settings_disagree(per_rank: list[dict[str, object]]) -> str | None:
    """One line naming the first setting in which a rank differs from rank 0 (``shared_settings``), or
    None when all agree."""
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        for name, want in first.items():
            have = other.get(name)
            if name == "job" and isinstance(want, dict) and isinstance(have, dict):
                diff = next((k for k in want if want[k] != have.get(k)), None)
                if diff is None:
                    continue
                shown = "differs" if diff == "key" else f"rank 0 has {want[diff]!r}, rank {rank} {have.get(diff)!r}"
                return (f"the ranks' DDPHookConfig disagree on the job's {diff} ({shown}): every rank must "
                        f"give the same job")
            if have != want:
                return (f"the ranks' DDPHookConfig disagree on {name}: rank 0 has {want!r}, rank {rank} "
                        f"{have!r}; every rank must use the same")
    return None


@dataclass
class HookStats:
    """Where the hook's time goes (seconds, cumulative, measured on the exchange thread)."""

    buckets: int = 0
    coordinates: int = 0
    #: error feedback, norm, RHT (or fixed-point scaling); THC's quantization runs beside the data exchange
    #: (``worker_lib.allreduce``: the first chunks leave while the rest is quantized) and counts in network_s
    encode_s: float = 0.0
    network_s: float = 0.0  #: norm stage and data exchange with the aggregator (incl. waiting for peers)
    decode_s: float = 0.0  #: the rest: decoding the average, error bookkeeping, copy back into the bucket
    cpu_s: float = 0.0  #: CPU time of the exchange thread over all of the above (the rest of the time it waits)
    #: of that waiting, the time the thread was ready to run but had no CPU (``thread_wait_s``): what a busy
    #: machine adds to the hook; nan where the kernel keeps no such account
    wait_s: float = 0.0
    lost_chunks: int = 0
    bytes_sent: int = 0  #: payload bytes of DATA packets (headers excluded)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def thread_wait_s() -> float:
    """Seconds the calling thread has spent ready to run but waiting for a CPU (its run-queue delay, the
    second field of Linux's ``/proc/thread-self/schedstat``), or nan where the kernel does not keep it.
    Unlike ``time.thread_time``, this is time the thread lost to others: on a machine short of cores it
    is how late the exchange answers what the network brought."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return math.nan


@dataclass
class _BucketError:
    """Error feedback of one bucket layout: one flat tensor and a view per parameter, or with the fixed
    rotation the bucket's error rotated (padded length), of parameters of these sizes."""

    params: tuple[int, ...]
    flat: torch.Tensor
    sizes: tuple[int, ...] = ()
    rotated: bool = False


@dataclass
class THCHookState:
    """State of the hook in one process: transport, THC workers (one per device) and error feedback.

    ``rank`` and ``world_size`` default to torch.distributed's (of ``process_group``). Create it after
    ``init_process_group``; call ``close()`` at the end (or use it as a context manager).
    """

    config: DDPHookConfig
    rank: int | None = None
    world_size: int | None = None
    process_group: dist.ProcessGroup | None = None
    stats: HookStats = field(default_factory=HookStats)
    step: int = field(init=False, default=0)
    transport: Transport = field(init=False)
    _exchange: TransportExchange = field(init=False)
    _workers: dict[str, THCWorker] = field(init=False, default_factory=dict)
    _bucket_errors: dict[int, _BucketError] = field(init=False, default_factory=dict)
    _param_errors: dict[int, torch.Tensor] = field(init=False, default_factory=dict)
    _executor: concurrent.futures.ThreadPoolExecutor | None = field(init=False, default=None)
    _failed: BaseException | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.rank is None or self.world_size is None:
            if not dist.is_initialized():
                raise RuntimeError("THCHookState needs rank and world_size, or an initialized torch.distributed")
            self.rank = dist.get_rank(self.process_group) if self.rank is None else self.rank
            self.world_size = dist.get_world_size(self.process_group) if self.world_size is None else self.world_size
        self.transport = Transport(self.config.transport_config(self.rank, self.world_size))
        self._exchange = TransportExchange(self.transport)
        if self.config.overlap:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"thc-hook{self.rank}")
        log.info("rank %d: THC hook (%s) to aggregator %s:%d job %d from %s", self.rank, self.config.job.kind,
                 *self.config.aggregator, self.config.job.job, self.transport.address)

    # -- life cycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the exchange thread and close the socket."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self.transport.close()

    def __enter__(self) -> "THCHookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the hook's work ----------------------------------------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average one bucket; the future completes with the bucket's buffer (or the error)."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        buffer = bucket.buffer()
        index = bucket.index()
        params = tuple(id(p) for p in bucket.parameters())
        sizes = [p.numel() for p in bucket.parameters()]
        step, last = self.step, bucket.is_last()
        if last:
            self.step += 1

        def work() -> None:
            try:
                if self._failed is not None:  # the transport's use sequence is broken: do not go on
                    raise RuntimeError(f"THC hook: an earlier exchange failed: {self._failed}") from self._failed
                self._average(buffer, index, params, sizes, step, last)
                fut.set_result(buffer)
            except BaseException as exc:  # delivered through the future: backward() raises it
                self._failed = self._failed or exc
                fut.set_exception(exc)

        if self._executor is None:
            work()
        else:
            self._executor.submit(work)
        return fut

    def _worker_for(self, device: torch.device) -> THCWorker:
        key = str(device)
        w = self._workers.get(key)
        if w is None:
            cfg = self.config
            w = self._workers[key] = THCWorker(cfg.thc_config(), job=cfg.job.job, worker=self.rank, device=device,
                                               seed=cfg.seed * 7919 + self.rank)
            check_table(w, cfg.job)
        return w

    def prepare(self, devices: Iterable[torch.device]) -> None:
        """For a THC job, make each device's worker now (its table checked against the job's) and, on the
        CPU, load the codec's compiled passes (``worker_lib.thc.codec.warm_up``): what the first step
        would otherwise pay, 0.2-0.3 s of CPU per process, is paid before training starts."""
        if self.config.job.kind != "thc":
            return
        for device in devices:
            worker = self._worker_for(torch.device(device))
            if worker.codec.device.type == "cpu":
                warm_up(worker.config, sums_type=data_sums_type(self.config.job),
                        caller_error=self.config.error_feedback)

    def error_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The error feedback ``param``'s coordinates carry into the next step (flat; None before any). With
        the fixed rotation it is rotated back from its bucket's error (a new tensor)."""
        pid = id(param)
        for index, be in self._bucket_errors.items():
            if be.rotated and pid in be.params:
                return self._rotated_back(index, be)[be.params.index(pid)]
        return self._param_errors.get(pid)

    def _rotated_back(self, index: int, be: _BucketError) -> tuple[torch.Tensor, ...]:
        """Bucket ``index``'s rotated error rotated back and split into its parameters' errors."""
        back = self._worker_for(be.flat.device).error_from_rotated(index, be.flat, sum(be.sizes))
        return torch.split(back, list(be.sizes))

    def _unrotate(self, index: int) -> None:
        """Move bucket ``index``'s rotated error back into its parameters' errors (a rebuild moves them)."""
        be = self._bucket_errors.pop(index)
        for pid, part in zip(be.params, self._rotated_back(index, be), strict=True):
            self._param_errors[pid] = part

    def bucket_errors(self, index: int, params: tuple[int, ...], sizes: list[int],
                      device: torch.device) -> torch.Tensor:
        """The flat error-feedback buffer of bucket ``index`` holding parameters ``params`` (their ids).

        When the bucket's parameter set changed (DDP's rebuild), the buffer is assembled from the
        errors each parameter carried in its previous bucket, so no error feedback is lost.
        """
        be = self._bucket_errors.get(index)
        if be is not None and be.params == params and be.flat.device == device:
            return be.flat
        if self.config.rotation == "fixed":  # buckets holding any of these parameters give their errors back
            wanted = set(params)
            holders = [i for i, b in self._bucket_errors.items()
                       if b.rotated and (i == index or wanted & set(b.params))]
            for i in holders:
                self._unrotate(i)
        parts = [self._param_errors.get(pid) for pid in params]
        flat = torch.cat([torch.zeros(n, device=device) if e is None else e.to(device)
                          for e, n in zip(parts, sizes, strict=True)]) if params else torch.zeros(0, device=device)
        if be is not None:
            log.debug("rank %d: bucket %d changed its parameters; error feedback carried per parameter", self.rank,
                      index)
        if self.config.rotation == "fixed":
            for pid in params:
                self._param_errors.pop(pid, None)  # held, rotated, in the bucket's error from now on
            rotated = self._worker_for(device).error_to_rotated(index, flat)
            self._bucket_errors[index] = _BucketError(params, rotated, tuple(sizes), rotated=True)
            return rotated
        self._bucket_errors[index] = _BucketError(params, flat)
        for pid, view in zip(params, torch.split(flat, sizes), strict=True):
            self._param_errors[pid] = view
        return flat

    def _average(self, buffer: torch.Tensor, index: int, params: tuple[int, ...], sizes: list[int], step: int,
                 last: bool) -> None:
        cfg, st = self.config, self.stats
        t0, cpu0, wait0 = time.perf_counter(), time.thread_time(), thread_wait_s()
        busy = st.encode_s + st.network_s
        flat = buffer.detach().reshape(-1)
        if cfg.job.kind == "uncompressed":
            avg = self._average_fixed_point(flat.to(torch.float32), index)
        else:
            avg = self._average_thc(flat, index, params, sizes, step)
        if avg.data_ptr() != buffer.data_ptr():  # THC decodes float32 buckets in place
            buffer.copy_(avg.reshape(buffer.shape).to(buffer.dtype))
        st.decode_s += time.perf_counter() - t0 - (st.encode_s + st.network_s - busy)  # the rest of the bucket's time
        st.cpu_s += time.thread_time() - cpu0
        st.wait_s += thread_wait_s() - wait0
        st.buckets += 1
        st.coordinates += flat.numel()
        if last:
            # Drop the errors of bucket indices that no longer exist (a rebuild into fewer buckets).
            for gone in [i for i in self._bucket_errors if i > index]:
                if self._bucket_errors[gone].rotated:
                    self._unrotate(gone)  # its parameters' errors, for the buckets that hold them now
                else:
                    del self._bucket_errors[gone]

    def _average_thc(self, flat: torch.Tensor, index: int, params: tuple[int, ...], sizes: list[int],
                     step: int) -> torch.Tensor:
        """THC on the allreduce path shared with thc-allreduce and the simulations (worker_lib.allreduce),
        with the hook's per-parameter error feedback."""
        cfg, st, p = self.config, self.stats, self.transport.cfg.params
        err = self.bucket_errors(index, params, sizes, flat.device) if cfg.error_feedback else None
        grad = flat.to(torch.float32)  # the bucket itself when it is float32: decoded into it in place
        (res,) = thc_allreduce([self._worker_for(flat.device)], self._exchange, [grad],
                               tensor=index, step=step, errors=None if err is None else [err], outs=[grad])
        st.encode_s += res.encode_s
        st.network_s += res.network_s
        st.bytes_sent += res.sums.shape[0] * p.elems * p.bits // 8
        st.lost_chunks += int(res.lost.sum())
        return res.average

    def _average_fixed_point(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """int32 fixed point scaled by the job's max |value|: n workers' sums cannot overflow."""
        st, tr = self.stats, self.transport
        t0 = time.perf_counter()
        n = tr.cfg.params.workers
        amax = float(x.abs().max()) if x.numel() else 0.0
        if not math.isfinite(amax):
            raise ValueError(f"bucket {index} holds NaN or infinite gradients")
        t1 = time.perf_counter()
        top, _ = tr.exchange_norm(amax, tensor=index)
        t2 = time.perf_counter()
        # |round(x * scale)| <= (2^31 - 1 - n) / n + 1/2, so the n workers' sum stays below 2^31 - 1.
        scale = (_INT32_MAX - n) / (n * top) if top > 0 else 1.0
        q = torch.round(x.double() * scale).to(torch.int64).cpu().numpy()
        t3 = time.perf_counter()
        res = tr.exchange_int32(q, tensor=index)
        t4 = time.perf_counter()
        st.encode_s += (t1 - t0) + (t3 - t2)
        st.network_s += (t2 - t1) + (t4 - t3)
        st.bytes_sent += res.sums.shape[0] * tr.cfg.params.elems * 4
        d = q.size
        counts = np.repeat(res.contributors, tr.cfg.params.elems)[:d]
        st.lost_chunks += int(res.lost.sum())
        avg = res.sums.reshape(-1)[:d] / (np.maximum(counts, 1) * scale)
        avg[counts == 0] = 0.0
        return torch.from_numpy(avg.astype(np.float32)).to(x.device)


def thc_hook(state: THCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` through the THC aggregator (see the module docstring).

    Register with ``model.register_comm_hook(state, thc_hook)`` or ``register_thc_hook``.
    """
    return state.submit(bucket)


def register_thc_hook(model: torch.nn.parallel.DistributedDataParallel, config: DDPHookConfig, *,
                      process_group: dist.ProcessGroup | None = None) -> THCHookState:
    """Create the hook's state for this rank and register ``thc_hook`` on ``model``; returns the state.

    Before it returns, each device's THC worker is ready (``THCHookState.prepare``) and the ranks have made
    the run's first use (``Transport.open_run`` with a nonce of rank 0's): a job that an earlier run left
    on the aggregator raises ``AggregatorStateError`` here, not a training on its state. The ranks also
    compare their ``DDPHookConfig.shared_settings``: a rank with another job, rotation, error feedback or
    loss policy raises ValueError on every rank, naming the setting, instead of training replicas that
    part ways."""
    state = THCHookState(config, process_group=process_group)
    try:
        state.prepare({p.device for p in model.parameters()})
        # every rank's settings, and rank 0's nonce for the run's first use (which refuses an aggregator job
        # that holds another run's state)
        mine = (run_nonce() if state.rank == 0 else None, config.shared_settings())
        gathered: list[tuple[float | None, dict[str, object]] | None] = [None] * state.world_size
        dist.all_gather_object(gathered, mine, group=process_group)
        if (problem := settings_disagree([g[1] for g in gathered if g is not None])) is not None:
            raise ValueError(problem)
        state.transport.open_run(gathered[0][0] if gathered[0] is not None else None)
    except BaseException:
        state.close()
        raise
    hook: Callable[[THCHookState, dist.GradBucket], torch.futures.Future[torch.Tensor]] = thc_hook
    model.register_comm_hook(state, hook)
    return state
