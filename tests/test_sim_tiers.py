"""The simulations' two tiers (sim/tiered.py): packets through the leaf and spine state machines, the flat
design beside it, their agreement with the one-tier engine, loss and stragglers at both tiers, and the
link-rate step-time model (expected figures worked out by hand below)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sim.data import load_dataset
from sim.experiments import Options, tier_specs
from sim.network import LinkLoss, SimulatedNetwork
from sim.tiered import WIRE_OVERHEAD, FlatNetwork, TieredNetwork, step_time
from sim.training import SimConfig, run
from worker_lib.allreduce import thc_allreduce
from worker_lib.job import JobConfig
from worker_lib.thc import THCConfig, THCWorker

THC = THCConfig(bits=4, granularity=20, p=1 / 512, error_feedback=True)
TIERED = JobConfig(leaves=(4, 4, 4), workers=12, bits=4, granularity=20, p=1 / 512, elems=64, slots=8)
FLAT = JobConfig(workers=12, bits=4, granularity=20, p=1 / 512, elems=64, slots=8, result_bits=TIERED.result_bits)


def allreduce(net, late: np.ndarray | None = None, seed: int = 3):
    n = 12
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(1000, generator=gen) * (1 + w / 4) for w in range(n)]
    workers = [THCWorker(THC, job=1, worker=w, seed=w) for w in range(n)]
    late = np.zeros(n, bool) if late is None else late
    return thc_allreduce(workers, net.step(late), grads, tensor=0, step=0)


def test_two_tiers_flat_model_and_the_one_tier_engine_agree_bit_for_bit_without_loss() -> None:
    engine = allreduce(SimulatedNetwork(FLAT, LinkLoss(), seed=1))
    tiers = allreduce(TieredNetwork(TIERED, LinkLoss(), LinkLoss(), seed=1))
    flat = allreduce(FlatNetwork(TIERED, LinkLoss(), seed=1))
    for a, b, c in zip(engine, tiers, flat, strict=True):
        assert np.array_equal(a.sums, b.sums) and np.array_equal(a.sums, c.sums)
        assert (b.contributors == 12).all() and (c.contributors == 12).all()
        assert torch.equal(a.average, b.average) and torch.equal(a.average, c.average)


def test_a_lost_partial_or_spine_result_costs_chunks_the_spine_link_counts_its_packets() -> None:
    net = TieredNetwork(TIERED, LinkLoss(), LinkLoss(up=0.3, down=0.3), seed=2)
    out = allreduce(net)
    st = net.stats
    assert st.dropped_spine > 0 and st.packets_spine > st.dropped_spine
    assert st.dropped_up == st.dropped_down == 0
    lost = np.array([r.lost for r in out])
    assert lost.any() and not lost.all()
    # a lost PARTIAL loses the chunk for everyone; a lost spine RESULT only for that leaf's workers
    per_chunk = lost.sum(axis=0)
    assert set(per_chunk.tolist()) <= {0, 4, 8, 12}
    got = ~lost
    assert (np.array([r.contributors for r in out])[got] == 12).all()


def test_a_straggler_below_the_threshold_leaves_its_whole_leaf_out_which_gets_the_retained_result() -> None:
    late = np.zeros(12, bool)
    late[5] = True  # leaf 1's worker 1
    cfg = JobConfig(leaves=(4, 4, 4), workers=12, threshold=8, bits=4, granularity=20, p=1 / 512, elems=64,
                    slots=8)
    net = TieredNetwork(cfg, LinkLoss(), LinkLoss(), seed=4)
    out = allreduce(net, late)
    assert not any(r.lost.any() for r in out)
    assert all((r.contributors == 8).all() for r in out)  # leaves 0 and 2: 8 workers
    assert all((r.bitmap == 0b101).all() for r in out)
    assert sum(leaf.counters[4] for leaf in net.leaves) == 0  # no retained answer at a leaf ...
    assert net.spine.counters[4] > 0  # ... the spine's retained result reached leaf 1 instead
    flat = allreduce(FlatNetwork(cfg, LinkLoss(), seed=4), late)
    assert all((r.contributors == 8).all() for r in flat)  # the first 8 arrivals, the late one not among them


def test_step_time_model_counts_the_busiest_nic() -> None:
    job = JobConfig(leaves=(2, 6), workers=8, bits=4, granularity=20, elems=8, result_bits=8)
    head = WIRE_OVERHEAD + 32
    data, result = head + 4, head + 8  # K = 8: 4 bytes of 4-bit indices, 8 one-byte sums
    partial = [head + 8, head + 8]  # 20 * 6 = 120 < 256: 8-bit partials at both leaves
    chunks = 3  # 20 coordinates at K = 8
    rate = 1e6
    flat = 8 * chunks * max(data, result) * 8 / rate
    assert step_time(job, 20, rate, tiers=False) == pytest.approx(flat)
    leaf1 = chunks * max(6 * data + result, partial[1] + 6 * result)
    spine = chunks * max(sum(partial), 2 * result)
    assert step_time(job, 20, rate, tiers=True) == pytest.approx(max(leaf1, spine) * 8 / rate)


def test_training_runs_through_both_tiers_and_the_flat_model_past_32_workers() -> None:
    data = load_dataset("digits", seed=0)
    base = SimConfig(workers=40, batch=2, steps=2, eval_every=1, elems=256, slots=16, seed=1)
    tiers = run(SimConfig(**{**base.__dict__, "leaves": 2}), data=data)
    flat = run(base, data=data)
    assert set(tiers.network.contributors) == {40} == set(flat.network.contributors)
    assert tiers.network.forwarded and tiers.network.packets_spine > 0
    assert all(torch.equal(a, b) for a, b in zip(tiers.final_params, flat.final_params, strict=True))


@pytest.mark.parametrize(("kw", "says"), [
    ({"workers": 40, "leaves": 1}, "at most 32 workers a leaf"),
    ({"workers": 4, "leaves": 5}, "at least one"),
    ({"workers": 1025}, "1024 in all"),
    ({"workers": 8, "spine_drop_up": 0.1}, "set leaves"),
])
def test_bad_tier_settings_are_refused(kw: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SimConfig(**kw)


def test_tier_experiment_runs_at_the_scale_the_issue_names() -> None:
    quick = tier_specs(Options(quick=True))
    full = tier_specs(Options())
    assert {cfg.workers for _, _, cfg in quick} == {256} and {cfg.workers for _, _, cfg in full} == {1024}
    assert {cfg.leaves for _, _, cfg in quick} == {0, 8} and {cfg.leaves for _, _, cfg in full} == {0, 32}
    assert any(cfg.spine_drop_up for _, _, cfg in quick) and any(cfg.stragglers for _, _, cfg in quick)
