"""`thc-bench`: measurements of the THC library (NMSE experiment; codec comparison)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from worker_lib.cli.args import MAX_BENCH_DIM, MAX_SEED, check_bench_size, fraction, int_in
from worker_lib.codecs.cli import add_codecs_parser
from worker_lib.thc.nmse import NMSESetting, nmse_trials


def _add_nmse(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nmse", help="NMSE of one THC round (THC paper, Appendix C.1)",
                       description="Draw a LogNormal(0,1) gradient, copy it to N workers (shared RHT "
                                   "signs, independent quantization), run one THC round without error "
                                   "feedback and print the mean NMSE over the trials.")
    p.add_argument("--bits", type=int, default=4, help="index width b (1..8), default 4")
    p.add_argument("--granularity", type=int, default=38, help="granularity g >= 2^b - 1, default 38")
    p.add_argument("--p", type=fraction, default=1 / 32, help="truncation fraction p, e.g. 1/32 (default)")
    p.add_argument("--workers", type=int_in(1, 1024), default=4, help="number of workers n, 1..1024, default 4")
    p.add_argument("--dim", type=int_in(1, MAX_BENCH_DIM), default=1 << 20,
                   help=f"gradient length d, 1..{MAX_BENCH_DIM} (2^26), default 2^20")
    p.add_argument("--trials", type=int_in(1, 100_000), default=10, help="independent trials to average, default 10")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="seed of data and quantization, default 0")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_run_nmse)


def _run_nmse(args: argparse.Namespace) -> int:
    check_bench_size(args.workers, args.dim)
    setting = NMSESetting(bits=args.bits, granularity=args.granularity, p=args.p, workers=args.workers,
                          dim=args.dim, trials=args.trials, seed=args.seed)
    values = nmse_trials(setting)
    result = {"nmse": float(values.mean()), "std": float(values.std()), "bits": args.bits,
              "granularity": args.granularity, "p": args.p, "workers": args.workers, "dim": args.dim,
              "trials": args.trials}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"NMSE {result['nmse']:.6g} (std {result['std']:.3g}) for b={args.bits} g={args.granularity} "
              f"p={args.p:.6g} n={args.workers} d={args.dim} over {args.trials} trials")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thc-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_nmse(sub)
    add_codecs_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"thc-bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
