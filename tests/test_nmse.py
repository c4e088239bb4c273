"""The NMSE experiment (THC paper, Appendix C.1) and `thc-bench nmse`."""

import json

import numpy as np
import pytest
from scipy.stats import norm

from tests.cli_support import assert_one_line_refusal, call_main
from worker_lib.cli import bench_cli
from worker_lib.thc.nmse import NMSESetting, mean_nmse, nmse_trials
from worker_lib.thc.table import solve_table


def test_nmse_falls_with_bits_and_workers():
    base = dict(p=1 / 32, dim=1 << 14, trials=3, seed=1)
    by_bits = [mean_nmse(NMSESetting(bits=b, granularity=36, workers=4, **base)) for b in (2, 3, 4)]
    assert by_bits[0] > 2 * by_bits[1] and by_bits[1] > 1.5 * by_bits[2] > 0
    by_workers = [mean_nmse(NMSESetting(bits=4, granularity=38, workers=n, **base)) for n in (1, 4)]
    # quantization noise averages out over independent workers (the clamping bias does not)
    assert by_workers[0] > 1.5 * by_workers[1]


def test_nmse_is_reproducible_and_single_worker_matches_direct_error():
    s = NMSESetting(bits=3, granularity=20, workers=1, dim=5000, trials=2, seed=4)
    a, b = nmse_trials(s), nmse_trials(s)
    assert np.array_equal(a, b)
    assert np.all((a > 0) & (a < 1))


def test_cli_json(capsys):
    assert bench_cli.main(["nmse", "--bits", "2", "--granularity", "36", "--workers", "2", "--dim", "4096",
                           "--trials", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = mean_nmse(NMSESetting(bits=2, granularity=36, workers=2, dim=4096, trials=2))
    assert abs(data["nmse"] - expected) < 1e-12
    assert bench_cli.main(["nmse", "--bits", "4", "--granularity", "2"]) == 2
    err = capsys.readouterr().err
    assert "granularity" in err and "Traceback" not in err


@pytest.mark.parametrize("bits,g,workers", [(2, 36, 1), (3, 36, 4), (4, 38, 10), (4, 20, 2)])
def test_nmse_matches_the_table_objective_prediction(bits, g, workers):
    """After the RHT the coordinates are ~N(0, ||x||^2/D): the expected NMSE is the clamping loss
    E[(|Z| - t_p)^2; |Z| > t_p] plus the table's objective (its rounding variance) divided by n."""
    t = norm.ppf(1 - 1 / 64)
    clamping = 2 * ((1 + t * t) * norm.sf(t) - t * norm.pdf(t))
    predicted = clamping + solve_table(bits, g, 1 / 32).objective / workers
    measured = mean_nmse(NMSESetting(bits=bits, granularity=g, p=1 / 32, workers=workers, dim=1 << 16,
                                     trials=2, seed=3))
    assert abs(measured - predicted) < 0.06 * predicted


@pytest.mark.parametrize("argv, says", [
    (["nmse", "--dim", "99999999999999"], "argument --dim: must be in 1..67108864"),
    (["nmse", "--seed", "-1"], "argument --seed: must be in 0..4294967295, got -1"),
    (["nmse", "--workers", "0"], "argument --workers: must be in 1..1024, got 0"),
    (["nmse", "--workers", "1024", "--dim", "1048576"], "--workers 1024 x --dim 1048576 = 1,073,741,824 coordinates"),
    (["codecs", "--dim", "99999999999999"], "argument --dim: must be in 1..67108864"),
    (["codecs", "--seed", "-1"], "argument --seed: must be in 0..4294967295, got -1"),
    (["codecs", "--workers", "2,2000"], "argument --workers: need integers in 1..1024"),
    (["codecs", "--workers", "1000", "--dim", "1048576"], "--workers 1000 x --dim 1048576"),
])
def test_sizes_that_cannot_run_get_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A vector or worker count the machine cannot hold is refused before any allocation (an allocation
    failure's traceback before), and a negative seed names its option (numpy's message did not)."""
    assert_one_line_refusal(*call_main(bench_cli.main, argv, capsys), says)
