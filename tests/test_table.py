"""The lookup-table solver returns the exact optimum of the paper's problem (Section 5.3, App. B)."""

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

from worker_lib.cli import table_cli
from worker_lib.thc.table import (
    LookupTable,
    _segment_cost,
    grid_points,
    solve_table,
    table_objective,
    truncation_threshold,
    uniform_table,
)


def objective_by_quadrature(values, g, p):
    """The paper's integral, computed numerically and independently of the solver's closed form."""
    t = norm.ppf(1 - p / 2)
    a = [-t + 2 * t * v / g for v in values]
    total = 0.0
    for lo, hi in itertools.pairwise(a):
        val, _ = integrate.quad(lambda x, lo=lo, hi=hi: (x - lo) * (hi - x) * norm.pdf(x), lo, hi,
                                epsabs=1e-14, epsrel=1e-12)
        total += val
    return total


def brute_force(bits, g, p):
    inner = (1 << bits) - 2
    best = min((objective_by_quadrature((0, *c, g), g, p), c)
               for c in itertools.combinations(range(1, g), inner))
    return best[0]


@pytest.mark.parametrize("bits,g,p", [(1, 1, 0.5), (1, 9, 0.01), (2, 3, 0.2), (2, 7, 1 / 32), (2, 12, 1 / 32),
                                      (2, 9, 0.9), (3, 7, 1 / 32), (3, 10, 1 / 64), (3, 11, 1 / 512)])
def test_optimal_against_brute_force(bits, g, p):
    table = solve_table(bits, g, p)
    best = brute_force(bits, g, p)
    assert math.isclose(objective_by_quadrature(table.values, g, p), best, rel_tol=1e-9, abs_tol=1e-14)
    assert math.isclose(table.objective, best, rel_tol=1e-8)


def full_matrix_dp(bits, g, p):
    """The textbook dynamic programme over the whole (g+1) x (g+1) cost matrix at once (the solver
    works on blocks of a lower triangle for speed): ties to the smaller start, like the solver. Cost
    sums are the same floats, so near-ties must break the same way."""
    a = grid_points(g, truncation_threshold(p))
    cost = _segment_cost(a[:, None], a[None, :])  # the same segment costs (checked by quadrature below)
    cost[np.tril_indices(g + 1)] = np.inf
    best = np.full(g + 1, np.inf)
    best[0] = 0.0
    parents = []
    for _ in range((1 << bits) - 1):
        total = best[:, None] + cost
        parents.append(np.argmin(total, axis=0))
        best = total.min(axis=0)
    values = [g]
    for parent in reversed(parents):
        values.append(int(parent[values[-1]]))
    return tuple(reversed(values)), best[g]


@pytest.mark.parametrize("bits,g,p", [(8, 255, 1 / 32), (8, 320, 1 / 64), (6, 129, 1 / 8), (7, 200, 1 / 1000),
                                      (4, 64, 1 / 32), (4, 65, 0.5)])
def test_blocked_solver_equals_the_full_matrix_programme(bits, g, p):
    """Sizes around the solver's 64-row blocks: the same table, the same objective (to rounding)."""
    values, objective = full_matrix_dp(bits, g, p)
    table = solve_table(bits, g, p)
    assert table.values == values
    assert table.objective == objective


@pytest.mark.parametrize("bits,g", [(1, 1), (2, 36), (3, 36), (4, 15), (4, 30), (4, 51), (5, 100), (8, 255),
                                    (8, 400)])
def test_table_invariants(bits, g):
    table = solve_table(bits, g, 1 / 32)
    v = table.values
    assert len(v) == 1 << bits and v[0] == 0 and v[-1] == g
    assert all(b > a for a, b in itertools.pairwise(v))
    assert math.isclose(table_objective(v, g, 1 / 32), table.objective, rel_tol=1e-12)


def test_closed_form_matches_quadrature():
    for values, g, p in [((0, 3, 5, 7), 7, 1 / 32), ((0, 1, 2, 9, 30), 30, 0.001), ((0, 51), 51, 0.3)]:
        assert math.isclose(table_objective(values, g, p), objective_by_quadrature(values, g, p), rel_tol=1e-9)


def test_more_granularity_never_hurts_when_it_contains_the_old_grid():
    # g = 2k contains every grid point of g = k, so its optimum can only be at least as good
    for bits, g in [(2, 9), (3, 12), (4, 20)]:
        assert solve_table(bits, 2 * g, 0.05).objective <= solve_table(bits, g, 0.05).objective + 1e-15


def test_minimal_granularity_is_the_identity():
    assert solve_table(3, 7, 0.1).values == tuple(range(8))
    assert uniform_table(3).values == tuple(range(8))


@pytest.mark.parametrize("bits,g,p,match", [(4, 14, 0.1, "granularity must be >="), (0, 5, 0.1, "bits"),
                                            (9, 600, 0.1, "bits"), (2, 5, 0.0, "p must lie"),
                                            (2, 5, 1.0, "p must lie"), (2, 5, -0.5, "p must lie"),
                                            (2, 10**6, 0.1, "not supported"),
                                            (2, 5, 1e-300, r"too small: 1 - p/2 rounds to 1")])
def test_bad_parameters(bits, g, p, match):
    with pytest.raises(ValueError, match=match):
        solve_table(bits, g, p)


def test_truncation_threshold():
    assert math.isclose(truncation_threshold(0.05), 1.959963984540054, rel_tol=1e-12)


def test_lookup_table_validation_and_id():
    with pytest.raises(ValueError):
        LookupTable(bits=2, granularity=5, p=0.1, values=(0, 3, 2, 5), objective=None)
    a, b = solve_table(4, 30, 1 / 32), solve_table(4, 31, 1 / 32)
    assert a.table_id() != b.table_id() and 0 <= a.table_id() < 1 << 16


def test_cli_json_and_errors(capsys):
    assert table_cli.main(["--bits", "3", "--granularity", "11", "--p", "1/512", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert math.isclose(data["objective"], brute_force(3, 11, 1 / 512), rel_tol=1e-8)
    assert data["table"][0] == 0 and data["table"][-1] == 11
    assert table_cli.main(["--bits", "4", "--granularity", "3", "--p", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "granularity must be" in err and "Traceback" not in err
    # b = 4 and p = 1/32 by default (the jobs' and the paper's), so the auto form needs only g and n
    assert table_cli.main(["--granularity", "auto", "--workers", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["bits"], data["granularity"], data["table"]) == (4, 17, [0, 2, *range(3, 16), 17])


def test_cli_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "worker_lib.cli.table_cli", "--bits", "2", "--granularity", "3",
                          "--p", "0.5"], capture_output=True, text=True, check=True)
    assert "[0, 1, 2, 3]" in out.stdout
