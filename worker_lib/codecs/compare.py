"""The codec comparison behind ``thc-bench codecs``: every codec on the same inputs, n workers.

Inputs (``INPUTS``):

* ``lognormal``: a LogNormal(0, 1) vector of ``dim`` coordinates, the THC paper's NMSE input;
* ``normal``: a N(0, 1) vector;
* ``model``: real gradients: a small CNN (two convolutions, two linear layers, about 147k
  parameters) is trained for a few SGD steps on a fixed synthetic task, then every worker computes
  the gradient of its own minibatch; each parameter tensor is one codec round (per tensor, as
  TernGrad's layer-wise scaling and the other papers intend).

For the synthetic inputs every worker holds a copy of the same vector (the THC paper's Appendix C.1
convention, with independent quantization randomness per worker); ``independent=True`` draws one
vector per worker instead. The reference is always the exact average of the workers' inputs.

Per (input, codec, n) one row: bits per coordinate up (mean per worker) and down (the multicast
result), both including the preliminary exchange; NMSE of the estimate every worker ends with;
``nmse_up``, the NMSE of the aggregator's exact average of the decoded uplink messages (equal to
``nmse`` for homomorphic codecs, whose downlink is lossless); worker encode and decode throughput;
and the aggregator's time per round with a description of its work. Times are CPU time of the
process (all threads), the least of ``repeats`` runs: they measure work and are far less disturbed
by other processes than wall time. One round, no error feedback (the first round of any run),
pooled over ``trials`` independent rounds.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import TypeVar

import torch

from worker_lib.codecs import CODEC_NAMES, make_codec
from worker_lib.codecs.base import Codec, CodecKind, RoundContext

log = logging.getLogger(__name__)
T = TypeVar("T")

INPUTS: tuple[str, ...] = ("lognormal", "normal", "model")
DEFAULT_CODECS: tuple[str, ...] = CODEC_NAMES
PAPER_NOTE = "THC paper (Section 2, 1M coordinates, 2 workers): TernGrad NMSE 15.7, TopK 10% 0.36"


@dataclass(frozen=True)
class CompareSetting:
    """What to compare."""

    codecs: tuple[str, ...] = DEFAULT_CODECS
    inputs: tuple[str, ...] = INPUTS
    workers: tuple[int, ...] = (2, 4, 8)
    dim: int = 1 << 20
    trials: int = 1
    seed: int = 0
    independent: bool = False
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in self.codecs:
            if name not in CODEC_NAMES:
                raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
        for name in self.inputs:
            if name not in INPUTS:
                raise ValueError(f"unknown input {name!r}; known: {', '.join(INPUTS)}")
        if not self.codecs or not self.inputs or not self.workers:
            raise ValueError("need at least one codec, input and worker count")
        if any(n < 1 for n in self.workers):
            raise ValueError(f"worker counts must be positive, got {self.workers}")
        if self.dim < 1 or self.trials < 1 or self.repeats < 1:
            raise ValueError("dim, trials and repeats must be positive")


@dataclass
class Row:
    """One line of the comparison table (also the --json object)."""

    input: str
    codec: str
    kind: str
    workers: int
    dim: int
    nmse: float
    nmse_up: float
    bits_up: float
    bits_down: float
    encode_mcoords_per_cpu_s: float
    decode_mcoords_per_cpu_s: float
    agg_cpu_ms: float
    agg_work: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# -- inputs ------------------------------------------------------------------------------------
def _small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def model_gradients(workers: int, seed: int, batch: int = 32, warmup: int = 5) -> list[list[torch.Tensor]]:
    """Per worker, the list of per-parameter gradients of one training step of a small CNN.

    The task is synthetic (28x28 noise images labelled by a fixed random teacher), so no dataset is
    needed; the model takes ``warmup`` SGD steps first so that the gradients are not those of the
    initialization. Each worker uses its own minibatch of the same task.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _small_cnn()
    teacher = torch.randn(28 * 28, 10, generator=gen)

    def batch_of(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, 1, 28, 28, generator=gen)
        return images, (images.reshape(size, -1) @ teacher).argmax(dim=1)

    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(warmup):
        images, labels = batch_of(batch * workers)
        opt.zero_grad()
        loss_fn(model(images), labels).backward()
        opt.step()
    grads = []
    for _ in range(workers):
        images, labels = batch_of(batch)
        model.zero_grad()
        loss_fn(model(images), labels).backward()
        grads.append([p.grad.detach().reshape(-1).clone() for p in model.parameters()])
    return grads


def make_inputs(kind: str, workers: int, setting: CompareSetting, trial: int) -> list[list[torch.Tensor]]:
    """inputs[worker][tensor] for one trial."""
    seed = setting.seed * 1_000_003 + trial
    if kind == "model":
        return model_gradients(workers, seed)
    gen = torch.Generator().manual_seed(seed)

    def draw() -> torch.Tensor:
        x = torch.empty(setting.dim)
        return x.log_normal_(0.0, 1.0, generator=gen) if kind == "lognormal" else x.normal_(generator=gen)

    if setting.independent:
        return [[draw()] for _ in range(workers)]
    x = draw()
    return [[x] for _ in range(workers)]


# -- one round ---------------------------------------------------------------------------------
@dataclass
class _Totals:
    err: float = 0.0
    err_up: float = 0.0
    ref: float = 0.0
    bits_up: float = 0.0
    bits_down: float = 0.0
    coords: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    agg_s: float = 0.0


def _timed(fn: Callable[[], T], repeats: int) -> tuple[T, float]:
    """(result of the last call, the least CPU time of ``repeats`` calls, in seconds).

    CPU time of this process (all its threads), not wall time: it measures the work done and is
    much less disturbed by other processes on a shared machine.
    """
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t0)
    return result, best


def run_round(workers_codecs: Sequence[Codec], agg_codec: Codec, inputs: Sequence[Sequence[torch.Tensor]],
              totals: _Totals, step: int, repeats: int = 1) -> None:
    """One aggregation round over every tensor of ``inputs`` (per worker), added into totals.

    Every timed operation runs ``repeats`` times and counts its least CPU time, which filters out
    interference from other processes; the messages of the last run are the ones used.
    """
    n = len(workers_codecs)
    codec = workers_codecs[0]
    for t in range(len(inputs[0])):
        xs = [inputs[i][t] for i in range(n)]
        d = xs[0].numel()
        ctx = RoundContext(length=d, workers=n, tensor=t, step=step)
        if codec.needs_prelim:
            published = [c.prelim(x) for c, x in zip(workers_codecs, xs, strict=True)]
            ctx = replace(ctx, shared=codec.combine_prelim(published))
        enc_times, ups = [], []
        for c, x in zip(workers_codecs, xs, strict=True):
            msg, seconds = _timed(partial(c.encode, x, ctx), repeats)
            ups.append(msg)
            enc_times.append(seconds)
        down, seconds = _timed(partial(agg_codec.aggregate, ups, ctx), repeats)
        totals.agg_s += seconds
        est, seconds = _timed(partial(codec.decode_result, down, ctx), repeats)
        totals.decode_s += seconds
        totals.encode_s += statistics.median(enc_times)
        ref = torch.stack([x.to(torch.float64) for x in xs]).mean(dim=0)
        totals.err += float(((est.cpu().to(torch.float64) - ref) ** 2).sum())
        if codec.kind is CodecKind.HOMOMORPHIC:
            up_est = est.cpu().to(torch.float64)
        else:
            up_est = torch.stack([codec.decode_one(m, ctx).cpu().to(torch.float64) for m in ups]).mean(dim=0)
        totals.err_up += float(((up_est - ref) ** 2).sum())
        totals.ref += float((ref ** 2).sum())
        totals.bits_up += sum(m.bits for m in ups) / n + codec.prelim_bits
        totals.bits_down += down.bits + codec.prelim_bits
        totals.coords += d


def agg_work(codec: Codec, n: int) -> str:
    """What the aggregator does per coordinate and round."""
    if codec.kind is CodecKind.HOMOMORPHIC:
        return f"{n} int lookups+adds"
    return f"{n} decodes+float sum+encode"


def compare(setting: CompareSetting) -> list[Row]:
    """All rows of the comparison."""
    rows = []
    for kind in setting.inputs:
        for n in setting.workers:
            data = [make_inputs(kind, n, setting, trial) for trial in range(setting.trials)]
            for name in setting.codecs:
                base = setting.seed * 7919 + 1
                workers_codecs = [make_codec(name, seed=base + i) for i in range(n)]
                agg_codec = make_codec(name, seed=base + n)
                warm = [[x[:4096] for x in per_worker] for per_worker in data[0]]
                run_round(workers_codecs, agg_codec, warm, _Totals(), step=setting.trials)  # untimed warm-up
                totals = _Totals()
                for trial, inputs in enumerate(data):
                    run_round(workers_codecs, agg_codec, inputs, totals, step=trial, repeats=setting.repeats)
                rounds = setting.trials
                coords = totals.coords / rounds
                codec = workers_codecs[0]
                rows.append(Row(
                    input=kind, codec=name, kind=codec.kind.value, workers=n, dim=int(coords),
                    nmse=totals.err / totals.ref, nmse_up=totals.err_up / totals.ref,
                    bits_up=totals.bits_up / totals.coords, bits_down=totals.bits_down / totals.coords,
                    encode_mcoords_per_cpu_s=totals.coords / max(totals.encode_s, 1e-12) / 1e6,
                    decode_mcoords_per_cpu_s=totals.coords / max(totals.decode_s, 1e-12) / 1e6,
                    agg_cpu_ms=1e3 * totals.agg_s / rounds, agg_work=agg_work(codec, n)))
                log.info("%s n=%d %s: nmse %.4g", kind, n, name, rows[-1].nmse)
    return rows


def ordering(rows: Sequence[Row], terngrad: str = "terngrad-noclip") -> list[str]:
    """Whether NMSE(thc) < NMSE(topk10) < NMSE(terngrad) holds, per input and worker count."""
    lines = []
    index = {(r.input, r.workers, r.codec): r for r in rows}
    for kind, n in dict.fromkeys((r.input, r.workers) for r in rows):
        try:
            a, b, c = (index[(kind, n, name)].nmse for name in ("thc", "topk10", terngrad))
        except KeyError:
            continue
        verdict = "holds" if a < b < c else "does NOT hold"
        lines.append(f"{kind} n={n}: thc {a:.4g} < topk10 {b:.4g} < {terngrad} {c:.4g}: {verdict}")
    return lines


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table (Markdown-compatible)."""
    head = ("| input | codec | kind | n | bits/coord up | bits/coord down | NMSE | NMSE uplink only "
            "| encode Mcoord/CPU-s | decode Mcoord/CPU-s | aggregator CPU ms/round | aggregator work per coordinate |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        kind = "hom" if r.kind == CodecKind.HOMOMORPHIC.value else "DAR"
        out.append(f"| {r.input} | {r.codec} | {kind} | {r.workers} | {r.bits_up:.3f} | {r.bits_down:.3f} "
                   f"| {r.nmse:.4g} | {r.nmse_up:.4g} | {r.encode_mcoords_per_cpu_s:.1f} "
                   f"| {r.decode_mcoords_per_cpu_s:.1f} | {r.agg_cpu_ms:.1f} | {r.agg_work} |")
    return "\n".join(out)
