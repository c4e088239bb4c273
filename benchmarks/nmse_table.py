"""The README's NMSE table: bits 2, 3, 4 x workers 1, 2, 4, 10 (THC paper, Appendix C.1 setting).

    python benchmarks/nmse_table.py [--dim 1048576] [--trials 10]

Granularity 36/36/38 for 2/3/4 bits and p = 1/32, as in the paper's workers experiment; the numbers
come from worker_lib.thc.nmse, the same code as `thc-bench nmse`.
"""

from __future__ import annotations

import argparse

from worker_lib.cli.args import int_in
from worker_lib.thc.nmse import NMSESetting, nmse_trials

GRANULARITY = {2: 36, 3: 36, 4: 38}
WORKERS = (1, 2, 4, 10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int_in(1, 1 << 28), default=1 << 20,
                        help="coordinates per vector, 1..2^28 (default 2^20)")
    parser.add_argument("--trials", type=int_in(1, 1000), default=10,
                        help="vectors per cell, 1..1000 (mean and standard deviation; default 10)")
    args = parser.parse_args(argv)
    print("| bits (g) | " + " | ".join(f"n = {n}" for n in WORKERS) + " |")
    print("|---|" + "---|" * len(WORKERS))
    for bits, g in GRANULARITY.items():
        cells = []
        for n in WORKERS:
            vals = nmse_trials(NMSESetting(bits=bits, granularity=g, p=1 / 32, workers=n, dim=args.dim,
                                           trials=args.trials))
            cells.append(f"{vals.mean():.4g} ± {vals.std():.1g}")
        print(f"| {bits} ({g}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
