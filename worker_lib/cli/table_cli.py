"""`thc-table`: solve for the optimal THC lookup table T_{b,g,p} and print it with its objective."""

from __future__ import annotations

import argparse
import json
import sys

from worker_lib.cli.args import fraction
from worker_lib.thc.table import solve_table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thc-table",
        description="Compute the exact optimal lookup table of non-uniform THC (THC paper Section 5.3, "
                    "Appendix B): 2^b increasing integers from 0 to g minimising the variance of unbiased "
                    "stochastic rounding of a standard normal truncated to [-t_p, t_p], t_p = "
                    "Phi^-1(1 - p/2).")
    parser.add_argument("--bits", type=int, required=True, help="bits per index b, 1..8")
    parser.add_argument("--granularity", type=int, required=True, help="granularity g >= 2^b - 1")
    parser.add_argument("--p", type=fraction, required=True,
                        help="truncation fraction p in (0, 1), e.g. 0.03125 or 1/32")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"table": [...], "objective": x}')
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        table = solve_table(args.bits, args.granularity, args.p)
    except ValueError as exc:
        print(f"thc-table: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"table": list(table.values), "objective": table.objective}))
    else:
        print(f"T_{{b={args.bits}, g={args.granularity}, p={args.p:.6g}}} = {list(table.values)}")
        print(f"objective = {table.objective:.12g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
