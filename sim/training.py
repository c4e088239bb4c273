"""Data-parallel training of n simulated workers whose gradients travel compressed.

Each worker keeps its own copy of the model (and its own momentum), computes a gradient on its own
shard with a fixed per-worker batch size, compresses it (THC with error feedback, or a baseline
codec), and the average comes back through the in-process network of ``sim.network`` (for THC: real
packets through the reference aggregator). Each worker updates its own copy with what it received,
so downstream loss makes the copies drift, as in the THC paper's Section 8.3; optional model
synchronization averages the copies at the end of every epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from sim.data import Dataset, load_dataset, shard_indices
from sim.models import make_model
from sim.network import LinkLoss, NetworkStats, SimulatedNetwork, StagedNetwork
from sim.tiered import FlatNetwork, TieredNetwork
from worker_lib.allreduce import thc_allreduce
from worker_lib.job import JobConfig
from worker_lib.thc import THCConfig, THCWorker, next_pow2
from worker_lib.wire.layout import MAX_WORKERS

Compression = str  # "thc", "none", or a name from worker_lib.codecs.CODEC_NAMES
LossModel = Literal["protocol", "paper"]


@dataclass(frozen=True)
class SimConfig:
    """One simulated training run."""

    dataset: str = "digits"
    workers: int = 10
    batch: int = 16  # per worker
    steps: int = 200
    lr: float = 0.05
    momentum: float = 0.9
    compression: Compression = "thc"
    bits: int = 4
    granularity: int = 20
    p: float = 1 / 512
    threshold: int | None = None  # completion threshold; defaults to workers - stragglers
    stragglers: int = 0  # workers drawn at random every step to arrive after the threshold
    drop_up: float = 0.0
    drop_down: float = 0.0
    loss_model: LossModel = "protocol"
    sync_every_epoch: bool = False
    elems: int = 256  # K: coordinates per packet
    slots: int = 64
    #: two tiers: the workers split as evenly as possible over this many leaves under one spine
    #: (sim.tiered.TieredNetwork); 0: one aggregator (the wire's, up to 32 workers; the flat design's
    #: outcome without packets, sim.tiered.FlatNetwork, beyond)
    leaves: int = 0
    spine_drop_up: float = 0.0  # two tiers: loss on the leaves' links to the spine, leaf -> spine
    spine_drop_down: float = 0.0  # and spine -> leaf
    eval_every: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.batch < 1 or self.steps < 1 or self.eval_every < 1:
            raise ValueError("workers, batch, steps and eval_every must be positive")
        if not 0 <= self.stragglers < self.workers:
            raise ValueError(f"stragglers must be in 0..workers-1, got {self.stragglers}")
        if self.threshold is not None and not 1 <= self.threshold <= self.workers - self.stragglers:
            raise ValueError(f"threshold must be in 1..workers-stragglers = {self.workers - self.stragglers}")
        if not 0 <= self.leaves <= MAX_WORKERS:
            raise ValueError(f"leaves must be in 0..{MAX_WORKERS}, got {self.leaves}")
        if self.workers > MAX_WORKERS * (self.leaves or MAX_WORKERS) or self.leaves > self.workers:
            raise ValueError(f"{self.workers} workers over {self.leaves} leaves: at least one and at most "
                             f"{MAX_WORKERS} workers a leaf, {MAX_WORKERS * MAX_WORKERS} in all")
        if (self.spine_drop_up or self.spine_drop_down) and not self.leaves:
            raise ValueError("spine_drop_up/down are losses of two tiers: set leaves")
        if self.loss_model not in ("protocol", "paper"):
            raise ValueError(f"loss_model must be 'protocol' or 'paper', got {self.loss_model!r}")
        if (self.drop_up or self.drop_down or self.stragglers) and self.compression != "thc" \
                and self.loss_model == "protocol":
            raise ValueError("loss and stragglers go through the THC aggregator: use compression='thc' "
                             "(or loss_model='paper')")

    @property
    def leaf_sizes(self) -> tuple[int, ...]:
        """Workers per leaf (two tiers; the flat design past 32 workers borrows the split for its job)."""
        groups = self.leaves or -(-self.workers // MAX_WORKERS)
        return tuple(len(a) for a in np.array_split(np.arange(self.workers), groups))

    @property
    def completion_threshold(self) -> int:
        return self.threshold if self.threshold is not None else self.workers - self.stragglers


@dataclass
class RunResult:
    """Evaluation records of one run (one dict per evaluation) and the network's counters."""

    config: SimConfig
    records: list[dict] = field(default_factory=list)
    network: NetworkStats | None = None
    final_params: list[torch.Tensor] = field(default_factory=list)

    def final_accuracy(self, last: int = 5) -> float:
        """Mean test accuracy of worker 0 over the last evaluations (the paper's sliding window)."""
        accs = [r["accuracy"] for r in self.records[-last:]]
        return float(np.mean(accs))

    def steps_to(self, target: float, window: int = 5) -> int | None:
        """First step whose sliding-window accuracy reaches the target (None if never)."""
        accs = np.array([r["accuracy"] for r in self.records])
        steps = [r["step"] for r in self.records]
        for i in range(len(accs)):
            if accs[max(0, i - window + 1): i + 1].mean() >= target:
                return int(steps[i])
        return None


class _Learner:
    """Gradients of one shared architecture at any worker's parameter vector."""

    def __init__(self, model: nn.Module, data: Dataset) -> None:
        self.model = model
        self.data = data
        self.loss = nn.CrossEntropyLoss()

    def gradient(self, theta: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        vector_to_parameters(theta, self.model.parameters())
        self.model.zero_grad(set_to_none=False)
        x, y = self.data.train_x[idx], self.data.train_y[idx]
        self.loss(self.model(x), y).backward()
        return parameters_to_vector(p.grad for p in self.model.parameters()).detach().clone()

    @torch.no_grad()
    def evaluate(self, theta: torch.Tensor) -> tuple[float, float]:
        vector_to_parameters(theta, self.model.parameters())
        logits = self.model(self.data.test_x)
        loss = float(self.loss(logits, self.data.test_y))
        return float((logits.argmax(1) == self.data.test_y).float().mean()), loss


class _Batches:
    """Per-worker minibatches from the worker's own shard, reshuffled every pass."""

    def __init__(self, shard: np.ndarray, batch: int, rng: np.random.Generator) -> None:
        self.shard, self.batch, self.rng = shard, batch, rng
        self.order = rng.permutation(shard)
        self.pos = 0

    def next(self) -> np.ndarray:
        if self.pos + self.batch > len(self.order):
            self.order, self.pos = self.rng.permutation(self.shard), 0
        out = self.order[self.pos: self.pos + self.batch]
        self.pos += self.batch
        return out


def _zero_blocks(vec: torch.Tensor, k: int, p: float, rng: np.random.Generator) -> int:
    """The paper's loss model: each K-coordinate block is zeroed with probability p. Returns the count."""
    blocks = math.ceil(vec.numel() / k)
    hit = np.flatnonzero(rng.random(blocks) < p)
    for b in hit.tolist():
        vec[b * k: (b + 1) * k] = 0
    return int(hit.size)


class _THCExchange:
    """THC through the reference aggregator, on the real workers' allreduce path (worker_lib.allreduce)."""

    def __init__(self, cfg: SimConfig, length: int) -> None:
        thc = THCConfig(bits=cfg.bits, granularity=cfg.granularity, p=cfg.p, error_feedback=True)
        self.workers = [THCWorker(thc, job=1, worker=w, seed=cfg.seed * 7919 + w) for w in range(cfg.workers)]
        padded = next_pow2(length)
        k = min(cfg.elems, padded)
        leaves = cfg.leaf_sizes if cfg.leaves or cfg.workers > MAX_WORKERS else None
        job = JobConfig(job=1, workers=cfg.workers, threshold=cfg.completion_threshold, bits=cfg.bits,
                        granularity=cfg.granularity, p=cfg.p, slots=cfg.slots, elems=k, leaves=leaves)
        loss = LinkLoss(cfg.drop_up, cfg.drop_down) if cfg.loss_model == "protocol" else LinkLoss()
        if cfg.leaves:
            self.net: StagedNetwork = TieredNetwork(job, loss, LinkLoss(cfg.spine_drop_up, cfg.spine_drop_down),
                                                    seed=cfg.seed + 101)
        elif leaves:
            self.net = FlatNetwork(job, loss, seed=cfg.seed + 101)
        else:
            self.net = SimulatedNetwork(job, loss, seed=cfg.seed + 101)

    def average(self, grads: list[torch.Tensor], late: np.ndarray, step: int) -> list[torch.Tensor]:
        results = thc_allreduce(self.workers, self.net.step(late), grads, tensor=0, step=step)
        return [r.average for r in results]


class _CodecExchange:
    """A baseline codec from worker_lib.codecs, aggregated in process (its PS does the work)."""

    def __init__(self, cfg: SimConfig) -> None:
        from worker_lib.codecs import RoundContext, make_codec

        self.codec = make_codec(cfg.compression, seed=cfg.seed)
        self.context = RoundContext
        self.workers = cfg.workers

    def average(self, grads: list[torch.Tensor], late: np.ndarray, step: int) -> list[torch.Tensor]:
        ctx = self.context(length=grads[0].numel(), workers=self.workers, job=1, step=step)
        avg, _, _ = self.codec.average(grads, ctx)
        return [avg.clone() for _ in grads]


def run(cfg: SimConfig, progress: Callable[[int], None] | None = None,
        data: Dataset | None = None) -> RunResult:
    """Train for cfg.steps update steps; evaluate worker 0 every cfg.eval_every steps."""
    data = data or load_dataset(cfg.dataset, seed=cfg.seed)
    model = make_model(data.image_shape, data.classes, seed=cfg.seed)
    learner = _Learner(model, data)
    theta0 = parameters_to_vector(model.parameters()).detach().clone()
    thetas = [theta0.clone() for _ in range(cfg.workers)]
    moms = [torch.zeros_like(theta0) for _ in range(cfg.workers)]
    rng = np.random.default_rng(cfg.seed)
    shards = shard_indices(len(data.train_y), cfg.workers, cfg.seed)
    batches = [_Batches(s, cfg.batch, np.random.default_rng([cfg.seed, w])) for w, s in enumerate(shards)]
    steps_per_epoch = max(1, math.ceil(len(data.train_y) / (cfg.workers * cfg.batch)))
    if cfg.compression == "thc":
        exchange: _THCExchange | _CodecExchange | None = _THCExchange(cfg, theta0.numel())
    elif cfg.compression == "none":
        exchange = None
    else:
        exchange = _CodecExchange(cfg)
    result = RunResult(cfg)
    paper_loss = cfg.loss_model == "paper"
    for step in range(cfg.steps):
        grads = [learner.gradient(thetas[w], batches[w].next()) for w in range(cfg.workers)]
        late = np.zeros(cfg.workers, bool)
        if cfg.stragglers:
            late[rng.choice(cfg.workers, cfg.stragglers, replace=False)] = True
        if paper_loss and cfg.drop_up:
            for g in grads:
                _zero_blocks(g, cfg.elems, cfg.drop_up, rng)
        if exchange is None:
            mean = torch.stack([g for g, lt in zip(grads, late, strict=True) if not lt]).mean(0)
            averages = [mean.clone() for _ in grads]
        else:
            averages = exchange.average(grads, late, step)
        if paper_loss and cfg.drop_down:
            for a in averages:
                _zero_blocks(a, cfg.elems, cfg.drop_down, rng)
        for w in range(cfg.workers):
            moms[w].mul_(cfg.momentum).add_(averages[w])
            thetas[w].sub_(cfg.lr * moms[w])
        epoch_end = (step + 1) % steps_per_epoch == 0
        if cfg.sync_every_epoch and epoch_end:
            mean_theta, mean_mom = torch.stack(thetas).mean(0), torch.stack(moms).mean(0)
            for w in range(cfg.workers):
                thetas[w].copy_(mean_theta)
                moms[w].copy_(mean_mom)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            acc, loss = learner.evaluate(thetas[0])
            spread = max(float((t - thetas[0]).norm()) for t in thetas) / max(float(thetas[0].norm()), 1e-12)
            result.records.append({"step": step + 1, "epoch": (step + 1) / steps_per_epoch, "accuracy": acc,
                                   "test_loss": loss, "divergence": spread})
        if progress:
            progress(1)
    result.network = exchange.net.stats if isinstance(exchange, _THCExchange) else None
    result.final_params = [t.clone() for t in thetas]
    return result


def describe(cfg: SimConfig) -> dict:
    """The configuration as a flat dict (for CSV rows)."""
    return asdict(cfg)
