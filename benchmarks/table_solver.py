"""Time of the exact lookup-table solver for a few (b, g, p), cold (no cache), median of repeats.

    python benchmarks/table_solver.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from worker_lib.thc.table import solve_table

CASES = [(2, 36, 1 / 32), (4, 30, 1 / 32), (4, 51, 1 / 32), (4, 255, 1 / 64), (8, 255, 1 / 32), (8, 1000, 1 / 32)]


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="It takes no options.").parse_args(argv)
    print("| b | g | p | solve time (ms) | objective |")
    print("|---|---|---|---|---|")
    for bits, g, p in CASES:
        times = []
        for _ in range(5):
            solve_table.cache_clear()
            t0 = time.perf_counter()
            table = solve_table(bits, g, p)
            times.append(time.perf_counter() - t0)
        print(f"| {bits} | {g} | {p:.4g} | {statistics.median(times) * 1e3:.2f} | {table.objective:.6g} |")


if __name__ == "__main__":
    main()
