"""The THC paper's Section 8.3 study (Figures 8-11, Appendix C) at laptop scale.

Each experiment is a list of labelled runs (``sim.training.SimConfig``) plus a summary; the CLI
(`thc-sim`) writes their records to CSV, plots them, and prints the summary as a markdown table.
``quick`` selects a reduced version of the same experiment (fewer steps, smaller vectors) for tests
and a first look.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from sim.data import Dataset, load_dataset
from sim.training import RunResult, SimConfig, run
from worker_lib.thc.nmse import NMSESetting, nmse_trials

EXPERIMENTS = ("scalability", "loss", "stragglers", "nmse", "codecs", "tiers")


@dataclass(frozen=True)
class Options:
    """Knobs shared by every experiment."""

    quick: bool = False
    dataset: str = "digits"
    seed: int = 0
    steps: int | None = None  # overrides the experiment's default
    loss_model: str = "protocol"
    lr: float | None = None  # default: 0.05 for the digits MLP, 0.02 for the MNIST CNN (0.05 diverges there)
    loss_rates: tuple[float, ...] = (0.001, 0.01)  # packet drop probabilities of the loss experiment

    def base(self, **kw: object) -> SimConfig:
        steps = self.steps or (25 if self.quick else 200)
        lr = self.lr or (0.05 if self.dataset == "digits" else 0.02)
        cfg = SimConfig(dataset=self.dataset, seed=self.seed, steps=steps, eval_every=5, lr=lr,
                        loss_model=self.loss_model)  # type: ignore[arg-type]
        return replace(cfg, **kw)  # type: ignore[arg-type]


@dataclass
class Labelled:
    """One run of an experiment: a legend label, a group (plot panel), and its result."""

    label: str
    group: str
    result: RunResult


def _runs(specs: list[tuple[str, str, SimConfig]], data: Dataset, tick: Callable[[int], None]) -> list[Labelled]:
    return [Labelled(label, group, run(cfg, tick, data)) for label, group, cfg in specs]


def scalability_specs(opt: Options) -> list[tuple[str, str, SimConfig]]:
    """4, 10, 30 workers with the paper's 4/4/3 bits and granularity 38/16/8 (g*n fits 8 bits), p = 1/64."""
    specs = []
    for n, bits, g in ((4, 4, 38), (10, 4, 16), (30, 3, 8)):
        group = f"{n} workers"
        specs.append((f"baseline (uncompressed), n={n}", group, opt.base(workers=n, compression="none")))
        specs.append((f"THC b={bits} g={g}, n={n}", group,
                      opt.base(workers=n, compression="thc", bits=bits, granularity=g, p=1 / 64)))
    return specs


def _loss_base(opt: Options) -> SimConfig:
    return opt.base(workers=10, compression="thc", bits=4, granularity=20, p=1 / 512)


def loss_specs(opt: Options) -> list[tuple[str, str, SimConfig]]:
    """Packet loss (0.1% and 1% by default), upstream and downstream separately, with and without model
    synchronization every epoch."""
    thc = _loss_base(opt)
    specs = []
    for direction in ("upstream", "downstream"):
        specs.append(("baseline (uncompressed, no loss)", direction, replace(thc, compression="none")))
        specs.append(("THC, no loss", direction, thc))
        for rate in opt.loss_rates:
            for sync in (False, True):
                drops = {"drop_up": rate} if direction == "upstream" else {"drop_down": rate}
                label = f"THC, {rate:.1%} loss" + (", sync every epoch" if sync else "")
                specs.append((label, direction, replace(thc, sync_every_epoch=sync, **drops)))
    return specs


def straggler_specs(opt: Options) -> list[tuple[str, str, SimConfig]]:
    """1, 2, 3 of 10 workers late every round: aggregation completes at 90/80/70%."""
    thc = _loss_base(opt)
    specs = [("baseline (uncompressed)", "stragglers", replace(thc, compression="none")),
             ("THC, all 10 workers", "stragglers", thc)]
    for k in (1, 2, 3):
        specs.append((f"THC, waits for {10 - k} of 10 ({k} late per round)", "stragglers",
                      replace(thc, stragglers=k)))
    return specs


def codec_specs(opt: Options) -> list[tuple[str, str, SimConfig]]:
    """THC next to TernGrad, TopK 10% and the uncompressed baseline (the paper's Figure 4)."""
    thc = _loss_base(opt)
    return [("baseline (uncompressed)", "codecs", replace(thc, compression="none")),
            ("THC b=4 g=20", "codecs", thc),
            ("TernGrad", "codecs", replace(thc, compression="terngrad")),
            ("TopK 10%", "codecs", replace(thc, compression="topk10"))]


def tier_specs(opt: Options) -> list[tuple[str, str, SimConfig]]:
    """Two tiers against the flat design at scale (1,024 workers over 32 leaves for 60 steps; quick: 256
    over 8 for 25): lossless, with loss on the workers' links (0.01 % each way) and on the leaf-spine
    links (0.1 % each way), and with 1 % of the workers late every step. Each worker's batch is 4 images
    (the digits' 1,437 training images over 1,024 workers leave about one each)."""
    n, leaves = (256, 8) if opt.quick else (1024, 32)
    flat = opt.base(workers=n, batch=4, compression="thc", bits=4, granularity=20, p=1 / 512,
                    steps=opt.steps or (25 if opt.quick else 60))
    tiers = replace(flat, leaves=leaves)
    late = max(1, n // 100)
    scale = f"{n} workers"
    return [("baseline (uncompressed)", scale, replace(flat, compression="none")),
            ("flat THC (one aggregator)", scale, flat),
            (f"two tiers ({leaves} leaves)", scale, tiers),
            ("flat, 0.01% loss on worker links", "loss", replace(flat, drop_up=1e-4, drop_down=1e-4)),
            ("two tiers, 0.01% loss on worker links", "loss", replace(tiers, drop_up=1e-4, drop_down=1e-4)),
            ("two tiers, 0.1% loss on leaf-spine links", "loss",
             replace(tiers, spine_drop_up=1e-3, spine_drop_down=1e-3)),
            (f"flat, {late} late, waits for {n - late}", "stragglers", replace(flat, stragglers=late)),
            (f"two tiers, {late} late, waits for {n - late}", "stragglers", replace(tiers, stragglers=late))]


SPECS = {"scalability": scalability_specs, "loss": loss_specs, "stragglers": straggler_specs,
         "codecs": codec_specs, "tiers": tier_specs}


def training_experiment(name: str, opt: Options, tick: Callable[[int], None]) -> list[Labelled]:
    """Run every configuration of a training experiment (progress reported per step)."""
    data = load_dataset(opt.dataset, seed=opt.seed)
    return _runs(SPECS[name](opt), data, tick)


def total_steps(name: str, opt: Options) -> int:
    if name == "nmse":
        return len(nmse_points(opt))
    return sum(cfg.steps for _, _, cfg in SPECS[name](opt))


def summary_rows(name: str, runs: list[Labelled], target: float | None = None) -> list[dict]:
    """Final accuracy (sliding window of 5 evaluations), gap to the group's baseline, steps to target."""
    rows = []
    baselines = {r.group: r.result.final_accuracy() for r in runs if r.result.config.compression == "none"}
    if target is None:
        target = 0.9 * min(baselines.values()) if baselines else 0.5
    only = next(iter(baselines.values())) if len(baselines) == 1 else None  # for groups without a baseline
    for r in runs:
        acc = r.result.final_accuracy()
        net = r.result.network
        base = baselines.get(r.group, acc if only is None else only)
        rows.append({
            "experiment": name, "group": r.group, "setting": r.label, "final_accuracy": round(acc, 4),
            "gap_to_baseline": round(acc - base, 4),
            "target_accuracy": round(target, 4), "steps_to_target": r.result.steps_to(target),
            "model_divergence": round(r.result.records[-1]["divergence"], 6),
            "lost_chunks": net.lost_chunks if net else 0,
            "mean_contributors": round(float(np.mean(net.contributors)), 3) if net and net.contributors else None,
        })
    return rows


def nmse_points(opt: Options) -> list[tuple[str, int, NMSESetting]]:
    """(panel, bits, setting): NMSE vs granularity (10 workers, p = 1/1024) and vs workers (g = 36/36/38,
    p = 1/32), for 2, 3 and 4 bits (Appendix C.1)."""
    dim, trials = (1 << 12, 1) if opt.quick else (1 << 18, 3)
    points = []
    for bits in (2, 3, 4):
        for g in (15, 20, 25, 30, 36, 43, 51):
            points.append(("granularity", bits, NMSESetting(bits=bits, granularity=g, p=1 / 1024, workers=10,
                                                             dim=dim, trials=trials, seed=opt.seed)))
        for n in (1, 2, 4, 8, 10, 16, 32):
            g = {2: 36, 3: 36, 4: 38}[bits]
            points.append(("workers", bits, NMSESetting(bits=bits, granularity=g, p=1 / 32, workers=n, dim=dim,
                                                         trials=trials, seed=opt.seed)))
    return points


def nmse_experiment(opt: Options, tick: Callable[[int], None]) -> list[dict]:
    """NMSE of one THC round at every point (the same code as `thc-bench nmse`)."""
    rows = []
    for panel, bits, s in nmse_points(opt):
        vals = nmse_trials(s)
        rows.append({"panel": panel, "bits": bits, "granularity": s.granularity, "p": s.p, "workers": s.workers,
                     "dim": s.dim, "trials": s.trials, "nmse": float(vals.mean()), "nmse_std": float(vals.std())})
        tick(1)
    return rows
