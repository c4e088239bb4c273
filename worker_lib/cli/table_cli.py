"""`thc-table`: solve for the optimal THC lookup table T_{b,g,p} and print it with its objective.

``--granularity auto`` (with ``--workers``) chooses g, and with ``--bits auto`` b too, so that the sums of
that many workers fit ``--result-bits`` (worker_lib.thc.widths), and says what the choice costs."""

from __future__ import annotations

import argparse
import json
import sys

from worker_lib.cli.args import fraction, int_in, int_or_auto
from worker_lib.thc.table import solve_table
from worker_lib.thc.widths import WidthError, choose_widths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thc-table",
        description="Compute the exact optimal lookup table of non-uniform THC (THC paper Section 5.3, "
                    "Appendix B): 2^b increasing integers from 0 to g minimising the variance of unbiased "
                    "stochastic rounding of a standard normal truncated to [-t_p, t_p], t_p = "
                    "Phi^-1(1 - p/2). With --granularity auto, g (and with --bits auto, b) is chosen so that "
                    "the sums of --workers workers fit --result-bits bits.")
    parser.add_argument("--bits", type=int_or_auto(1, 8), default=4,
                        help="bits per index b, 1..8 (default 4), or auto (with --granularity auto: the largest "
                             "up to 4 that the sums allow)")
    parser.add_argument("--granularity", type=int_or_auto(1, 1 << 16), required=True,
                        help="granularity g >= 2^b - 1, or auto (needs --workers): the g the sums allow whose "
                             "table rounds best")
    parser.add_argument("--p", type=fraction, default=1 / 32,
                        help="truncation fraction p in (0, 1), e.g. 0.03125 or 1/32 (the default)")
    parser.add_argument("--workers", type=int_in(1, 1 << 16), help="workers whose sums must fit (for auto)")
    parser.add_argument("--result-bits", type=int, choices=(8, 16, 32),
                        help="width of the sums (for auto; default 8, the switch programs')")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"table": [...], "objective": x} (with auto: also bits, '
                             'granularity, result_bits and cost)')
    return parser


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    choice = None
    if args.granularity is None:
        if args.workers is None:
            ap.error("--granularity auto needs --workers (the sums of that many workers must fit)")
        try:
            choice = choose_widths(args.workers, args.result_bits, args.bits, args.p)
        except WidthError as exc:
            print(f"thc-table: error: {exc}", file=sys.stderr)
            return 2
        args.bits, args.granularity = choice.bits, choice.granularity
    elif args.bits is None:
        ap.error("--bits auto chooses b together with g: give --granularity auto")
    try:
        table = solve_table(args.bits, args.granularity, args.p)
    except ValueError as exc:
        print(f"thc-table: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"table": list(table.values), "objective": table.objective}
        if choice is not None:
            out.update(bits=choice.bits, granularity=choice.granularity, result_bits=choice.result_bits,
                       cost=choice.cost)
        print(json.dumps(out))
    else:
        if choice is not None:
            print(choice.describe(args.workers))
        print(f"T_{{b={args.bits}, g={args.granularity}, p={args.p:.6g}}} = {list(table.values)}")
        print(f"objective = {table.objective:.12g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
