"""Run the target-neutral scenario table (tests/scenarios.py) against both Python implementations of the
state table: the reference (aggregator/state.py) and the batch engine (aggregator/engine.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aggregator.engine import Aggregator
from aggregator.state import ReferenceAggregator
from tests.scenarios import SCENARIOS, scenario_packet
from worker_lib.job import job_from_mapping
from worker_lib.wire import Header, PacketType, bits_float, float_bits
from worker_lib.wire.protocol import Counter


def _check(got: tuple[bool, bytes], want: dict, jobs: dict, where: str) -> None:
    fanout, data = got
    assert fanout == (want["to"] == "all"), f"{where}: destination"
    hdr, payload = Header.parse(data)
    assert hdr.type == PacketType[want["type"]], f"{where}: type {hdr.type}"
    for name, value in want.items():
        if name in ("to", "type", "sums", "norm", "ints"):
            continue
        assert getattr(hdr, name) == value, f"{where}: field {name} = {getattr(hdr, name)}, expected {value}"
    cfg = jobs[hdr.job]
    assert hdr.key == cfg.key
    if "sums" in want:
        assert hdr.width == cfg.result_bits and hdr.elems == len(want["sums"])
        sums = np.frombuffer(payload, {8: ">u1", 16: ">u2", 32: ">u4"}[cfg.result_bits]).tolist()
        assert sums == want["sums"], f"{where}: sums"
    if "ints" in want:
        assert np.frombuffer(payload, ">i4").tolist() == want["ints"], f"{where}: int32 sums"
    if "norm" in want:
        assert len(payload) == 4 and bits_float(int.from_bytes(payload, "big")) == want["norm"]
    if want["type"] == "STRAGGLER":
        assert payload == b""


IMPLEMENTATIONS = {"reference": ReferenceAggregator, "engine": Aggregator,
                   "compiled": lambda jobs: Aggregator(jobs, compiled=True)}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario(scenario: dict, impl: str) -> None:
    """Each packet produces exactly the listed packets, and the counters end as listed."""
    jobs = {c.job: c for c in (job_from_mapping(dict(j)) for j in scenario["jobs"])}
    agg = IMPLEMENTATIONS[impl](jobs.values())
    for n, step in enumerate(scenario["steps"]):
        got = agg.handle(scenario_packet(step["send"], jobs))
        where = f"{scenario['name']} step {n}"
        assert len(got) == len(step["expect"]), f"{where}: {len(got)} packets out, expected {len(step['expect'])}"
        for g, w in zip(got, step["expect"], strict=True):
            _check(g, w, jobs, where)
    for name, value in scenario["counters"].items():
        assert agg.counters[Counter[name]] == value, f"{scenario['name']}: counter {name}"
    assert agg.counters[Counter.RX] == len(scenario["steps"])


def test_scenario_norm_values_are_exact_floats() -> None:
    """Norm scenarios use floats that float32 holds exactly (so the expected bits are unambiguous)."""
    for sc in SCENARIOS:
        for step in sc["steps"]:
            for pkt in [step["send"], *step["expect"]]:
                if "norm" in pkt and math.isfinite(pkt["norm"]):
                    assert bits_float(float_bits(pkt["norm"])) == pkt["norm"]
