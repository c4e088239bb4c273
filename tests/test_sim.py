"""The simulation machinery: model copies, loss, synchronization, partial aggregation, reproducibility."""

import csv

import numpy as np
import pytest
import torch

from sim.cli import main as sim_main
from sim.data import load_dataset
from sim.experiments import Options, nmse_experiment
from sim.models import make_model
from sim.training import SimConfig, run

DATA = load_dataset("digits", seed=0)


def small(**kw):
    base = dict(workers=4, batch=8, steps=12, eval_every=1, elems=256, slots=16, seed=5)
    base.update(kw)
    return SimConfig(**base)


def test_copies_identical_without_loss():
    res = run(small(), data=DATA)
    assert len(res.records) == 12
    assert all(r["divergence"] == 0.0 for r in res.records)
    assert all(torch.equal(p, res.final_params[0]) for p in res.final_params)
    assert res.network.lost_chunks == 0 and set(res.network.contributors) == {4}


def test_downstream_loss_makes_copies_differ_and_sync_restores_them():
    lossy = run(small(drop_down=0.2), data=DATA)
    assert lossy.network.dropped_down > 0
    assert lossy.records[-1]["divergence"] > 0
    synced = run(small(drop_down=0.2, sync_every_epoch=True, steps=60, eval_every=1), data=DATA)
    per_epoch = round(1 / synced.records[0]["epoch"])  # steps per epoch
    at_sync = [r for r in synced.records if r["step"] % per_epoch == 0]
    between = [r for r in synced.records if r["step"] % per_epoch != 0]
    assert at_sync and all(r["divergence"] == 0.0 for r in at_sync)
    assert any(r["divergence"] > 0 for r in between)


def test_upstream_loss_under_full_threshold_costs_every_worker_the_chunk():
    res = run(small(drop_up=0.1), data=DATA)
    assert res.network.dropped_up > 0
    # a chunk that never completes is zero for every worker alike, so the copies stay identical
    assert res.network.lost_chunks > 0 and res.network.lost_chunks % 4 == 0
    assert all(r["divergence"] == 0.0 for r in res.records)


def test_partial_aggregation_uses_exactly_nine_of_ten():
    res = run(small(workers=10, stragglers=1, steps=4), data=DATA)
    assert set(res.network.contributors) == {9}
    assert res.network.lost_chunks == 0  # the late worker gets the retained result
    assert all(r["divergence"] == 0.0 for r in res.records)


def test_bit_for_bit_reproducible():
    cfg = small(drop_down=0.1, drop_up=0.05, steps=8)
    a, b = run(cfg, data=DATA), run(cfg, data=DATA)
    assert a.records == b.records
    assert all(torch.equal(x, y) for x, y in zip(a.final_params, b.final_params, strict=True))
    c = run(SimConfig(**{**cfg.__dict__, "seed": 6}), data=DATA)
    assert not torch.equal(a.final_params[0], c.final_params[0])


def test_paper_loss_model_and_codecs_run():
    res = run(small(loss_model="paper", drop_down=0.3, compression="none"), data=DATA)
    assert res.records[-1]["divergence"] > 0
    for name in ("terngrad", "topk10"):
        r = run(small(compression=name, steps=3), data=DATA)
        assert np.isfinite(r.records[-1]["test_loss"])


def test_bad_configuration():
    with pytest.raises(ValueError, match="stragglers"):
        SimConfig(workers=4, stragglers=4)
    with pytest.raises(ValueError, match="compression='thc'"):
        SimConfig(compression="none", drop_up=0.1)


def test_cnn_hidden_layer_sets_the_parameter_count():
    """A hidden fully connected layer of H units between the CNN's features (16 x 7 x 7 on 28x28 images)
    and the classifier; without one, the CNN as before. Counts worked out by hand per layer."""
    conv = (1 * 8 * 25 + 8) + (8 * 16 * 25 + 16)
    n = sum(p.numel() for p in make_model((1, 28, 28), 10, seed=0, hidden=32).parameters())
    assert n == conv + (784 * 32 + 32) + (32 * 10 + 10)
    assert sum(p.numel() for p in make_model((1, 28, 28), 10, seed=0).parameters()) == conv + 784 * 10 + 10
    assert sum(p.numel() for p in make_model((1, 8, 8), 10, seed=0, hidden=16).parameters()) == 64 * 16 + 16 + 170
    with pytest.raises(ValueError, match="hidden must be a positive width"):
        make_model((1, 28, 28), 10, seed=0, hidden=0)


def test_nmse_experiment_uses_the_bench_code():
    rows = nmse_experiment(Options(quick=True), lambda _: None)
    assert {r["panel"] for r in rows} == {"granularity", "workers"}
    four = [r for r in rows if r["panel"] == "workers" and r["bits"] == 4]
    assert four[0]["nmse"] > four[-1]["nmse"]  # more workers, less error


def test_cli_quick_writes_csv_and_png(tmp_path):
    rc = sim_main(["stragglers", "--quick", "--steps", "5", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    with (tmp_path / "stragglers_summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5 and {"final_accuracy", "steps_to_target"} <= set(rows[0])
    assert (tmp_path / "stragglers.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, says", [
    (["loss", "--steps", "-3"], "--steps: must be in 1..1000000, got -3"),
    (["loss", "--lr", "-1"], "--lr: must be in 1e-09..100, got -1"),
    (["loss", "--seed", "-1"], "--seed: must be in 0..4294967295, got -1"),
    (["loss", "--out", "/proc/no/such"], "cannot create the output folder /proc/no/such"),
    (["nmse", "--loss-rates", "0.1"], "--loss-rates: not used by the nmse experiment"),
    (["stragglers", "--paper-loss-model"], "--paper-loss-model: not used by the stragglers experiment"),
    (["nmse", "--steps", "5", "--dataset", "mnist"], "--steps, --dataset: not used by the nmse experiment"),
])
def test_cli_bad_input_is_one_line(argv, says, capsys):
    try:
        rc = sim_main([*argv, "--quick", "--no-progress"])
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln and not ln.startswith(("usage:", " "))]
    assert rc == 2 and len(lines) == 1 and says in lines[0], err
