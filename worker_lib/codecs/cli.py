"""The ``codecs`` subcommand of ``thc-bench`` (registered by worker_lib/cli/bench_cli.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from worker_lib.cli.args import MAX_BENCH_DIM, MAX_SEED, check_bench_size, int_in
from worker_lib.codecs import CODEC_NAMES
from worker_lib.codecs.compare import INPUTS, PAPER_NOTE, CompareSetting, compare, format_table, ordering


def _names(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in known]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(known)} (comma-separated), "
                                             f"got {text!r}")
        return items
    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1 or max(values) > 1024:
        raise argparse.ArgumentTypeError(f"need integers in 1..1024, got {text!r}")
    return values


def add_codecs_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``thc-bench codecs``."""
    p = sub.add_parser(
        "codecs", help="compare THC with TernGrad, TopK, 3LC, natural compression, dynamic quantization",
        description="Run one aggregation round of every codec on the same inputs for each worker count "
                    "and print bits per coordinate (up, down), NMSE of the averaged estimate, "
                    "encode/decode throughput and the aggregator's CPU time per round. " + PAPER_NOTE + ".")
    p.add_argument("--codecs", type=_names(CODEC_NAMES), default=CODEC_NAMES,
                   help=f"comma-separated codecs (default all: {','.join(CODEC_NAMES)})")
    p.add_argument("--inputs", type=_names(INPUTS), default=INPUTS,
                   help=f"comma-separated inputs (default all: {','.join(INPUTS)})")
    p.add_argument("--workers", type=_ints, default=(2, 4, 8), help="worker counts, default 2,4,8")
    p.add_argument("--dim", type=int_in(1, MAX_BENCH_DIM), default=1 << 20,
                   help=f"length of the synthetic vectors, 1..{MAX_BENCH_DIM} (2^26), default 2^20")
    p.add_argument("--trials", type=int_in(1, 100_000), default=1, help="rounds averaged per row, default 1")
    p.add_argument("--repeats", type=int_in(1, 1000), default=3,
                   help="timed repetitions of each operation, least CPU time counted (default 3)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="seed of inputs and codecs, default 0")
    p.add_argument("--independent", action="store_true",
                   help="one synthetic vector per worker instead of one copied to all")
    p.add_argument("--json", action="store_true", help="one JSON object per line and row")
    p.set_defaults(func=run_codecs)


def run_codecs(args: argparse.Namespace) -> int:
    """Run the comparison and print it."""
    check_bench_size(max(args.workers), args.dim)
    setting = CompareSetting(codecs=args.codecs, inputs=args.inputs, workers=args.workers, dim=args.dim,
                             trials=args.trials, seed=args.seed, independent=args.independent,
                             repeats=args.repeats)
    rows = compare(setting)
    if args.json:
        for r in rows:
            print(json.dumps(r.as_dict()))
        return 0
    print(format_table(rows))
    print()
    print(PAPER_NOTE)
    for line in ordering(rows, "terngrad-noclip") + ordering(rows, "terngrad"):
        print(line)
    return 0
